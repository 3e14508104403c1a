"""`attribution_patch` against the exact sweeps and against plain autograd in TransformerLens.

Where the metric is linear in the patched activation from the patch on, the estimate is
exact: values and head outputs of the last layer of an attention-only model without
LayerNorm, read by a linear metric; with the QK fix, keys and queries of a one-layer
such model too. Those cases are compared with TransformerLens' own exact patching.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformer_lens.patching as tl_patching
from transformer_lens import HookedTransformer, HookedTransformerConfig

from safelens import AttributionResult, PatchingError, attribution_patch
from tests.devices import DEVICE
from tests.models import make_model, tokens

EXACT = {
    "k": tl_patching.get_act_patch_attn_head_k_by_pos,
    "v": tl_patching.get_act_patch_attn_head_v_by_pos,
    "q": tl_patching.get_act_patch_attn_head_q_by_pos,
    "z": tl_patching.get_act_patch_attn_head_out_by_pos,
}


@functools.cache
def linear_model(n_layers: int, positional: str = "standard", n_kv_heads: int | None = None):
    """Attention-only, no LayerNorm: the logits are linear in the last layer's pattern."""
    cfg = HookedTransformerConfig(
        n_layers=n_layers,
        d_model=32,
        n_ctx=32,
        d_head=8,
        n_heads=4,
        n_key_value_heads=n_kv_heads,
        d_vocab=23,
        attn_only=True,
        normalization_type=None,
        positional_embedding_type=positional,
        seed=3,
        device=str(DEVICE),
    )
    model = HookedTransformer(cfg)
    with torch.no_grad():  # larger queries and keys: sharper, saturating attention
        for block in model.blocks:
            block.attn.W_Q.mul_(8.0)
            block.attn.W_K.mul_(8.0)
    return model.eval()


def linear_metric(logits: torch.Tensor) -> torch.Tensor:
    weights = torch.linspace(-1.0, 1.0, logits.shape[-1])
    return (logits[:, -1] * weights).sum()


def setup(model, batch: int = 2, length: int = 7):
    clean = tokens(batch, length, seed=11) % model.cfg.d_vocab
    corrupted = tokens(batch, length, seed=12) % model.cfg.d_vocab
    _, clean_cache = model.run_with_cache(clean)
    return corrupted, clean_cache


@pytest.mark.parametrize("name", ["v", "z"])
def test_last_layer_values_and_outputs_are_exact_under_a_linear_metric(name: str) -> None:
    model = linear_model(2)
    corrupted, clean_cache = setup(model)
    result = attribution_patch(model, corrupted, clean_cache, linear_metric, activations=[name])
    exact = EXACT[name](model, corrupted, clean_cache, linear_metric)
    assert result.estimates[name].shape == exact.shape
    torch.testing.assert_close(result.estimates[name][-1], exact[-1], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(result.estimates[name][0], exact[0], atol=1e-4)


@pytest.mark.parametrize(
    ("positional", "n_kv_heads"), [("standard", None), ("rotary", None), ("rotary", 2)]
)
@pytest.mark.parametrize("name", ["k", "q"])
def test_qk_fix_is_exact_for_a_one_layer_attention_only_model(
    name: str, positional: str, n_kv_heads: int | None
) -> None:
    model = linear_model(1, positional, n_kv_heads)
    corrupted, clean_cache = setup(model)
    exact = EXACT[name](model, corrupted, clean_cache, linear_metric)
    fixed = attribution_patch(model, corrupted, clean_cache, linear_metric, activations=[name])
    plain = attribution_patch(
        model, corrupted, clean_cache, linear_metric, activations=[name], qk_fix=False
    )
    assert fixed.estimates[name].shape == exact.shape
    torch.testing.assert_close(fixed.estimates[name], exact, atol=1e-4, rtol=1e-4)
    # Without the fix the softmax is linearised, and these sharp heads saturate: its
    # largest error is a sizeable share of the largest effect.
    largest_effect = (exact - fixed.baseline).abs().max()
    assert (plain.estimates[name] - exact).abs().max() > 0.05 * largest_effect


def test_verification_returns_the_exact_values_of_the_top_k_estimates() -> None:
    model = make_model(n_kv_heads=2)
    corrupted, clean_cache = setup(model)
    result = attribution_patch(
        model, corrupted, clean_cache, linear_metric, activations=["k", "z"], verify_top_k=5
    )
    assert isinstance(result, AttributionResult)
    for name in ("k", "z"):
        exact = EXACT[name](model, corrupted, clean_cache, linear_metric)
        verified = result.exact[name].isfinite()
        assert int(verified.sum()) == 5
        effect = (result.estimates[name] - result.baseline).abs()
        assert effect[verified].min() >= effect[~verified].max()
        torch.testing.assert_close(
            result.exact[name][verified], exact[verified], atol=1e-4, rtol=1e-4
        )


SITES = {  # activation -> TransformerLens hook name under blocks.{layer}.
    "k": "attn.hook_k",
    "v": "attn.hook_v",
    "q": "attn.hook_q",
    "z": "attn.hook_z",
    "pattern": "attn.hook_pattern",
    "resid_pre": "hook_resid_pre",
    "resid_mid": "hook_resid_mid",
    "attn_out": "hook_attn_out",
    "mlp_out": "hook_mlp_out",
}


@pytest.mark.parametrize(("positional", "n_kv_heads"), [("rotary", None), ("standard", 2)])
def test_first_order_estimates_equal_autograd_through_transformer_lens_without_a_cache(
    positional: str, n_kv_heads: int | None
) -> None:
    """Every site against `run_with_hooks` and `torch.autograd.grad` in TransformerLens."""
    model = make_model(positional=positional, n_kv_heads=n_kv_heads)
    corrupted, clean_cache = setup(model)
    result = attribution_patch(
        model, corrupted, clean_cache, linear_metric, activations=list(SITES), qk_fix=False
    )
    names = {
        (a, layer): f"blocks.{layer}.{hook}" for a, hook in SITES.items() for layer in range(2)
    }
    captured: dict[str, torch.Tensor] = {}

    def keep(tensor: torch.Tensor, hook) -> None:
        captured[hook.name] = tensor

    with torch.enable_grad():
        logits = model.run_with_hooks(corrupted, fwd_hooks=[(n, keep) for n in names.values()])
        baseline = linear_metric(logits)
        grads = torch.autograd.grad(baseline, [captured[n] for n in names.values()])
    for ((activation, layer), name), grad in zip(names.items(), grads, strict=True):
        product = grad * (clean_cache[name] - captured[name].detach())
        # pattern: [layer, head, dest, src], as get_act_patch_attn_head_pattern_dest_src_pos
        expected = product.sum(0) if activation == "pattern" else product.sum(dim=(0, -1))
        got = result.estimates[activation][layer]
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected + baseline.detach(), atol=1e-4, rtol=1e-4)


