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
change and run as usual. A generic sweep skips only where it runs as a named sweep of
its index rows (one of TransformerLens' own setters, whose writes are known:
`safelens.patching._front`); any other `patch_setter` may write anything. The corrupted
run's tensors at the sweep's site are compared as its patch hook sees them (on a bridge
or HuggingFace model captured by `seeing`), by `idle_runs`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..backends._backend import Backend
from ..backends._sites import Site
from ._hf_sites import site_edits

__all__ = ["idle_runs", "marked", "seeing", "unchanged"]

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


def marked(same: list[torch.Tensor], cells: list[tuple[int, ...]]) -> list[bool]:
    """`same[layer][rest]` for every cell `(layer, *rest)`: one indexing for all of them."""
    if not cells:
        return []
    flags = torch.stack(same)[tuple(torch.tensor(cells).T)]
    return [bool(flag) for flag in flags.tolist()]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s bits, as integers of its item size (`-0.0` and `0.0` differ)."""
    if not tensor.is_floating_point():
        return tensor
    return tensor.view(_BITS[tensor.element_size()])


# -- At a sweep's site: what its patch hooks see (`seeing`), and the runs that change nothing


@contextmanager
def seeing(
    backend: Backend, site: Site, cache: Any, seen: dict[int, torch.Tensor], generic: bool
) -> Iterator[None]:
    """Within the block, `seen[layer]` gets the tensor the site's patch hook sees (this thread's).

    Nothing for a `generic` sweep: its setter may write anything.
    """
    if generic:
        yield
        return
    me = threading.get_ident()

    def keep(layer: int) -> Callable[..., None]:
        def hook(tensor: torch.Tensor, hook: Any = None) -> None:
            if threading.get_ident() == me:
                seen[layer] = tensor.detach().clone()

        return hook

    hooked = [(site.hook(layer), keep(layer)) for layer in range(backend.n_layers)]
    inputs = {layer: keep(layer) for layer, (name, _) in enumerate(hooked) if name is None}
    pairs = [(name, hook) for name, hook in hooked if name is not None]
    with site_edits(backend, {site.activation: inputs}), backend.pass_hooks(cache, pairs):  # type: ignore[arg-type]
        yield


def idle_runs(
    site: Site, clean: list[torch.Tensor], seen: dict[int, torch.Tensor], runs: list[Any]
) -> list[Any]:
    """The runs `(slot, layer, pos, head, src)` whose patch writes what `seen` holds."""
    if not runs or len(seen) < len(clean):
        return []
    fields = [field for field in (2, 4, 3) if runs[0][field] is not None]  # pos, src, head
    axes = {2: site.pos_axis, 4: site.pos_axis + 1, 3: site.head_axis}
    same = [
        unchanged(clean[layer], seen[layer], [axes[field] for field in fields])
        for layer in range(len(clean))
    ]
    cells = [(run[1], *(run[field] for field in fields)) for run in runs]
    return [run for run, idle in zip(runs, marked(same, cells), strict=True) if idle]
