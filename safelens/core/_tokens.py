"""Checking token ids where they enter: dtype, range and context length.

TransformerLens indexes its embedding with whatever it is given: `-1` silently reads
the last vocabulary entry, a bool tensor reads rows 0 and 1, and an id past `d_vocab`
or a sequence past `n_ctx` fails deep inside the model as a bare `IndexError`.
[`check_tokens`][] refuses all of these at the public boundary with a
[`TokenError`][safelens.TokenError] that names the argument, the bound and the
offending value, before anything runs or is stored.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Int

from ._errors import TokenError

__all__ = ["check_tokens"]

# The dtypes an embedding indexes with (`torch.nn.functional.embedding`).
_EMBEDDABLE = frozenset({torch.long, torch.int32})


def _vocabulary(cfg: Any) -> int | None:
    for name in ("d_vocab", "vocab_size"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _context(cfg: Any) -> int | None:
    for name in ("n_ctx", "max_position_embeddings", "n_positions"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_tokens(
    tokens: Any,
    cfg: Any,
    name: str,
    *,
    past: int = 0,
    rank: int | None = 2,
) -> Int[torch.Tensor, "..."]:
    """`tokens` as an integer tensor, or a `TokenError` saying what is wrong with it.

    **Arguments:**

    - `tokens`: a tensor (or anything `torch.as_tensor` takes) of token ids.
    - `cfg`: the model config: `d_vocab` (or `vocab_size`) bounds the ids, `n_ctx` (or
      `max_position_embeddings`) bounds `past` plus the last axis.
    - `name`: the argument's name, for the message.
    - `past`: positions already cached before these tokens.
    - `rank`: the rank `tokens` must have (`None`: any rank of at least 1).

    **Returns:** `tokens` as a tensor (no copy when it already is one).

    **Raises:** [`TokenError`][safelens.TokenError] for a dtype other than `torch.long`
    or `torch.int32`, the wrong rank, an empty axis (with `rank` given; else an empty last
    axis), an id outside `[0, d_vocab)`, or more than `n_ctx` positions.

    ```python
    >>> from types import SimpleNamespace
    >>> cfg = SimpleNamespace(d_vocab=10, n_ctx=8)
    >>> check_tokens(torch.tensor([[1, 2, 3]]), cfg, "tokens").shape
    torch.Size([1, 3])
    >>> check_tokens(torch.tensor([[1, -1]]), cfg, "tokens")
    Traceback (most recent call last):
    ...
    safelens.TokenError: tokens holds token id -1 at index (0, 1); ids must be in [0, d_vocab=10) ...

    ```
    """
    if not isinstance(tokens, torch.Tensor):
        try:
            tokens = torch.as_tensor(tokens)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TokenError(
                f"{name} must be integer token ids, got {type(tokens).__name__}: {error}"
            ) from None
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        raise TokenError(
            f"{name} must hold integer token ids (torch.long), got dtype {tokens.dtype}. "
            "Token ids index the embedding; a bool or float tensor is almost always a mask "
            "or logits passed in the wrong place"
        )
    if tokens.dtype not in _EMBEDDABLE:
        raise TokenError(
            f"{name} must hold token ids of dtype torch.long (or torch.int32), got "
            f"{tokens.dtype}, which the embedding refuses; pass {name}.long()"
        )
    if (rank is not None and tokens.dim() != rank) or tokens.dim() == 0:
        expected = "[batch, pos]" if rank == 2 else f"rank {rank}" if rank else "rank >= 1"
        raise TokenError(f"{name} must be {expected} token ids, got shape {tuple(tokens.shape)}")
    if tokens.shape[-1] == 0:
        raise TokenError(f"{name} must hold at least one position, got shape {tuple(tokens.shape)}")
    if rank is not None and 0 in tokens.shape[:-1]:
        raise TokenError(f"{name} must hold at least one prompt, got shape {tuple(tokens.shape)}")
    d_vocab = _vocabulary(cfg)
    if d_vocab is not None and tokens.numel():
        bad = (tokens < 0) | (tokens >= d_vocab)
        if bool(bad.any()):
            where = tuple(int(i) for i in bad.nonzero()[0])
            value = int(tokens[where])
            raise TokenError(
                f"{name} holds token id {value} at index {where}; ids must be in "
                f"[0, d_vocab={d_vocab}) for this model. A negative id would silently read "
                "the last rows of the embedding; check the tokenizer matches the model"
            )
    n_ctx = _context(cfg)
    if n_ctx is not None and past + tokens.shape[-1] > n_ctx:
        cached = f" after {past} cached positions" if past else ""
        raise TokenError(
            f"{name} has {tokens.shape[-1]} positions{cached}: {past + tokens.shape[-1]} in "
            f"all, more than the model's context n_ctx={n_ctx}. Shorten the input or crop "
            "the cache (cache.crop(length))"
        )
    return tokens
