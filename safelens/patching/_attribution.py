"""Attribution patching: whole key, value, query and head-output grids from one backward pass.

An exact by-position sweep runs one patched pass per (layer, position, head). Attribution
patching (AtP) estimates every one of them at once from the corrupted run's gradient:

    metric(patched) ≈ metric(corrupted) + dmetric/dactivation · (clean - corrupted)

one clean run (the `clean_cache` the exact sweeps take), one corrupted forward pass
through a safelens key/value cache and one backward pass. Values and head outputs use
this first-order estimate; keys and queries, by default, AtP*'s QK fix: their patched
attention softmax is recomputed exactly and only what follows the pattern is linearised
(see `safelens.patching._qk_fix`). The grids have the exact sweeps' shapes, and hold
estimates of the same numbers: the metric of the patched run, not its change.

When to trust it: exactly right where the metric is linear in the patched activation
from the patch on (a value or head output of the last attention layer of an
attention-only model without a final LayerNorm, read by a linear metric; with the QK fix,
keys and queries there too). Elsewhere it is first order: it fails where a patch
saturates something after it (a softmax of a later layer, a LayerNorm, the metric's
own nonlinearity, e.g. a probability near 0 or 1), and it can mis-rank components
whose effects cancel along different paths. The remedy is `verify_top_k`: the top
candidates by estimated effect are recomputed by the exact sweep, and a large gap
between estimate and exact value there shows the estimate cannot be trusted for this
model and metric.

On a TransformerBridge the same hook points are read (the bridge's own, TransformerLens'
names and layouts), through the bridge's forward on a safelens `HFKeyValueCache`; the QK
fix there scores with a scale times `q·k` read off the corrupted run (`_scores_function`).
A plain HuggingFace model has no such hook points and is refused.

Caveat: the backward pass keeps the corrupted run's graph, about one training step's
activation memory, and the QK fix holds a few `[batch, n_heads, pos, pos]` float64
tensors per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import pandas as pd
import torch
from jaxtyping import Float, Int

from ..backends._backend import Backend, backend_of
from ..core._arguments import flag, positive_int
from ..core._errors import PatchingError
from ..core._thread_hooks import thread_hooks
from ._clean_cache import CLEAN_CACHE_OF, axes_of, backend_sizes, check_clean_cache, shape_error
from ._hf_shortcuts import tolerance
from ._hf_sites import _tokens
from ._hf_sweeps import _check_no_dropout
from ._limits import DEFAULT_MAX_BYTES, _check_limits
from ._metric import Metric, check_metric
from ._patterns import _check_pattern_hook
from ._qk_fix import Scores, key_effects, query_effects
from ._sweeps import generic_activation_patch

if TYPE_CHECKING:
    from transformer_lens import ActivationCache, HookedTransformer

__all__ = ["AttributionResult", "attribution_patch"]

Activation = Literal["k", "v", "q", "z"]
_ACTIVATIONS: tuple[Activation, ...] = ("k", "v", "q", "z")


@dataclass(frozen=True)
class AttributionResult:
    """Estimated patching grids, and the exact values of the verified cells.

    - `baseline`: the metric of the corrupted run (0-d).
    - `estimates`: per activation (`"k"`, `"v"`, `"q"`, `"z"`), the estimated metric of
      each patched run, `[layer, pos, head]` as the exact
      `get_act_patch_attn_head_{k,v,q,out}_by_pos` (`n_kv_heads` heads for k and v).
    - `exact`: per activation, the same shape, NaN except the `verify_top_k` cells of
      largest estimated effect, which hold the exact sweep's value.
    """

    baseline: torch.Tensor
    estimates: dict[str, torch.Tensor]
    exact: dict[str, torch.Tensor]


def _check(
    model: Any, activations: Any, qk_fix: Any, verify_top_k: Any
) -> tuple[Backend, tuple[Activation, ...]]:
    backend = backend_of(model, "attribution_patch")
    if backend.family == "hf":
        raise PatchingError(
            "attribution_patch reads queries, keys, values and head outputs at hook points, "
            f"which a plain HuggingFace model ({type(model).__name__}) does not have; wrap it "
            "in a TransformerLens TransformerBridge (TransformerBridge.boot_transformers(path, "
            "hf_model=model)), or use the exact sweeps"
        )
    flag(qk_fix, "qk_fix", error=PatchingError, shown=repr)
    if verify_top_k != 0:
        positive_int(verify_top_k, "verify_top_k", error=PatchingError, shown=repr)
    if isinstance(activations, str) or not isinstance(activations, Sequence):
        raise PatchingError(
            f"activations must be a sequence of {list(_ACTIVATIONS)}, got {activations!r}"
        )
    unknown = [name for name in activations if name not in _ACTIVATIONS]
    if unknown or not activations:
        raise PatchingError(
            f"activations must be a non-empty sequence of {list(_ACTIVATIONS)}, got "
            f"{list(activations)!r}"
        )
    chosen = tuple(dict.fromkeys(activations))
    if backend.family == "hooked":
        _check_hooked_attention(model.cfg, qk_fix and bool({"k", "q"} & set(chosen)))
    return backend, chosen


def _check_hooked_attention(cfg: Any, qk_fix: bool) -> None:
    """Refuse the QK fix on a HookedTransformer whose attention transforms q and k further."""
    special = [
        name
        for name, on in (
            ("use_attention_sinks", cfg.use_attention_sinks),
            ("use_logn_attn", cfg.use_logn_attn),
            ("use_qk_norm", cfg.use_qk_norm and cfg.positional_embedding_type != "rotary"),
            ("clip_qkv", cfg.clip_qkv is not None and cfg.positional_embedding_type != "rotary"),
        )
        if on
    ]
    if qk_fix and special:
        raise PatchingError(
            f"the QK fix recomputes attention from the keys and queries, which this model "
            f"transforms further ({', '.join('cfg.' + s for s in special)}); pass "
            "qk_fix=False for plain gradient estimates of k and q"
        )


def _site_names(model: Any, activations: Sequence[str], qk_fix: bool) -> list[str]:
    """The per-layer hook names (under `blocks.{layer}.attn.`) the estimate reads."""
    names = [f"hook_{name}" for name in activations]
    if qk_fix and {"k", "q"} & set(activations):
        rotary = "blocks.0.attn.hook_rot_q" in model.hook_dict
        names += ["hook_rot_q", "hook_rot_k"] if rotary else ["hook_q", "hook_k"]
        names += ["hook_attn_scores", "hook_pattern"]
    return list(dict.fromkeys(names))


def _corrupted_pass(
    backend: Backend, tokens: torch.Tensor, names: list[str], metric: Metric
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The corrupted run's metric, activations and metric gradients at `names`.

    Runs through a fresh safelens cache, so gradients flow through its appends.
    """
    model = backend.model
    captured: dict[str, torch.Tensor] = {}

    def capture(name: str) -> Any:
        # Keyed by the name asked for: a bridge's `attn.hook_k` is an alias of a hook
        # point named otherwise (`attn.k.hook_out`). Returned, so that what follows is
        # computed from this very tensor: a bridge hands its hooks a converted copy
        # (heads split out), which is used on only when a hook returns it.
        def hook(tensor: torch.Tensor, hook: Any = None) -> torch.Tensor:
            captured[name] = tensor
            return tensor

        return hook

    hooked = [
        (f"blocks.{layer}.attn.{name}", capture(f"blocks.{layer}.attn.{name}"))
        for layer in range(backend.n_layers)
        for name in names
    ]
    with torch.enable_grad():
        logits = _corrupted_logits(backend, tokens, hooked)
        value = metric(logits)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else value
            raise PatchingError(
                f"patching_metric returned {got} for the corrupted logits "
                f"{tuple(logits.shape)}; attribution needs one differentiable value for the "
                "run (a scalar, or a batched metric's [1])"
            )
        if not value.requires_grad:
            raise PatchingError(
                "patching_metric's value does not depend differentiably on the logits (it "
                "has no gradient); attribution patching differentiates it, so compute it with "
                "torch operations on the logits, without .item(), argmax or detach()"
            )
        missing = sorted({name for name, _ in hooked} - set(captured))
        if missing:
            raise PatchingError(
                f"the corrupted run fired no {missing[0]} (of {len(missing)} hook points "
                f"attribution_patch reads), so this {type(model).__name__}'s attention does "
                "not expose it; pass activations without it, or qk_fix=False"
            )
        wanted = [name for name in captured if not name.endswith(("attn_scores", "rot_q", "rot_k"))]
        wanted = [name for name in wanted if captured[name].requires_grad]
        grads = torch.autograd.grad(value.sum(), [captured[n] for n in wanted], allow_unused=True)
    gradients = {
        name: torch.zeros_like(captured[name]) if grad is None else grad
        for name, grad in zip(wanted, grads, strict=True)
    }
    activations = {name: tensor.detach() for name, tensor in captured.items()}
    return value.detach().reshape(()), activations, gradients


