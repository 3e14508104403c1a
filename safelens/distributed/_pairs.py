"""What every job over prompt pairs does on the driver before it runs.

`patch_dataset` and `attribution_patch_dataset` sharded on workers check the same
options and the same pairs as they do in one process, before anything is sent: the
options, the metric, and the token ids against the workers' model (its vocabulary and
context, read once from a replica). Their fingerprints share the pairs' part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..core._errors import PatchingError
from ..patching._dataset import check_options, pair_tokens
from ._fingerprint import describe, tensor_digest

if TYPE_CHECKING:
    from ._workers import RayWorkers

__all__ = ["checked_pairs", "pairs_fingerprint"]


def checked_pairs(
    workers: RayWorkers,
    clean_tokens: Any,
    corrupted_tokens: Any,
    functions: dict[str, Any],
    n_bootstrap: Any,
    confidence: Any,
    seed: Any,
    max_bytes: Any,
    progress: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clean and corrupted token ids, checked as one process checks them, on the CPU.

    `functions` maps an argument's name to a value that must be callable (the metric,
    the sweep).

    **Raises:** what `patch_dataset` raises for its options and tokens; a
    [`PatchingError`][safelens.PatchingError] naming an argument that is not a function.
    """
    check_options(n_bootstrap, confidence, seed, max_bytes, progress)
    for name, value in functions.items():
        if not callable(value):
            raise PatchingError(f"{name} must be a function, got {type(value).__name__}")
    clean, corrupted = pair_tokens(workers.limits, clean_tokens, corrupted_tokens)
    return clean.long().cpu(), corrupted.long().cpu()


def pairs_fingerprint(
    workers: RayWorkers,
    job: str,
    clean: torch.Tensor,
    corrupted: torch.Tensor,
    metric: Any,
    options: dict[str, Any],
    **parts: Any,
) -> dict[str, str]:
    """A pair job's fingerprint: the job, the model, the pairs, the metric, `parts` (each
    described) and `options`."""
    return {
        "job": job,
        "model": workers.model_identity,
        "clean_tokens": tensor_digest(clean),
        "corrupted_tokens": tensor_digest(corrupted),
        "metric": describe(metric),
        **{name: describe(value) for name, value in parts.items()},
        "options": describe(options),
    }
