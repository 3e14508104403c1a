"""The HuggingFace benchmark's quick mode runs, and every row's numbers agree."""

from __future__ import annotations

import torch

from benchmarks import bench_hf


def test_quick_rows_agree_and_cover_continuations_memory_generation_and_the_bridge():
    torch.manual_seed(0)
    rows = bench_hf.run(quick=True)
    jobs = [row.job for row in rows]
    assert [row.job for row in rows if not row.agree] == []
    assert sum("continuations × 4 tokens" in job for job in jobs) == 4
    assert sum("DynamicCaches" in job for job in jobs) == 1
    assert sum("greedy generation" in job for job in jobs) == 3
    assert sum(job.startswith("TransformerBridge") for job in jobs) == 3
    assert all(row.safelens > 0 and row.reference > 0 for row in rows)
