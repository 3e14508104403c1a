"""Attribution patching on plain HuggingFace models, against plain torch hooks and autograd.

Reference: one uncached forward of the model (no safelens cache, no hooks of safelens')
with plain PyTorch hooks keeping the key and value projections' outputs, each decoder
layer's input and the attention and MLP modules' outputs, then `torch.autograd.grad` of
the metric. Keys are read before the rotary embedding there and after it by safelens;
the first-order estimates agree because a position's rotation is a fixed orthogonal
map. `verify_top_k` is checked against the exact sweeps. Every family of `hf_models`.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hf_models import CONFIGS, ids, model

import safelens
from safelens import PatchingError, attribution_patch, run_with_patching_cache

TOL = 1e-4
FAMILIES = list(CONFIGS)
SITES = ["k", "v", "resid_pre", "attn_out", "mlp_out"]


def linear_metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 3].sum() - logits[:, -1, 5].sum()


def layers_of(lm) -> torch.nn.ModuleList:
    return lm.transformer.h if hasattr(lm, "transformer") else lm.model.layers


def projections(lm, layer: torch.nn.Module) -> tuple[dict[str, torch.nn.Module], Callable]:
    """The modules whose outputs hold a layer's keys and values, and how to read them off.

    `read(outputs)` maps the modules' outputs (by name) to `{"k": …, "v": …}`."""
    config = lm.config
    heads = config.num_attention_heads
    d_head = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if hasattr(layer, "attn"):  # GPT-2: one projection, [q | k | v]
        sizes, module = [heads * d_head] * 3, layer.attn.c_attn
    elif hasattr(layer.self_attn, "qkv_proj"):  # Phi-3: one projection, [q | k | v]
        sizes, module = [heads * d_head, *[kv_heads * d_head] * 2], layer.self_attn.qkv_proj
    else:
        attention = layer.self_attn
        return {"k": attention.k_proj, "v": attention.v_proj}, lambda out: out

    def read(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        _, k, v = out["qkv"].split(sizes, dim=-1)
        return {"k": k, "v": v}

    return {"qkv": module}, read


def reference(lm, tokens: torch.Tensor) -> tuple[torch.Tensor, dict, dict]:
    """The metric, activations and gradients of one plain uncached forward, by site."""
    kept: dict[tuple[str, int], torch.Tensor] = {}
    handles = []

    def keep(key, read=lambda out: out):
        def hook(module, args, out):
            kept[key] = read(out)

        return hook

    def keep_input(key):
        def hook(module, args, kwargs):
            kept[key] = args[0] if args else kwargs["hidden_states"]

        return hook

    reads = []
    for index, layer in enumerate(layers_of(lm)):
        attention = layer.attn if hasattr(layer, "attn") else layer.self_attn
        modules, read = projections(lm, layer)
        reads.append((index, list(modules), read))
        for name, module in modules.items():
            handles.append(module.register_forward_hook(keep((name, index))))
        handles.append(
            layer.register_forward_pre_hook(keep_input(("resid_pre", index)), with_kwargs=True)
        )
        handles.append(attention.register_forward_hook(keep(("attn_out", index), lambda o: o[0])))
        handles.append(layer.mlp.register_forward_hook(keep(("mlp_out", index))))
    try:
        with torch.enable_grad():
            value = linear_metric(lm(tokens, use_cache=False).logits)
            keys = list(kept)
            grads = dict(
                zip(keys, torch.autograd.grad(value, [kept[k] for k in keys]), strict=True)
            )
    finally:
        for handle in handles:
            handle.remove()
    acts = {key: tensor.detach() for key, tensor in kept.items()}
    for index, names, read in reads:  # keys and values out of the projections' outputs
        for got in (acts, grads):
            split = read({name: got.pop((name, index)) for name in names})
            got.update({(name, index): tensor for name, tensor in split.items()})
    return value.detach(), acts, grads


def expected_grids(lm, clean: torch.Tensor, corrupted: torch.Tensor) -> tuple[torch.Tensor, dict]:
    baseline, acts, grads = reference(lm, corrupted)
    _, clean_acts, _ = reference(lm, clean)
    d_head = lm.config.hidden_size // lm.config.num_attention_heads
    d_head = getattr(lm.config, "head_dim", None) or d_head
    grids: dict[str, list[torch.Tensor]] = {}
    for (name, layer), grad in grads.items():
        product = grad * (clean_acts[name, layer] - acts[name, layer])
        if name in "kv" and product.shape[-1] != d_head:  # [batch, pos, kv_heads * d_head]
            product = product.unflatten(-1, (-1, d_head))
        grids.setdefault(name, [None] * lm.config.num_hidden_layers)[layer] = product.sum(-1).sum(0)
    return baseline, {name: torch.stack(layers) + baseline for name, layers in grids.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_estimates_equal_autograd_through_plain_torch_hooks(family):
    lm = model(family)
    clean, corrupted = ids(2, 7, seed=11), ids(2, 7, seed=12)
    _, clean_cache = run_with_patching_cache(lm, clean)
    result = attribution_patch(
        lm, corrupted, clean_cache, linear_metric, activations=SITES, qk_fix=False
    )
    baseline, expected = expected_grids(lm, clean, corrupted)
    torch.testing.assert_close(result.baseline, baseline, atol=1e-5, rtol=1e-5)
    kv_heads = getattr(lm.config, "num_key_value_heads", None) or lm.config.num_attention_heads
    for name in SITES:
        assert result.estimates[name].shape == ((2, 7, kv_heads) if name in "kv" else (2, 7))
        torch.testing.assert_close(result.estimates[name], expected[name], atol=TOL, rtol=TOL)
        assert (expected[name] - baseline).abs().max() > 1e-4  # the grids measure something


EXACT = {
    "k": safelens.get_act_patch_attn_head_k_by_pos,
    "v": safelens.get_act_patch_attn_head_v_by_pos,
    "resid_pre": safelens.get_act_patch_resid_pre,
    "attn_out": safelens.get_act_patch_attn_out,
    "mlp_out": safelens.get_act_patch_mlp_out,
}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_verification_gives_the_exact_sweeps_values(family):
    lm = model(family)
    clean, corrupted = ids(2, 6, seed=11), ids(2, 6, seed=12)
    _, clean_cache = run_with_patching_cache(lm, clean)
    result = attribution_patch(
        lm, corrupted, clean_cache, linear_metric, activations=SITES, qk_fix=False, verify_top_k=4
    )
    for name, sweep in EXACT.items():
        exact = sweep(lm, corrupted, clean_cache, linear_metric, progress=False)
        verified = result.exact[name].isfinite()
        assert int(verified.sum()) == 4
        torch.testing.assert_close(
            result.exact[name][verified], exact[verified], atol=TOL, rtol=TOL
        )
        effect = (result.estimates[name] - result.baseline).abs()
        assert effect[verified].min() >= effect[~verified].max()


def test_the_model_keeps_no_hooks_and_no_gradients():
    lm = model("llama")
    clean, corrupted = ids(1, 5, seed=11), ids(1, 5, seed=12)
    _, clean_cache = run_with_patching_cache(lm, clean)
    hooks = {
        name: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in lm.named_modules()
    }
    attribution_patch(lm, corrupted, clean_cache, linear_metric, activations=SITES, qk_fix=False)
    assert {
        name: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in lm.named_modules()
    } == hooks
    assert all(parameter.grad is None for parameter in lm.parameters())


def test_frozen_parameters_still_give_gradients():
    lm = model("gpt2")
    clean, corrupted = ids(1, 5, seed=11), ids(1, 5, seed=12)
    _, clean_cache = run_with_patching_cache(lm, clean)
    expected = attribution_patch(
        lm, corrupted, clean_cache, linear_metric, activations=SITES, qk_fix=False
    )
    for parameter in lm.parameters():
        parameter.requires_grad_(False)
    try:
        got = attribution_patch(
            lm, corrupted, clean_cache, linear_metric, activations=SITES, qk_fix=False
        )
    finally:
        for parameter in lm.parameters():
            parameter.requires_grad_(True)
    for name in SITES:
        torch.testing.assert_close(got.estimates[name], expected.estimates[name])


def test_sites_a_plain_model_lacks_are_refused_with_the_reason():
    lm = model("llama")
    clean, corrupted = ids(1, 5, seed=11), ids(1, 5, seed=12)
    _, clean_cache = run_with_patching_cache(lm, clean)
    with pytest.raises(
        PatchingError, match=r"activation 'z' has no hook point on a plain HuggingFace"
    ):
        attribution_patch(lm, corrupted, clean_cache, linear_metric, activations=["z"])
    with pytest.raises(PatchingError, match=r"the QK fix .*pass qk_fix=False"):
        attribution_patch(lm, corrupted, clean_cache, linear_metric, activations=["k"])
    with pytest.raises(
        PatchingError, match=r"safelens.run_with_patching_cache\(model, clean_tokens\)"
    ):
        attribution_patch(lm, corrupted, {}, linear_metric, activations=["v"])
