"""What one layer's cache accepts: the checks `KeyValueCacheEntry` runs on keys and values.

`check_pair` refuses keys and values that cannot be one layer's cache (one given without
the other, non-numbers, tensors beside another kind, differing batch, pos or head
sizes); `fitted` turns new keys or values into a tensor like the stored ones (same
dtype and device) or says why it cannot, naming the layer, the expected
`[batch, pos, n_heads, d_head]` sizes and what arrived.

Caveat: a floating cache refuses integer keys instead of converting them, and new keys
in head-major `[batch, heads, pos, d_head]` layout are refused with a pointer to
`transpose(1, 2)`, not read as some other shape.
"""

from __future__ import annotations

from typing import Any

import torch

from ._errors import CacheShapeError
from ._storage import Sequence
from ._values import check_numbers, shape_of

__all__ = ["POS", "check_pair", "fitted"]

_LAYOUT = ("batch", "pos", "n_heads", "d_head")
POS = 1


def check_pair(keys: Any, values: Any, where: str) -> None:
    """Refuse keys and values that cannot be one layer's cache (see `KeyValueCacheEntry`)."""
    if (keys is None) != (values is None):
        missing = "values" if values is None else "keys"
        raise CacheShapeError(
            f"{where}: {missing} is None but the other is not; pass both keys and values "
            "(or neither, for an entry that starts empty)"
        )
    try:
        check_numbers(keys, "keys")
        check_numbers(values, "values")
    except CacheShapeError as error:
        raise CacheShapeError(f"{where}: {error}") from None
    key_shape, value_shape = shape_of(keys), shape_of(values)
    if key_shape is None or value_shape is None:
        return
    if isinstance(keys, torch.Tensor) != isinstance(values, torch.Tensor):
        raise CacheShapeError(
            f"{where}: keys are {type(keys).__name__} but values are "
            f"{type(values).__name__}; pass both as tensors (or both as the same kind)"
        )
    if len(key_shape) != len(value_shape) or key_shape[: POS + 2] != value_shape[: POS + 2]:
        raise CacheShapeError(
            f"{where}: keys of shape {key_shape} and values of shape {value_shape} do not "
            "fit one cache; they need the same rank and the same batch, pos and n_heads "
            "sizes ([batch, pos_so_far, n_kv_heads, d_head])"
        )


def fitted(where: str, name: str, new: Any, held: Sequence) -> torch.Tensor:
    """`new` as a tensor like `held`'s, or a `CacheShapeError` (naming `where`) saying why not."""
    like = held.template
    if isinstance(new, torch.Tensor):
        if like.is_floating_point() and not new.is_floating_point():
            raise CacheShapeError(
                f"{where}: {name} have dtype {new.dtype}; expected a floating "
                f"dtype (the cache holds {like.dtype})"
            )
        try:
            new = new.to(device=like.device, dtype=like.dtype)
        except RuntimeError as error:
            raise CacheShapeError(
                f"{where}: {name} on {new.device} cannot be moved to the "
                f"cache's device {like.device}: {error}"
            ) from None
    else:
        try:
            new = torch.as_tensor(new, dtype=like.dtype, device=like.device)
        except (TypeError, ValueError, RuntimeError) as error:
            raise CacheShapeError(
                f"{where}: {name} of type {type(new).__name__} cannot be "
                f"converted to a {like.dtype} tensor: {error}"
            ) from None
    expected = list(like.shape)
    got = list(new.shape)
    if len(got) == len(expected) and all(
        i == POS or a == b for i, (a, b) in enumerate(zip(got, expected, strict=True))
    ):
        return new
    names = _LAYOUT if len(expected) == len(_LAYOUT) else None
    wanted = ", ".join(
        f"{names[i] if names else f'axis{i}'}={'any' if i == POS else size}"
        for i, size in enumerate(expected)
    )
    message = f"{where}: {name} of shape {tuple(got)} do not fit the cache; expected [{wanted}]"
    if (
        names
        and len(got) == 4
        and got[0] == expected[0]
        and got[1] == expected[2]
        and got[3] == expected[3]
    ):
        message += (
            ". This looks like head-major [batch, heads, pos, d_head] layout; "
            f"pass {name}.transpose(1, 2)"
        )
    raise CacheShapeError(message)
