"""Patching over a dataset of prompt pairs: per-pair values, mean, standard error, bootstrap.

[`patch_dataset`][safelens.patch_dataset] runs any sweep of this package (every
`get_act_patch_*` function, `generic_activation_patch` through a `functools.partial`)
over many clean/corrupted pairs at once: the pairs of a chunk are the sweep's
`batch`, so each forward pass holds many patched runs of many pairs. The metric is
*per pair*: it scores each row of the patched logits on its own, and the result keeps
one value per pair and component, `[pairs, *grid]`, next to its mean, standard error
and percentile-bootstrap confidence interval, all computed on the model's device.

How a chunk of pairs runs through the sweep, and how each pair's values find their
grid cell without touching the sweep: `safelens.patching._dataset_chunks`. This module
checks the inputs, walks the chunks and summarises the per-pair values.

Models: a `HookedTransformer`, a TransformerBridge or a plain HuggingFace causal LM,
whatever the sweep takes. Each chunk's clean cache is what the sweeps read on that
family: `model.run_with_cache(clean)`'s `ActivationCache` on a `HookedTransformer` or a
bridge, [`run_with_patching_cache`][safelens.run_with_patching_cache]'s dict on a
HuggingFace model. Left padding is masked as the sweeps mask a batch of prompts
(on a HuggingFace model whose tokenizer has a pad token, a batch of several: a chunk of
one pair runs it twice, so a pair's values do not depend on its chunk). This module
imports nothing from TransformerLens, so it loads on TransformerLens 4 and without it.

Caveat: a grid of more than 2**24 cells per chunk of pairs is refused, and the chunk
size comes from an estimate, not a measurement (both: `safelens.patching._dataset_chunks`).
The standard error is the sample one (`n - 1`);
with one pair it is NaN, and so is the interval's width information (both bounds equal
the value).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Int
from tqdm import tqdm

from ..backends._backend import Backend
from ..backends._supported import SupportedModel
from ..core._arguments import described, flag, is_int, positive_int
from ..core._errors import PatchingError
from ..core._repr import summary_repr
from ..core._tokens import check_tokens
from ..experiments._prefix import token_limits
from ._dataset_chunks import PairMetric, pairs_per_chunk, patched_chunk
from ._limits import DEFAULT_MAX_BYTES
from ._metric import check_metric
from ._runners import sweep_backend

__all__ = [
    "PatchingResult",
    "check_options",
    "dataset_backend",
    "pair_tokens",
    "patch_dataset",
    "summary",
]


@dataclass(frozen=True, repr=False)
class PatchingResult:
    """A sweep over a dataset of prompt pairs: per-pair values and their summary.

    Every tensor lies on the model's device. `grid` is the sweep's own result shape
    (e.g. `[layer, pos, head]`).

    - `per_pair`: `[pairs, *grid]`, the metric of each pair under each patch.
    - `mean`: `[*grid]`, the mean over pairs.
    - `std_err`: `[*grid]`, the sample standard deviation over `sqrt(pairs)` (NaN for
      one pair).
    - `ci_low`, `ci_high`: `[*grid]`, the percentile-bootstrap interval of the mean at
      `confidence`, from `n_bootstrap` resamples of the pairs.
    """

    __repr__ = summary_repr  # tensors by shape, not by value

    per_pair: torch.Tensor
    mean: torch.Tensor
    std_err: torch.Tensor
    ci_low: torch.Tensor
    ci_high: torch.Tensor
    confidence: float
    n_bootstrap: int


def dataset_backend(model: Any) -> Backend:
    """`model`'s adapter (sizes, device, family), or a `PatchingError` naming what arrived."""
    return sweep_backend(model, "patch_dataset")


def check_options(
    n_bootstrap: Any, confidence: Any, seed: Any, max_bytes: Any, progress: Any
) -> None:
    """`patch_dataset`'s options checked, or a `PatchingError` naming the one that is wrong."""
    positive_int(n_bootstrap, "n_bootstrap", error=PatchingError)
    positive_int(max_bytes, "max_bytes", error=PatchingError)
    flag(progress, "progress", error=PatchingError)
    if not is_int(seed) or seed < 0:
        raise PatchingError(f"seed must be a non-negative int, got {described(seed)}")
    if isinstance(confidence, bool) or not isinstance(confidence, float | int):
        raise PatchingError(f"confidence must be a float in (0, 1), got {confidence!r}")
    if not 0 < confidence < 1:
        raise PatchingError(f"confidence must be in (0, 1) (e.g. 0.95), got {confidence!r}")


def _tokens(limits: Any, value: Any, name: str) -> torch.Tensor:
    tokens = check_tokens(value, limits, name)
    if tokens.dim() != 2 or tokens.shape[0] == 0:
        raise PatchingError(
            f"{name} must be token ids [pairs, pos] with at least one pair, got shape "
            f"{tuple(tokens.shape)}"
        )
    return tokens


def pair_tokens(
    limits: Any, clean_tokens: Any, corrupted_tokens: Any
) -> tuple[Int[torch.Tensor, "pairs pos"], Int[torch.Tensor, "pairs pos"]]:
    """Clean and corrupted token ids checked against `limits` (`d_vocab`, `n_ctx`) and
    against each other; a `TokenError` or `PatchingError` otherwise."""
    clean = _tokens(limits, clean_tokens, "clean_tokens")
    corrupted = _tokens(limits, corrupted_tokens, "corrupted_tokens")
    if clean.shape != corrupted.shape:
        raise PatchingError(
            f"clean_tokens {tuple(clean.shape)} and corrupted_tokens "
            f"{tuple(corrupted.shape)} must have one shape [pairs, pos]: pair i is row i of "
            "each"
        )
    return clean, corrupted


