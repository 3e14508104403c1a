"""Families beyond `hf_models`' table: what runs there equals a loop of hooked forwards,
and what cannot run is refused with the reason.

- Granite-MoE's MLP is a mixture of experts named `block_sparse_moe`: `mlp_out` is its
  output.
- Apertus names the norm before its MLP `feedforward_layernorm`: `resid_mid` is its input.
- OLMo-2 normalises its attention's and MLP's outputs instead of their inputs (post-norm)
  and hands its MLP the residual stream itself: `resid_mid` is the MLP's input; the
  reference patches the normalised attention output so that the sum is the clean one.
- BLOOM's attention and MLP add the residual stream to their own outputs, so those
  outputs are `resid_mid` and `resid_post`: `attn_out` and `mlp_out` are refused there,
  and left out of the clean cache; its attention computes outside transformers'
  attention functions, so attribution's QK fix of keys is refused, saying to turn it off.
- A model with layers that keep another state than keys and values (LFM2's convolutions,
  MiniMax's linear attention), or keys and values of two head sizes (DeepSeek-V3's latent
  attention), is refused by every entry point, naming what does not fit.

Reference: one uncached forward per patch with a PyTorch hook written here. Runs in both
CI environments.
"""

from __future__ import annotations

from collections.abc import Callable

import hf_models
import pytest
import torch
import transformers
from test_patching_every_hf import batched, last_position, metric, prompts

import safelens
from safelens import CacheConfigError, PatchingError, run_with_patching_cache
from safelens.patching import _hf_shortcuts

TOL = 1e-4
SIZES = dict(
    **hf_models.SIZES,
    **hf_models.SPECIAL,
    num_hidden_layers=2,
    num_key_value_heads=2,
    initializer_range=0.2,  # patterns that differ between prompts
)