def _corrupted_logits(backend: Backend, tokens: torch.Tensor, hooked: list[Any]) -> torch.Tensor:
    """The corrupted logits through a fresh cache, `hooked` (name, hook) on this thread."""
    model = backend.model
    cache = backend.empty_cache(tokens.shape[0])
    if backend.family == "bridge":
        # As the sweeps and `bridge(tokens)`: every position attended.
        mask = torch.ones_like(tokens)
        if "hook_embed" in model.hook_dict:
            # A leaf at the embedding: the graph exists even with frozen parameters.
            hooked = [("hook_embed", _leaf), *hooked]
        with backend.pass_hooks(cache, hooked):
            logits: torch.Tensor = backend.forward(tokens, mask, cache)
        return logits
    from ._grid import _attention_mask_of

    points = [(model.hook_dict[name], hook) for name, hook in hooked]
    full = _attention_mask_of(model, tokens)
    mask = torch.ones_like(tokens) if full is None else full
    with thread_hooks(points):
        embedded = model(tokens, attention_mask=mask, stop_at_layer=0).detach().requires_grad_()
        return model(embedded, start_at_layer=0, past_kv_cache=cache, attention_mask=mask)


def _leaf(tensor: torch.Tensor, hook: Any = None) -> torch.Tensor:
    return tensor.detach().requires_grad_()


