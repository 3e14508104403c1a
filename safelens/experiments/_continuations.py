"""Scoring many continuations of one frozen prefix: `score_continuations`.

[`score_continuations`][safelens.score_continuations] scores many continuations of a
[`Prefix`][safelens.Prefix] in batches, broadcasting the prefix to each batch without
copying it (`cache.expand(n)`), right-padding ragged continuations under an attention
mask, and returns their per-token log-probabilities as
[`ContinuationScores`][safelens.ContinuationScores].

Each batch runs through the backend's `forward_continuations`, on a `HookedTransformer`
under [`shared_prefix_attention`][safelens.shared_prefix_attention] and on a HuggingFace
model under [`shared_prefix`][safelens.shared_prefix], so attention reads the prefix's
keys and values once per layer rather than once per row. The stored prefix
is never written: it stays frozen and bitwise unchanged.

Everything is checked before anything runs: token ids (dtype, `0 <= id < d_vocab`, at
most `n_ctx` positions counting the prefix), sizes and flags, and that the prefix is
frozen, self-consistent and made by this model. A refused call changes nothing.

Caveat on memory: the attention scores against the prefix still take `rows * n_heads *
new_tokens * pos` values per layer; `memory_budget` and `batch_size` bound how many
rows run at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from jaxtyping import Float, Int

from ..backends._backend import Backend
from ..backends._supported import SupportedModel
from ..core._arguments import flag, positive_int
from ..core._errors import CacheShapeError, TokenError
from ..core._repr import summary_repr
from ..core._tokens import check_tokens
from ._prefix import Prefix, check_prefix, runner_of, token_limits

__all__ = ["ContinuationScores", "continuation_rows", "score_continuations"]

DEFAULT_MEMORY_BUDGET = 1 << 30
_AUTO_PROGRESS_BATCHES = 8


@dataclass(frozen=True, repr=False)
class ContinuationScores:
    """Per-token log-probabilities of continuations, right-padded to the longest.

    **Fields:**

    - `log_probs`: `[n, new_tokens]` log-probability of each continuation token given
      the prefix and the tokens before it; 0 on padding.
    - `mask`: `[n, new_tokens]`, True on real tokens.
    - `sums`: `[n]` total log-probability of each continuation.
    """

    __repr__ = summary_repr  # tensors by shape, not by value

    log_probs: Float[torch.Tensor, "n new_tokens"]
    mask: torch.Tensor
    sums: Float[torch.Tensor, " n"]

    def per_continuation(self) -> list[torch.Tensor]:
        """The log-probabilities of each continuation, at its own length."""
        return [row[keep] for row, keep in zip(self.log_probs, self.mask, strict=True)]


def continuation_rows(continuations: Any, limits: Any, past: int) -> list[torch.Tensor]:
    """Each continuation as 1-D token ids, checked against `limits` (`token_limits`) after
    `past` positions: ids the model embeds and its logits score."""
    d_vocab = min(limits.d_vocab, limits.d_logits)
    limits = SimpleNamespace(d_vocab=d_vocab, n_ctx=limits.n_ctx)
    if isinstance(continuations, torch.Tensor):
        if continuations.dim() != 2:
            raise TokenError(
                f"continuations as one tensor must be [n, new_tokens], got shape "
                f"{tuple(continuations.shape)}; pass a list of 1-D tensors for ragged lengths"
            )
        rows = list(check_tokens(continuations, limits, "continuations", past=past))
    elif isinstance(continuations, Sequence) and not isinstance(continuations, str):
        rows = [
            check_tokens(
                torch.zeros(0, dtype=torch.long) if _empty(row) else row,
                limits,
                f"continuations[{i}]",
                past=past,
                rank=1,
            )
            for i, row in enumerate(continuations)
        ]
    else:
        raise TypeError(
            f"continuations must be a list of 1-D token tensors or lists, or an [n, "
            f"new_tokens] tensor; got {type(continuations).__name__}"
        )
    if not rows:
        raise ValueError("continuations is empty; pass at least one continuation")
    return rows


def _empty(row: Any) -> bool:
    return isinstance(row, list | tuple) and len(row) == 0


def bytes_per_row(backend: Backend, prefix_length: int, new_tokens: int) -> int:
    """An estimate of the peak memory one continuation row needs in a forward pass.

    Query heads and the MLP width are taken as `d_model / d_head` and `4 * d_model`.
    """
    item = torch.empty((), dtype=backend.dtype).element_size()
    total = prefix_length + new_tokens
    n_heads = max(backend.d_model // backend.d_head, backend.n_kv_heads)
    keys_values = 4 * total * n_heads * backend.d_head * item
    scores = 3 * n_heads * new_tokens * total * 4
    hidden = 3 * new_tokens * 4 * backend.d_model * 4
    logits = 2 * new_tokens * backend.d_vocab * 4
    return keys_values + scores + hidden + logits


def _batches(
    count: int, per_row: int, batch_size: int | None, memory_budget: int | None
) -> list[range]:
    size = batch_size
    if size is None:
        budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget
        size = max(1, budget // max(per_row, 1))
    return [range(start, min(start + size, count)) for start in range(0, count, size)]


def _progress(items: list[range], progress: bool | None, what: str) -> Any:
    show = len(items) >= _AUTO_PROGRESS_BATCHES if progress is None else progress
    if not show:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=what, unit="batch")


def score_continuations(
    model: SupportedModel,
    prefix: Prefix,
    continuations: Sequence[Int[torch.Tensor, " new_tokens"] | list[int]]
    | Int[torch.Tensor, "n new_tokens"],
    batch_size: int | None = None,
    memory_budget: int | None = None,
    progress: bool | None = None,
) -> ContinuationScores:
    """Log-probabilities of each token of many continuations of one prefix.

    The first continuation token is scored from the prefix's last logits, later tokens
    from the continuation's own positions; the numbers equal an uncached run of
    prefix + continuation. Continuations run in batches that read the shared, frozen
    prefix (never copied into storage, never changed); ragged ones are right-padded.

    **Arguments:**

    - `model`: the model the prefix was run through (a `HookedTransformer`, a
      TransformerBridge or a HuggingFace causal LM; a bridge with no hook attached
      runs the passes on its plain HuggingFace model where one pass of the prefix's
      last token there gives the bridge's logits).
    - `prefix`: a batch-1 [`Prefix`][safelens.Prefix] (`prefix.select(row)` for a row of
      a batch), possibly ablated ([`ablate_read`][safelens.ablate_read]).
    - `continuations`: a list of 1-D token tensors or lists (ragged lengths allowed), or
      an `[n, new_tokens]` tensor.
    - `batch_size`: at most this many continuations per forward pass.
    - `memory_budget`: bytes one forward pass may use (an estimate; default 1 GiB), used
      when `batch_size` is not given.
    - `progress`: show a tqdm bar; `None` shows one when there are 8 batches or more.

    **Returns:** [`ContinuationScores`][safelens.ContinuationScores], in the order given.

    **Raises:** [`TokenError`][safelens.TokenError] for continuations that are not
    integer ids in `[0, d_vocab)`, or that run past `n_ctx` after the prefix;
    [`CacheConfigError`][safelens.CacheConfigError] for a prefix made by another model;
    [`CacheShapeError`][safelens.CacheShapeError] or
    [`FrozenCacheError`][safelens.FrozenCacheError] for a prefix of several rows, whose
    parts disagree or whose cache is not frozen; `TypeError` / `ValueError` for sizes
    or flags of the wrong type or range. Nothing runs before these checks pass.

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> model = HookedTransformer(HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=32, d_head=8, d_vocab=20, act_fn="gelu"))
    >>> prefix = prefill(model, torch.tensor([[1, 2, 3, 4]]))
    >>> scores = score_continuations(model, prefix, [[5, 6, 7], [8]])
    >>> scores.log_probs.shape, scores.sums.shape, [len(s) for s in scores.per_continuation()]
    (torch.Size([2, 3]), torch.Size([2]), [3, 1])

    ```
    """
    backend = check_prefix(model, prefix, "score_continuations")
    if prefix.batch_size != 1:
        raise CacheShapeError(
            f"score_continuations needs a batch-1 prefix, got batch {prefix.batch_size}; use "
            "prefix.select(row) to pick one row of a batch of prefixes"
        )
    rows = continuation_rows(continuations, token_limits(backend), prefix.length)
    positive_int(batch_size, "batch_size", optional=True)
    positive_int(memory_budget, "memory_budget", optional=True, unit=" (bytes)")
    flag(progress, "progress", optional=True)
    lengths = torch.tensor([len(r) for r in rows])
    longest = int(lengths.max())
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    per_row = bytes_per_row(backend, prefix.length, longest)
    device = prefix.tokens.device
    log_probs = torch.zeros(len(rows), longest, dtype=torch.float32, device=device)
    # On the tokens' device: the unembedding's may differ in a model split over devices.
    first = torch.log_softmax(prefix.last_logits[0].float(), dim=-1).to(device)
    batches = _batches(len(rows), per_row, batch_size, memory_budget)
    runner = runner_of(backend, prefix)
    for batch in _progress(batches, progress, "continuations"):
        picked = [order[i] for i in batch]
        width = int(lengths[picked[0]])
        tokens = torch.zeros(len(picked), width, dtype=torch.long, device=device)
        mask = torch.zeros_like(tokens)
        for j, index in enumerate(picked):
            tokens[j, : lengths[index]] = rows[index]
            mask[j, : lengths[index]] = 1
        cache = prefix.cache.expand(len(picked))
        cache.freeze()
        full_mask = torch.cat([prefix.attention_mask.expand(len(picked), -1), mask], dim=1)
        with torch.no_grad():
            logits = runner.forward_continuations(tokens, full_mask, cache)
        scores = torch.empty(len(picked), width, dtype=torch.float32, device=device)
        scores[:, 0] = first[tokens[:, 0]]
        if width > 1:
            later = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            following = tokens[:, 1:, None].to(later.device)
            scores[:, 1:] = later.gather(-1, following)[..., 0].to(device)
        log_probs[picked, :width] = scores * mask
    keep = (torch.arange(longest)[None] < lengths[:, None]).to(device)
    return ContinuationScores(log_probs, keep, log_probs.sum(dim=-1))
