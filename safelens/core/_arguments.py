"""Checking scalar arguments at the public boundary: ints, sizes, flags, numbers.

Python's `bool` is an `int` (`True == 1`), so `isinstance(value, int)` would take
`True` as a size of one and `False` as zero; every check here refuses bools (and bool
tensors) where an int is meant. Each check raises `TypeError` for a value of the wrong
type and `ValueError` for one out of range, with a message `"{name} must be …, got …"`.

The public functions word some of these checks their own way (a sweep's limits raise
a `PatchingError`, a cache's sizes a `ValueError` for both faults), so a check takes
the error class to raise (`error=`) and how to show the value that arrived (`shown=`);
the defaults are the common wording.

Caveat: `is_int` takes Python ints only; `as_index` also takes what `operator.index`
takes (numpy integers, 0-d integer tensors). Which one a public argument uses is part
of its contract: keep it when moving a check here.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable
from numbers import Real
from typing import Any

import torch

__all__ = [
    "as_index",
    "described",
    "finite_number",
    "flag",
    "indices",
    "integer",
    "is_int",
    "positive_int",
]


def is_int(value: Any) -> bool:
    """Whether `value` is a Python int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def as_index(value: Any) -> int | None:
    """`value` as an int if it is one (numpy and 0-d integer tensors too), else `None`.

    Bools and bool tensors are not ints here.

    ```python
    >>> as_index(3), as_index(torch.tensor(2)), as_index(True), as_index(2.0)
    (3, 2, None, None)

    ```
    """
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def indices(value: Any, name: str, *, error: type[Exception] = TypeError) -> int | tuple[int, ...]:
    """`value` as an int, or a tuple of ints: positions, heads or layers as a user passes them.

    An int (what `as_index` takes), or a sequence (a 1-D tensor too) of such ints;
    bools, floats, strings and nested sequences are refused with `error` naming `name`.

    ```python
    >>> indices([0, -1], "positions"), indices(torch.tensor([2, 3]), "heads"), indices(1, "layers")
    ((0, -1), (2, 3), 1)
    >>> indices("0", "positions")
    Traceback (most recent call last):
    ...
    TypeError: positions must be an int, a sequence of ints or None, got str '0'

    ```
    """
    single = as_index(value)
    if single is not None:
        return single
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise error(f"{name} must be an int, a sequence of ints or None, got {described(value)}")
    items = list(value)
    picked = [as_index(item) for item in items]
    for i, (item, index) in enumerate(zip(items, picked, strict=True)):
        if index is None:
            raise error(f"{name} must hold ints, got {item!r} ({type(item).__name__}) at index {i}")
    return tuple(index for index in picked if index is not None)


def described(value: Any) -> str:
    """`value` shown as its type's name and its repr: `"str 'a'"`."""
    return f"{type(value).__name__} {value!r}"


def integer(
    value: Any, name: str, *, optional: bool = False, shown: Callable[[Any], str] = described
) -> None:
    """Refuse `value` with a `TypeError` unless it is an int (or `None` when `optional`).

    ```python
    >>> integer(True, "layer")
    Traceback (most recent call last):
    ...
    TypeError: layer must be an int, got bool True

    ```
    """
    if (value is None and optional) or is_int(value):
        return
    raise TypeError(f"{name} must be an int{' or None' if optional else ''}, got {shown(value)}")


def positive_int(
    value: Any,
    name: str,
    *,
    optional: bool = False,
    unit: str = "",
    index_like: bool = False,
    error: type[Exception] | None = None,
    shown: Callable[[Any], str] | None = None,
) -> None:
    """Refuse `value` unless it is an int >= 1 (or `None` when `optional`).

    **Arguments:**

    - `value`, `name`: the argument and its name.
    - `optional`: take `None` too.
    - `unit`: words after "a positive int" in the message, e.g. `" (bytes)"`.
    - `index_like`: take what `operator.index` takes (numpy ints), not just Python ints.
    - `error`: the class to raise; `None` raises `TypeError` for a value that is not an
      int and `ValueError` for an int below 1.
    - `shown`: how the message shows the value; `None` shows a wrong type as `described`
      does and an int below 1 as itself.

    ```python
    >>> positive_int(0, "batch_size", optional=True)
    Traceback (most recent call last):
    ...
    ValueError: batch_size must be a positive int or None, got 0

    ```
    """
    if value is None and optional:
        return
    if index_like:
        number = as_index(value)
    else:
        number = value if is_int(value) else None
    if number is not None and number >= 1:
        return
    expected = f"{name} must be a positive int{unit}{' or None' if optional else ''}"
    if shown is None:
        got = described(value) if number is None else str(value)
    else:
        got = shown(value)
    kind = error or (TypeError if number is None else ValueError)
    raise kind(f"{expected}, got {got}")


def flag(
    value: Any,
    name: str,
    *,
    optional: bool = False,
    error: type[Exception] = TypeError,
    shown: Callable[[Any], str] = described,
) -> None:
    """Raise `error` (`TypeError` unless given) unless `value` is a bool (or `None` if `optional`)."""
    if (value is None and optional) or isinstance(value, bool):
        return
    raise error(f"{name} must be True or False{' or None' if optional else ''}, got {shown(value)}")


def finite_number(value: Any, name: str) -> float:
    """`value` as a float; a `TypeError` for a non-number (or bool), a `ValueError` if not finite."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, got {described(value)}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return float(value)