def _model(config: transformers.PretrainedConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _loop(
    lm: torch.nn.Module,
    module: Callable[[int], torch.nn.Module],
    pre: bool,
    clean: torch.Tensor,
    corrupted: torch.Tensor,
) -> torch.Tensor:
    """`[layer, pos]`: one forward of `corrupted` per cell, the clean value written in place
    at that position of `module(layer)`'s input (`pre`) or output."""
    layers = lm.config.num_hidden_layers
    captured: dict[int, torch.Tensor] = {}

    def tensor_of(args: tuple, output: object) -> torch.Tensor:
        value = args[0] if pre else output
        return value[0] if isinstance(value, tuple) else value  # type: ignore[index,return-value]

    def hooked(layer: int, fn: Callable[[torch.Tensor], None]):
        if pre:
            return module(layer).register_forward_pre_hook(
                lambda m, args: fn(tensor_of(args, None))
            )
        return module(layer).register_forward_hook(lambda m, args, out: fn(tensor_of(args, out)))

    handles = [
        hooked(layer, lambda t, layer=layer: captured.__setitem__(layer, t.detach().clone()))
        for layer in range(layers)
    ]
    with torch.no_grad():
        lm(clean)
    for handle in handles:
        handle.remove()
    values = torch.zeros(layers, clean.shape[1])
    for layer in range(layers):
        for pos in range(clean.shape[1]):

            def write(t, layer=layer, pos=pos):
                t[:, pos] = captured[layer][:, pos]

            handle = hooked(layer, write)
            with torch.no_grad():
                values[layer, pos] = metric(lm(corrupted).logits)
            handle.remove()
    return values


def test_a_mixture_of_experts_named_block_sparse_moe_is_patched_as_mlp_out():
    lm = _model(transformers.GraniteMoeConfig(**SIZES, num_local_experts=4, num_experts_per_tok=2))
    clean, corrupted = prompts()
    _, clean_cache = run_with_patching_cache(lm, clean)
    expected = _loop(
        lm, lambda layer: lm.model.layers[layer].block_sparse_moe, False, clean, corrupted
    )
    assert (expected - expected[0, 0]).abs().max() > 1e-3  # patches that change the metric
    for sweep_metric in (metric, last_position):
        got = safelens.get_act_patch_mlp_out(
            lm, corrupted, clean_cache, sweep_metric, progress=False
        )
        assert (got - expected).abs().max() <= TOL


def test_an_mlp_norm_named_feedforward_layernorm_is_patched_as_resid_mid():
    lm = _model(transformers.ApertusConfig(**SIZES))
    clean, corrupted = prompts()
    _, clean_cache = run_with_patching_cache(lm, clean)
    expected = _loop(
        lm, lambda layer: lm.model.layers[layer].feedforward_layernorm, True, clean, corrupted
    )
    assert (expected - expected[0, 0]).abs().max() > 1e-3
    got = safelens.get_act_patch_resid_mid(lm, corrupted, clean_cache, batched, progress=False)
    assert (got - expected).abs().max() <= TOL


def test_a_post_norm_family_patches_resid_mid_at_its_mlps_input():
    lm = _model(transformers.Olmo2Config(**SIZES))
    clean, corrupted = prompts()
    layers = lm.model.layers
    # Reference: resid_mid = the layer's input + its normalised attention output; the
    # latter patched so that the sum at one position is the clean run's.
    kept: dict[tuple[str, int], torch.Tensor] = {}

    def keep(key):
        return lambda module, args, out=None: kept.__setitem__(
            key, (args[0] if out is None else out).detach().clone()
        )

    handles = [layer.register_forward_pre_hook(keep(("in", i))) for i, layer in enumerate(layers)]
    handles += [
        layer.post_attention_layernorm.register_forward_hook(keep(("add", i)))
        for i, layer in enumerate(layers)
    ]
    with torch.no_grad():
        lm(clean)
    for handle in handles:
        handle.remove()
    clean_mid = {i: kept["in", i] + kept["add", i] for i in range(len(layers))}
    expected = torch.zeros(len(layers), clean.shape[1])
    for i, layer in enumerate(layers):
        for pos in range(clean.shape[1]):
            seen: dict[str, torch.Tensor] = {}

            def patch(module, args, out, i=i, pos=pos, seen=seen):
                out = out.clone()
                out[:, pos] = clean_mid[i][:, pos] - seen["in"][:, pos]
                return out

            handles = [
                layer.register_forward_pre_hook(
                    lambda module, args, seen=seen: seen.__setitem__("in", args[0])
                ),
                layer.post_attention_layernorm.register_forward_hook(patch),
            ]
            with torch.no_grad():
                expected[i, pos] = metric(lm(corrupted).logits)
            for handle in handles:
                handle.remove()
    assert (expected - expected[0, 0]).abs().max() > 1e-3
    _, clean_cache = run_with_patching_cache(lm, clean)
    for sweep_metric in (metric, last_position):
        got = safelens.get_act_patch_resid_mid(
            lm, corrupted, clean_cache, sweep_metric, progress=False
        )
        assert (got - expected).abs().max() <= TOL
    # Passes that cannot skip layers run the last layer's patches with the others, where
    # the MLP's last-position trim (a pre-hook on the MLP) must not cut the patched input.
    plain = _hf_shortcuts.Shortcuts.of.__func__

    def no_skipping(cls, backend, activation, metric, inputs, forms, check, *rest):
        def whole(shortcuts, entries, start):
            return not shortcuts.skips and check(shortcuts, entries, start)

        chosen = plain(cls, backend, activation, metric, inputs, forms, whole, *rest)
        assert chosen.trim and not chosen.skips
        return chosen

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(_hf_shortcuts.Shortcuts, "of", classmethod(no_skipping))
        got = safelens.get_act_patch_resid_mid(
            lm, corrupted, clean_cache, last_position, progress=False
        )
    assert (got - expected).abs().max() <= TOL
    # Attribution reads it there too: the gradient of the whole residual stream (the
    # MLP's input and the sum after it), from the model's own autograd.
    residual: dict[int, torch.Tensor] = {}

    def retain(i):
        def hook(module, args):
            args[0].retain_grad()
            residual[i] = args[0]

        return hook

    handles = [layer.mlp.register_forward_pre_hook(retain(i)) for i, layer in enumerate(layers)]
    with torch.enable_grad():  # the tests run without gradients (`conftest`)
        value = metric(lm(corrupted).logits)
        value.backward()
    for handle in handles:
        handle.remove()
    lm.zero_grad(set_to_none=True)
    grads = torch.stack([residual[i].grad for i in range(len(layers))])
    corrupted_mid = torch.stack([residual[i].detach() for i in range(len(layers))])
    clean_mids = torch.stack([clean_mid[i] for i in range(len(layers))])
    estimate = ((clean_mids - corrupted_mid) * grads).sum(-1).sum(1) + value.detach()
    result = safelens.attribution_patch(
        lm, corrupted, clean_cache, metric, activations=["resid_mid"]
    )
    torch.testing.assert_close(result.estimates["resid_mid"], estimate, atol=1e-4, rtol=1e-4)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in lm.modules())


def _bloom() -> torch.nn.Module:
    return _model(
        transformers.BloomConfig(
            **hf_models.SPECIAL, hidden_size=32, n_layer=2, n_head=4, initializer_range=0.2
        )
    )


