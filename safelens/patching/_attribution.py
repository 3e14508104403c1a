"""Attribution patching: whole patching grids from one forward and one backward pass.

An exact by-position sweep runs one patched pass per (layer, position, head). Attribution
patching (AtP) estimates every one of them at once from the corrupted run's gradient:

    metric(patched) ≈ metric(corrupted) + dmetric/dactivation · (clean - corrupted)

one clean run (the `clean_cache` the exact sweeps take), one corrupted forward pass
through a safelens key/value cache and one backward pass. Values, head outputs,
patterns and the node sites (`resid_pre`, `resid_mid`, `attn_out`, `mlp_out`) use this
first-order estimate; keys and queries, by default, AtP*'s QK fix: their patched
attention softmax is recomputed exactly and only what follows the pattern is linearised
(`safelens.patching._qk_fix`). The grids have the exact sweeps' shapes and hold
estimates of the same numbers: the metric of the patched run, not its change. What one
attribution reads: `safelens.patching._attribution_plan`; where each site is read on
each model family: `safelens.patching._attribution_pass`.

When to trust it: exactly right where the metric is linear in the patched activation
from the patch on (a value or head output of the last attention layer of an
attention-only model without a final LayerNorm, read by a linear metric; with the QK fix,
keys and queries there too). Elsewhere it is first order: it fails where a patch
saturates something after it (a softmax of a later layer, a LayerNorm, the metric's
own nonlinearity, e.g. a probability near 0 or 1), and it can mis-rank components
whose effects cancel along different paths. The remedy is `verify_top_k`: the top
candidates by estimated effect are recomputed by the exact sweep engine, and a large
gap between estimate and exact value there shows the estimate cannot be trusted for
this model and metric.

Caveat: the backward pass keeps the corrupted run's graph, about one training step's
activation memory, and the QK fix holds a few `[batch, n_heads, pos, pos]` float64
tensors per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float, Int

from ..backends._families import backend_of
from ..backends._sites import Site
from ..backends._supported import SupportedModel
from ..core._arguments import positive_int
from ..core._errors import PatchingError
from ..core._repr import summary_repr
from ._attribution_pass import Reads, corrupted_pass
from ._attribution_plan import FIXED, HEAD_SITES, Activation, Plan, plan
from ._clean_cache import (
    axes_of,
    backend_sizes,
    check_clean_cache,
    shape_error,
    sweep_tokens,
)
from ._engine import Run
from ._limits import DEFAULT_MAX_BYTES, Limits, _check_limits
from ._metric import Metric, check_metric
from ._qk_fix import key_effects, query_effects, scores_function
from ._runners import prepare_of

if TYPE_CHECKING:
    from transformer_lens import ActivationCache

__all__ = ["AttributionResult", "attribution_patch"]


@dataclass(frozen=True, repr=False)
class AttributionResult:
    """Estimated patching grids, and the exact values of the verified cells.

    - `baseline`: the metric of the corrupted run (0-d).
    - `estimates`: per activation, the estimated metric of each patched run, shaped as
      the exact sweep's result: `"k"`, `"v"`, `"q"`, `"z"` `[layer, pos, head]` as
      `get_act_patch_attn_head_{k,v,q,out}_by_pos` (`n_kv_heads` heads for k and v);
      `"pattern"` `[layer, head, dest_pos, src_pos]` as
      `get_act_patch_attn_head_pattern_dest_src_pos`; `"resid_pre"`, `"resid_mid"`,
      `"attn_out"`, `"mlp_out"` `[layer, pos]` as `get_act_patch_{name}`.
    - `exact`: per activation, the same shape, NaN except the `verify_top_k` cells of
      largest estimated effect, which hold the exact sweep's value.
    """

    __repr__ = summary_repr  # tensors by shape, not by value

    baseline: torch.Tensor
    estimates: dict[str, torch.Tensor]
    exact: dict[str, torch.Tensor]


def _clean(
    plan: Plan, clean_cache: Any, site: Site, layer: int, like: torch.Tensor
) -> torch.Tensor:
    """`site`'s clean activation at `layer`, checked against the corrupted run's `like`.

    In `like`'s layout: a clean tensor stored position-major where the site's hook sees
    it head-major (`site.transposed`) is transposed.
    """
    name = site.clean(layer)
    how = (
        "safelens.run_with_patching_cache(model, clean_tokens)"
        if plan.backend.family == "hf"
        else "model.run_with_cache(clean_tokens), without a names_filter"
    )
    try:
        clean = clean_cache[name]
    except (KeyError, TypeError):
        raise PatchingError(
            f"clean_cache has no activation {name!r}, which attribution_patch reads; run the "
            f"clean prompt with {how}"
        ) from None
    if site.transposed:
        clean = clean.transpose(1, 2)
    if clean.shape[0] not in (1, like.shape[0]) or clean.shape[1:] != like.shape[1:]:
        raise shape_error(
            name,
            tuple(clean.shape),
            tuple(like.shape[1:]),
            like.shape[0],
            axes_of(name),
            plan.backend.clean_cache_call,
        )
    return clean.to(like.device, like.dtype).expand_as(like)


def _position_major(site: Site, tensor: torch.Tensor) -> torch.Tensor:
    """`[batch, pos, heads, d_head]` from a site's tensor in either layout."""
    return tensor.transpose(1, 2) if site.pos_axis == 2 else tensor


