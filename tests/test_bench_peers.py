"""The peers benchmark's quick mode runs, and safelens, nnsight and pyvene agree on every
grid, and safelens' attribution with nnsight's hand-written one."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_peers


@pytest.mark.slow  # nnsight and pyvene wrap each model anew
def test_quick_run_agrees_on_every_grid_and_attribution_against_the_peers():
    torch.manual_seed(0)
    rows = bench_peers.run(quick=True)
    assert [row.job for row in rows if not row.agree] == []
    for family in ("llama", "gpt2"):
        for peer in ("nnsight", "pyvene"):
            grids = {
                row.job.split(" ")[0]
                for row in rows
                if f"HF {family}," in row.job and peer in row.job and "grid" in row.job
            }
            assert grids == set(bench_peers.SITES)
        # Without and with the QK fix, under the suite's no_grad (conftest).
        attribution = [
            row for row in rows if row.job.startswith("attribution") and family in row.job
        ]
        assert len(attribution) == 2, [row.job for row in attribution]
    assert all(row.safelens > 0 and row.reference > 0 for row in rows)
