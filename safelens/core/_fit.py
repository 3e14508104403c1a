"""Whether a cache fits a model: `check_fits`, listing every mismatch at once.

A cache computed by one model means nothing to another, and TransformerLens would fail
deep inside attention (or, worse, read keys of the wrong size as if they fitted).
`check_fits` compares the cache with what the model config implies
([`CacheDimensions`][safelens.CacheDimensions]: the layer count, the key/value heads
a layer caches, `d_head` and the dtype) and raises one
[`CacheConfigError`][safelens.CacheConfigError] listing every mismatch, expected (the
config's) against found (the cache's), with the layers that differ.

Caveat: only sizes and dtype are compared. Nothing in a cache records which weights
computed it, so a cache from another model of the same sizes fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._config import CacheDimensions
from ._errors import CacheConfigError
from ._persistence import CachedLayer
from ._tensor_layout import POSITION_MAJOR, TensorLayout

__all__ = ["check_fits"]


def check_fits(
    entries: Sequence[CachedLayer], cfg: Any, layout: TensorLayout = POSITION_MAJOR
) -> None:
    """Raise `CacheConfigError` listing every way a cache of `entries` does not fit `cfg`.

    The entries' tensors are in `layout`; an entry that holds nothing yet (keys `None`)
    fits any config.
    """
    dims = CacheDimensions.of(cfg)
    problems = []
    if len(entries) != dims.n_layers:
        problems.append(f"layers: cfg expects {dims.n_layers}, cache has {len(entries)}")
    mismatches: dict[tuple[str, str, str], list[int | None]] = {}
    for entry in entries:
        keys = entry.keys
        if keys is None:
            continue
        if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
            found = f"{type(keys).__name__} of shape {getattr(keys, 'shape', None)}"
            key = ("layout", f"{layout.shape} tensors", found)
            mismatches.setdefault(key, []).append(entry.layer)
            continue
        sizes = layout.sizes(tuple(keys.shape))
        found_sizes: list[tuple[str, object]] = [
            ("n_kv_heads", sizes["n_kv_heads"]),
            ("d_head", sizes["d_head"]),
            ("dtype", keys.dtype),
        ]
        for name, value in found_sizes:
            wanted = getattr(dims, name)
            if value != wanted:
                mismatches.setdefault((name, str(wanted), str(value)), []).append(entry.layer)
    for (name, wanted, found), layers in mismatches.items():
        problems.append(f"{name}: cfg expects {wanted}, cache has {found} (layers {layers})")
    if problems:
        raise CacheConfigError(
            "the cache does not fit the model config: " + "; ".join(problems) + ". This "
            "usually means the cache was made for another model"
        )
