"""Patches that change nothing: their runs are the corrupted run, and run no pass.

Two prompts of a pair usually share their first positions (a name swapped in the middle
of a sentence, a corrupted subject after a shared template). In a causal model every
activation of those positions is the same in the clean and the corrupted run, so a
by-position patch there writes the values the corrupted run already holds: the patched
run *is* the corrupted run, and its metric is the corrupted run's. The sweeps find such
patches before running anything and give them the corrupted run's metric, without a
pass; on a prompt pair that differs from position `d` on, that is every patch before `d`,
the costliest ones (they recompute the most positions).

The test is bitwise, on the tensor the patch would be written into, every row of the
batch: values equal only after rounding, `-0.0` against `0.0`, and NaN all count as a
change and run as usual. A generic sweep skips only with one of TransformerLens' own
setters, whose writes are known; any other `patch_setter` may write anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["unchanged"]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def unchanged(clean: torch.Tensor, corrupted: torch.Tensor, keep: Sequence[int]) -> torch.Tensor:
    """Per index of the axes `keep` (in that order): whether `clean` there is `corrupted`, bitwise.

    Both tensors are `[batch, ...]` alike; every axis not in `keep` (the batch among
    them) must match whole. Returns a bool tensor shaped by the `keep` axes.
    """
    if clean.shape != corrupted.shape or clean.dtype != corrupted.dtype:
        return torch.zeros([clean.shape[axis] for axis in keep], dtype=torch.bool)
    same = _bits(clean) == _bits(corrupted)
    if clean.is_floating_point():
        same &= ~clean.isnan()
    rest = [axis for axis in range(same.dim()) if axis not in keep]
    return same.permute(*keep, *rest).flatten(len(keep)).all(-1).cpu()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s bits, as integers of its item size (`-0.0` and `0.0` differ)."""
    if not tensor.is_floating_point():
        return tensor
    return tensor.view(_BITS[tensor.element_size()])
