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

from ..core._errors import PatchingError
from ..patching._dataset import (
    PatchingResult,
    _backend,
    _chunk,
    _summary,
    check_options,
    pair_tokens,
    pairs_per_chunk,
)
from ._fingerprint import describe, tensor_digest
from ._job import ShardedJob

if TYPE_CHECKING:
    from ._workers import RayWorkers

__all__ = ["patching_job", "patching_result"]


def _chunk_size(model: Any, pairs: int, length: int, max_bytes: int) -> int:
    """On a worker: the pairs `patch_dataset` puts in one chunk."""
    return pairs_per_chunk(_backend(model), pairs, length, max_bytes)


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
    backend = _backend(model)
    clean, corrupted = clean.to(backend.device), corrupted.to(backend.device)
    rows = torch.arange(start, start + clean.shape[0], device=backend.device)
    values = _chunk(sweep, backend, clean, corrupted, metric, rows, max_batch, max_bytes)
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
    check_options(n_bootstrap, confidence, seed, max_bytes, progress)
    for value, name in ((sweep, "sweep"), (metric, "metric")):
        if not callable(value):
            raise PatchingError(f"{name} must be a function, got {type(value).__name__}")
    clean, corrupted = pair_tokens(workers.limits, clean_tokens, corrupted_tokens)
    clean, corrupted = clean.long().cpu(), corrupted.long().cpu()
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

    fingerprint = {
        "job": "patch_dataset",
        "model": workers.model_identity,
        "clean_tokens": tensor_digest(clean),
        "corrupted_tokens": tensor_digest(corrupted),
        "sweep": describe(sweep),
        "metric": describe(metric),
        "options": describe(
            dict(
                n_bootstrap=n_bootstrap,
                confidence=confidence,
                seed=seed,
                max_batch=max_batch,
                max_bytes=max_bytes,
            )
        ),  # fmt: skip
    }
    return ShardedJob("pairs", pairs, _patch_shard, inputs, fingerprint, chunk)


def patching_result(
    shards: list[dict[str, torch.Tensor]], n_bootstrap: int, confidence: float, seed: int
) -> PatchingResult:
    """`patch_dataset`'s result from the shards' per-pair values."""
    per_pair = torch.cat([shard["per_pair"] for shard in shards])
    return _summary(per_pair, n_bootstrap, confidence, seed)
