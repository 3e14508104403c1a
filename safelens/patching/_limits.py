"""The limits every patching sweep takes: `max_batch`, `max_bytes`, `progress`.

`max_batch` caps the patched runs per forward pass; `max_bytes` is a memory budget
(default 1 GiB) from which a sweep derives its own cap; `progress` shows a progress
bar. `_check_limits` refuses, with a `PatchingError` naming the argument, what is not a
positive int or a bool, before any forward pass.

Caveat: the budget bounds the activations a sweep estimates per forward pass, not the
process's peak memory.
"""

from __future__ import annotations

from typing import Any

from ..core._arguments import flag, positive_int
from ..core._errors import PatchingError

__all__ = ["DEFAULT_MAX_BYTES"]

DEFAULT_MAX_BYTES = 2**30


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