def _clean(clean_cache: Any, name: str, like: torch.Tensor) -> torch.Tensor:
    try:
        clean = clean_cache[name]
    except KeyError:
        raise PatchingError(
            f"clean_cache has no activation {name!r}, which attribution_patch reads; run the "
            "clean prompt with model.run_with_cache(clean_tokens), without a names_filter"
        ) from None
    if clean.shape[0] not in (1, like.shape[0]) or clean.shape[1:] != like.shape[1:]:
        raise shape_error(
            name,
            tuple(clean.shape),
            tuple(like.shape[1:]),
            like.shape[0],
            axes_of(name),
            CLEAN_CACHE_OF["hooked"],
        )
    return clean.to(like.device, like.dtype).expand_as(like)


def _estimate(
    backend: Backend,
    layer: int,
    name: Activation,
    qk_fix: bool,
    acts: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    clean_cache: Any,
) -> Float[torch.Tensor, "pos head"]:
    """The estimated change of the metric for each (position, head) patch of one layer."""
    prefix = f"blocks.{layer}.attn."
    if not qk_fix or name in ("v", "z"):
        corrupted = acts[prefix + f"hook_{name}"]
        delta = _clean(clean_cache, prefix + f"hook_{name}", corrupted) - corrupted
        return (grads[prefix + f"hook_{name}"] * delta).sum(dim=(0, 3)).double()
    q_name, k_name = ("rot_q", "rot_k") if prefix + "hook_rot_q" in acts else ("q", "k")
    q, k = acts[prefix + f"hook_{q_name}"], acts[prefix + f"hook_{k_name}"]
    scores, grad = acts[prefix + "hook_attn_scores"], grads[prefix + "hook_pattern"]
    scores_of = _scores_function(backend, layer, q, k, scores)
    if name == "k":
        clean_k = _clean(clean_cache, prefix + f"hook_{k_name}", k)
        return key_effects(scores_of, scores, grad, q, k, clean_k)
    clean_q = _clean(clean_cache, prefix + f"hook_{q_name}", q)
    return query_effects(scores_of, scores, grad, q, k, clean_q)


