"""A tensor's in-place edit counter, where it has one: `version_of`.

Several shortcuts keep a result for a tensor until it is edited in place, which PyTorch
counts in `tensor._version`. A tensor made under `torch.inference_mode()` counts
nothing, and reading its counter raises; such a tensor has no version here (`None`),
and a shortcut keyed on it is not taken.
"""

from __future__ import annotations

import torch

__all__ = ["version_of"]


def version_of(tensor: torch.Tensor) -> int | None:
    """`tensor._version`, or `None` for an inference tensor (which counts no edits)."""
    return None if tensor.is_inference() else tensor._version
