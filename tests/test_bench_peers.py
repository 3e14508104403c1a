"""The peers benchmark's quick mode runs, and safelens, nnsight and pyvene agree on every grid."""

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
            assert {"resid_pre", "attn_out", "mlp_out", "k", "v"} <= grids
    assert all(row.safelens > 0 and row.reference > 0 for row in rows)
