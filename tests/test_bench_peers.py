"""The peers benchmark's quick mode runs, and safelens, nnsight and pyvene agree on every
grid, and safelens' attribution with nnsight's hand-written one."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_peers


@pytest.mark.slow  # minutes on two shared cores: nnsight and pyvene wrap each model anew
def test_quick_rows_agree_on_both_families_against_both_peers():
    torch.manual_seed(0)
    sizes = bench_peers.QUICK
    rows = [
        row
        for family in ("llama", "gpt2")
        for row in bench_peers.grid_rows(
            family, bench_peers.model_of(family, sizes), sizes.lengths[0], sizes
        )
    ]
    assert [row.job for row in rows if not row.agree] == []
    for family in ("llama", "gpt2"):
        for peer in ("nnsight", "pyvene"):
            grids = {
                row.job.split(" ")[0]
                for row in rows
                if f"HF {family}," in row.job and peer in row.job
            }
            assert grids == set(bench_peers.SITES)
    assert all(row.safelens > 0 and row.reference > 0 for row in rows)


@pytest.mark.slow  # nnsight wraps each model anew
def test_quick_attribution_rows_agree_with_nnsight_under_no_grad():
    # The suite runs every test under no_grad (conftest): both sides take their gradients
    # whatever the caller's grad mode.
    sizes = bench_peers.QUICK
    for family in ("llama", "gpt2"):
        model = bench_peers.model_of(family, sizes)
        rows = bench_peers.attribution_rows(family, model, sizes.lengths[0], sizes)
        assert len(rows) == 2, [row.job for row in rows]
        unfixed = rows[0]
        assert unfixed.agree, unfixed.note
        assert "QK fix" not in unfixed.job and "QK fix" in rows[1].job