def _scores_function(
    backend: Backend, layer: int, q: torch.Tensor, k: torch.Tensor, scores: torch.Tensor
) -> Scores:
    """How attention scores `q` against `k` at `layer`: the attention module's own code on
    a HookedTransformer; on a bridge, `scale · q·k` (soft-capped as the layer's
    HuggingFace attention caps it, `cap · tanh(x / cap)`) with the scale read off the
    corrupted run, which must reproduce its scores (a `PatchingError` where it does not)."""
    if backend.family == "hooked":
        attn = backend.model.blocks[layer].attn
        return lambda q, k: attn.calculate_attention_scores(q, k).double()
    component = backend.model.blocks[layer].attn
    cap = getattr(
        getattr(component, "original_component", component), "attn_logit_softcapping", None
    )
    cap = float(cap) if isinstance(cap, (int, float)) and cap > 0 else None

    def capped(x: torch.Tensor) -> torch.Tensor:
        return x if cap is None else cap * torch.tanh(x / cap)

    raw = _dot(q, k)
    kept = scores.isfinite() & (scores > torch.finfo(scores.dtype).min / 2)
    s, r = scores.double()[kept], raw[kept]
    # The scale from the scores a cap has not flattened, uncapped.
    fit = s.abs() < 0.9 * cap if cap is not None else torch.ones_like(s, dtype=torch.bool)
    target = s[fit] if cap is None else cap * torch.atanh(s[fit] / cap)
    usable = bool((r[fit] != 0).any())
    scale = float((target * r[fit]).sum() / (r[fit] * r[fit]).sum()) if usable else 0.0
    error = float((capped(scale * r) - s).abs().max()) if s.numel() else 0.0
    if not usable or error > tolerance(scores.dtype) * float(s.abs().max()) + 1e-7:
        form = "q·k soft-capped" if cap else "q·k"
        raise PatchingError(
            f"the QK fix recomputes layer {layer}'s attention scores from its queries and "
            f"keys, but this bridge's scores are no fixed multiple of {form} (off by "
            f"{error:.2g}: position biases, or keys and queries other than the ones "
            "attention uses); pass qk_fix=False for plain gradient estimates of k and q"
        )
    return lambda q, k: capped(scale * _dot(q, k))


