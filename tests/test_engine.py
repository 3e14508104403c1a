"""The loop every sweep runs (`safelens.patching._engine`): idle runs, budgets, slots.

Unit tests with a stand-in pass runner, and the HookedTransformer sweeps through it: a
memory budget bounds each pass by the positions it runs, as on HuggingFace models
(`tests/test_patching_hf_hostile.py`), with TransformerLens' numbers.
"""

from __future__ import annotations

import pytest
import torch
import transformer_lens.patching as tl_patching
from models import make_model, tokens

import safelens
from safelens.patching import _grid
from safelens.patching._engine import Run, score
from safelens.patching._limits import rows_within

BATCH = 2


def _metric(logits: torch.Tensor) -> torch.Tensor:
    """Per run: the first logit at the last position, summed over the run's rows."""
    return logits[:, -1, 0].reshape(-1, BATCH).sum(-1)


def _runner(seen: list[list[int]]):
    """A pass runner whose logits say which run each row belongs to (its slot)."""

    def run(chunk: list[Run]) -> torch.Tensor:
        seen.append([run.slot for run in chunk])
        slots = torch.tensor([float(run.slot) for run in chunk]).repeat_interleave(BATCH)
        return slots[:, None, None].expand(-1, 1, 3).clone()

    return run


def test_idle_runs_get_the_corrupted_runs_metric_without_a_pass():
    seen: list[list[int]] = []
    idle = [Run(1, 0, 1), Run(3, 1, 0)]
    runs = [Run(0, 0, 0), Run(2, 1, 1)]
    corrupted = torch.full((BATCH, 1, 3), 0.25)
    out = score(
        torch.zeros(4), _metric, BATCH, idle, corrupted, [(0, runs, _runner(seen))],
        lambda start: 100, None, False,
    )  # fmt: skip
    assert seen == [[0, 2]]
    assert out.tolist() == [0.0, 0.5, 4.0, 0.5]


@pytest.mark.parametrize("max_batch", [None, 3, 1])
def test_each_pass_is_cut_by_the_budget_of_its_start_and_by_max_batch(max_batch):
    seen: list[list[int]] = []
    early = [Run(slot, 0, 0) for slot in range(5)]
    late = [Run(slot, 0, 4) for slot in range(5, 14)]
    budget = {0: 2 * BATCH, 4: 4 * BATCH + 1}  # rows: two runs from 0, four from 4
    out = score(
        torch.zeros(14), _metric, BATCH, [], torch.zeros(BATCH, 1, 3),
        [(0, early, _runner(seen)), (4, late, _runner(seen))], budget.__getitem__,
        max_batch, False,
    )  # fmt: skip
    assert out.tolist() == [2.0 * slot for slot in range(14)]
    per_pass = [min(2, max_batch or 2), min(4, max_batch or 4)]
    sizes = [len(chunk) for chunk in seen]
    assert sum(seen, []) == list(range(14))
    assert sizes == _cut(5, per_pass[0]) + _cut(9, per_pass[1])


def _cut(runs: int, per_pass: int) -> list[int]:
    return [min(per_pass, runs - at) for at in range(0, runs, per_pass)]


def test_a_budget_too_small_for_one_run_still_runs_one_per_pass():
    seen: list[list[int]] = []
    runs = [Run(slot, 0, None) for slot in range(3)]
    score(
        torch.zeros(3), _metric, BATCH, [], torch.zeros(BATCH, 1, 3),
        [(0, runs, _runner(seen))], lambda start: 0, None, False,
    )  # fmt: skip
    assert seen == [[0], [1], [2]]


def test_hooked_sweeps_take_the_budget_of_each_pass_start(monkeypatch):
    model = make_model(n_layers=2)
    clean, corrupted = tokens(1, 8, seed=3), tokens(1, 8, seed=4)
    _, clean_cache = model.run_with_cache(clean)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1, 3] - logits[:, -1, 5]

    cfg = model.cfg
    sizes = dict(d_vocab=cfg.d_vocab, d_model=cfg.d_model, d_mlp=cfg.d_mlp, n_heads=cfg.n_heads)

    def rows(budget: int, new: int) -> int:  # the one estimate every sweep takes
        return rows_within(budget, **sizes, new=new, length=8, dtype=cfg.dtype)

    budget = 2 * (2**40 // rows(2**40, 8))  # two rows of a pass over every position
    assert rows(budget, 8) == 2 and rows(budget, 4) > 2
    passes: list[tuple[int, int]] = []
    forward = _grid._forward_chunk

    def counted(model, corrupted, pos, chunk, **shortcuts):
        passes.append((pos, len(chunk)))
        return forward(model, corrupted, pos, chunk, **shortcuts)

    monkeypatch.setattr(_grid, "_forward_chunk", counted)
    capped = safelens.get_act_patch_resid_pre(
        model, corrupted, clean_cache, metric, max_bytes=budget, progress=False
    )
    expected = tl_patching.get_act_patch_resid_pre(model, corrupted, clean_cache, metric)
    assert torch.allclose(capped, expected, atol=1e-4)
    assert all(runs <= rows(budget, 8 - start) for start, runs in passes)
    # Passes from later positions hold more runs than the first pass's budget allows.
    assert max(runs for start, runs in passes if start) > 2
