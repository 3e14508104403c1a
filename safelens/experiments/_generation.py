"""Generating from a shared, frozen prefix: `generate`, greedy or seeded sampling.

Every sample grows its own suffix on a branch of the prefix's cache (`expand` for a
batch-1 prefix: the prefix's storage is shared, only the new tokens are stored per
sample), so the prefix is run once, stays frozen and is never changed.

Stop tokens: a sample that produces one of `stop_tokens` is finished. Its later
positions hold `pad_token` and a log-probability of 0; it still rides along in the
batched forward pass until every sample has finished or `max_new_tokens` is reached
(its tokens there are discarded), as TransformerLens' `generate` does.

Everything is checked before the first step: the prefix (frozen, made by this model),
that prefix plus `max_new_tokens` fits `n_ctx`, stop and pad tokens in `[0, d_vocab)`,
and each count, flag and sampling setting (NaN, infinities and bools refused).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from jaxtyping import Float, Int

from ..backends._supported import SupportedModel
from ..core._arguments import finite_number, flag, integer, positive_int
from ..core._errors import TokenError
from ..core._repr import summary_repr
from ..core._tokens import check_tokens
from ._prefix import Prefix, check_prefix, runner_of

__all__ = ["Generation", "check_sampling", "check_seed", "generate", "sample_logits"]


@dataclass(frozen=True, repr=False)
class Generation:
    """New tokens generated after a prefix.

    **Fields:**

    - `tokens`: `[n, new_tokens]`; after a sample's stop token, `pad_token`.
    - `lengths`: `[n]` tokens each sample generated, its stop token included.
    - `log_probs`: `[n, new_tokens]` log-probability of each generated token under the
      model (before temperature, top-k or top-p); 0 after a stop token.
    """

    __repr__ = summary_repr  # tensors by shape, not by value

    tokens: Int[torch.Tensor, "n new_tokens"]
    lengths: Int[torch.Tensor, " n"]
    log_probs: Float[torch.Tensor, "n new_tokens"]


def check_sampling(temperature: Any, top_k: Any, top_p: Any) -> None:
    """`generate`'s sampling options checked: a `TypeError` or `ValueError` naming the bad one."""
    if finite_number(temperature, "temperature") < 0:
        raise ValueError(
            f"temperature must be >= 0 (0 means greedy), got {temperature}; a negative "
            "temperature would turn the distribution over and pick the least likely tokens"
        )
    positive_int(top_k, "top_k", optional=True)
    if top_p is not None and not 0 < finite_number(top_p, "top_p") <= 1:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")


def _sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
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


