"""Small random-weight HookedTransformer models for the tests (no download), on `DEVICE`."""

from __future__ import annotations

import functools

import torch
from devices import DEVICE
from transformer_lens import HookedTransformer, HookedTransformerConfig

D_VOCAB = 61


@functools.cache
def make_model(
    positional: str = "standard",
    n_kv_heads: int | None = None,
    dtype: torch.dtype = torch.float32,
    n_layers: int = 2,
    d_model: int = 64,
    n_heads: int = 4,
    attn_only: bool = False,
    seed: int = 0,
) -> HookedTransformer:
    """A tiny causal model; cached, so tests must not change its weights or hooks."""
    cfg = HookedTransformerConfig(
        n_layers=n_layers,
        d_model=d_model,
        n_ctx=256,
        d_head=d_model // n_heads,
        n_heads=n_heads,
        d_vocab=D_VOCAB,
        d_mlp=None if attn_only else 4 * d_model,
        act_fn="gelu",
        attn_only=attn_only,
        positional_embedding_type=positional,
        n_key_value_heads=n_kv_heads,
        normalization_type="LN",
        dtype=dtype,
        seed=seed,
        device=str(DEVICE),
    )
    model = HookedTransformer(cfg)
    model.eval()
    return model


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    """Random token ids `[batch, length]` on `DEVICE` (the same ids on every device)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, D_VOCAB, (batch, length), generator=generator).to(DEVICE)


def ones_mask(batch: int, length: int) -> torch.Tensor:
    return torch.ones(batch, length, dtype=torch.long, device=DEVICE)
