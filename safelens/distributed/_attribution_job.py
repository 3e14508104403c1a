"""`attribution_patch_dataset` as a sharded job: each shard is one chunk of pairs.

A shard runs `attribution_patch_dataset`'s own chunk on its pairs (one corrupted forward
and backward pass, one clean cache), so a shard holding the pairs of one of its chunks
gives its per-pair estimates bitwise. The driver concatenates the shards' baselines and
grids and summarises them as `attribution_patch_dataset` does, with the same seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..backends._families import backend_of
from ..patching._attribution_dataset import (
    AttributionDatasetResult,
    attribution_chunk,
    attribution_summary,
    pairs_per_attribution_chunk,
)
from ..patching._attribution_plan import check_activations, plan
from ..patching._dataset_chunks import PairMetric
from ._job import ShardedJob
from ._pairs import checked_pairs, pairs_fingerprint

if TYPE_CHECKING:
    from ._workers import RayWorkers

__all__ = ["attribution_job", "attribution_result"]

_WHAT = "attribution_patch_dataset"
_BASELINE = "baseline"  # a shard's corrupted metric; its grids are named by activation


def _checked_chunk_size(
    model: Any,
    activations: Any,
    qk_fix: Any,
    corrupted: torch.Tensor,
    pairs: int,
    max_bytes: int,
) -> int:
    """On a worker: the activations and `qk_fix` checked against the model (what
    `attribution_patch_dataset` refuses), then the pairs one of its chunks takes."""
    device = backend_of(model, _WHAT).device
    chosen = plan(model, activations, qk_fix, None, corrupted.to(device), _WHAT)
    return pairs_per_attribution_chunk(chosen.backend, pairs, corrupted.shape[1], max_bytes)


def _attribution_shard(
    model: Any,
    activations: Sequence[str],
    qk_fix: bool,
    clean: torch.Tensor,
    corrupted: torch.Tensor,
    metric: PairMetric,
    start: int,
) -> dict[str, torch.Tensor]:
    """On a worker: the baselines and grids of pairs `start`, `start + 1`, … (one chunk)."""
    device = backend_of(model, _WHAT).device
    clean, corrupted = clean.to(device), corrupted.to(device)
    chosen = plan(model, activations, qk_fix, None, corrupted, _WHAT)
    rows = torch.arange(start, start + clean.shape[0], device=device)
    baseline, grids = attribution_chunk(chosen, metric, clean, corrupted, rows)
    return {_BASELINE: baseline, **grids}


def attribution_job(
    workers: RayWorkers,
    clean_tokens: Any,
    corrupted_tokens: Any,
    metric: PairMetric,
    activations: Any,
    qk_fix: Any,
    n_bootstrap: int,
    confidence: float,
    seed: int,
    max_bytes: int,
    progress: bool,
) -> ShardedJob:
    """The sharded job of `attribution_patch_dataset`, its arguments checked first."""
    clean, corrupted = checked_pairs(
        workers, clean_tokens, corrupted_tokens, {"metric": metric},
        n_bootstrap, confidence, seed, max_bytes, progress,
    )  # fmt: skip
    activations = check_activations(activations)
    pairs = clean.shape[0]
    chunk = workers.call(_checked_chunk_size, activations, qk_fix, corrupted[:1], pairs, max_bytes)

    def inputs(start: int, stop: int) -> tuple[Any, ...]:
        return (activations, qk_fix, clean[start:stop], corrupted[start:stop], metric, start)

    options = dict(
        qk_fix=qk_fix, n_bootstrap=n_bootstrap, confidence=confidence, seed=seed,
        max_bytes=max_bytes,
    )  # fmt: skip
    fingerprint = pairs_fingerprint(
        workers, _WHAT, clean, corrupted, metric, options, activations=activations
    )
    return ShardedJob("pairs", pairs, _attribution_shard, inputs, fingerprint, chunk)


def attribution_result(
    shards: list[dict[str, torch.Tensor]],
    activations: Sequence[str],
    n_bootstrap: int,
    confidence: float,
    seed: int,
) -> AttributionDatasetResult:
    """`attribution_patch_dataset`'s result from the shards' baselines and grids."""
    return attribution_summary(
        [shard[_BASELINE] for shard in shards],
        {name: [shard[name] for shard in shards] for name in check_activations(activations)},
        n_bootstrap,
        confidence,
        seed,
    )