def test_modules_that_add_the_residual_stream_are_refused_as_attn_out_and_mlp_out():
    lm = _bloom()
    clean, corrupted = prompts()
    _, clean_cache = run_with_patching_cache(lm, clean)
    assert "blocks.0.hook_attn_out" not in clean_cache
    assert "blocks.0.hook_mlp_out" not in clean_cache
    refusals = {
        safelens.get_act_patch_attn_out: r"BloomAttention .* adds the residual stream .* resid_mid",
        safelens.get_act_patch_mlp_out: r"BloomMLP .* adds the residual stream .* resid_post",
    }
    for sweep, message in refusals.items():
        with pytest.raises(PatchingError, match=message):
            sweep(lm, corrupted, clean_cache, batched, progress=False)
    with pytest.raises(PatchingError, match="adds the residual stream"):
        safelens.attribution_patch(lm, corrupted, clean_cache, batched, activations=["attn_out"])
    # The residual stream itself is patched as everywhere.
    expected = _loop(lm, lambda layer: lm.transformer.h[layer], True, clean, corrupted)
    got = safelens.get_act_patch_resid_pre(lm, corrupted, clean_cache, batched, progress=False)
    assert (got - expected).abs().max() <= TOL


UNCACHEABLE = {
    "lfm2 convolutions": (
        lambda: transformers.Lfm2Config(**SIZES, layer_types=["conv", "full_attention"]),
        r"layer 0 is 'conv'",
    ),
    "minimax linear attention": (
        lambda: transformers.MiniMaxConfig(
            **SIZES, layer_types=["full_attention", "linear_attention"], num_local_experts=2
        ),
        r"layer 1 is 'linear_attention'",
    ),
    "deepseek_v3 latent attention": (
        lambda: transformers.DeepseekV3Config(
            **SIZES,
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=8,
            q_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=6,
        ),
        r"multi-head latent attention \(keys of 12 and values of 6 per head",
    ),
    "gemma4 head sizes per layer": (
        lambda: transformers.Gemma4TextConfig(
            **SIZES,
            head_dim=8,
            global_head_dim=16,
            hidden_size_per_layer_input=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
        r"sets attributes per layer \(head_dim 8 \(layer 0\), 16 \(layer 1\)\)",
    ),
}


@pytest.mark.parametrize("name", sorted(UNCACHEABLE))
def test_a_model_whose_cache_safelens_cannot_hold_is_refused(name):
    config, message = UNCACHEABLE[name]
    lm = _model(config())
    clean, corrupted = prompts()
    calls = {
        "prefill": lambda: safelens.prefill(lm, clean),
        "run_with_patching_cache": lambda: run_with_patching_cache(lm, clean),
        "HFKeyValueCache": lambda: safelens.HFKeyValueCache(config=lm.config),
        "get_act_patch_resid_pre": lambda: safelens.get_act_patch_resid_pre(
            lm, corrupted, {}, batched, progress=False
        ),
    }
    for call, run in calls.items():
        with pytest.raises(CacheConfigError, match=message):
            run()
        assert not any(module._forward_hooks for module in lm.modules()), call


def test_the_qk_fix_on_a_family_without_reachable_queries_says_to_turn_it_off():
    """BLOOM computes attention itself: no queries or pattern for the QK fix of keys."""
    lm = _bloom()
    clean, corrupted = prompts()
    _, clean_cache = run_with_patching_cache(lm, clean)
    with pytest.raises(PatchingError, match=r"QK fix for k .* pass qk_fix=False") as raised:
        safelens.attribution_patch(lm, corrupted, clean_cache, batched, activations=["k", "v"])
    assert "BloomAttention computes its attention without" in str(raised.value)
    plain = safelens.attribution_patch(
        lm, corrupted, clean_cache, batched, activations=["k", "v"], qk_fix=False
    )
    assert plain.estimates["k"].shape == (2, 6, 4)


def test_a_model_whose_attention_reads_later_positions_is_refused_a_prefix():
    """Gemma-3 with `use_bidirectional_attention`: its own cache gives continuations
    about 1.0 off the uncached run, so no prefix of it is cached."""
    lm = _model(
        transformers.Gemma3TextConfig(**SIZES, head_dim=8, use_bidirectional_attention=True)
    )
    clean, _ = prompts()
    message = r"prefill: .*reads later positions \(config.use_bidirectional_attention=True\)"
    with pytest.raises(CacheConfigError, match=message):
        safelens.prefill(lm, clean)
    assert not any(module._forward_hooks for module in lm.modules())
