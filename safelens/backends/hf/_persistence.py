"""Saving, loading and fit-checking an [`HFKeyValueCache`][safelens.HFKeyValueCache].

The file is a safelens cache file (`safelens.core._persistence`: safetensors, never
unpickled, every header field, shape, byte range and checksum checked before use) in
the HuggingFace layout `HEAD_MAJOR`: each layer's keys and values head-major, `[batch,
n_kv_heads, pos_so_far, d_head]`, keys after the rotary embedding, exactly as
`cache.layers[l].keys` shows them (and as `DynamicCache` holds them). It has no
attention mask (HuggingFace passes the mask with each call) and records the frozen flag.

`KeyValueCache.load` refuses such a file, and `HFKeyValueCache.load` refuses a
`KeyValueCache` file, each naming the class that reads it: the two backends cache
different keys (pre- against post-rotary), so one's file means nothing to the other.

Caveat: as for `KeyValueCache`, the file holds the materialised keys and values: a fork
is saved with its whole prefix, an `expand(n)` result with all `n` rows, and hook points
are not saved. Every layer must hold keys: a cache with a layer no forward pass reached
is refused.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence as SequenceOf
from os import PathLike
from typing import Any

import torch

from ...core._errors import CacheShapeError
from ...core._fit import check_fits
from ...core._persistence import Devices, load_cache, save_cache
from ...core._storage import Sequence
from ...core._tensor_layout import TensorLayout
from ._layer import HFCacheLayer, HookNaming

__all__ = ["HEAD_MAJOR", "save_layers", "load_layers", "check_layers_fit", "text_config"]

HEAD_MAJOR = TensorLayout(
    "head-major", ("batch", "n_kv_heads", "pos_so_far", "d_head"), "post-rotary", "HFKeyValueCache"
)
"""What HuggingFace attention hands `Cache.update`: head-major, post-rotary keys."""


def text_config(config: Any) -> Any:
    """The decoder text config of a HuggingFace config (itself for a plain text model)."""
    if hasattr(config, "get_text_config"):
        return config.get_text_config(decoder=True)
    return config


def save_layers(layers: SequenceOf[HFCacheLayer], frozen: bool, path: str | PathLike[str]) -> None:
    """Write `layers` and the `frozen` flag to `path` as a head-major safelens cache file."""
    empty = [layer.layer for layer in layers if not layer.is_initialized]
    if empty:
        raise CacheShapeError(
            f"save needs keys in every layer; layers {empty} hold nothing yet (no forward "
            "pass reached them). Save after a forward pass through every layer"
        )
    slid = [layer.layer for layer in layers if layer.evicted]
    if slid:
        raise CacheShapeError(
            f"save needs every position; sliding-window layers {slid} hold only their "
            "window, as DynamicCache holds them. Make the cache to save with "
            "HFKeyValueCache() (no config) or prefill(model, tokens), which keep every position"
        )
    save_cache(layers, None, frozen, path, HEAD_MAJOR)


def _layers(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], naming: HookNaming
) -> list[HFCacheLayer]:
    def stored(tensor: torch.Tensor) -> Sequence:
        # Storage is position-major (see `_layer`); the file is head-major.
        return Sequence.of(tensor.transpose(1, 2).contiguous())

    return [
        HFCacheLayer(layer, stored(keys), stored(values), naming)
        for layer, (keys, values) in enumerate(pairs)
    ]


def load_layers(
    path: str | PathLike[str], device: Devices | None, naming: HookNaming
) -> tuple[list[HFCacheLayer], bool]:
    """The layers and frozen flag of the head-major cache file at `path`, on `device`."""

    def build(
        pairs: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None, frozen: bool
    ) -> tuple[list[HFCacheLayer], bool]:
        if mask is not None:
            raise CacheShapeError("it holds an attention mask, which an HFKeyValueCache has not")
        return _layers(pairs, naming), frozen

    return load_cache(build, path, device, HEAD_MAJOR)


def check_layers_fit(layers: SequenceOf[HFCacheLayer], config: Any) -> None:
    """Raise `CacheConfigError` listing every way `layers` do not fit HF `config`.

    `config` may be a model: its config is read, with the dtype of its parameters (a
    model cast with `.to(dtype)` keeps the dtype its config was made with).
    """
    if isinstance(config, torch.nn.Module):
        dtype = next(config.parameters()).dtype
        config = copy.copy(text_config(config.config))
        config.dtype = dtype
    check_fits(layers, text_config(config), HEAD_MAJOR)
