"""AtP*'s QK fix: the attention softmax of a key or query patch, recomputed exactly.

A plain gradient estimate (AtP) of a key or query patch is linear in the attention
*scores*, but the softmax that follows saturates: a clean key that would draw all of a
query's attention, or a query that would move its attention elsewhere, is badly
under- (or over-) estimated by its gradient. The QK fix (Kramár et al. 2024, "AtP*")
computes the patched attention pattern exactly, for every patch at once, and
linearises only from the pattern on:

    effect ≈ sum over rows of  dM/dpattern · (pattern_patched - pattern)

- *Key* patch at source position `s` of a head: in each destination row `t`, only the
  score `S[t, s]` changes (to `S'[t, s]`, the corrupted query against the clean key).
  The patched row is the old one renormalised, with a new entry at `s`: with
  `L = logsumexp(S[t])`, `a = pattern[t, s]`, `L' = log(exp(L) (1 - a) + exp(S'[t, s]))`,
  every other entry is scaled by `r = exp(L - L')` and entry `s` becomes
  `exp(S'[t, s] - L')`. So, with `c[t] = sum_j G[t, j] pattern[t, j]`, the effect at
  `(t, s)` is `(c[t] - G[t, s] a)(r - 1) + G[t, s](exp(S'[t, s] - L') - a)`, summed
  over `t`: O(pos²) per head for every source position together.
- *Query* patch at destination `t`: row `t` of the scores becomes the clean query
  against the corrupted keys; the row's softmax is recomputed whole.

Scores are computed by a `Scores` function (`scores_function`): on a HookedTransformer
the attention module's own `calculate_attention_scores` (scale, soft cap, grouped-query
key sharing), elsewhere a scale times `q·k` read off the corrupted run; from the keys and
queries attention uses (post-rotary on rotary models). Position biases (ALiBi)
and masks come with the corrupted run's `hook_attn_scores`, which a key or query patch
does not change. Arithmetic is float64. Effects are per row of the batch (one prompt pair each), which
`attribution_patch` sums and `attribution_patch_dataset` keeps.

Caveat: exact in the softmax only. What follows the pattern is still linearised, so
an effect carried through later layers' nonlinearities (a head whose output another
head's keys read, LayerNorm scales) is first-order there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float

from ..core._errors import PatchingError
from ._hf_shortcuts import tolerance

__all__ = ["Scores", "key_effects", "query_effects", "scores_function"]

# `(q [batch, pos, n_heads, d_head], k [batch, pos, n_kv_heads, d_head])` -> float64
# attention scores `[batch, n_heads, pos, pos]`, before any mask.
Scores = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def key_effects(
    scores_of: Scores,
    scores: Float[torch.Tensor, "batch n_heads pos pos"],
    grad_pattern: Float[torch.Tensor, "batch n_heads pos pos"],
    q: Float[torch.Tensor, "batch pos n_heads d_head"],
    k: Float[torch.Tensor, "batch pos n_kv_heads d_head"],
    clean_k: Float[torch.Tensor, "batch pos n_kv_heads d_head"],
) -> Float[torch.Tensor, "batch pos n_kv_heads"]:
    """The linearised-from-the-pattern effect of each key patch, per row of the batch.

    `scores` are the corrupted run's `hook_attn_scores`; `q`, `k` the queries and keys
    its attention used; `clean_k` the clean run's keys at the same positions.
    """
    scores = scores.double()
    grad = grad_pattern.double()
    patched = scores + (scores_of(q, clean_k) - scores_of(q, k))
    total = torch.logsumexp(scores, dim=-1, keepdim=True)
    pattern = (scores - total).exp()
    weighted = (grad * pattern).sum(-1, keepdim=True)
    new_total = torch.logaddexp(total + torch.log1p(-pattern), patched)
    ratio = (total - new_total).exp()
    effect = (weighted - grad * pattern) * (ratio - 1) + grad * (
        (patched - new_total).exp() - pattern
    )
    per_head = effect.nan_to_num(0.0).sum(dim=2)
    return _by_key_head(per_head, k.shape[2]).transpose(1, 2)


def query_effects(
    scores_of: Scores,
    scores: Float[torch.Tensor, "batch n_heads pos pos"],
    grad_pattern: Float[torch.Tensor, "batch n_heads pos pos"],
    q: Float[torch.Tensor, "batch pos n_heads d_head"],
    k: Float[torch.Tensor, "batch pos n_kv_heads d_head"],
    clean_q: Float[torch.Tensor, "batch pos n_heads d_head"],
) -> Float[torch.Tensor, "batch pos n_heads"]:
    """The linearised-from-the-pattern effect of each query patch, per row of the batch."""
    scores = scores.double()
    patched = scores + (scores_of(clean_q, k) - scores_of(q, k))
    change = torch.softmax(patched, dim=-1) - torch.softmax(scores, dim=-1)
    effect = (grad_pattern.double() * change.nan_to_num(0.0)).sum(-1)
    return effect.transpose(1, 2)


def _by_key_head(
    per_head: Float[torch.Tensor, "batch n_heads pos"], kv_heads: int
) -> Float[torch.Tensor, "batch n_kv_heads pos"]:
    """Query heads' effects summed over the heads that share each key/value head."""
    batch, heads, _ = per_head.shape
    if heads == kv_heads:
        return per_head
    return per_head.reshape(batch, kv_heads, heads // kv_heads, -1).sum(2)


def scores_function(
    model: Any,
    family: str,
    layer: int,
    q: Float[torch.Tensor, "batch pos n_heads d_head"],
    k: Float[torch.Tensor, "batch pos n_kv_heads d_head"],
    scores: Float[torch.Tensor, "batch n_heads pos pos"],
) -> Scores:
    """How attention scores `q` against `k` at `layer`.

    On a HookedTransformer, the attention module's own code. Elsewhere `scale · q·k`
    (soft-capped as the layer's HuggingFace attention caps it, `cap · tanh(x / cap)`),
    with the scale read off the corrupted run, which must reproduce its `scores`.

    **Raises:** [`PatchingError`][safelens.PatchingError] where `scale · q·k` does not
    reproduce `scores` (position biases, or keys and queries other than attention's).
    """
    if family == "hooked":
        attn = model.blocks[layer].attn
        return lambda q, k: attn.calculate_attention_scores(q, k).double()
    cap = _soft_cap(model, family, layer)

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
            f"keys, but this model's scores are no fixed multiple of {form} (off by "
            f"{error:.2g}: position biases, or keys and queries other than the ones "
            "attention uses); pass qk_fix=False for plain gradient estimates of k and q"
        )
    return lambda q, k: capped(scale * _dot(q, k))


def _soft_cap(model: Any, family: str, layer: int) -> float | None:
    """The attention logit soft cap of `layer`'s HuggingFace attention, or `None`."""
    config = getattr(model, "config", None)
    if family == "bridge":
        component = model.blocks[layer].attn
        config = getattr(component, "original_component", component)
    cap = getattr(config, "attn_logit_softcapping", None)
    return float(cap) if isinstance(cap, (int, float)) and cap > 0 else None


def _dot(
    q: Float[torch.Tensor, "batch pos n_heads d_head"],
    k: Float[torch.Tensor, "batch pos n_kv_heads d_head"],
) -> Float[torch.Tensor, "batch n_heads pos pos"]:
    """`q · k` per head in float64, each key/value head serving its consecutive query heads."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    return torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double())