def patch_dataset(
    sweep: Callable[..., torch.Tensor],
    model: SupportedModel,
    clean_tokens: Int[torch.Tensor, "pairs pos"],
    corrupted_tokens: Int[torch.Tensor, "pairs pos"],
    metric: PairMetric,
    *,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    max_batch: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: bool = True,
) -> PatchingResult:
    """Run a patching sweep over prompt pairs; per-pair values, mean, SE and bootstrap CI.

    Pair `i` patches `clean_tokens[i]`'s activations into `corrupted_tokens[i]`'s run,
    as `sweep(model, corrupted_tokens[i:i+1], clean_cache_i, metric_i)` would, but many
    pairs share each forward pass. Pairs are taken in chunks whose clean caches fit
    `max_bytes` (the same budget then bounds each sweep's forward passes).

    **Arguments:**

    - `sweep`: a safelens sweep, e.g.
      [`get_act_patch_attn_head_k_by_pos`][safelens.get_act_patch_attn_head_k_by_pos]
      (any function taking `(model, corrupted_tokens, clean_cache, metric, *,
      max_batch, max_bytes, progress)`).
    - `model`: a `HookedTransformer`, a TransformerBridge or a plain HuggingFace
      causal LM that `sweep` takes. Each chunk's clean cache comes from
      `model.run_with_cache` (`HookedTransformer`, bridge) or
      [`run_with_patching_cache`][safelens.run_with_patching_cache] (HuggingFace).
    - `clean_tokens`, `corrupted_tokens`: `[pairs, pos]` token ids, one pair per row.
    - `metric`: `metric(logits, pairs) -> [rows]`: patched logits `[rows, pos,
      d_vocab]` and the dataset index of each row's pair `[rows]`, to one value per
      row. With `metric.last_position_only = True` it gets the last position only.
    - `n_bootstrap`: resamples of the pairs for the interval.
    - `confidence`: the interval's coverage, in (0, 1).
    - `seed`: seeds the bootstrap's resampling.
    - `max_batch`, `max_bytes`: as in the sweeps; `max_bytes` also bounds the pairs per
      chunk.
    - `progress`: one progress bar over the pairs.

    **Returns:** a [`PatchingResult`][safelens.PatchingResult], tensors on the model's
    device.

    **Raises:** [`TokenError`][safelens.TokenError] for token ids that do not fit the
    model; [`PatchingError`][safelens.PatchingError] for a model of none of the three
    families, clean and corrupted tokens of different shapes, a metric that does not
    return one value per row, bad limits, or what the sweep refuses.

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from safelens import get_act_patch_resid_pre
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=11))
    >>> clean, corrupted = torch.tensor([[1, 2, 3], [4, 2, 3]]), torch.tensor([[1, 5, 3], [4, 6, 3]])
    >>> metric = lambda logits, pairs: logits[:, -1, 0] - logits[:, -1, 1]
    >>> result = patch_dataset(get_act_patch_resid_pre, model, clean, corrupted, metric, progress=False)
    >>> result.per_pair.shape, result.mean.shape
    (torch.Size([2, 2, 3]), torch.Size([2, 3]))

    ```
    """
    check_options(n_bootstrap, confidence, seed, max_bytes, progress)
    check_metric(metric, "metric")
    backend = dataset_backend(model)
    clean, corrupted = pair_tokens(token_limits(backend), clean_tokens, corrupted_tokens)
    clean, corrupted = clean.to(backend.device), corrupted.to(backend.device)
    pairs, length = clean.shape
    chunk = pairs_per_chunk(backend, pairs, length, max_bytes)
    per_chunk: list[torch.Tensor] = []
    with tqdm(total=pairs, disable=not progress, desc="pairs") as bar:
        for start in range(0, pairs, chunk):
            rows = torch.arange(start, min(start + chunk, pairs), device=clean.device)
            per_chunk.append(
                patched_chunk(
                    sweep, backend, clean[rows], corrupted[rows], metric, rows, max_batch, max_bytes
                )
            )
            bar.update(rows.numel())
    per_pair = torch.cat(per_chunk)
    return summary(per_pair, n_bootstrap, confidence, seed)


def summary(
    per_pair: torch.Tensor, n_bootstrap: int, confidence: float, seed: int
) -> PatchingResult:
    """Mean, standard error and percentile-bootstrap interval over axis 0 of `per_pair`."""
    pairs = per_pair.shape[0]
    flat = per_pair.reshape(pairs, -1)
    mean = flat.mean(0)
    if pairs > 1:
        std_err = ((flat - mean).square().sum(0) / (pairs - 1)).sqrt() / pairs**0.5
    else:
        std_err = torch.full_like(mean, float("nan"))
    generator = torch.Generator(device=flat.device).manual_seed(seed)
    draws = torch.randint(pairs, (n_bootstrap, pairs), generator=generator, device=flat.device)
    counts = torch.zeros(n_bootstrap, pairs, device=flat.device)
    counts.scatter_add_(1, draws, torch.ones_like(draws, dtype=counts.dtype))
    means = (counts @ flat).div_(pairs).sort(0).values
    tail = (1 - confidence) / 2
    low, high = (_quantile(means, q) for q in (tail, 1 - tail))
    shape = per_pair.shape[1:]
    return PatchingResult(
        per_pair,
        mean.reshape(shape),
        std_err.reshape(shape),
        low.reshape(shape),
        high.reshape(shape),
        float(confidence),
        n_bootstrap,
    )


def _quantile(ordered: torch.Tensor, q: float) -> torch.Tensor:
    """The `q` quantile of each column of the sorted `ordered`, linearly interpolated."""
    where = q * (ordered.shape[0] - 1)
    below = int(where)
    above = min(below + 1, ordered.shape[0] - 1)
    return torch.lerp(ordered[below], ordered[above], where - below)
