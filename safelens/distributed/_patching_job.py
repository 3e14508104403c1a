"""`patch_dataset` as a sharded job: each shard is one chunk of pairs, as in one process.

A shard runs `patch_dataset`'s own chunk on its pairs (the same sweep call, the same
run numbering), so a shard holding the pairs of one of `patch_dataset`'s chunks gives
its per-pair values bitwise. The driver concatenates the shards' per-pair values and
computes the mean, standard error and bootstrap interval as `patch_dataset` does, with
the same seed: the same numbers, on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..patching._dataset import PatchingResult, dataset_backend, summary
from ..patching._dataset_chunks import pairs_per_chunk, patched_chunk
from ._job import ShardedJob
from ._pairs import checked_pairs, pairs_fingerprint

if TYPE_CHECKING:
    from ._workers import RayWorkers

__all__ = ["patching_job", "patching_result"]


def _chunk_size(model: Any, pairs: int, length: int, max_bytes: int) -> int:
    """On a worker: the pairs `patch_dataset` puts in one chunk."""
    return pairs_per_chunk(dataset_backend(model), pairs, length, max_bytes)


def _patch_shard(
    model: Any,
    sweep: Callable[..., torch.Tensor],
    clean: torch.Tensor,
    corrupted: torch.Tensor,
    metric: Callable[..., torch.Tensor],
    start: int,
    max_batch: int | None,
    max_bytes: int,
) -> dict[str, torch.Tensor]:
    """On a worker: the per-pair values of pairs `start`, `start + 1`, … (one chunk)."""
    backend = dataset_backend(model)
    clean, corrupted = clean.to(backend.device), corrupted.to(backend.device)
    rows = torch.arange(start, start + clean.shape[0], device=backend.device)
    values = patched_chunk(sweep, backend, clean, corrupted, metric, rows, max_batch, max_bytes)
    return {"per_pair": values}


def patching_job(
    workers: RayWorkers,
    sweep: Callable[..., torch.Tensor],
    clean_tokens: Any,
    corrupted_tokens: Any,
    metric: Callable[..., torch.Tensor],
    n_bootstrap: int,
    confidence: float,
    seed: int,
    max_batch: int | None,
    max_bytes: int,
    progress: bool,
) -> ShardedJob:
    """The sharded job of `patch_dataset`, its arguments checked on the driver."""
    functions = {"sweep": sweep, "metric": metric}
    clean, corrupted = checked_pairs(
        workers, clean_tokens, corrupted_tokens, functions,
        n_bootstrap, confidence, seed, max_bytes, progress,
    )  # fmt: skip
    pairs, length = clean.shape
    chunk = workers.call(_chunk_size, pairs, length, max_bytes)

    def inputs(start: int, stop: int) -> tuple[Any, ...]:
        return (
            sweep,
            clean[start:stop],
            corrupted[start:stop],
            metric,
            start,
            max_batch,
            max_bytes,
        )

    options = dict(
        n_bootstrap=n_bootstrap, confidence=confidence, seed=seed, max_batch=max_batch,
        max_bytes=max_bytes,
    )  # fmt: skip
    fingerprint = pairs_fingerprint(
        workers, "patch_dataset", clean, corrupted, metric, options, sweep=sweep
    )
    return ShardedJob("pairs", pairs, _patch_shard, inputs, fingerprint, chunk)


def patching_result(
    shards: list[dict[str, torch.Tensor]], n_bootstrap: int, confidence: float, seed: int
) -> PatchingResult:
    """`patch_dataset`'s result from the shards' per-pair values."""
    per_pair = torch.cat([shard["per_pair"] for shard in shards])
    return summary(per_pair, n_bootstrap, confidence, seed)
