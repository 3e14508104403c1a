"""The loop of every sweep, on every family: its runs scored into the result, pass by pass.

A sweep is a list of patched runs ([`Run`][safelens.patching._engine.Run]), one per
index of its grid. `run_passes` runs them on any family: the family's corrupted run
(a `Passes`) says where the runs patch and what its own run holds there; the runs
split in two:

- the *idle* runs, whose patch writes what the corrupted run already holds
  (`safelens.patching._unchanged`): each gets the metric of the corrupted run's logits,
  without a pass;
- the others in *passes* `(start, runs, runner)` (the family's `Schedule`): runs that
  share a pass from position `start` (`safelens.patching._grouping`), in layer order.
  The memory budget bounds the rows of one pass of the positions from `start`
  (`safelens.patching._limits`), so a pass's runs are cut into chunks of at most that
  many (and at most `max_batch`), and `runner(chunk)` gives each chunk's logits,
  `batch` rows per run (`score`).

What runs a pass is the family's: on a `HookedTransformer`, `safelens.patching._grid`;
on a HuggingFace model or a TransformerBridge, `safelens.patching._hf_passes`. Both
write a sweep's patches with `put`, at the runs' rows, positions, heads and source
positions (`patch_index`), in the layout the family's site declares
(`safelens.backends._sites.Site`); a user's `patch_setter` writes its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

import torch
from tqdm import tqdm

from ..backends._sites import Site
from ._limits import Limits
from ._metric import Metric, _Metric
from ._unchanged import idle_runs

__all__ = [
    "Passes",
    "Patcher",
    "Planned",
    "Run",
    "Schedule",
    "patch_index",
    "put",
    "run_passes",
    "score",
]


class Run(NamedTuple):
    """One patched run: where its metric goes in the result, and what it patches.

    `slot` is its place in the result (flattened); `layer` the layer of its patch; `pos`
    the position of its patch (`None` for a patch of every position); `head` and `src`
    its head and source position where the sweep has them; `cell` its row of the
    sweep's index (on a `HookedTransformer`, what a user's `patch_setter` and the idle
    check read).
    """

    slot: int
    layer: int
    pos: int | None
    head: int | None = None
    src: int | None = None
    cell: tuple[int, ...] = ()


# Patch an activation in place for `runs`, the `batch` rows of each at its place in `places`.
# `patcher(tensor, runs, places, batch, start)`: `tensor` holds positions `start:`.
Patcher = Callable[[torch.Tensor, list[Run], list[int], int, int], None]

# A pass: its first position, its runs (in layer order), and what gives a chunk's logits.
Planned = tuple[int, list[Run], Callable[[list[Run]], torch.Tensor]]


class Schedule(NamedTuple):
    """A sweep's passes on its family, ready to score (`score`'s arguments).

    `passes` are `Planned`; `idle_logits` the corrupted run's logits an idle run is
    scored on (the last position's alone for a metric that reads only that);
    `rows(start)` how many rows a pass from position `start` may hold; `context` what
    the passes run within (no gradients, the family's module replacements).
    """

    passes: list[Planned]
    idle_logits: torch.Tensor
    rows: Callable[[int], int]
    context: AbstractContextManager[Any]


class Passes(Protocol):
    """One family's passes for a sweep, its corrupted run done.

    - `batch`: the rows of the corrupted prompt;
    - `site`: where the runs patch, laid out as `put` writes it (`None` where a user's
      setter writes: then no run is idle); `seen`: per layer, what the corrupted run
      holds there as the patch sees it (empty: no run is idle);
    - `schedule(runs, metric, max_bytes)`: the passes of `runs`, none idle, each within
      `max_bytes`.
    """

    @property
    def batch(self) -> int: ...

    @property
    def site(self) -> Site | None: ...

    @property
    def seen(self) -> dict[int, torch.Tensor]: ...

    def schedule(self, runs: list[Run], metric: Metric, max_bytes: int) -> Schedule: ...


def run_passes(
    passes: Passes,
    clean: list[torch.Tensor],
    runs: list[Run],
    out: torch.Tensor,
    metric: Metric,
    limits: Limits,
) -> torch.Tensor:
    """Every run's metric at its slot of `out`, on any family; return `out`.

    Runs that write what the corrupted run holds (`clean[layer]` equal to `seen[layer]`
    where they write, `safelens.patching._unchanged`) get its metric without a pass; the
    others run in the family's passes (`Passes.schedule`), scored chunk by chunk.
    """
    site = passes.site
    idle = idle_runs(site, clean, passes.seen, runs) if site is not None else []
    skipped = {run.slot for run in idle}
    busy = [run for run in runs if run.slot not in skipped]
    schedule = passes.schedule(busy, metric, limits.max_bytes)
    with schedule.context:
        return score(
            out,
            metric,
            passes.batch,
            idle,
            schedule.idle_logits,
            schedule.passes,
            schedule.rows,
            limits.max_batch,
            limits.progress,
        )


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


def patch_index(
    places: Sequence[int], runs: Sequence[Run], batch: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Where `runs`, at `places` of their pass (`batch` rows each), write: `put`'s `index`.

    `(rows, clean rows, pos, head, src)`: each run's rows, the clean run's rows they
    take, and each run's position, head and source position repeated per row (empty
    for a field the runs do not have).
    """
    offsets = torch.arange(batch, device=device)
    rows = (torch.tensor(list(places), device=device)[:, None] * batch + offsets).reshape(-1)
    fields = (
        torch.tensor(
            [run[field] for run in runs if run[field] is not None], dtype=torch.long, device=device
        ).repeat_interleave(batch)
        for field in (2, 3, 4)  # pos, head, src
    )
    return (rows, offsets.repeat(len(runs)), *fields)


def put(
    site: Site,
    tensor: torch.Tensor,
    clean: torch.Tensor,
    index: tuple[torch.Tensor, ...],
    start: int,
) -> torch.Tensor:
    """Write the clean values at `index` into `tensor`, which holds positions `start:`.

    `index` is `patch_index`'s: rows of `tensor`, rows of `clean`, and the runs'
    positions, heads and source positions (empty where the runs have none: every
    position the pass runs, every head). `tensor` and `clean` are laid out as `site`
    says. `clean` is on its layer's device; `tensor` too, except a layer's input, which
    a `device_map` model hands on from the previous layer's device (accelerate moves it).
    """
    rows, clean_rows, pos, head, src = index
    target: list[Any] = [slice(None)] * tensor.dim()
    source: list[Any] = [slice(None)] * clean.dim()
    target[0], source[0] = rows, clean_rows
    if pos.numel():
        target[site.pos_axis], source[site.pos_axis] = pos - start, pos
    else:  # every position the pass runs
        source[site.pos_axis] = slice(start, None)
    if head.numel():
        target[site.head_axis], source[site.head_axis] = head, head
    if src.numel():  # a pattern's source positions, after its destination positions
        target[site.pos_axis + 1], source[site.pos_axis + 1] = src, src
    # In place, as TransformerLens' setters: a bridge alias such as `hook_resid_mid`
    # (`ln2.hook_in`) ignores what its hook returns. Cast, as their slice assignment does.
    values = clean[_on(source, clean.device)].to(tensor.device, tensor.dtype)
    tensor[_on(target, tensor.device)] = values
    return tensor


def _on(index: list[Any], device: torch.device) -> tuple[Any, ...]:
    """`index` with its tensors on `device` (no copy when they are there already)."""
    return tuple(part.to(device) if isinstance(part, torch.Tensor) else part for part in index)
