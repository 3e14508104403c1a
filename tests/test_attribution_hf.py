"""Attribution patching on plain HuggingFace models, against plain torch hooks and autograd.

Reference: one uncached forward of the model in eager attention (no safelens cache, no
hooks of safelens') with plain PyTorch hooks keeping the query, key and value
projections' outputs, the output projection's input (`z`), each decoder layer's input,
the MLP norm's input (`resid_mid`) and the attention and MLP modules' outputs, and the
attention weights the model returns (`output_attentions`, the pattern its eager
attention multiplies the values with), then `torch.autograd.grad` of the metric. Keys
and queries are read before the rotary embedding there and after it by safelens; the
first-order estimates agree because a position's rotation is a fixed orthogonal map.
The QK fix is checked against a TransformerBridge of the same weights (whose QK fix
`test_attribution_bridge` checks against TransformerLens' patched patterns),
`verify_top_k` against the exact sweeps. Every family of `hf_models`.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable

import pytest
import torch
import transformers
from hf_models import CONFIGS, ids, model, tokenizer
from transformer_lens.model_bridge import TransformerBridge

import safelens
from safelens import PatchingError, attribution_patch, run_with_patching_cache

TOL = 1e-4
FAMILIES = list(CONFIGS)
SITES = ["k", "v", "q", "z", "pattern", "resid_pre", "resid_mid", "attn_out", "mlp_out"]
# The norm before the MLP, whose input is resid_mid, by family.
MLP_NORMS = ("pre_feedforward_layernorm", "post_attention_layernorm", "ln_2")


def linear_metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 3].sum() - logits[:, -1, 5].sum()


def layers_of(lm) -> torch.nn.ModuleList:
    return lm.transformer.h if hasattr(lm, "transformer") else lm.model.layers


def projections(lm, layer: torch.nn.Module) -> tuple[dict[str, torch.nn.Module], Callable]:
    """The modules whose outputs hold a layer's queries, keys and values, and how to read them.

    `read(outputs)` maps the modules' outputs (by name) to `{"q": …, "k": …, "v": …}`,
    each `[batch, pos, heads, d_head]`."""
    config = lm.config
    heads = config.num_attention_heads
    d_head = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if hasattr(layer, "attn"):  # GPT-2: one projection, [q | k | v]
        sizes, modules = [heads * d_head] * 3, {"qkv": layer.attn.c_attn}
    elif hasattr(layer.self_attn, "qkv_proj"):  # Phi-3: one projection, [q | k | v]
        sizes = [heads * d_head, *[kv_heads * d_head] * 2]
        modules = {"qkv": layer.self_attn.qkv_proj}
    else:
        attention = layer.self_attn
        modules = {name: getattr(attention, f"{name}_proj") for name in "qkv"}

    def read(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        split = (
            dict(zip("qkv", out["qkv"].split(sizes, dim=-1), strict=True)) if "qkv" in out else out
        )
        return {name: tensor.unflatten(-1, (-1, d_head)) for name, tensor in split.items()}

    return modules, read


def reference(lm, tokens: torch.Tensor) -> tuple[torch.Tensor, dict, dict]:
    """The metric, activations and gradients of one plain uncached forward, by site.

    Runs on a copy: `output_attentions` makes transformers install output-capturing hooks
    on the model for good, which the other tests' checks for left-over hooks would see.
    """
    lm = copy.deepcopy(lm)
    kept: dict[tuple[str, int], torch.Tensor] = {}
    handles = []

    def keep(key, read=lambda out: out):
        def hook(module, args, out):
            kept[key] = read(out)

        return hook

    def keep_input(key):
        def hook(module, args, kwargs):
            tensor = args[0] if args else kwargs["hidden_states"]
            kept[key] = tensor

        return hook

    reads = []
    for index, layer in enumerate(layers_of(lm)):
        attention = layer.attn if hasattr(layer, "attn") else layer.self_attn
        modules, read = projections(lm, layer)
        reads.append((index, list(modules), read))
        for name, module in modules.items():
            handles.append(module.register_forward_hook(keep((name, index))))
        output = attention.c_proj if hasattr(attention, "c_proj") else attention.o_proj
        norm = next(getattr(layer, name) for name in MLP_NORMS if hasattr(layer, name))
        for key, module in (("z", output), ("resid_pre", layer), ("resid_mid", norm)):
            handles.append(
                module.register_forward_pre_hook(keep_input((key, index)), with_kwargs=True)
            )
        handles.append(attention.register_forward_hook(keep(("attn_out", index), lambda o: o[0])))
        # A mixture of experts (GPT-OSS's) returns its router's scores beside its output.
        first = lambda o: o[0] if isinstance(o, tuple) else o  # noqa: E731
        handles.append(layer.mlp.register_forward_hook(keep(("mlp_out", index), first)))
    before = lm.config._attn_implementation
    lm.set_attn_implementation("eager")  # attention weights that the values are read with
    try:
        with torch.enable_grad():
            out = lm(tokens, use_cache=False, output_attentions=True)
            kept.update({("pattern", i): pattern for i, pattern in enumerate(out.attentions)})
            value = linear_metric(out.logits)
            keys = list(kept)
            grads = dict(
                zip(keys, torch.autograd.grad(value, [kept[k] for k in keys]), strict=True)
            )
    finally:
        lm.set_attn_implementation(before)
        for handle in handles:
            handle.remove()
    acts = {key: tensor.detach() for key, tensor in kept.items()}
    for index, names, read in reads:  # queries, keys, values out of the projections
        for got in (acts, grads):
            split = read({name: got.pop((name, index)) for name in names})
            got.update({(name, index): tensor for name, tensor in split.items()})
            got["z", index] = got["z", index].unflatten(-1, (lm.config.num_attention_heads, -1))
    return value.detach(), acts, grads


def expected_grids(lm, clean: torch.Tensor, corrupted: torch.Tensor) -> tuple[torch.Tensor, dict]:
    baseline, acts, grads = reference(lm, corrupted)
    _, clean_acts, _ = reference(lm, clean)
    grids: dict[str, list[torch.Tensor]] = {}
    for (name, layer), grad in grads.items():
        product = grad * (clean_acts[name, layer] - acts[name, layer])
        grid = product.sum(0) if name == "pattern" else product.sum(-1).sum(0)
        grids.setdefault(name, [None] * lm.config.num_hidden_layers)[layer] = grid
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
    shapes = {"k": (2, 7, kv_heads), "v": (2, 7, kv_heads), "q": (2, 7, 4), "z": (2, 7, 4)}
    shapes["pattern"] = (2, 4, 7, 7)
    for name in SITES:
        assert result.estimates[name].shape == shapes.get(name, (2, 7))
        torch.testing.assert_close(result.estimates[name], expected[name], atol=TOL, rtol=TOL)
        assert (expected[name] - baseline).abs().max() > 1e-4  # the grids measure something


def test_the_qk_fix_is_refused_where_attention_has_sinks_and_plain_estimates_run():
    """GPT-OSS: a learned sink logit per head joins each softmax, which the fix does not know."""
    lm = model("gpt_oss")
    clean, corrupted = ids(2, 7, seed=11), ids(2, 7, seed=12)
    _, clean_cache = run_with_patching_cache(lm, clean)
    with pytest.raises(PatchingError, match=r"learned sink per head \(GptOssAttention.sinks"):
        attribution_patch(lm, corrupted, clean_cache, linear_metric, activations=["v", "k"])
    with pytest.raises(PatchingError, match="learned sink per head"):
        safelens.attribution_patch_dataset(
            lm, clean, corrupted, linear_metric, activations=["q"], progress=False
        )
    plain = attribution_patch(
        lm, corrupted, clean_cache, linear_metric, activations=["k"], qk_fix=False
    )
    assert plain.estimates["k"].isfinite().all()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in lm.modules())


def sharp_pair(family: str) -> tuple[torch.nn.Module, TransformerBridge]:
    """An HF model with large weights (sharp, saturating attention) and a bridge of a copy."""
    config = CONFIGS[family](2)
    config.initializer_range = 0.3
    torch.manual_seed(0)
    lm = transformers.AutoModelForCausalLM.from_config(config).eval()
    with tempfile.TemporaryDirectory() as folder:
        tokenizer().save_pretrained(folder)
        booted = TransformerBridge.boot_transformers(
            folder, hf_model=copy.deepcopy(lm), device="cpu"
        )
    return lm, booted.eval()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_qk_fix_equals_the_bridges_on_the_same_weights(family):
    lm, on_bridge = sharp_pair(family)
    clean, corrupted = ids(2, 6, seed=11), ids(2, 6, seed=12)
    _, clean_cache = run_with_patching_cache(lm, clean)
    _, bridge_cache = on_bridge.run_with_cache(clean)
    fixed = attribution_patch(lm, corrupted, clean_cache, linear_metric, activations=["k", "q"])
    expected = attribution_patch(
        on_bridge, corrupted, bridge_cache, linear_metric, activations=["k", "q"]
    )
    plain = attribution_patch(
        lm, corrupted, clean_cache, linear_metric, activations=["k", "q"], qk_fix=False
    )
    for name in ("k", "q"):
        torch.testing.assert_close(
            fixed.estimates[name], expected.estimates[name], atol=TOL, rtol=TOL
        )
        # The fix recomputes a saturating softmax: far from the plain estimate here.
        effect = (fixed.estimates[name] - fixed.baseline).abs().max()
        assert (fixed.estimates[name] - plain.estimates[name]).abs().max() > 0.05 * effect


EXACT = {
    "k": "attn_head_k_by_pos",
    "v": "attn_head_v_by_pos",
    "q": "attn_head_q_by_pos",
    "z": "attn_head_out_by_pos",
    "pattern": "attn_head_pattern_dest_src_pos",
    "resid_pre": "resid_pre",
    "resid_mid": "resid_mid",
    "attn_out": "attn_out",
    "mlp_out": "mlp_out",
}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_verification_gives_the_exact_sweeps_values(family):
    lm = model(family)
    clean, corrupted = ids(2, 6, seed=11), ids(2, 6, seed=12)
    _, clean_cache = run_with_patching_cache(lm, clean)
    result = attribution_patch(
        lm, corrupted, clean_cache, linear_metric, activations=SITES, verify_top_k=4
    )
    for name, sweep in EXACT.items():
        exact = getattr(safelens, f"get_act_patch_{sweep}")(
            lm, corrupted, clean_cache, linear_metric, progress=False
        )
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


def test_a_clean_cache_without_the_site_is_refused_naming_its_maker():
    lm = model("llama")
    corrupted = ids(1, 5, seed=12)
    with pytest.raises(
        PatchingError,
        match=r"no activation 'blocks.0.attn.hook_q'.*safelens.run_with_patching_cache\(model",
    ):
        attribution_patch(lm, corrupted, {}, linear_metric, activations=["q"], qk_fix=False)
