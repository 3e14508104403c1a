"""Generating from a shared, frozen prefix: `generate`, greedy or seeded sampling.

Every sample grows its own suffix on a branch of the prefix's cache (`expand` for a
batch-1 prefix: the prefix's storage is shared, only the new tokens are stored per
sample), so the prefix is run once, stays frozen and is never changed.

Stop tokens: a sample that produces one of `stop_tokens` is finished. Its later
positions hold `pad_token` and a log-probability of 0; it still rides along in the
batched forward pass until every sample has finished or `max_new_tokens` is reached
(its tokens there are discarded), as TransformerLens' `generate` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int

from ._prefix import Prefix

__all__ = ["Generation", "generate", "sample_logits"]


@dataclass(frozen=True)
class Generation:
    """New tokens generated after a prefix.

    **Fields:**

    - `tokens`: `[n, new_tokens]`; after a sample's stop token, `pad_token`.
    - `lengths`: `[n]` tokens each sample generated, its stop token included.
    - `log_probs`: `[n, new_tokens]` log-probability of each generated token under the
      model (before temperature, top-k or top-p); 0 after a stop token.
    """

    tokens: Int[torch.Tensor, "n new_tokens"]
    lengths: Int[torch.Tensor, " n"]
    log_probs: Float[torch.Tensor, "n new_tokens"]


def sample_logits(
    logits: Float[torch.Tensor, "batch d_vocab"],
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Int[torch.Tensor, " batch"]:
    """One token per row from `logits`, after temperature, top-k and top-p filtering.

    `temperature == 0` picks the arg-max. Top-p keeps the smallest set of most likely
    tokens whose probability reaches `top_p` (always at least the most likely one).

    ```python
    >>> logits = torch.tensor([[0.0, 5.0, 1.0]])
    >>> sample_logits(logits, temperature=0.0), sample_logits(logits, top_k=1)
    (tensor([1]), tensor([1]))

    ```
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        ordered, indices = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(ordered, dim=-1) >= top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, indices, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _check(
    max_new_tokens: int,
    n_samples: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> None:
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"n_samples must be a positive int, got {n_samples!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be a positive int or None, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")


def generate(
    model: Any,
    prefix: Prefix,
    max_new_tokens: int,
    n_samples: int = 1,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_tokens: Sequence[int] | None = None,
    pad_token: int | None = None,
) -> Generation:
    """Generate `max_new_tokens` after `prefix`, greedily or by seeded sampling.

    Greedy generation gives the tokens of TransformerLens' `model.generate` on the full
    prompt with `do_sample=False`. Sampling draws from a `torch.Generator` seeded with
    `seed`, so equal seeds give equal samples.

    **Arguments:**

    - `model`: the `HookedTransformer` the prefix was run through.
    - `prefix`: a [`Prefix`][safelens.Prefix]; each of its rows gets `n_samples` samples
      (rows `r * n_samples … (r + 1) * n_samples - 1` of the result).
    - `max_new_tokens`: tokens to generate per sample.
    - `n_samples`: samples per prefix row, generated together.
    - `do_sample`: sample (`True`) or take the arg-max (`False`).
    - `temperature`, `top_k`, `top_p`: sampling filters (see
      [`sample_logits`][safelens.sample_logits]).
    - `seed`: seed of the sampling generator; `None` uses torch's global generator.
    - `stop_tokens`: token ids that finish a sample.
    - `pad_token`: what fills a finished sample; defaults to its first stop token, else 0.

    **Returns:** a [`Generation`][safelens.Generation].

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> model = HookedTransformer(HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=32, d_head=8, d_vocab=20, act_fn="gelu"))
    >>> prefix = prefill(model, torch.tensor([[1, 2, 3, 4]]))
    >>> out = generate(model, prefix, 5, n_samples=3, do_sample=True, seed=0)
    >>> out.tokens.shape, out.lengths.tolist()
    (torch.Size([3, 5]), [5, 5, 5])

    ```
    """
    if not isinstance(prefix, Prefix):
        raise TypeError(
            f"generate needs a Prefix (from safelens.prefill), got {type(prefix).__name__}"
        )
    _check(max_new_tokens, n_samples, temperature, top_k, top_p)
    device = prefix.tokens.device
    rows = prefix.batch_size * n_samples
    if prefix.batch_size == 1:
        branch = prefix.cache.expand(rows)
    elif n_samples == 1:
        branch = prefix.cache.fork()
    else:
        branch = prefix.cache.select(torch.arange(prefix.batch_size).repeat_interleave(n_samples))
    generator = None
    if do_sample and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    stops = torch.tensor(list(stop_tokens or []), dtype=torch.long, device=device)
    fill = pad_token if pad_token is not None else (int(stops[0]) if stops.numel() else 0)
    tokens = torch.full((rows, max_new_tokens), fill, dtype=torch.long, device=device)
    log_probs = torch.zeros(rows, max_new_tokens, dtype=torch.float32, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    lengths = torch.full((rows,), max_new_tokens, dtype=torch.long, device=device)
    logits = prefix.last_logits.repeat_interleave(n_samples, dim=0)
    ones = torch.ones(rows, 1, dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        if do_sample:
            token = sample_logits(logits, temperature, top_k, top_p, generator)
        else:
            token = logits.argmax(dim=-1)
        chosen = torch.log_softmax(logits.float(), dim=-1).gather(-1, token[:, None])[:, 0]
        live = ~finished
        tokens[live, step] = token[live]
        log_probs[live, step] = chosen[live]
        if stops.numel():
            stopped = live & torch.isin(token, stops)
            lengths[stopped] = step + 1
            finished |= stopped
            if bool(finished.all()):
                break
        if step + 1 < max_new_tokens:
            with torch.no_grad():
                logits = model(token[:, None], attention_mask=ones, past_kv_cache=branch)[:, -1]
    return Generation(tokens, lengths, log_probs)
