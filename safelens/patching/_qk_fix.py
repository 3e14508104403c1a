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

Scores are computed by a `Scores` function the caller gives: on a HookedTransformer the
attention module's own `calculate_attention_scores` (scale, soft cap, grouped-query key
sharing), on a TransformerBridge a scale times `q·k` read off the corrupted run; from the
keys and queries attention uses (post-rotary on rotary models). Position biases (ALiBi)
and masks come with the corrupted run's `hook_attn_scores`, which a key or query patch
does not change. Arithmetic is float64.

Caveat: exact in the softmax only. What follows the pattern is still linearised, so
an effect carried through later layers' nonlinearities (a head whose output another
head's keys read, LayerNorm scales) is first-order there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from jaxtyping import Float

__all__ = ["Scores", "key_effects", "query_effects"]

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
) -> Float[torch.Tensor, "pos n_kv_heads"]:
    """The linearised-from-the-pattern effect of each key patch, summed over the batch.

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
    per_head = effect.nan_to_num(0.0).sum(dim=(0, 2))
    return _by_key_head(per_head, k.shape[2]).T


def query_effects(
    scores_of: Scores,
    scores: Float[torch.Tensor, "batch n_heads pos pos"],
    grad_pattern: Float[torch.Tensor, "batch n_heads pos pos"],
    q: Float[torch.Tensor, "batch pos n_heads d_head"],
    k: Float[torch.Tensor, "batch pos n_kv_heads d_head"],
    clean_q: Float[torch.Tensor, "batch pos n_heads d_head"],
) -> Float[torch.Tensor, "pos n_heads"]:
    """The linearised-from-the-pattern effect of each query patch, summed over the batch."""
    scores = scores.double()
    patched = scores + (scores_of(clean_q, k) - scores_of(q, k))
    change = torch.softmax(patched, dim=-1) - torch.softmax(scores, dim=-1)
    effect = (grad_pattern.double() * change.nan_to_num(0.0)).sum(-1)
    return effect.sum(0).T


def _by_key_head(
    per_head: Float[torch.Tensor, "n_heads pos"], kv_heads: int
) -> Float[torch.Tensor, "n_kv_heads pos"]:
    """Query heads' effects summed over the heads that share each key/value head."""
    heads = per_head.shape[0]
    if heads == kv_heads:
        return per_head
    return per_head.reshape(kv_heads, heads // kv_heads, -1).sum(1)
