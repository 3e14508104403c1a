"""How every sweep groups its patched runs into passes: by the position a pass starts at.

A patch at position `p` of a causal model changes nothing before `p`, so a pass that
starts at a position `s <= p`, on the corrupted run's frozen cache cropped to `s`, gives
the run's numbers. Runs patched at nearby positions share one pass: the one that starts
at their position rounded down to a multiple of a *span*. That means fewer, larger
passes, at the price of the positions `s … p - 1` each run recomputes.

Each family's runner chooses the spans:
- the `HookedTransformer` runner (`safelens.patching._grid`) uses a fixed one;
- the HuggingFace and bridge runner (`safelens.patching._hf_passes`) takes the cheapest
  of several by its cost model;
- where positions cannot be reused, the span is the prompt's length, so every pass
  starts at 0.

A group's runs are in layer order, as a staggered pass stacks them. Each pass reads
the corrupted run's frozen cache cropped to its start, its rows repeated once per run
(`run_rows`), frozen: no pass stores into it. A metric of every position gets the
corrupted run's logits before the start (`with_positions_before`): a patch changes
nothing there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch

from ._engine import Run

__all__ = ["groups", "run_rows", "with_positions_before"]

C = TypeVar("C", bound=Any)


def _by_start(runs: Iterable[Run], span: int) -> dict[int, list[Run]]:
    """`runs` by the position their pass starts at: theirs rounded down to a multiple of `span`.

    A run without a position (one that patches every position) starts at 0.
    """
    starts: dict[int, list[Run]] = {}
    for run in runs:
        pos = run.pos
        starts.setdefault(0 if pos is None else pos - pos % span, []).append(run)
    return starts


def groups(
    runs: Sequence[Run],
    spans: Sequence[int],
    cost: Callable[[int, list[Run]], float] | None = None,
) -> list[tuple[int, list[Run]]]:
    """`(start, runs in layer order)` for each pass start, in order of start (module notes).

    The span is the one of `spans` whose groups cost least by `cost(start, runs)`; the
    first of `spans` without `cost`. Runs of one layer keep their order in `runs`.
    """
    span = spans[0]
    if cost is not None and len(spans) > 1:
        totals = {
            each: sum(cost(start, chunk) for start, chunk in _by_start(runs, each).items())
            for each in spans
        }
        span = min(totals, key=totals.__getitem__)
    grouped = _by_start(runs, span)
    return [(start, sorted(grouped[start], key=_layer)) for start in sorted(grouped)]


def _layer(run: Run) -> int:
    return run.layer


def run_rows(prefix: C, runs: int, batch: int) -> C:
    """`prefix` (a cache of `batch` rows) repeated for `runs` runs, run-major, and frozen.

    A view of `prefix` where the batch is one row (`expand`); a copy of its rows
    otherwise (`select`).
    """
    rows = prefix.expand(runs) if batch == 1 else prefix.select(torch.arange(batch).repeat(runs))
    rows.freeze()
    return rows


def with_positions_before(
    logits: torch.Tensor, corrupted: torch.Tensor, start: int
) -> torch.Tensor:
    """`logits` of positions `start:` of its runs, after the `corrupted` run's logits before `start`.

    `logits` is `[runs * batch, pos - start, d_vocab]`, `corrupted` `[batch, pos, d_vocab]`.
    """
    if not start:
        return logits
    runs = logits.shape[0] // corrupted.shape[0]
    return torch.cat([corrupted[:, :start].repeat(runs, 1, 1), logits], dim=1)