def sample_logits(
    logits: Float[torch.Tensor, "batch d_vocab"],
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Int[torch.Tensor, " batch"]:
    """One token per row from `logits`, after temperature, top-k and top-p filtering.

    `temperature == 0` picks the arg-max. Top-k keeps the `top_k` most likely tokens
    (all of them when `top_k >= d_vocab`). Top-p keeps the smallest set of most likely
    tokens whose probability reaches `top_p` (always at least the most likely one).

    **Raises:** `ValueError` for logits that are not `[batch, d_vocab]` floats with a
    finite logit in every row and no NaN or `+inf`, a negative, NaN or infinite
    `temperature`, `top_k < 1` or `top_p` outside `(0, 1]`; `TypeError` for arguments
    of the wrong type (bools included).

    ```python
    >>> logits = torch.tensor([[0.0, 5.0, 1.0]])
    >>> sample_logits(logits, temperature=0.0), sample_logits(logits, top_k=1)
    (tensor([1]), tensor([1]))

    ```
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(
            f"logits must be a floating tensor [batch, d_vocab], got "
            f"{getattr(logits, 'dtype', type(logits).__name__)}"
        )
    if logits.dim() != 2 or 0 in logits.shape:
        hint = "; for one row pass logits[None]" if logits.dim() == 1 else ""
        raise ValueError(
            f"logits must be [batch, d_vocab] with batch, d_vocab >= 1, got shape "
            f"{tuple(logits.shape)}{hint}"
        )
    if bool((logits.isnan() | (logits == float("inf"))).any()) or not bool(
        logits.isfinite().any(dim=-1).all()
    ):
        raise ValueError(
            "logits hold NaN or +inf, or a row with no finite logit; there is no "
            "distribution to sample from. Check the model's output"
        )
    check_sampling(temperature, top_k, top_p)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__}"
        )
    return _sample(logits, temperature, top_k, top_p, generator)


def check_seed(seed: Any) -> None:
    """`seed` checked: `None` or an integer in `torch.Generator`'s range."""
    integer(seed, "seed", optional=True)
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise ValueError(f"seed must be in [-2**63, 2**64) (torch.Generator's range), got {seed}")


def _token_ids(values: Any, d_vocab: int, name: str) -> torch.Tensor:
    return check_tokens(values, SimpleNamespace(d_vocab=d_vocab), name, rank=1)


def generate(
    model: SupportedModel,
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

    Greedy generation gives the tokens of the model's own `generate` on the full prompt
    with `do_sample=False` (TransformerLens' or HuggingFace's). Sampling draws from a
    `torch.Generator` seeded with `seed`, so equal seeds give equal samples; on the CPU
    they are HuggingFace's samples after `torch.manual_seed(seed)` with the same
    settings (it draws with `torch.multinomial` on the same distribution).

    **Arguments:**

    - `model`: the model the prefix was run through (a `HookedTransformer`, a
      TransformerBridge or a HuggingFace causal LM; a bridge with no hook attached
      runs the passes on its plain HuggingFace model where one pass of the prefix's
      last token there gives the bridge's logits).
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

    **Raises:** [`TokenError`][safelens.TokenError] when the prefix plus
    `max_new_tokens` is longer than `n_ctx`, or for stop or pad tokens outside
    `[0, d_vocab)`; [`CacheConfigError`][safelens.CacheConfigError] for a prefix made by
    another model; what [`Prefix.check`][safelens.Prefix.check] raises for a prefix
    whose parts disagree or whose cache is not frozen; `TypeError` / `ValueError` for
    counts, flags, seeds or sampling settings of the wrong type or range (see
    [`sample_logits`][safelens.sample_logits]). Nothing runs before these checks pass.

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> model = HookedTransformer(HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=32, d_head=8, d_vocab=20, act_fn="gelu"))
    >>> prefix = prefill(model, torch.tensor([[1, 2, 3, 4]]))
    >>> out = generate(model, prefix, 5, n_samples=3, do_sample=True, seed=0)
    >>> out.tokens.shape, out.lengths.tolist()
    (torch.Size([3, 5]), [5, 5, 5])

    ```
    """
    backend = check_prefix(model, prefix, "generate")
    positive_int(max_new_tokens, "max_new_tokens")
    positive_int(n_samples, "n_samples")
    flag(do_sample, "do_sample")
    check_sampling(temperature, top_k, top_p)
    check_seed(seed)
    d_vocab = backend.d_vocab
    device = prefix.tokens.device
    stops = torch.zeros(0, dtype=torch.long, device=device)
    if stop_tokens is not None and not (isinstance(stop_tokens, list | tuple) and not stop_tokens):
        stops = _token_ids(stop_tokens, d_vocab, "stop_tokens").to(device)
    fill = int(stops[0]) if stops.numel() else 0
    if pad_token is not None:
        fill = int(_token_ids([pad_token], d_vocab, "pad_token")[0])
    total, n_ctx = prefix.length + max_new_tokens, backend.n_ctx
    if n_ctx is not None and total > n_ctx:
        raise TokenError(
            f"max_new_tokens={max_new_tokens} after a prefix of {prefix.length} positions "
            f"makes {total} positions, more than the model's context n_ctx={n_ctx}; "
            f"generate at most {n_ctx - prefix.length} new tokens, or shorten the prefix"
        )
    runner = runner_of(backend, prefix)
    rows = prefix.batch_size * n_samples
    if rows == 1:
        # One row gets the prefix copied once into a buffer of its own that later tokens
        # extend in place; a branch sharing the prefix would join it to the new tokens at
        # every step, a copy of the whole sequence per layer per token.
        branch = prefix.cache.select([0])
    elif prefix.batch_size == 1:
        branch = prefix.cache.expand(rows)
    elif n_samples == 1:
        branch = prefix.cache.fork()
    else:
        branch = prefix.cache.select(torch.arange(prefix.batch_size).repeat_interleave(n_samples))
    generator = None
    if do_sample and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.full((rows, max_new_tokens), fill, dtype=torch.long, device=device)
    log_probs = torch.zeros(rows, max_new_tokens, dtype=torch.float32, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    lengths = torch.full((rows,), max_new_tokens, dtype=torch.long, device=device)
    # Logits come off the unembedding's device; a model split over devices may hold it
    # apart from the embedding's, where the tokens, the generator and the next pass are.
    logits = prefix.last_logits.repeat_interleave(n_samples, dim=0).to(device)
    past = prefix.attention_mask.repeat_interleave(n_samples, dim=0)
    # Every step's mask is a view of this one: the prefix's, then one column per token.
    mask = torch.cat([past, past.new_ones(rows, max_new_tokens)], dim=1)
    with torch.no_grad():
        for step in range(max_new_tokens):
            if do_sample:
                token = _sample(logits, temperature, top_k, top_p, generator)
            else:
                token = logits.argmax(dim=-1)
            chosen = torch.log_softmax(logits.float(), dim=-1).gather(-1, token[:, None])[:, 0]
            if stops.numel():
                # A finished sample keeps its fill token and a log-probability of 0.
                tokens[:, step] = token.masked_fill(finished, fill)
                log_probs[:, step] = chosen.masked_fill(finished, 0.0)
                stopped = ~finished & torch.isin(token, stops)
                lengths.masked_fill_(stopped, step + 1)
                finished |= stopped
                if bool(finished.all()):
                    break
            else:
                tokens[:, step] = token
                log_probs[:, step] = chosen
            if step + 1 < max_new_tokens:
                seen = mask[:, : prefix.length + step + 1]
                logits = runner.forward(token[:, None], seen, branch)[:, -1].to(device)
    return Generation(tokens, lengths, log_probs)