NODE_EXACT = {
    "pattern": tl_patching.get_act_patch_attn_head_pattern_dest_src_pos,
    "resid_pre": tl_patching.get_act_patch_resid_pre,
    "resid_mid": tl_patching.get_act_patch_resid_mid,
    "attn_out": tl_patching.get_act_patch_attn_out,
    "mlp_out": tl_patching.get_act_patch_mlp_out,
}


def test_verification_of_patterns_and_node_sites_gives_transformer_lens_values() -> None:
    model = make_model(positional="rotary")
    corrupted, clean_cache = setup(model, length=5)
    result = attribution_patch(
        model, corrupted, clean_cache, linear_metric, activations=list(NODE_EXACT), verify_top_k=3
    )
    for name, sweep in NODE_EXACT.items():
        exact = sweep(model, corrupted, clean_cache, linear_metric)
        assert result.estimates[name].shape == exact.shape
        verified = result.exact[name].isfinite()
        assert int(verified.sum()) == 3
        torch.testing.assert_close(
            result.exact[name][verified], exact[verified], atol=1e-4, rtol=1e-4
        )


def test_the_model_keeps_no_hooks_and_no_gradients() -> None:
    model = make_model()
    corrupted, clean_cache = setup(model)
    attribution_patch(model, corrupted, clean_cache, linear_metric, verify_top_k=2)
    assert all(not point._forward_hooks for point in model.hook_dict.values())
    assert all(parameter.grad is None for parameter in model.parameters())


def test_bad_inputs_are_refused_naming_them() -> None:
    model = make_model()
    corrupted, clean_cache = setup(model)
    with pytest.raises(PatchingError, match=r"activations must be .*got \['x'\]"):
        attribution_patch(model, corrupted, clean_cache, linear_metric, activations=["x"])
    with pytest.raises(PatchingError, match=r"returned shape \(2,\)"):
        attribution_patch(model, corrupted, clean_cache, lambda logits: logits[:, -1, 0])
    with pytest.raises(PatchingError, match="does not depend differentiably"):
        attribution_patch(
            model, corrupted, clean_cache, lambda logits: logits[:, -1].argmax().float()
        )
    partial = {name: value for name, value in clean_cache.items() if "hook_v" not in name}
    with pytest.raises(
        PatchingError, match=r"clean_cache has no activation 'blocks.0.attn.hook_v'"
    ):
        attribution_patch(model, corrupted, partial, linear_metric)
    _, shorter = model.run_with_cache(tokens(2, 5))
    with pytest.raises(PatchingError, match=r"expected \[batch=2 or 1, 7, 4, 16\]"):
        attribution_patch(model, corrupted, shorter, linear_metric)
    with pytest.raises(PatchingError, match="verify_top_k"):
        attribution_patch(model, corrupted, clean_cache, linear_metric, verify_top_k=-1)


def test_the_qk_fix_is_refused_where_attention_transforms_keys_further() -> None:
    cfg = HookedTransformerConfig(
        n_layers=1,
        d_model=16,
        n_ctx=8,
        d_head=4,
        n_heads=4,
        d_vocab=11,
        attn_only=True,
        use_attention_sinks=True,
        device=str(DEVICE),
    )
    model = HookedTransformer(cfg)
    corrupted, clean_cache = (
        torch.tensor([[1, 5, 3]], device=DEVICE),
        model.run_with_cache(torch.tensor([[1, 2, 3]], device=DEVICE))[1],
    )
    with pytest.raises(PatchingError, match=r"\(cfg.use_attention_sinks\); pass qk_fix=False"):
        attribution_patch(model, corrupted, clean_cache, linear_metric)
    plain = attribution_patch(model, corrupted, clean_cache, linear_metric, qk_fix=False)
    assert plain.estimates["k"].shape == (1, 3, 4)
