"""Attribution patching over a dataset of prompt pairs: per-pair estimates and their summary.

[`attribution_patch_dataset`][safelens.attribution_patch_dataset] is to
[`attribution_patch`][safelens.attribution_patch] what
[`patch_dataset`][safelens.patch_dataset] is to a sweep: the pairs of a chunk are the
batch of one corrupted forward and one backward pass, the metric scores each row on its
own, and the gradient of their sum is each row's own gradient (rows of a batch do not
interact in a transformer). So every pair gets its estimated grids, `[pairs, *grid]`,
equal to `attribution_patch` run on that pair alone, next to their mean, standard error
and percentile-bootstrap interval, computed as `patch_dataset` computes them.

Caveat: a metric that mixes rows (a mean over the batch) gives each pair a share of every
pair's gradient; score each row on its own. A chunk's clean cache and the corrupted
run's graph are held together, so chunks are sized from `max_bytes` by an estimate.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Int
from tqdm import tqdm

from ..backends._backend import Backend
from ..backends._families import backend_of
from ..experiments._prefix import token_limits
from ._attribution import effects
from ._attribution_pass import corrupted_pass
from ._attribution_plan import HEAD_SITES, Activation, Plan, plan
from ._dataset import PatchingResult, check_options, pair_tokens, summary
from ._dataset_chunks import PairMetric, clean_cache_of, lone_pair_doubled, pair_bytes
from ._limits import DEFAULT_MAX_BYTES

__all__ = ["AttributionDatasetResult", "attribution_patch_dataset"]

# A chunk holds its clean cache, the corrupted run's graph and its gradients: about
# this many times `patch_dataset`'s estimate of a pair's clean cache and logits.
_GRAPH_FACTOR = 4


@dataclass(frozen=True)
class AttributionDatasetResult:
    """Attribution over prompt pairs: the corrupted metric and the estimated grids.

    - `baseline`: the corrupted run's metric per pair, `per_pair` `[pairs]`, and its
      summary (0-d `mean`, `std_err`, `ci_low`, `ci_high`).
    - `estimates`: per activation, as in
      [`AttributionResult`][safelens.AttributionResult], a
      [`PatchingResult`][safelens.PatchingResult] whose `per_pair` is `[pairs, *grid]`:
      the estimated metric of each pair under each patch.
    """

    baseline: PatchingResult
    estimates: dict[str, PatchingResult]


def attribution_patch_dataset(
    model: Any,
    clean_tokens: Int[torch.Tensor, "pairs pos"],
    corrupted_tokens: Int[torch.Tensor, "pairs pos"],
    metric: PairMetric,
    *,
    activations: Sequence[Activation] = HEAD_SITES,
    qk_fix: bool = True,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: bool = True,
) -> AttributionDatasetResult:
    """Attribution patching of prompt pairs; per-pair estimates, mean, SE and bootstrap CI.

    Pair `i`'s estimates equal `attribution_patch(model, corrupted_tokens[i:i+1],
    clean_cache_i, lambda logits: metric(logits, tensor([i])), ...)`, but many pairs
    share each forward and backward pass.

    **Arguments:**

    - `model`: a `HookedTransformer`, a TransformerBridge or a plain HuggingFace
      causal LM, as `attribution_patch` takes it; each chunk's clean cache comes from
      `model.run_with_cache` (`HookedTransformer`, bridge) or
      [`run_with_patching_cache`][safelens.run_with_patching_cache] (HuggingFace).
    - `clean_tokens`, `corrupted_tokens`: `[pairs, pos]` token ids, one pair per row.
    - `metric`: `metric(logits, pairs) -> [rows]`, as in `patch_dataset`: the corrupted
      logits `[rows, pos, d_vocab]` and each row's pair index `[rows]`, to one
      differentiable value per row, computed from that row alone.
    - `activations`, `qk_fix`: as in `attribution_patch`.
    - `n_bootstrap`, `confidence`, `seed`: the bootstrap interval, as in `patch_dataset`.
    - `max_bytes`: bounds the pairs per chunk (an estimate of their clean cache and graph).
    - `progress`: one progress bar over the pairs.

    **Returns:** an [`AttributionDatasetResult`][safelens.AttributionDatasetResult],
    tensors on the model's device.

    **Raises:** [`TokenError`][safelens.TokenError] for token ids that do not fit the
    model; [`PatchingError`][safelens.PatchingError] for clean and corrupted tokens of
    different shapes, a metric without one differentiable value per row, or what
    `attribution_patch` refuses.

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=11))
    >>> clean, corrupted = torch.tensor([[1, 2, 3], [4, 2, 3]]), torch.tensor([[1, 5, 3], [4, 6, 3]])
    >>> metric = lambda logits, pairs: logits[:, -1, 0] - logits[:, -1, 1]
    >>> result = attribution_patch_dataset(model, clean, corrupted, metric,
    ...     activations=["v", "resid_pre"], progress=False)
    >>> result.estimates["v"].per_pair.shape, result.estimates["resid_pre"].mean.shape
    (torch.Size([2, 2, 3, 2]), torch.Size([2, 3]))

    ```
    """
    check_options(n_bootstrap, confidence, seed, max_bytes, progress)
    backend = backend_of(model, "attribution_patch_dataset")
    clean, corrupted = pair_tokens(token_limits(backend), clean_tokens, corrupted_tokens)
    clean, corrupted = clean.to(backend.device), corrupted.to(backend.device)
    chosen = plan(model, activations, qk_fix, None, corrupted, "attribution_patch_dataset")
    pairs, length = clean.shape
    chunk = pairs_per_attribution_chunk(backend, pairs, length, max_bytes)
    baselines: list[torch.Tensor] = []
    grids: dict[str, list[torch.Tensor]] = {name: [] for name in chosen.activations}
    with tqdm(total=pairs, disable=not progress, desc="pairs") as bar:
        for start in range(0, pairs, chunk):
            rows = torch.arange(start, min(start + chunk, pairs), device=clean.device)
            baseline, found = attribution_chunk(chosen, metric, clean[rows], corrupted[rows], rows)
            baselines.append(baseline)
            for name, grid in found.items():
                grids[name].append(grid)
            bar.update(rows.numel())
    return attribution_summary(baselines, grids, n_bootstrap, confidence, seed)


def pairs_per_attribution_chunk(backend: Backend, pairs: int, length: int, max_bytes: int) -> int:
    """How many pairs of `length` tokens one chunk (clean cache and graph) takes."""
    return max(1, min(pairs, max_bytes // (_GRAPH_FACTOR * pair_bytes(backend, length))))


def attribution_chunk(
    chosen: Plan,
    metric: PairMetric,
    clean: Int[torch.Tensor, "rows pos"],
    corrupted: Int[torch.Tensor, "rows pos"],
    rows: Int[torch.Tensor, " rows"],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One chunk's pairs (`rows`, their indices): the corrupted metric `[rows]` and each
    activation's estimated grids `[rows, *grid]`, in float64."""
    backend = chosen.backend
    some_clean, some_corrupted = lone_pair_doubled(backend, clean, corrupted)
    batch_rows = rows.repeat(some_clean.shape[0] // rows.numel())
    reads = corrupted_pass(
        backend,
        some_corrupted,
        chosen.reads(),
        functools.partial(_scored, metric, batch_rows),
        rows=batch_rows.numel(),
    )
    value = reads.value.reshape(-1).double()
    clean_cache = clean_cache_of(backend, some_clean, chosen.clean_names())
    grids = {}
    for name, effect in effects(chosen, reads, clean_cache).items():
        shaped = value.reshape(-1, *[1] * (effect.dim() - 1))
        grids[name] = (effect + shaped)[: rows.numel()]
    return value[: rows.numel()], grids


def attribution_summary(
    baselines: list[torch.Tensor],
    grids: dict[str, list[torch.Tensor]],
    n_bootstrap: int,
    confidence: float,
    seed: int,
) -> AttributionDatasetResult:
    """The result from the chunks' baselines and grids, in pair order."""
    stats = (n_bootstrap, confidence, seed)
    return AttributionDatasetResult(
        summary(torch.cat(baselines).float(), *stats),
        {name: summary(torch.cat(parts).float(), *stats) for name, parts in grids.items()},
    )


def _scored(metric: PairMetric, rows: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    return metric(logits, rows)