def _layer_effects(
    plan: Plan, name: str, layer: int, reads: Reads, clean_cache: Any
) -> Float[torch.Tensor, "batch ..."]:
    """The estimated change of the metric per row of the batch, for each patch of one layer."""
    key = (name, layer)
    if plan.qk is None or name not in FIXED:
        site = plan.sites[name]
        corrupted = reads.acts[key]
        delta = _clean(plan, clean_cache, site, layer, corrupted) - corrupted
        product = reads.grads[key] * delta
        if name == "pattern":  # [batch, n_heads, dest_pos, src_pos]: no d_head to sum
            return product.double()
        summed = product.sum(-1).double()
        return summed.transpose(1, 2) if site.pos_axis == 2 else summed
    qk = plan.qk
    q = _position_major(qk["qk_q"], reads.acts[("qk_q", layer)])
    k = _position_major(qk["qk_k"], reads.acts[("qk_k", layer)])
    scores, grad = reads.acts[("scores", layer)], reads.grads[("pattern", layer)]
    scores_of = scores_function(plan.backend.model, plan.backend.family, layer, q, k, scores)
    role = "qk_k" if name == "k" else "qk_q"
    raw = reads.acts[(role, layer)]
    clean = _position_major(qk[role], _clean(plan, clean_cache, qk[role], layer, raw))
    if name == "k":
        return key_effects(scores_of, scores, grad, q, k, clean)
    return query_effects(scores_of, scores, grad, q, k, clean)


def effects(
    plan: Plan, reads: Reads, clean_cache: Any
) -> dict[str, Float[torch.Tensor, "batch layer ..."]]:
    """Per activation, the estimated change of the metric, per row and cell (float64)."""
    return {
        # Each layer's effects are computed on its layer's device, gathered on the metric's.
        name: torch.stack(
            [
                _layer_effects(plan, name, layer, reads, clean_cache).to(reads.value.device)
                for layer in range(plan.backend.n_layers)
            ],
            dim=1,
        )
        for name in plan.activations
    }


