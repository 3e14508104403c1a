"""`CacheDimensions` and `parse_dtype`: reading TransformerLens and HF-style configs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformer_lens import HookedTransformerConfig
from transformer_lens.utilities.multi_gpu import get_device_for_block_index

from safelens import CacheConfigError, CacheDimensions, parse_dtype


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
