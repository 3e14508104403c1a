"""`CacheDimensions` and `parse_dtype`: reading TransformerLens and HF-style configs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformer_lens.utilities.multi_gpu import get_device_for_block_index

from safelens import CacheConfigError, CacheDimensions, KeyValueCache, parse_dtype


def test_transformer_lens_config():
    cfg = HookedTransformerConfig(
        n_layers=3, d_model=64, n_ctx=16, d_head=8, n_heads=8, d_vocab=10, act_fn="gelu",
        n_key_value_heads=2, dtype=torch.bfloat16, device="cpu",
    )  # fmt: skip
    dims = CacheDimensions.of(cfg)
    assert dims == CacheDimensions(
        n_layers=3, n_kv_heads=2, d_head=8, dtype=torch.bfloat16, n_devices=1
    )


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        (SimpleNamespace(n_layer=2, n_head=4, n_embd=64), (2, 4, 16)),
        (SimpleNamespace(num_hidden_layers=5, num_attention_heads=8, hidden_size=256), (5, 8, 32)),
        (
            SimpleNamespace(
                num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, hidden_size=64
            ),
            (2, 2, 8),
        ),
        (SimpleNamespace(num_hidden_layers=2, num_attention_heads=8, head_dim=128), (2, 8, 128)),
        (SimpleNamespace(n_layers=1, n_heads=4, n_key_value_heads=1, d_head=3), (1, 1, 3)),
        (SimpleNamespace(n_layers=1, n_heads=4, d_model=32, n_key_value_heads=None), (1, 4, 8)),
    ],
)
def test_hf_style_configs(cfg, expected):
    dims = CacheDimensions.of(cfg)
    assert (dims.n_layers, dims.n_kv_heads, dims.d_head) == expected
    assert dims.dtype == torch.float32


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.float16, torch.float16),
        ("bfloat16", torch.bfloat16),
        ("torch.float16", torch.float16),
        ("float64", torch.float64),
        (None, torch.float32),
    ],
)
def test_dtype_from_config(dtype, expected):
    hf = SimpleNamespace(
        num_hidden_layers=1, num_attention_heads=2, hidden_size=8, torch_dtype=dtype
    )
    assert CacheDimensions.of(hf).dtype == expected
    tl_style = SimpleNamespace(n_layers=1, n_heads=2, d_head=4, dtype=dtype)
    assert CacheDimensions.of(tl_style).dtype == expected
    assert parse_dtype(dtype) == expected


@pytest.mark.parametrize("bad", ["floaty", "torch.Size", 3])
def test_bad_dtype_names_the_accepted_forms(bad):
    with pytest.raises(CacheConfigError, match=r"dtype must be a torch.dtype.*got"):
        parse_dtype(bad)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (
            SimpleNamespace(n_heads=2, d_head=4),
            r"no layer count.*n_layers, n_layer, num_hidden_layers",
        ),
        (
            SimpleNamespace(n_layers=2, d_head=4),
            r"no head count.*n_heads, n_head, num_attention_heads",
        ),
        (
            SimpleNamespace(n_layers=2, n_key_value_heads=2, d_model=8),
            r"no head count \(needed to derive d_head\)",
        ),
        (
            SimpleNamespace(n_layers=2, n_heads=2),
            r"no d_head or hidden size.*d_model, n_embd, hidden_size",
        ),
    ],
)
def test_missing_attribute_is_named(cfg, match):
    with pytest.raises(CacheConfigError, match=match):
        CacheDimensions.of(cfg)


@pytest.mark.parametrize("n_layers", [1, 2, 3, 4, 7, 62])
@pytest.mark.parametrize("n_devices", [2, 3, 8])
@pytest.mark.parametrize("device", ["cuda", "cuda:1", None])
def test_layer_devices_match_transformer_lens(n_layers, n_devices, device):
    cfg = SimpleNamespace(
        n_layers=n_layers, n_heads=2, d_head=4, n_devices=n_devices, device="cuda"
    )
    dims = CacheDimensions.of(cfg)
    start = device if device is not None else cfg.device
    for layer in range(n_layers):
        assert dims.device_of_layer(layer, start) == get_device_for_block_index(layer, cfg, device)


def test_cpu_and_single_device_keep_the_device():
    dims = CacheDimensions.of(SimpleNamespace(n_layers=4, n_heads=2, d_head=4, n_devices=2))
    assert {dims.device_of_layer(i, "cpu") for i in range(4)} == {torch.device("cpu")}
    single = CacheDimensions.of(SimpleNamespace(n_layers=4, n_heads=2, d_head=4))
    assert single.device_of_layer(3, "cuda:1") == torch.device("cuda:1")
    assert single.device_of_layer(3, None) == torch.device("cpu")


def test_empty_keys():
    dims = CacheDimensions.of(
        SimpleNamespace(n_layers=1, n_heads=4, n_key_value_heads=2, d_head=8, dtype="float16")
    )
    empty = dims.empty_keys(3, "cpu")
    assert empty.shape == (3, 0, 2, 8) and empty.dtype == torch.float16


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (
            SimpleNamespace(n_layers=-1, n_heads=2, d_head=4),
            r"has n_layers=-1 \(int\); expected the layer count as a positive int",
        ),
        (SimpleNamespace(n_layers=0, n_heads=2, d_head=4), r"n_layers=0 \(int\)"),
        (SimpleNamespace(n_layers=True, n_heads=2, d_head=4), r"n_layers=True \(bool\)"),
        (
            SimpleNamespace(n_layers=2, n_heads=0, d_head=4),
            r"n_heads=0 \(int\); expected the head count as a positive int",
        ),
        (SimpleNamespace(n_layers=2, n_heads=2.5, d_head=4), r"n_heads=2.5 \(float\)"),
        (SimpleNamespace(n_layers=2, n_heads=2.0, d_head=4), r"n_heads=2.0 \(float\)"),
        (SimpleNamespace(n_layers=2, n_heads="4", d_head=4), r"n_heads='4' \(str\)"),
        (
            SimpleNamespace(n_layers=2, n_heads=2, d_head=-8),
            r"d_head=-8 \(int\); expected the head size as a positive int",
        ),
        (
            SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=0,
                            hidden_size=16),
            r"num_key_value_heads=0 \(int\); expected the key/value head count",
        ),
        (
            SimpleNamespace(n_layers=2, n_heads=2, d_head=4, n_devices=0),
            r"n_devices=0 \(int\); expected the device count as a positive int",
        ),
        (
            SimpleNamespace(n_layers=2, n_heads=8, n_key_value_heads=3, d_head=4),
            r"n_key_value_heads=3, which does not divide n_heads=8",
        ),
        (
            SimpleNamespace(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=4,
                            head_dim=4),
            r"num_key_value_heads=4, which does not divide num_attention_heads=2",
        ),
        (
            SimpleNamespace(n_layer=2, n_head=4, n_embd=66),
            r"no d_head, and n_embd=66 is not divisible by n_head=4; set d_head \(or head_dim\)",
        ),
    ],
)  # fmt: skip
def test_invalid_sizes_are_named(cfg, match):
    with pytest.raises(CacheConfigError, match=match):
        CacheDimensions.of(cfg)
    with pytest.raises(CacheConfigError, match=match):
        KeyValueCache.init_cache(cfg)


def test_integer_like_sizes_are_accepted():
    numpy = pytest.importorskip("numpy")
    cfg = SimpleNamespace(n_layers=numpy.int64(2), n_heads=torch.tensor(4), d_model=numpy.int32(32))
    dims = CacheDimensions.of(cfg)
    assert (dims.n_layers, dims.n_kv_heads, dims.d_head) == (2, 4, 8)
    assert all(type(v) is int for v in (dims.n_layers, dims.n_kv_heads, dims.d_head))


@pytest.mark.parametrize("ungroup", [False, True])
def test_cache_holds_the_key_heads_transformer_lens_appends(ungroup):
    cfg = HookedTransformerConfig(
        n_layers=1, d_model=32, n_ctx=16, d_head=8, n_heads=4, n_key_value_heads=2, d_vocab=10,
        act_fn="gelu", ungroup_grouped_query_attention=ungroup, device="cpu",
    )  # fmt: skip
    assert CacheDimensions.of(cfg).n_kv_heads == (4 if ungroup else 2)
    attn = HookedTransformer(cfg).blocks[0].attn
    cache = KeyValueCache.init_cache(cfg)
    resid = torch.randn(1, 3, 32)
    attn(resid, resid, resid, past_kv_cache_entry=cache[0])  # TransformerLens appends its keys
    assert cache[0].keys.shape == (1, 3, 4 if ungroup else 2, 8)
