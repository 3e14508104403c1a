"""The limits every patching sweep takes: `max_batch`, `max_bytes`, `progress`.

`max_batch` caps the patched runs per forward pass; `max_bytes` is a memory budget
(default 1 GiB) from which a sweep derives its own cap; `progress` shows a progress
bar. `_check_limits` refuses, with a `PatchingError` naming the argument, what is not a
positive int or a bool, before any forward pass.

Caveat: the budget bounds the activations a sweep estimates per forward pass, not the
process's peak memory.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..core._arguments import flag, positive_int
from ..core._errors import PatchingError

__all__ = ["DEFAULT_MAX_BYTES", "Limits", "rows_within"]

DEFAULT_MAX_BYTES = 2**30


class Limits(NamedTuple):
    """A sweep's limits, as its caller gave them: check them with `Limits.checked`."""

    max_batch: int | None
    max_bytes: int
    progress: bool

    def checked(self) -> Limits:
        """These limits, or a `PatchingError` naming the one that does not fit."""
        _check_limits(*self)
        return self


def _with_type(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _check_limits(max_batch: Any, max_bytes: Any, progress: Any) -> None:
    """A `PatchingError` unless the sweep's limits are positive ints and `progress` a bool."""
    for value, name, optional, unit in (
        (max_batch, "max_batch", True, " (patched runs per forward pass)"),
        (max_bytes, "max_bytes", False, ", a memory budget in bytes (default 2**30, 1 GiB)"),
    ):
        positive_int(
            value,
            name,
            optional=optional,
            unit=unit,
            index_like=True,
            error=PatchingError,
            shown=_with_type,
        )
    flag(progress, "progress", error=PatchingError, shown=repr)


def rows_within(
    max_bytes: int,
    *,
    d_vocab: int,
    d_model: int,
    d_mlp: int,
    n_heads: int,
    new: int,
    length: int,
    dtype: torch.dtype,
) -> int:
    """Rows of `new` positions one pass may hold within `max_bytes` (an estimate, at least 1).

    Per position of a row: the logits (twice), a few residual-width tensors, the MLP's
    hidden layer (twice), and the attention scores, patterns and masks of `n_heads`
    query heads over `length` key positions.
    """
    width = 2 * d_vocab + 8 * d_model + 2 * d_mlp + 3 * n_heads * length
    itemsize = torch.empty((), dtype=dtype).element_size()
    return max(1, max_bytes // (new * width * itemsize))
