"""What makes entries and a mask one cache, and rows one batch index: the layout checks.

A [`KeyValueCache`][safelens.KeyValueCache] holds one entry per layer, each `[batch,
pos_so_far, n_kv_heads, d_head]`, and a `[batch, pos_so_far]` integer attention mask of
what is cached. `check_layout` refuses entries and a mask that cannot be one cache:
layers of differing batch or `pos_so_far`, or a mask of another shape, rank or dtype.
`check_rows` refuses batch-row indices that torch would read some other way than meant
(floats, or a list mixing bools and ints); the HuggingFace cache selects rows with it
too.

Caveat: the checks read shapes only (entries whose keys are not tensors, as a plain
list cache holds, are skipped), so they are cheap at every construction, and a cache
built unchecked (`KeyValueCache.assembled`, for internal passes) is not checked at all.
"""

from __future__ import annotations

from typing import Any

import torch

from ._arguments import is_int
from ._cache_entry import KeyValueCacheEntry
from ._errors import CacheShapeError
from ._values import shape_of

__all__ = ["check_layout", "check_rows", "row_index"]


def check_rows(rows: Any) -> None:
    """Refuse row indices that torch would read some other way (bools, floats)."""
    if isinstance(rows, slice) or is_int(rows):
        return
    if isinstance(rows, torch.Tensor):
        if rows.dtype in (torch.bool,) or not (rows.is_floating_point() or rows.is_complex()):
            return
        raise TypeError(f"rows must be an integer (or bool mask) tensor, got dtype {rows.dtype}")
    if isinstance(rows, list | tuple) and (
        all(is_int(r) for r in rows) or all(isinstance(r, bool) for r in rows)
    ):
        return
    raise TypeError(
        f"rows must be an int, a slice, a list of ints or an integer tensor, got {rows!r}; "
        "torch would read floats or bools as other rows than meant"
    )


def row_index(rows: Any, batch: int) -> torch.Tensor:
    """The 1-D index of the rows `rows` selects of a batch of `batch` rows.

    Raises `TypeError` for rows torch would read some other way (see `check_rows`) and
    `IndexError` for rows outside the batch or none at all.

    ```python
    >>> row_index([0, -1], 4), row_index((0, 2), 4), row_index(slice(1, 3), 4)
    (tensor([0, 3]), tensor([0, 2]), tensor([1, 2]))

    ```
    """
    check_rows(rows)
    # A tuple is a list of rows (as `DynamicCache.batch_select_indices` reads it); torch
    # would read it as one index per axis.
    rows = list(rows) if isinstance(rows, tuple) else rows
    device = rows.device if isinstance(rows, torch.Tensor) else None
    try:
        index = torch.arange(batch, device=device)[rows].reshape(-1)
    except (IndexError, TypeError, RuntimeError) as error:
        raise IndexError(f"rows {rows!r} do not index a batch of {batch} rows: {error}") from None
    if index.numel() == 0:
        raise IndexError(f"rows {rows!r} select no row of a batch of {batch}")
    return index


def check_layout(entries: dict[int, KeyValueCacheEntry], mask: Any) -> None:
    """Refuse entries and a mask that cannot be one cache: every layer one batch and length."""
    sized = {
        layer: shape_of(entry.keys)
        for layer, entry in entries.items()
        if isinstance(entry.keys, torch.Tensor) and entry.keys.dim() >= 2
    }
    shapes = {layer: (shape[0], shape[1]) for layer, shape in sized.items() if shape}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"layer {i}: batch={b}, pos={p}" for i, (b, p) in shapes.items())
        raise CacheShapeError(
            f"entries do not fit one cache: every layer needs the same batch and pos_so_far, "
            f"got {listed}. Crop or select the entries to one length and batch first"
        )
    if mask is None:
        return
    mask_shape = shape_of(mask)
    if mask_shape is None or len(mask_shape) != 2:
        raise CacheShapeError(
            f"previous_attention_mask must be [batch, pos_so_far], got "
            f"{mask_shape if mask_shape is not None else type(mask).__name__}"
        )
    if isinstance(mask, torch.Tensor) and (mask.is_floating_point() or mask.is_complex()):
        raise CacheShapeError(
            f"previous_attention_mask must hold integer 0/1 values, got dtype {mask.dtype}; "
            "pass mask.long()"
        )
    if shapes:
        batch, length = next(iter(shapes.values()))
        if mask_shape != (batch, length):
            raise CacheShapeError(
                f"previous_attention_mask of shape {mask_shape} does not fit the entries "
                f"[batch={batch}, pos_so_far={length}]; the mask needs one column per cached "
                "position and one row per batch row"
            )