def _dot(
    q: Float[torch.Tensor, "batch pos n_heads d_head"],
    k: Float[torch.Tensor, "batch pos n_kv_heads d_head"],
) -> Float[torch.Tensor, "batch n_heads pos pos"]:
    """`q · k` per head in float64, each key/value head serving its consecutive query heads."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    return torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double())


def attribution_patch(
    model: HookedTransformer | Any,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: ActivationCache,
    patching_metric: Metric,
    *,
    activations: Sequence[Activation] = _ACTIVATIONS,
    qk_fix: bool = True,
    verify_top_k: int = 0,
    max_batch: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: bool = False,
) -> AttributionResult:
    """Estimate the k, v, q and z by-position patching grids from one backward pass.

    Same arguments as the exact sweeps (e.g.
    [`get_act_patch_attn_head_k_by_pos`][safelens.get_act_patch_attn_head_k_by_pos]),
    same result shapes; see the module notes for what is approximated and when to
    trust it.

    **Arguments:**

    - `model`: a `HookedTransformer` or a TransformerLens `TransformerBridge` (whose
      hook points are read as a `HookedTransformer`'s; a plain HuggingFace model has
      none and is refused).
    - `corrupted_tokens`: `[batch, pos]` tokens of the corrupted run.
    - `clean_cache`: the clean run's `ActivationCache` (`model.run_with_cache`).
    - `patching_metric`: logits `[batch, pos, d_vocab]` of one run to a differentiable
      scalar (or `[1]`, as a batched metric gives for one run).
    - `activations`: which grids to estimate, of `"k"`, `"v"`, `"q"`, `"z"`.
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
    differentiable value, unknown `activations`, bad limits, a plain HuggingFace model,
    or a QK fix on a model whose attention transforms keys and queries further (on a
    bridge: whose scores are no fixed multiple of `q·k`, or whose attention does not
    use what `hook_pattern` returns).

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> cfg = HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=8, d_head=4, n_heads=4, d_vocab=11, act_fn="gelu")
    >>> model = HookedTransformer(cfg)
    >>> _, clean_cache = model.run_with_cache(torch.tensor([[1, 2, 3]]))
    >>> metric = lambda logits: logits[:, -1, 0].sum() - logits[:, -1, 1].sum()
    >>> result = attribution_patch(model, torch.tensor([[1, 5, 3]]), clean_cache, metric, verify_top_k=2)
    >>> result.estimates["k"].shape, int(result.exact["v"].isfinite().sum())
    (torch.Size([2, 3, 4]), 2)

    ```
    """
    backend, chosen = _check(model, activations, qk_fix, verify_top_k)
    _check_limits(max_batch, max_bytes, progress)
    tokens = _tokens(backend, corrupted_tokens, "corrupted_tokens")
    check_clean_cache(clean_cache, backend_sizes(backend), CLEAN_CACHE_OF[backend.family])
    check_metric(patching_metric)
    _check_no_dropout(backend.model)
    if qk_fix and {"k", "q"} & set(chosen):
        # The fix reads the gradient at `hook_pattern`: the attention must use its output.
        _check_pattern_hook(model, tokens, "attribution_patch's QK fix")
    baseline, acts, grads = _corrupted_pass(
        backend, tokens, _site_names(model, chosen, qk_fix), patching_metric
    )
    estimates: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}
    for name in chosen:
        grid = torch.stack(
            [
                _estimate(backend, layer, name, qk_fix, acts, grads, clean_cache)
                for layer in range(backend.n_layers)
            ]
        )
        estimates[name] = (grid + baseline.double()).float()
        exact[name] = torch.full_like(estimates[name], float("nan"))
        if verify_top_k:
            _verify(
                model,
                tokens,
                clean_cache,
                patching_metric,
                name,
                estimates[name],
                baseline,
                exact[name],
                verify_top_k,
                max_batch,
                max_bytes,
                progress,
            )
    return AttributionResult(baseline, estimates, exact)


def _verify(
    model: Any,
    tokens: torch.Tensor,
    clean_cache: Any,
    metric: Metric,
    name: str,
    estimate: torch.Tensor,
    baseline: torch.Tensor,
    exact: torch.Tensor,
    top_k: int,
    max_batch: int | None,
    max_bytes: int,
    progress: bool,
) -> None:
    """Fill `exact` at the `top_k` cells of largest estimated effect with the exact sweep."""
    order = (estimate - baseline).abs().flatten().argsort(descending=True)[:top_k]
    cells = torch.stack(torch.unravel_index(order, estimate.shape), dim=1)
    index_df = pd.DataFrame(cells.cpu().numpy(), columns=["layer", "pos", "head_index"])
    from transformer_lens.patching import layer_pos_head_vector_patch_setter

    with torch.no_grad():
        values = generic_activation_patch(
            model,
            tokens,
            clean_cache,
            metric,
            layer_pos_head_vector_patch_setter,
            name,
            index_df=index_df,
            max_batch=max_batch,
            max_bytes=max_bytes,
            progress=progress,
        )
    assert isinstance(values, torch.Tensor)
    exact.view(-1)[order] = values.to(exact)