def attribution_patch(
    model: SupportedModel,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: ActivationCache | dict[str, torch.Tensor],
    patching_metric: Metric,
    *,
    activations: Sequence[Activation] = HEAD_SITES,
    qk_fix: bool = True,
    verify_top_k: int = 0,
    max_batch: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: bool = False,
) -> AttributionResult:
    """Estimate patching grids (k, v, q, z, pattern and the node sites) from one backward pass.

    Same arguments as the exact sweeps (e.g.
    [`get_act_patch_attn_head_k_by_pos`][safelens.get_act_patch_attn_head_k_by_pos]),
    same result shapes; the how-to "Attribution patching" says what is approximated,
    when to trust it, and how well it agrees with the exact sweeps.

    **Arguments:**

    - `model`: a `HookedTransformer`, a TransformerLens `TransformerBridge` or a plain
      HuggingFace causal LM (read where its exact sweeps patch it; a family without a
      site, such as `resid_mid` in parallel-attention families, is refused with the
      reason).
    - `corrupted_tokens`: `[batch, pos]` tokens of the corrupted run.
    - `clean_cache`: the clean run's cache, as the exact sweeps take it:
      `model.run_with_cache(clean_tokens)` (`HookedTransformer`, bridge) or
      [`run_with_patching_cache`][safelens.run_with_patching_cache] (HuggingFace).
    - `patching_metric`: logits `[batch, pos, d_vocab]` of one run to a differentiable
      scalar (or `[1]`, as a batched metric gives for one run).
    - `activations`: which grids to estimate, of `"k"`, `"v"`, `"q"`, `"z"`,
      `"pattern"`, `"resid_pre"`, `"resid_mid"`, `"attn_out"`, `"mlp_out"`.
    - `qk_fix`: recompute the attention softmax of key and query patches exactly
      (AtP*); `False` gives plain first-order estimates.
    - `verify_top_k`: per grid, run the exact sweep on this many cells of largest
      estimated effect `|estimate - baseline|` (0: none).
    - `max_batch`, `max_bytes`, `progress`: for the verifying exact sweep.

    **Returns:** an [`AttributionResult`][safelens.AttributionResult] on the model's
    device.

    **Raises:** [`TokenError`][safelens.TokenError] for corrupted tokens that are not
    token ids of this model; [`PatchingError`][safelens.PatchingError] for a clean
    cache without an activation read or of another length, a metric without one
    differentiable value, unknown `activations` or one the model has no site for, bad
    limits, or a QK fix on a model whose attention transforms keys and queries further
    (elsewhere than on a `HookedTransformer`: whose scores are no fixed multiple of
    `q·k`, or whose attention does not use what `hook_pattern` returns).

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> cfg = HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=8, d_head=4, n_heads=4, d_vocab=11, act_fn="gelu")
    >>> model = HookedTransformer(cfg)
    >>> _, clean_cache = model.run_with_cache(torch.tensor([[1, 2, 3]]))
    >>> metric = lambda logits: logits[:, -1, 0].sum() - logits[:, -1, 1].sum()
    >>> result = attribution_patch(model, torch.tensor([[1, 5, 3]]), clean_cache, metric,
    ...     activations=["k", "v", "resid_pre"], verify_top_k=2)
    >>> result.estimates["k"].shape, result.estimates["resid_pre"].shape
    (torch.Size([2, 3, 4]), torch.Size([2, 3]))
    >>> int(result.exact["v"].isfinite().sum())
    2

    ```
    """
    if verify_top_k != 0:
        positive_int(verify_top_k, "verify_top_k", error=PatchingError, shown=repr)
    _check_limits(max_batch, max_bytes, progress)
    backend = backend_of(model, "attribution_patch")
    tokens = sweep_tokens(backend, corrupted_tokens, "corrupted_tokens")
    check_clean_cache(clean_cache, backend_sizes(backend), backend.clean_cache_call)
    check_metric(patching_metric)
    chosen = plan(model, activations, qk_fix, clean_cache, tokens)
    reads = corrupted_pass(backend, tokens, chosen.reads(), patching_metric)
    baseline = reads.value.reshape(())
    estimates: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}
    for name, effect in effects(chosen, reads, clean_cache).items():
        estimates[name] = (effect.sum(0) + baseline.double()).float()
        exact[name] = torch.full_like(estimates[name], float("nan"))
        if verify_top_k:
            order = (estimates[name] - baseline).abs().flatten().argsort(descending=True)
            order = order[:verify_top_k]
            cells = torch.stack(torch.unravel_index(order, estimates[name].shape), dim=1)
            with torch.no_grad():
                values = verify(
                    chosen,
                    name,
                    tokens,
                    clean_cache,
                    patching_metric,
                    cells.tolist(),
                    max_batch,
                    max_bytes,
                    progress,
                )
            exact[name].view(-1)[order] = values.to(exact[name])
    return AttributionResult(baseline, estimates, exact)


def verify(
    plan: Plan,
    name: str,
    tokens: torch.Tensor,
    clean_cache: Any,
    metric: Metric,
    cells: list[list[int]],
    max_batch: int | None,
    max_bytes: int,
    progress: bool,
) -> Float[torch.Tensor, " cells"]:
    """The exact sweep's value of each cell (grid index) of `name`'s grid, many per pass.

    Each cell is the named sweep's run there (`[layer, pos, head]` of a head grid,
    `[layer, head, dest_pos, src_pos]` of the pattern's, `[layer, pos]` of a node's),
    run by the family's `prepare` (`safelens.patching._runners`), as the sweeps run.
    """
    kind = "head" if name in HEAD_SITES else "pattern" if name == "pattern" else "node"
    runs = [
        Run(slot, cell[0], cell[1], cell[2])
        if kind == "head"
        else Run(slot, cell[0], cell[2], cell[1], cell[3])
        if kind == "pattern"
        else Run(slot, cell[0], cell[1])
        for slot, cell in enumerate(cells)
    ]
    model = plan.backend.model
    prepared = prepare_of(model)(model, tokens, clean_cache, name, None)
    return prepared.run(runs, (len(runs),), metric, Limits(max_batch, max_bytes, progress))
