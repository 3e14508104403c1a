"""The loop of every sweep, on every family: its runs scored into the result, pass by pass.

A sweep is a list of patched runs ([`Run`][safelens.patching._engine.Run]), one per
index of its grid. Every sweep hands them here split in two:

- the *idle* runs, whose patch writes what the corrupted run already holds
  (`safelens.patching._unchanged`): each gets the metric of the corrupted run's logits,
  without a pass;
- the others in *passes* `(start, runs, runner)`: runs that share a pass from position
  `start` (`safelens.patching._grouping`), in layer order. The memory budget bounds the
  rows of one pass of the positions from `start` (`safelens.patching._limits`), so a
  pass's runs are cut into chunks of at most that many (and at most `max_batch`), and
  `runner(chunk)` gives each chunk's logits, `batch` rows per run.

What runs a pass is the family's: on a `HookedTransformer`, `safelens.patching._grid`;
on a HuggingFace model or a TransformerBridge, `safelens.patching._hf_passes`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from tqdm import tqdm

from ._metric import Metric, _Metric

__all__ = ["Planned", "Run", "score"]


class Run(NamedTuple):
    """One patched run: where its metric goes in the result, and what it patches.

    `slot` is its place in the result (flattened); `layer` the layer of its patch; `pos`
    the position of its patch (`None`, or 0 on a `HookedTransformer`, for a patch of
    every position); `head` and `src` its head and source position where the sweep has
    them; `cell` its row of the sweep's index (a `HookedTransformer`'s patchers read it).
    """

    slot: int
    layer: int
    pos: int | None
    head: int | None = None
    src: int | None = None
    cell: tuple[int, ...] = ()


# A pass: its first position, its runs (in layer order), and what gives a chunk's logits.
Planned = tuple[int, list[Run], Callable[[list[Run]], torch.Tensor]]


def score(
    out: torch.Tensor,
    metric: Metric,
    batch: int,
    idle: Sequence[Run],
    idle_logits: torch.Tensor,
    passes: Sequence[Planned],
    rows: Callable[[int], int],
    max_batch: int | None,
    progress: bool,
) -> torch.Tensor:
    """Fill `out.view(-1)[run.slot]` with the metric of every run; return `out` (module notes).

    `idle_logits` are the corrupted run's (the last position's alone for a metric that
    reads only that); `rows(start)` is how many rows a pass from position `start` may hold.
    """
    flat = out.view(-1)
    scored = _Metric(metric, batch)
    total = len(idle) + sum(len(runs) for _, runs, _ in passes)
    with tqdm(total=total, disable=not progress, desc="patching") as bar:
        if idle:
            slots = torch.tensor([run.slot for run in idle], device=out.device)
            flat[slots] = scored(idle_logits.detach(), 1).to(out.device, out.dtype)
            bar.update(len(idle))
        for start, runs, runner in passes:
            per_pass = max(1, rows(start) // batch)
            per_pass = min(per_pass, max_batch) if max_batch else per_pass
            for at in range(0, len(runs), per_pass):
                chunk = runs[at : at + per_pass]
                logits = runner(chunk)
                slots = torch.tensor([run.slot for run in chunk], device=out.device)
                flat[slots] = scored(logits, len(chunk)).to(out.device, out.dtype)
                bar.update(len(chunk))
    return out
