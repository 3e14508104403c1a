"""Scoring and generation after many prompts, as sharded jobs: a shard is a run of prompts.

Each prompt is one item: on its worker it is run once into a frozen prefix with
[`prefill`][safelens.prefill], then its continuations are scored with
[`score_continuations`][safelens.score_continuations], or samples drawn with
[`generate`][safelens.generate] (prompt `i` with `seed + i`). Each prompt's numbers are
computed alone, as in a one-process loop over the prompts, so they do not depend on
the shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from ..backends._families import backend_of
from ..core._arguments import flag, positive_int
from ..core._tokens import check_tokens
from ..experiments._continuations import (
    ContinuationScores,
    continuation_rows,
    score_continuations,
)
from ..experiments._generation import Generation, check_sampling, check_seed, generate
from ..experiments._prefix import prefill, token_limits
from ..patching._dataset import dataset_backend
from ._fingerprint import describe
from ._job import ShardedJob

if TYPE_CHECKING:
    from ._workers import RayWorkers

__all__ = [
    "token_limits_of",
    "continuations_job",
    "continuations_result",
    "generation_job",
    "generation_result",
]

# Tensors a shard file's header lists at most about 1500 (256 KiB); three per prompt.
_MAX_PROMPTS_PER_SHARD = 256
# Prompts run one by one, so small shards cost nothing and even out unequal lengths.
_SHARDS_PER_WORKER = 4


def token_limits_of(model: Any) -> SimpleNamespace:
    """On a worker: the `d_vocab` and `n_ctx` token ids are checked against."""
    return token_limits(dataset_backend(model))


def _prompts(limits: SimpleNamespace, prompts: Any, past: int = 0) -> list[torch.Tensor]:
    """Each prompt as 1-D token ids, checked; a `TokenError` or `TypeError` otherwise."""
    if isinstance(prompts, torch.Tensor):
        rows = list(check_tokens(prompts, limits, "prompts", past=past))
    elif isinstance(prompts, Sequence) and not isinstance(prompts, str):
        rows = [
            check_tokens(row, limits, f"prompts[{i}]", past=past, rank=1)
            for i, row in enumerate(prompts)
        ]
    else:
        raise TypeError(
            f"prompts must be a list of 1-D token tensors or lists, or a [prompts, pos] "
            f"tensor; got {type(prompts).__name__}"
        )
    if not rows:
        raise ValueError("prompts is empty; pass at least one prompt")
    return [row.long().cpu() for row in rows]


def _device(model: Any) -> torch.device:
    return backend_of(model, "RayWorkers").device


def _score_shard(
    model: Any,
    start: int,
    prompts: list[torch.Tensor],
    continuations: list[list[torch.Tensor]],
    batch_size: int | None,
    memory_budget: int | None,
) -> dict[str, torch.Tensor]:
    """On a worker: each prompt's continuation scores, named by the prompt's index."""
    device, out = _device(model), dict[str, torch.Tensor]()
    for index, (prompt, rows) in enumerate(zip(prompts, continuations, strict=True), start):
        prefix = prefill(model, prompt[None].to(device), keep_residuals=False)
        rows = [row.to(device) for row in rows]
        scores = score_continuations(model, prefix, rows, batch_size, memory_budget, False)
        out |= {f"{name}.{index}": getattr(scores, name) for name in ("log_probs", "mask", "sums")}
    return out


def continuations_job(
    workers: RayWorkers,
    prompts: Any,
    continuations: Any,
    batch_size: int | None,
    memory_budget: int | None,
) -> ShardedJob:
    """The sharded job of scoring `continuations[i]` after `prompts[i]`, checked."""
    positive_int(batch_size, "batch_size", optional=True)
    positive_int(memory_budget, "memory_budget", optional=True, unit=" (bytes)")
    rows = _prompts(workers.limits, prompts)
    if not isinstance(continuations, Sequence) or len(continuations) != len(rows):
        got = len(continuations) if isinstance(continuations, Sequence) else continuations
        raise ValueError(
            f"continuations must be a list of one list of continuations per prompt "
            f"({len(rows)}), got {got!r}"
        )
    scored = [
        [row.long().cpu() for row in continuation_rows(c, workers.limits, len(prompt))]
        for prompt, c in zip(rows, continuations, strict=True)
    ]

    def inputs(start: int, stop: int) -> tuple[Any, ...]:
        return (start, rows[start:stop], scored[start:stop], batch_size, memory_budget)

    fingerprint = {
        "job": "score_continuations",
        "model": workers.model_identity,
        "prompts": describe(rows),
        "continuations": describe(scored),
        "options": describe(dict(batch_size=batch_size, memory_budget=memory_budget)),
    }
    size = (_MAX_PROMPTS_PER_SHARD, _SHARDS_PER_WORKER)
    return ShardedJob("prompts", len(rows), _score_shard, inputs, fingerprint, *size)


def continuations_result(
    shards: list[dict[str, torch.Tensor]], prompts: int
) -> list[ContinuationScores]:
    """One `ContinuationScores` per prompt, from the shards."""
    named = {name: tensor for shard in shards for name, tensor in shard.items()}
    return [
        ContinuationScores(named[f"log_probs.{i}"], named[f"mask.{i}"], named[f"sums.{i}"])
        for i in range(prompts)
    ]


def _generate_shard(
    model: Any,
    start: int,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    seed: int | None,
    options: dict[str, Any],
) -> dict[str, torch.Tensor]:
    """On a worker: each prompt's generation, named by the prompt's index."""
    device, out = _device(model), dict[str, torch.Tensor]()
    for index, prompt in enumerate(prompts, start):
        prefix = prefill(model, prompt[None].to(device), keep_residuals=False)
        seeded = None if seed is None else seed + index
        result = generate(model, prefix, max_new_tokens, seed=seeded, **options)
        out |= {
            f"{name}.{index}": getattr(result, name) for name in ("tokens", "lengths", "log_probs")
        }
    return out


def generation_job(
    workers: RayWorkers,
    prompts: Any,
    max_new_tokens: int,
    seed: int | None,
    options: dict[str, Any],
) -> ShardedJob:
    """The sharded job of generating after each of `prompts`, checked."""
    positive_int(max_new_tokens, "max_new_tokens")
    positive_int(options["n_samples"], "n_samples")
    flag(options["do_sample"], "do_sample")
    check_sampling(options["temperature"], options["top_k"], options["top_p"])
    check_seed(seed)
    if options["do_sample"] and seed is None:
        raise ValueError(
            "generate on RayWorkers with do_sample=True needs a seed: each worker draws "
            "from its own generator, so unseeded samples would depend on the shards. "
            "Pass seed=...; prompt i samples with seed + i"
        )
    rows = _prompts(workers.limits, prompts, past=max_new_tokens)

    def inputs(start: int, stop: int) -> tuple[Any, ...]:
        return (start, rows[start:stop], max_new_tokens, seed, options)

    fingerprint = {
        "job": "generate",
        "model": workers.model_identity,
        "prompts": describe(rows),
        "options": describe(dict(options, max_new_tokens=max_new_tokens, seed=seed)),
    }
    size = (_MAX_PROMPTS_PER_SHARD, _SHARDS_PER_WORKER)
    return ShardedJob("prompts", len(rows), _generate_shard, inputs, fingerprint, *size)


def generation_result(shards: list[dict[str, torch.Tensor]], prompts: int) -> list[Generation]:
    """One `Generation` per prompt, from the shards."""
    named = {name: tensor for shard in shards for name, tensor in shard.items()}
    return [
        Generation(named[f"tokens.{i}"], named[f"lengths.{i}"], named[f"log_probs.{i}"])
        for i in range(prompts)
    ]
