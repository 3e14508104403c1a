"""How every sweep groups its runs into passes (`safelens.patching._grouping`).

The sweeps' own tests check the numbers; these check the grouping both runners share.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hf_models import ids
from hf_models import model as hf_model

from safelens.backends._families import backend_of
from safelens.patching._engine import Run
from safelens.patching._grouping import groups, run_rows, with_positions_before


def test_runs_group_at_their_position_rounded_down_to_the_span_in_layer_order():
    cells = itertools.product(range(7), (2, 0, 1))
    runs = [Run(i, depth, pos) for i, (pos, depth) in enumerate(cells)]
    random.Random(0).shuffle(runs)
    got = groups(runs, (3,))
    assert [start for start, _ in got] == [0, 3, 6]
    for start, chunk in got:
        assert {run.pos for run in chunk} == set(range(start, min(start + 3, 7)))
        assert [run.layer for run in chunk] == sorted(run.layer for run in chunk)
        # runs of one layer keep the order they came in
        for each in (0, 1, 2):
            mine = [run for run in chunk if run.layer == each]
            assert mine == [run for run in runs if run.layer == each and run in mine]
    assert sorted(run for _, chunk in got for run in chunk) == sorted(runs)


def test_a_run_without_a_position_starts_at_zero():
    first, second, third = Run(0, 1, None), Run(1, 0, 5), Run(2, 0, None)
    assert groups([first, second, third], (4,)) == [(0, [third, first]), (4, [second])]


def test_the_span_is_the_cheapest_by_the_cost_and_the_first_without_one():
    runs = [Run(pos, 0, pos) for pos in range(8)]

    def per_pass(start, chunk):  # a pass costs 10, each run its positions from the start
        return 10 + sum(8 - start for _ in chunk)

    def per_position(start, chunk):  # passes are free: the smallest span wins
        return sum(8 - start for _ in chunk)

    assert [start for start, _ in groups(runs, (1, 2, 4, 8), per_pass)] == [0, 4]
    assert len(groups(runs, (8, 1, 2), per_position)) == 8
    assert len(groups(runs, (2, 1))) == 4


def _family_model(family):
    if family == "hf":
        return hf_model("llama")
    from models import make_model

    return make_model()


@pytest.mark.parametrize(
    "family", [pytest.param("hooked", marks=pytest.mark.hooked_transformer), "hf"]
)
@pytest.mark.parametrize("batch", [1, 2])
def test_run_rows_hands_each_run_the_frozen_prefix(family, batch):
    """Every run's rows continue the prefix as the prefix itself does; the prefix keeps its length."""
    backend = backend_of(_family_model(family))
    tokens = ids(batch, 6)
    mask = torch.ones_like(tokens)
    with torch.no_grad():
        prefix = backend.empty_cache(batch)
        backend.forward(tokens[:, :5], mask[:, :5], prefix)
        prefix.freeze()
        alone = backend.forward(tokens[:, 5:], mask, prefix)
        rows = run_rows(prefix, 3, batch)
        got = backend.forward(tokens[:, 5:].repeat(3, 1), mask.repeat(3, 1), rows)
    assert got.shape[0] == 3 * batch
    assert torch.allclose(got, alone.repeat(3, 1, 1), atol=1e-5)
    ops = backend.caches
    assert ops.is_frozen(rows) and ops.batch_size(rows) == 3 * batch
    assert ops.length(prefix) == ops.length(rows) == 5
    for got_kv, prefix_kv in zip(ops.layer(rows, 1), ops.layer(prefix, 1), strict=True):
        assert torch.equal(got_kv, prefix_kv.repeat(3, *(1,) * (prefix_kv.dim() - 1)))


def test_positions_before_the_start_are_the_corrupted_runs():
    corrupted = torch.randn(2, 5, 7)
    logits = torch.randn(3 * 2, 3, 7)  # three runs of two rows, positions 2:
    got = with_positions_before(logits, corrupted, 2)
    assert got.shape == (6, 5, 7)
    assert torch.equal(got[:, :2], corrupted[:, :2].repeat(3, 1, 1))
    assert torch.equal(got[:, 2:], logits)
    assert with_positions_before(logits, corrupted, 0) is logits
