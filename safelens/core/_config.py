"""What a cache needs to know of a model config, read from TransformerLens or HF configs.

[`CacheDimensions.of`][safelens.CacheDimensions.of] reads layers, key/value heads,
`d_head`, dtype and per-layer devices from a TransformerLens `HookedTransformerConfig`
or a HuggingFace-style config, so [`KeyValueCache.init_cache`][safelens.KeyValueCache.init_cache]
works with both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._arguments import as_index
from ._errors import CacheConfigError

__all__ = ["CacheDimensions", "parse_dtype", "refuse_ungrouped"]

_LAYERS = ("n_layers", "n_layer", "num_hidden_layers")
_HEADS = ("n_heads", "n_head", "num_attention_heads")
_KV_HEADS = ("n_key_value_heads", "num_key_value_heads")
_D_HEAD = ("d_head", "head_dim")
_HIDDEN = ("d_model", "n_embd", "hidden_size")
_DTYPE = ("dtype", "torch_dtype")


def _first(cfg: Any, names: tuple[str, ...]) -> tuple[str, Any] | None:
    """`(name, value)` of the first of `names` that `cfg` sets (not `None`), else `None`."""
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return name, value
    return None


def _size(cfg: Any, names: tuple[str, ...], role: str) -> tuple[str, int] | None:
    """`(name, size)` of the first of `names` that `cfg` sets; it must be a positive int."""
    found = _first(cfg, names)
    if found is None:
        return None
    name, value = found
    size = as_index(value)
    if size is None or size < 1:
        raise CacheConfigError(
            f"cfg of type {type(cfg).__name__} has {name}={value!r} "
            f"({type(value).__name__}); expected the {role} as a positive int"
        )
    return name, size


def _required(cfg: Any, names: tuple[str, ...], role: str) -> tuple[str, int]:
    found = _size(cfg, names, role)
    if found is None:
        raise CacheConfigError(
            f"cfg of type {type(cfg).__name__} has no {role}: expected one of the "
            f"attributes {', '.join(names)}"
        )
    return found


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """A `torch.dtype` from a dtype, a name such as `"bfloat16"` or `"torch.float16"`.

    ```python
    >>> parse_dtype("torch.bfloat16"), parse_dtype("float16"), parse_dtype(None)
    (torch.bfloat16, torch.float16, torch.float32)

    ```
    """
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    parsed = getattr(torch, name, None)
    if not isinstance(parsed, torch.dtype):
        raise CacheConfigError(
            f"dtype must be a torch.dtype or a name such as 'float32' or "
            f"'torch.bfloat16', got {dtype!r}"
        )
    return parsed


@dataclass(frozen=True)
class CacheDimensions:
    """The sizes, dtype and devices of a model's key/value cache.

    ```python
    >>> from types import SimpleNamespace
    >>> hf = SimpleNamespace(num_hidden_layers=2, num_attention_heads=8, hidden_size=64)
    >>> CacheDimensions.of(hf)
    CacheDimensions(n_layers=2, n_kv_heads=8, d_head=8, dtype=torch.float32, n_devices=1)

    ```
    """

    n_layers: int
    n_kv_heads: int
    d_head: int
    dtype: torch.dtype
    n_devices: int = 1

    @classmethod
    def of(cls, cfg: Any) -> CacheDimensions:
        """Read the dimensions from a TransformerLens or HuggingFace-style config.

        Every size read must be a positive int; the key/value heads must divide the
        query heads; a `d_head` derived from the hidden size must divide it exactly.
        With TransformerLens' `ungroup_grouped_query_attention=True` the model emits
        (and caches) one key/value head per query head, so `n_kv_heads = n_heads`.

        **Raises:** [`CacheConfigError`][safelens.CacheConfigError] naming the missing
        or invalid attribute, what was expected and what it holds.

        ```python
        >>> from types import SimpleNamespace
        >>> CacheDimensions.of(SimpleNamespace(n_layers=2, n_heads=8, n_key_value_heads=3, d_head=4))
        Traceback (most recent call last):
        ...
        safelens.CacheConfigError: cfg of type SimpleNamespace has n_key_value_heads=3, which does not divide n_heads=8; ...

        ```
        """
        kind = type(cfg).__name__
        _, n_layers = _required(cfg, _LAYERS, "layer count")
        heads = _size(cfg, _HEADS, "head count")
        kv_heads = _size(cfg, _KV_HEADS, "key/value head count")
        if getattr(cfg, "multi_query", False) is True and not getattr(
            cfg, "new_decoder_architecture", False
        ):
            # Multi-query attention (Falcon's older layout, GPTBigCode): one key/value head,
            # whatever `num_kv_heads` says.
            kv_heads = ("multi_query", 1)
        if heads is not None and kv_heads is not None and heads[1] % kv_heads[1]:
            raise CacheConfigError(
                f"cfg of type {kind} has {kv_heads[0]}={kv_heads[1]}, which does not divide "
                f"{heads[0]}={heads[1]}; grouped-query attention shares each key/value head "
                "among n_heads // n_kv_heads query heads"
            )
        if kv_heads is None or (
            heads is not None and getattr(cfg, "ungroup_grouped_query_attention", False)
        ):
            kv_heads = heads or _required(cfg, _HEADS, "head count")
        d_head = _size(cfg, _D_HEAD, "head size")
        if d_head is None:
            heads = heads or _required(cfg, _HEADS, "head count (needed to derive d_head)")
            hidden = _required(cfg, _HIDDEN, "d_head or hidden size")
            if hidden[1] % heads[1]:
                raise CacheConfigError(
                    f"cfg of type {kind} has no d_head, and {hidden[0]}={hidden[1]} is not "
                    f"divisible by {heads[0]}={heads[1]}; set d_head (or head_dim) to the "
                    "size of one attention head"
                )
            d_head = ("", hidden[1] // heads[1])
        dtype = _first(cfg, _DTYPE)
        devices = _size(cfg, ("n_devices",), "device count")
        return cls(
            n_layers=n_layers,
            n_kv_heads=kv_heads[1],
            d_head=d_head[1],
            dtype=parse_dtype(None if dtype is None else dtype[1]),
            n_devices=1 if devices is None else devices[1],
        )

    def device_of_layer(self, layer: int, device: torch.device | str | None) -> torch.device:
        """The device TransformerLens puts layer `layer` on, starting from `device`."""
        base = torch.device(device if device is not None else "cpu")
        if base.type == "cpu" or self.n_devices <= 1:
            return base
        return torch.device(
            base.type, (base.index or 0) + (layer * self.n_devices) // self.n_layers
        )

    def empty_keys(self, batch_size: int, device: torch.device | str | None) -> torch.Tensor:
        """An empty `[batch_size, 0, n_kv_heads, d_head]` tensor in the model's dtype."""
        return torch.empty(
            (batch_size, 0, self.n_kv_heads, self.d_head), dtype=self.dtype, device=device
        )


def refuse_ungrouped(cfg: Any, what: str) -> None:
    """Refuse a cached forward pass TransformerLens itself cannot run on this config.

    With `ungroup_grouped_query_attention=True`, TransformerLens' attention appends one
    key/value head per query head, but `HookedTransformer.forward` asserts (in
    `get_pos_offset`) that a cache holds `n_key_value_heads` heads, so no cache,
    TransformerLens' own included, can be passed to its forward with tokens.

    **Raises:** [`CacheConfigError`][safelens.CacheConfigError] saying so and how to
    get the same logits.
    """
    if getattr(cfg, "ungroup_grouped_query_attention", False) and getattr(
        cfg, "n_key_value_heads", None
    ):
        raise CacheConfigError(
            f"{what}: this model has ungroup_grouped_query_attention=True, and "
            "TransformerLens' forward then refuses every key/value cache (it asserts the "
            "cache holds n_key_value_heads heads while its attention appends n_heads). "
            "Build the model with ungroup_grouped_query_attention=False: the logits are "
            "the same, and the cache holds the n_key_value_heads heads. The patching "
            "sweeps do run on this model"
        )
