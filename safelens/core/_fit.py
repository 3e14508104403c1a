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

from typing import Any

import torch

from ._cache_entry import KeyValueCacheEntry
from ._config import CacheDimensions
from ._errors import CacheConfigError

__all__ = ["check_fits"]


def check_fits(entries: list[KeyValueCacheEntry], cfg: Any) -> None:
    """Raise `CacheConfigError` listing every way a cache of `entries` does not fit `cfg`."""
    dims = CacheDimensions.of(cfg)
    problems = []
    if len(entries) != dims.n_layers:
        problems.append(f"layers: cfg expects {dims.n_layers}, cache has {len(entries)}")
    mismatches: dict[tuple[str, str, str], list[int | None]] = {}
    for entry in entries:
        keys = entry.keys
        if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
            found = f"{type(keys).__name__} of shape {getattr(keys, 'shape', None)}"
            key = ("layout", "[batch, pos_so_far, n_kv_heads, d_head] tensors", found)
            mismatches.setdefault(key, []).append(entry.layer)
            continue
        found_sizes: list[tuple[str, object]] = [
            ("n_kv_heads", keys.shape[2]),
            ("d_head", keys.shape[3]),
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
