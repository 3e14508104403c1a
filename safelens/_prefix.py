"""A prompt prefix run once, frozen and shared: `prefill` and `score_continuations`.

[`prefill`][safelens.prefill] runs a prefix through a `HookedTransformer` into a frozen
[`KeyValueCache`][safelens.KeyValueCache] and returns a [`Prefix`][safelens.Prefix]: the
cache plus what a continuation needs from the prefix run (its tokens, attention mask,
the logits at its last position, and optionally the residual stream entering each
layer, which write-time ablations reuse). [`score_continuations`][safelens.score_continuations]
then scores many continuations of that prefix in batches, broadcasting the prefix to
each batch without copying it (`cache.expand(n)`), right-padding ragged continuations
under an attention mask.

Each batch runs under [`shared_prefix_attention`][safelens.shared_prefix_attention], so
attention reads the prefix's keys and values once per layer rather than once per row.
Caveat on memory: the attention scores against the prefix still take `rows * n_heads *
new_tokens * pos` values per layer; `memory_budget` and `batch_size` bound how many
rows run at once. The stored prefix is never written: it
stays frozen and bitwise unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int

from ._cache import KeyValueCache
from ._config import CacheDimensions
from ._errors import CacheShapeError
from ._shared_attention import shared_prefix_attention

__all__ = ["Prefix", "ContinuationScores", "prefill", "score_continuations"]

DEFAULT_MEMORY_BUDGET = 1 << 30
_AUTO_PROGRESS_BATCHES = 8


@dataclass(frozen=True)
class Prefix:
    """A prefix run once: its frozen cache and what continuations need from it.

    **Fields:**

    - `cache`: the prefix's keys and values, frozen.
    - `tokens`: `[batch, pos]` the prefix tokens (left padding included).
    - `attention_mask`: `[batch, pos]`, 0 on left padding.
    - `last_logits`: `[batch, d_vocab]` logits at the last position: the prediction of a
      continuation's first token.
    - `residuals`: the residual stream entering each layer (`blocks.{l}.hook_resid_pre`),
      `[batch, pos, d_model]` each, or `None` when not kept.
    """

    cache: KeyValueCache
    tokens: Int[torch.Tensor, "batch pos"]
    attention_mask: Int[torch.Tensor, "batch pos"]
    last_logits: Float[torch.Tensor, "batch d_vocab"]
    residuals: tuple[Float[torch.Tensor, "batch pos d_model"], ...] | None = None

    @property
    def batch_size(self) -> int:
        """Rows of the prefix."""
        return int(self.tokens.shape[0])

    @property
    def length(self) -> int:
        """Positions of the prefix, left padding included."""
        return int(self.tokens.shape[1])

    def select(self, row: int) -> Prefix:
        """Row `row` as a batch-1 prefix (its cache in storage of its own, frozen).

        ```python
        >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
        >>> model = HookedTransformer(HookedTransformerConfig(n_layers=1, d_model=16, n_ctx=32, d_head=8, d_vocab=20, act_fn="gelu"))
        >>> mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
        >>> prefix = prefill(model, torch.tensor([[0, 5, 6], [4, 5, 6]]), attention_mask=mask)
        >>> prefix.select(0).attention_mask, prefix.select(0).cache.batch_size
        (tensor([[0, 1, 1]]), 1)

        ```
        """
        if not -self.batch_size <= row < self.batch_size:
            raise IndexError(f"row {row} is out of range for a prefix of batch {self.batch_size}")
        cache = self.cache.select([row])
        cache.freeze()
        rows = slice(row, row + 1) if row != -1 else slice(-1, None)
        residuals = None if self.residuals is None else tuple(r[rows] for r in self.residuals)
        return Prefix(
            cache,
            self.tokens[rows],
            self.attention_mask[rows],
            self.last_logits[rows],
            residuals,
        )


@dataclass(frozen=True)
class ContinuationScores:
    """Per-token log-probabilities of continuations, right-padded to the longest.

    **Fields:**

    - `log_probs`: `[n, new_tokens]` log-probability of each continuation token given
      the prefix and the tokens before it; 0 on padding.
    - `mask`: `[n, new_tokens]`, True on real tokens.
    - `sums`: `[n]` total log-probability of each continuation.
    """

    log_probs: Float[torch.Tensor, "n new_tokens"]
    mask: torch.Tensor
    sums: Float[torch.Tensor, " n"]

    def per_continuation(self) -> list[torch.Tensor]:
        """The log-probabilities of each continuation, at its own length."""
        return [row[keep] for row, keep in zip(self.log_probs, self.mask, strict=True)]


def _prefix_tokens(model: Any, tokens_or_text: Any) -> torch.Tensor:
    if isinstance(tokens_or_text, str | list) and (
        isinstance(tokens_or_text, str) or any(isinstance(t, str) for t in tokens_or_text)
    ):
        if getattr(model, "tokenizer", None) is None:
            raise ValueError(
                "tokens_or_text is text but the model has no tokenizer; pass token ids "
                "(a [batch, pos] tensor) and an attention_mask instead"
            )
        tokens = model.to_tokens(tokens_or_text)
        return tokens
    tokens = torch.as_tensor(tokens_or_text)
    if tokens.dim() == 1:
        tokens = tokens[None]
    if tokens.dim() != 2 or tokens.dtype.is_floating_point or tokens.shape[1] == 0:
        raise CacheShapeError(
            f"tokens_or_text must be integer token ids [batch, pos] with pos >= 1, got "
            f"shape {tuple(tokens.shape)} of {tokens.dtype}"
        )
    return tokens


def _prefix_mask(model: Any, tokens: torch.Tensor, attention_mask: Any) -> torch.Tensor:
    if attention_mask is None:
        if tokens.shape[0] > 1 and getattr(model, "tokenizer", None) is not None:
            from transformer_lens.utilities import get_attention_mask

            return get_attention_mask(model.tokenizer, tokens, model.cfg.default_prepend_bos).long()
        return torch.ones_like(tokens, dtype=torch.long)
    mask = torch.as_tensor(attention_mask).to(tokens.device).long()
    if mask.shape != tokens.shape:
        raise CacheShapeError(
            f"attention_mask of shape {tuple(mask.shape)} does not fit the tokens "
            f"[batch={tokens.shape[0]}, pos={tokens.shape[1]}]"
        )
    if not bool((mask[:, -1] == 1).all()):
        raise CacheShapeError(
            "attention_mask has padding at the last position of some row; a prefix must be "
            "left-padded (padding first) so that continuations follow its real tokens"
        )
    return mask


def prefill(
    model: Any,
    tokens_or_text: Int[torch.Tensor, "batch pos"] | str | list[str] | list[int],
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
    keep_residuals: bool = True,
) -> Prefix:
    """Run a prefix through `model` once into a frozen cache, ready to share.

    **Arguments:**

    - `model`: a TransformerLens `HookedTransformer`.
    - `tokens_or_text`: `[batch, pos]` (or `[pos]`) token ids, or text when the model
      has a tokenizer.
    - `attention_mask`: `[batch, pos]`, 0 on left padding; all ones when omitted
      (TransformerLens' own mask from the tokenizer for a batch of text).
    - `keep_residuals`: keep the residual stream entering each layer, so that
      [`ablate_write`][safelens.ablate_write] skips the layers before the edit (memory:
      `n_layers * batch * pos * d_model` values, about as much as the cache).

    **Returns:** a [`Prefix`][safelens.Prefix] whose cache is frozen.

    **Raises:** `ValueError` for text without a tokenizer;
    [`CacheShapeError`][safelens.CacheShapeError] for tokens or a mask of the wrong
    shape, or a right-padded mask.

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> model = HookedTransformer(HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=32, d_head=8, d_vocab=20, act_fn="gelu"))
    >>> prefix = prefill(model, torch.tensor([[1, 2, 3, 4]]))
    >>> prefix.cache.sequence_length, bool(prefix.cache.frozen), prefix.last_logits.shape
    (4, True, torch.Size([1, 20]))

    ```
    """
    tokens = _prefix_tokens(model, tokens_or_text)
    tokens = tokens.to(model.cfg.device)
    mask = _prefix_mask(model, tokens, attention_mask)
    cache = KeyValueCache.init_cache(model.cfg, model.cfg.device, batch_size=tokens.shape[0])
    residuals: dict[int, torch.Tensor] = {}

    def keep(resid: torch.Tensor, hook: Any) -> None:
        residuals[hook.layer()] = resid

    hooks = [(f"blocks.{i}.hook_resid_pre", keep) for i in range(model.cfg.n_layers)]
    with torch.no_grad(), model.hooks(fwd_hooks=hooks if keep_residuals else []):
        logits = model(tokens, attention_mask=mask, past_kv_cache=cache)
    cache.freeze()
    kept = tuple(residuals[i] for i in range(model.cfg.n_layers)) if keep_residuals else None
    return Prefix(cache, tokens, mask, logits[:, -1], kept)


def _continuation_rows(continuations: Any, device: torch.device) -> list[torch.Tensor]:
    if isinstance(continuations, torch.Tensor):
        if continuations.dim() != 2:
            raise CacheShapeError(
                f"continuations as one tensor must be [n, new_tokens], got shape "
                f"{tuple(continuations.shape)}; pass a list of 1-D tensors for ragged lengths"
            )
        rows = list(continuations)
    elif isinstance(continuations, Sequence) and not isinstance(continuations, str):
        rows = [torch.as_tensor(c) for c in continuations]
    else:
        raise TypeError(
            f"continuations must be a list of 1-D token tensors or lists, or an [n, "
            f"new_tokens] tensor; got {type(continuations).__name__}"
        )
    if not rows:
        raise ValueError("continuations is empty; pass at least one continuation")
    for i, row in enumerate(rows):
        if row.dim() != 1 or row.numel() == 0 or row.dtype.is_floating_point:
            raise CacheShapeError(
                f"continuations[{i}] must be a non-empty 1-D sequence of token ids, got "
                f"shape {tuple(row.shape)} of {row.dtype}"
            )
    return [row.to(device) for row in rows]


def bytes_per_row(model: Any, prefix_length: int, new_tokens: int) -> int:
    """An estimate of the peak memory one continuation row needs in a forward pass."""
    cfg = model.cfg
    dims = CacheDimensions.of(cfg)
    item = torch.empty((), dtype=dims.dtype).element_size()
    total = prefix_length + new_tokens
    keys_values = 4 * total * cfg.n_heads * cfg.d_head * item
    scores = 3 * cfg.n_heads * new_tokens * total * 4
    hidden = 3 * new_tokens * max(cfg.d_model, cfg.d_mlp or 0) * 4
    logits = 2 * new_tokens * cfg.d_vocab_out * 4
    return keys_values + scores + hidden + logits


def _batches(
    count: int, per_row: int, batch_size: int | None, memory_budget: int | None
) -> list[range]:
    if batch_size is not None and (isinstance(batch_size, bool) or batch_size < 1):
        raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
    if memory_budget is not None and memory_budget < 1:
        raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget}")
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


def _batch_prefix(prefix: Prefix, what: str) -> None:
    if not isinstance(prefix, Prefix):
        raise TypeError(
            f"{what} needs a Prefix (from safelens.prefill), got {type(prefix).__name__}; "
            "prefill(model, tokens) returns the cache together with the prefix's last logits"
        )
    if prefix.batch_size != 1:
        raise CacheShapeError(
            f"{what} needs a batch-1 prefix, got batch {prefix.batch_size}; use "
            "prefix.select(row) to pick one row of a batch of prefixes"
        )


def score_continuations(
    model: Any,
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

    - `model`: the `HookedTransformer` the prefix was run through.
    - `prefix`: a batch-1 [`Prefix`][safelens.Prefix] (`prefix.select(row)` for a row of
      a batch), possibly ablated ([`ablate_read`][safelens.ablate_read]).
    - `continuations`: a list of 1-D token tensors or lists (ragged lengths allowed), or
      an `[n, new_tokens]` tensor.
    - `batch_size`: at most this many continuations per forward pass.
    - `memory_budget`: bytes one forward pass may use (an estimate; default 1 GiB), used
      when `batch_size` is not given.
    - `progress`: show a tqdm bar; `None` shows one when there are 8 batches or more.

    **Returns:** [`ContinuationScores`][safelens.ContinuationScores], in the order given.

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> model = HookedTransformer(HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=32, d_head=8, d_vocab=20, act_fn="gelu"))
    >>> prefix = prefill(model, torch.tensor([[1, 2, 3, 4]]))
    >>> scores = score_continuations(model, prefix, [[5, 6, 7], [8]])
    >>> scores.log_probs.shape, scores.sums.shape, [len(s) for s in scores.per_continuation()]
    (torch.Size([2, 3]), torch.Size([2]), [3, 1])

    ```
    """
    _batch_prefix(prefix, "score_continuations")
    rows = _continuation_rows(continuations, prefix.tokens.device)
    lengths = torch.tensor([len(r) for r in rows])
    longest = int(lengths.max())
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    per_row = bytes_per_row(model, prefix.length, longest)
    device = prefix.tokens.device
    log_probs = torch.zeros(len(rows), longest, dtype=torch.float32, device=device)
    first = torch.log_softmax(prefix.last_logits[0].float(), dim=-1)
    batches = _batches(len(rows), per_row, batch_size, memory_budget)
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
        with torch.no_grad(), shared_prefix_attention(model):
            logits = model(tokens, attention_mask=mask, past_kv_cache=cache)
        scores = torch.empty(len(picked), width, dtype=torch.float32, device=device)
        scores[:, 0] = first[tokens[:, 0]]
        if width > 1:
            later = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            scores[:, 1:] = later.gather(-1, tokens[:, 1:, None])[..., 0]
        log_probs[picked, :width] = scores * mask
    keep = (torch.arange(longest)[None] < lengths[:, None]).to(device)
    return ContinuationScores(log_probs, keep, log_probs.sum(dim=-1))
