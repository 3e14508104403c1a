"""Short reprs for result objects: each tensor by its shape and dtype, never its values.

`print(prefix)` of a dataclass full of tensors would print every number (thousands of
characters for a small model); TransformerLens' `ActivationCache` prints its keys instead.
`summary_repr` is the `__repr__` of safelens' result dataclasses: fields in order, a tensor
as `Tensor[1, 12] int64` (its device too, when not the CPU), a tuple or list of tensors as
their count and shape, a dict by its keys, a long list by its length, anything else (a
cache, a short list of positions) by its own repr.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["summary_repr"]

_LONGEST = 60  # a longer list (of positions, say) prints as its length


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        device = "" if value.device.type == "cpu" else f" {value.device}"
        return f"Tensor{list(value.shape)} {str(value.dtype).removeprefix('torch.')}{device}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key!r}: {_describe(item)}" for key, item in value.items()) + "}"
    if isinstance(value, (tuple, list)) and any(isinstance(item, torch.Tensor) for item in value):
        kinds = {_describe(item) for item in value}
        if len(kinds) == 1:
            return f"{type(value).__name__} of {len(value)} × {kinds.pop()}"
        return f"{type(value).__name__} of {len(value)}"
    text = repr(value)
    if len(text) > _LONGEST and isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)}"
    return text


def summary_repr(self: Any) -> str:
    """`Name(field=..., ...)` for dataclass `self`, tensors by shape and dtype.

    ```python
    >>> import dataclasses, torch
    >>> @dataclasses.dataclass(repr=False)
    ... class Result:
    ...     tokens: torch.Tensor
    ...     per_layer: tuple
    ...     __repr__ = summary_repr
    >>> Result(torch.zeros(2, 7, dtype=torch.long), (torch.ones(2, 3),) * 4)
    Result(tokens=Tensor[2, 7] int64, per_layer=tuple of 4 × Tensor[2, 3] float32)

    ```
    """
    fields = ", ".join(
        f"{f.name}={_describe(getattr(self, f.name))}" for f in dataclasses.fields(self)
    )
    return f"{type(self).__name__}({fields})"
