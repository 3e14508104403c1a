"""TransformerLens' own tests of its cache entry's dtype, run on safelens' `KeyValueCacheEntry`.

TransformerLens' `tests/unit/test_key_value_cache_entry.py`, step for step, with
safelens' `KeyValueCacheEntry` where they make `TransformerLensKeyValueCacheEntry`: a
new entry takes `cfg.dtype` (not PyTorch's default dtype), keeps it through an append,
and holds `n_key_value_heads` heads under grouped-query attention. No
`HookedTransformer` is needed, so these run with TransformerLens 3 and 4.
"""

from __future__ import annotations

import pytest
import torch
from transformer_lens.config.transformer_lens_config import TransformerLensConfig

from safelens import KeyValueCacheEntry


def _make_cfg(dtype: torch.dtype, n_heads: int = 4, d_head: int = 8, n_key_value_heads=None):
    return TransformerLensConfig(
        d_model=n_heads * d_head,
        d_head=d_head,
        n_layers=1,
        n_ctx=32,
        n_heads=n_heads,
        n_key_value_heads=n_key_value_heads,
        dtype=dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_init_cache_entry_uses_cfg_dtype(dtype):
    entry = KeyValueCacheEntry.init_cache_entry(_make_cfg(dtype=dtype), device="cpu")
    assert entry.past_keys.dtype == dtype
    assert entry.past_values.dtype == dtype


@pytest.mark.parametrize("default", [torch.float32, torch.float64], ids=str)
def test_init_cache_entry_dtype_independent_of_global_default(default):
    cfg = _make_cfg(dtype=torch.float16)
    original_default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(default)
        entry = KeyValueCacheEntry.init_cache_entry(cfg, device="cpu")
        assert entry.past_keys.dtype == torch.float16
        assert entry.past_values.dtype == torch.float16
    finally:
        torch.set_default_dtype(original_default)


def test_append_preserves_cfg_dtype():
    cfg = _make_cfg(dtype=torch.float16)
    entry = KeyValueCacheEntry.init_cache_entry(cfg, device="cpu")
    new_keys = torch.randn(1, 3, cfg.n_heads, cfg.d_head, dtype=torch.float16)
    new_values = torch.randn(1, 3, cfg.n_heads, cfg.d_head, dtype=torch.float16)
    updated_keys, updated_values = entry.append(new_keys, new_values)
    assert updated_keys.dtype == torch.float16
    assert updated_values.dtype == torch.float16
    assert entry.past_keys.dtype == torch.float16
    assert entry.past_values.dtype == torch.float16


def test_init_cache_entry_handles_grouped_query_attention():
    cfg = _make_cfg(dtype=torch.float16, n_heads=32, d_head=128, n_key_value_heads=8)
    entry = KeyValueCacheEntry.init_cache_entry(cfg, device="cpu", batch_size=2)
    assert entry.past_keys.shape == (2, 0, 8, 128)
    assert entry.past_values.shape == (2, 0, 8, 128)
    assert entry.past_keys.dtype == torch.float16
