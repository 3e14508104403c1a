"""The `*_every` bundles: several sweeps stacked, as TransformerLens' `patching` stacks them.

Each bundle runs the safelens sweeps its TransformerLens namesake runs, in the same
order, and stacks their results along a new first axis, `patch_type`:

| bundle | `patch_type` rows | shape |
| --- | --- | --- |
| `get_act_patch_block_every` | resid_pre, attn_out, mlp_out | `[3, layer, pos]` |
| `get_act_patch_attn_head_all_pos_every` | z, q, k, v, pattern | `[5, layer, n_heads]` |
| `get_act_patch_attn_head_by_pos_every` | z, q, k, v, pattern | `[5, layer, pos, n_heads]` |

Caveat, grouped-query models: keys and values have `n_kv_heads` heads while z, q and
the pattern have `n_heads`. As in TransformerLens (3.9 and 4.x), the k and v rows hold
the key/value-head results in heads `0 … n_kv_heads - 1` and zeros after them: the
zeros are padding, not measurements, and head index `g` of those rows is key/value
head `g` (which serves query heads `g * r … (g + 1) * r - 1`, `r = n_heads //
n_kv_heads`), not query head `g`. With `cfg.ungroup_grouped_query_attention=True` on a
`HookedTransformer` the k and v sweeps already index `n_heads` heads and nothing is
padded.

Models: every sweep runs on its model family's runner (`safelens.patching._runners`), so
a bundle takes what its sweeps take. A `HookedTransformer`, a TransformerBridge and a
plain HuggingFace causal LM run all three bundles (on a HuggingFace model at the sites
its adapter declares, `safelens.backends.hf._sites`; queries, keys and patterns as the
attention function sees them). What differs on a bridge or HuggingFace model: the k and
q rows patch keys and queries after the rotary embedding (at every position the same
patch as TransformerLens' `attn.hook_k`), the pattern row is refused on a bridge whose
attention does not use `hook_pattern` (see `safelens.patching._pattern_hook`), and the
clean cache is `bridge.run_with_cache`'s; on a HuggingFace model it is
[`run_with_patching_cache`][safelens.run_with_patching_cache]'s. Whatever the model, the
clean cache is checked for every activation the bundle patches before its first sweep
runs (`safelens.patching._front.check_bundle`). This module imports nothing from
TransformerLens, so it loads on TransformerLens 4.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from jaxtyping import Float, Int

from ..backends._supported import SupportedModel
from ._front import check_bundle
from ._patterns import (
    get_act_patch_attn_head_pattern_all_pos,
    get_act_patch_attn_head_pattern_by_pos,
)
from ._sweeps import (
    DEFAULT_MAX_BYTES,
    Metric,
    get_act_patch_attn_head_k_all_pos,
    get_act_patch_attn_head_k_by_pos,
    get_act_patch_attn_head_out_all_pos,
    get_act_patch_attn_head_out_by_pos,
    get_act_patch_attn_head_q_all_pos,
    get_act_patch_attn_head_q_by_pos,
    get_act_patch_attn_head_v_all_pos,
    get_act_patch_attn_head_v_by_pos,
    get_act_patch_attn_out,
    get_act_patch_mlp_out,
    get_act_patch_resid_pre,
)

__all__ = [
    "get_act_patch_attn_head_all_pos_every",
    "get_act_patch_attn_head_by_pos_every",
    "get_act_patch_block_every",
]

Sweep = Callable[..., Any]


def _stack(
    sweeps: Sequence[tuple[Sweep, str]],
    bundle: str,
    model: torch.nn.Module,
    corrupted_tokens: torch.Tensor,
    clean_cache: Any,
    metric: Metric,
    max_batch: int | None,
    max_bytes: int,
    progress: bool,
) -> torch.Tensor:
    """Every sweep's result, its last axis zero-padded to the first's, stacked on axis 0."""
    # Before any sweep runs: what the first sweep would not see (the last sweeps' sites
    # and clean activations). Other inputs are checked by the first sweep, before it runs.
    activations = [name for _, name in sweeps]
    check_bundle(model, corrupted_tokens, clean_cache, activations, bundle)
    results: list[torch.Tensor] = []
    for sweep, _ in sweeps:
        result = sweep(
            model,
            corrupted_tokens,
            clean_cache,
            metric,
            max_batch=max_batch,
            max_bytes=max_bytes,
            progress=progress,
        )
        if results:
            result = torch.nn.functional.pad(result, (0, results[0].shape[-1] - result.shape[-1]))
        results.append(result)
    return torch.stack(results)


def _pattern_by_dest_pos(*args: Any, **kwargs: Any) -> Float[torch.Tensor, "layer pos n_heads"]:
    """`get_act_patch_attn_head_pattern_by_pos` with its head and position axes swapped."""
    swept = get_act_patch_attn_head_pattern_by_pos(*args, **kwargs)
    assert isinstance(swept, torch.Tensor)  # the sweep itself: no index_df was asked for
    return swept.transpose(-1, -2)


def get_act_patch_block_every(
    model: SupportedModel,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: Any,
    metric: Metric,
    *,
    max_batch: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: bool = True,
) -> Float[torch.Tensor, "patch_type layer pos"]:
    """Patch the residual stream, attention output and MLP output of every block and position.

    TransformerLens' `patching.get_act_patch_block_every`: the results of
    `get_act_patch_resid_pre`,
    `get_act_patch_attn_out` and
    `get_act_patch_mlp_out`, stacked in that order.

    **Arguments:**

    - `model`: a `HookedTransformer` with MLP layers (not `cfg.attn_only`), a
      TransformerBridge or a HuggingFace causal LM.
    - `corrupted_tokens`: `[batch, pos]` tokens of the corrupted run.
    - `clean_cache`: the clean run's `ActivationCache` (`model.run_with_cache`; on a
      HuggingFace model, [`run_with_patching_cache`][safelens.run_with_patching_cache]'s
      dict), same `pos`.
    - `metric`: logits `[runs * batch, pos, d_vocab]` to `[runs]` (fast), or
      TransformerLens-style logits of one run to a scalar. (TransformerLens names this
      argument `metric` in its bundles, `patching_metric` in its sweeps.)
    - `max_batch`, `max_bytes`, `progress`: as in each sweep (one progress bar per sweep).

    **Returns:** float32 `[patch_type=3, layer, pos]` on the model's device; `patch_type`
    0 is resid_pre, 1 attn_out, 2 mlp_out.

    **Raises:** [`TokenError`][safelens.TokenError] for corrupted tokens that are not
    token ids of this model; [`PatchingError`][safelens.PatchingError] for an
    attention-only model, a clean cache missing an activation or of another length, a
    model, metric result or limit that does not fit, naming it (what the clean cache
    lacks, before any sweep runs).

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> cfg = HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=8, d_head=4, n_heads=4, d_vocab=11, act_fn="gelu")
    >>> model = HookedTransformer(cfg)
    >>> _, clean_cache = model.run_with_cache(torch.tensor([[1, 2, 3]]))
    >>> metric = lambda logits: logits[:, -1, 0] - logits[:, -1, 1]
    >>> get_act_patch_block_every(model, torch.tensor([[1, 5, 3]]), clean_cache, metric, progress=False).shape
    torch.Size([3, 2, 3])

    ```
    """
    sweeps = [
        (get_act_patch_resid_pre, "resid_pre"),
        (get_act_patch_attn_out, "attn_out"),
        (get_act_patch_mlp_out, "mlp_out"),
    ]
    return _stack(
        sweeps,
        "get_act_patch_block_every",
        model,
        corrupted_tokens,
        clean_cache,
        metric,
        max_batch,
        max_bytes,
        progress,
    )


def get_act_patch_attn_head_all_pos_every(
    model: SupportedModel,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: Any,
    metric: Metric,
    *,
    max_batch: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: bool = True,
) -> Float[torch.Tensor, "patch_type layer n_heads"]:
    """Patch every head's output, queries, keys, values and pattern at all positions at once.

    TransformerLens' `patching.get_act_patch_attn_head_all_pos_every`: the `*_all_pos`
    sweeps of z (`get_act_patch_attn_head_out_all_pos`),
    q, k, v and the attention pattern, stacked in that order.

    **Arguments:**

    - `model`: a `HookedTransformer`, a TransformerBridge or a HuggingFace causal LM.
    - `corrupted_tokens`: `[batch, pos]` tokens of the corrupted run.
    - `clean_cache`: the clean run's `ActivationCache` (`model.run_with_cache`; on a
      HuggingFace model, [`run_with_patching_cache`][safelens.run_with_patching_cache]'s
      dict), same `pos`.
    - `metric`: logits `[runs * batch, pos, d_vocab]` to `[runs]` (fast), or
      TransformerLens-style logits of one run to a scalar.
    - `max_batch`, `max_bytes`, `progress`: as in each sweep (one progress bar per sweep).

    **Returns:** float32 `[patch_type=5, layer, n_heads]` on the model's device;
    `patch_type` 0 is z, 1 q, 2 k, 3 v, 4 pattern. On a grouped-query model the k and v
    rows hold `n_kv_heads` results, then zeros up to `n_heads` (TransformerLens'
    padding; see the module notes).

    **Raises:** [`TokenError`][safelens.TokenError] for corrupted tokens that are not
    token ids of this model; [`PatchingError`][safelens.PatchingError] for a family
    without one of the sites (the "Patching sites" page says which), a bridge whose
    attention does not use `hook_pattern` (found by one probe pass), a clean cache
    missing an activation or of another
    length, a model, metric result or limit that does not fit, naming it; the model
    and the clean cache are checked before any sweep runs.

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> cfg = HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=8, d_head=4, n_heads=4, d_vocab=11, act_fn="gelu")
    >>> model = HookedTransformer(cfg)
    >>> _, clean_cache = model.run_with_cache(torch.tensor([[1, 2, 3]]))
    >>> metric = lambda logits: logits[:, -1, 0] - logits[:, -1, 1]
    >>> get_act_patch_attn_head_all_pos_every(model, torch.tensor([[1, 5, 3]]), clean_cache, metric, progress=False).shape
    torch.Size([5, 2, 4])

    ```
    """
    sweeps = [
        (get_act_patch_attn_head_out_all_pos, "z"),
        (get_act_patch_attn_head_q_all_pos, "q"),
        (get_act_patch_attn_head_k_all_pos, "k"),
        (get_act_patch_attn_head_v_all_pos, "v"),
        (get_act_patch_attn_head_pattern_all_pos, "pattern"),
    ]
    return _stack(
        sweeps,
        "get_act_patch_attn_head_all_pos_every",
        model,
        corrupted_tokens,
        clean_cache,
        metric,
        max_batch,
        max_bytes,
        progress,
    )


def get_act_patch_attn_head_by_pos_every(
    model: SupportedModel,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: Any,
    metric: Metric,
    *,
    max_batch: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: bool = True,
) -> Float[torch.Tensor, "patch_type layer pos n_heads"]:
    """Patch every head's output, queries, keys, values and pattern at each position.

    TransformerLens' `patching.get_act_patch_attn_head_by_pos_every`: the `*_by_pos`
    sweeps of z (`get_act_patch_attn_head_out_by_pos`),
    q, k and v, and [`get_act_patch_attn_head_pattern_by_pos`][safelens.get_act_patch_attn_head_pattern_by_pos]
    with its `[layer, n_heads, dest_pos]` turned to `[layer, dest_pos, n_heads]`, stacked
    in that order.

    **Arguments:**

    - `model`: a `HookedTransformer`, a TransformerBridge or a HuggingFace causal LM.
    - `corrupted_tokens`: `[batch, pos]` tokens of the corrupted run.
    - `clean_cache`: the clean run's `ActivationCache` (`model.run_with_cache`; on a
      HuggingFace model, [`run_with_patching_cache`][safelens.run_with_patching_cache]'s
      dict), same `pos`.
    - `metric`: logits `[runs * batch, pos, d_vocab]` to `[runs]` (fast), or
      TransformerLens-style logits of one run to a scalar.
    - `max_batch`, `max_bytes`, `progress`: as in each sweep (one progress bar per sweep).

    **Returns:** float32 `[patch_type=5, layer, pos, n_heads]` on the model's device;
    `patch_type` 0 is z, 1 q, 2 k, 3 v, 4 pattern (by destination position). On a
    grouped-query model the k and v rows hold `n_kv_heads` results, then zeros up to
    `n_heads` (TransformerLens' padding; see the module notes).

    **Raises:** [`TokenError`][safelens.TokenError] for corrupted tokens that are not
    token ids of this model; [`PatchingError`][safelens.PatchingError] for a family
    without one of the sites (the "Patching sites" page says which), a bridge whose
    attention does not use `hook_pattern` (found by one probe pass), a clean cache
    missing an activation or of another
    length, a model, metric result or limit that does not fit, naming it; the model
    and the clean cache are checked before any sweep runs.

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> cfg = HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=8, d_head=4, n_heads=4, d_vocab=11, act_fn="gelu")
    >>> model = HookedTransformer(cfg)
    >>> _, clean_cache = model.run_with_cache(torch.tensor([[1, 2, 3]]))
    >>> metric = lambda logits: logits[:, -1, 0] - logits[:, -1, 1]
    >>> get_act_patch_attn_head_by_pos_every(model, torch.tensor([[1, 5, 3]]), clean_cache, metric, progress=False).shape
    torch.Size([5, 2, 3, 4])

    ```
    """
    sweeps = [
        (get_act_patch_attn_head_out_by_pos, "z"),
        (get_act_patch_attn_head_q_by_pos, "q"),
        (get_act_patch_attn_head_k_by_pos, "k"),
        (get_act_patch_attn_head_v_by_pos, "v"),
        (_pattern_by_dest_pos, "pattern"),
    ]
    return _stack(
        sweeps,
        "get_act_patch_attn_head_by_pos_every",
        model,
        corrupted_tokens,
        clean_cache,
        metric,
        max_batch,
        max_bytes,
        progress,
    )
