"""Shapes and concatenation for the value kinds a cache can hold.

A cache entry may hold torch tensors, numpy arrays or nested Python lists. These helpers
give all three one meaning: [`shape_of`][safelens.shape_of] reads a shape (a nested
list's shape is the length at each depth, an empty list being `(0,)`), and
[`concat_values`][safelens.concat_values] joins two values along an axis, converting the
new value to the kind, dtype and device of the old one.
"""

from __future__ import annotations

from numbers import Number
from typing import Any

import numpy as np
import torch

from ._errors import CacheShapeError

__all__ = ["check_numbers", "shape_of", "concat_values", "to_like"]


def shape_of(value: Any) -> tuple[int, ...] | None:
    """The shape of a tensor, array or nested list; `None` when it has none.

    **Arguments:**

    - `value`: anything with a `.shape`, or a (nested) list or tuple.

    **Returns:** a tuple of sizes, or `None` for values with no inferable shape.

    ```python
    >>> shape_of([[[1], [3]]])
    (1, 2, 1)
    >>> shape_of([])
    (0,)
    >>> shape_of(torch.zeros(2, 5, 4, 8))
    (2, 5, 4, 8)
    >>> shape_of(7) is None
    True

    ```
    """
    shape = getattr(value, "shape", None)
    if shape is not None:
        return tuple(int(size) for size in shape)
    if isinstance(value, (list, tuple)):
        if len(value) == 0:
            return (0,)
        inner = shape_of(value[0])
        return (len(value),) + (inner if inner is not None else ())
    return None


def check_numbers(value: Any, what: str) -> None:
    """Refuse `value` unless it is a tensor, an array, a number, `None` or nested lists of numbers.

    A nested list (or tuple) must be rectangular and hold numbers only; every item is
    read, so this costs a walk over a list cache's elements. Anything with a `.shape`
    passes as an array.

    **Raises:** [`CacheShapeError`][safelens.CacheShapeError] naming `what` and the
    index of the first item that is not a number or has another length than its
    siblings.

    ```python
    >>> check_numbers([[1, 2.5]], "keys")
    >>> check_numbers([["a"]], "keys")
    Traceback (most recent call last):
    ...
    safelens.CacheShapeError: keys[0][0] is str 'a'; keys must be numbers: a tensor, a numpy array or nested lists of numbers

    ```
    """
    if not isinstance(value, (list, tuple)):
        if value is None or isinstance(value, Number) or hasattr(value, "shape"):
            return
        raise CacheShapeError(
            f"{what} is {type(value).__name__} {value!r}; {what} must be numbers: a tensor, a "
            "numpy array or nested lists of numbers"
        )
    shape = shape_of(value) or ()

    def walk(item: Any, depth: int, where: str) -> None:
        if depth == len(shape):
            number = isinstance(item, Number) or (
                isinstance(item, (torch.Tensor, np.ndarray)) and item.ndim == 0
            )
            if not number:
                raise CacheShapeError(
                    f"{where} is {type(item).__name__} {item!r}; {what} must be numbers: a "
                    "tensor, a numpy array or nested lists of numbers"
                )
            return
        if not isinstance(item, (list, tuple)) or len(item) != shape[depth]:
            got = (
                f"has {len(item)} items"
                if isinstance(item, (list, tuple))
                else f"is {type(item).__name__} {item!r}"
            )
            raise CacheShapeError(
                f"{what} is a ragged nested list: {where} {got} where the first list at its "
                f"depth has {shape[depth]}; every list at one depth needs one length"
            )
        for index, inner in enumerate(item):
            walk(inner, depth + 1, f"{where}[{index}]")

    walk(value, 0, what)


def to_like(new: Any, like: Any) -> Any:
    """Convert `new` to the kind, dtype and device of `like` (tensor, array or list)."""
    if isinstance(like, torch.Tensor):
        if isinstance(new, torch.Tensor):
            return new.to(device=like.device, dtype=like.dtype)
        return torch.as_tensor(np.asarray(new), dtype=like.dtype, device=like.device)
    if isinstance(like, np.ndarray):
        if isinstance(new, torch.Tensor):
            new = new.detach().cpu().numpy()
        return np.asarray(new, dtype=like.dtype)
    if isinstance(like, (list, tuple)) and hasattr(new, "tolist"):
        return new.tolist()
    return new


def _concat_lists(old: list, new: list, dim: int) -> list:
    if dim == 0:
        return list(old) + list(new)
    if len(old) != len(new):
        raise CacheShapeError(
            f"cannot concatenate nested lists: {len(old)} rows cached, {len(new)} arriving"
        )
    return [_concat_lists(a, b, dim - 1) for a, b in zip(old, new, strict=True)]


def concat_values(old: Any, new: Any, dim: int = 1) -> Any:
    """Join `new` after `old` along axis `dim`, in the kind, dtype and device of `old`.

    **Arguments:**

    - `old`: what is already held, or `None`.
    - `new`: what to append; converted to the kind of `old` first.
    - `dim`: the axis to join along; negative counts from the end.

    **Returns:** the joined value; `new` itself when `old` is `None`.

    **Raises:** [`CacheShapeError`][safelens.CacheShapeError] when the ranks differ or an
    axis other than `dim` has another size.

    ```python
    >>> concat_values([[[1]]], [[[3]]], dim=1)
    [[[1], [3]]]
    >>> concat_values(torch.zeros(1, 2, 3), torch.ones(1, 4, 3), dim=-2).shape
    torch.Size([1, 6, 3])
    >>> concat_values(None, [5])
    [5]

    ```
    """
    if old is None:
        return new
    new = to_like(new, old)
    if isinstance(old, (list, tuple)) and len(old) == 0:
        return list(new)
    old_shape, new_shape = shape_of(old), shape_of(new)
    if old_shape is not None and new_shape is not None:
        rank = len(old_shape)
        axis = dim + rank if dim < 0 else dim
        if len(new_shape) != rank or not 0 <= axis < rank:
            raise CacheShapeError(
                f"cannot concatenate along dim={dim}: cached shape {old_shape}, "
                f"new shape {new_shape}; both need the same rank, with dim inside it"
            )
        if any(i != axis and old_shape[i] != new_shape[i] for i in range(rank)):
            raise CacheShapeError(
                f"cannot concatenate along dim={dim}: cached shape {old_shape}, "
                f"new shape {new_shape}; every axis but {axis} must match"
            )
        dim = axis
    if isinstance(old, torch.Tensor):
        return torch.cat([old, new], dim=dim)
    if isinstance(old, np.ndarray):
        return np.concatenate([old, new], axis=dim)
    if isinstance(old, (list, tuple)):
        return _concat_lists(list(old), list(new), dim)
    raise CacheShapeError(
        f"cannot concatenate values of type {type(old).__name__}; expected a torch "
        "tensor, a numpy array or a nested list"
    )
