"""Attribution patching on a TransformerBridge, against TransformerLens' own machinery.

References: autograd through the bridge's own `run_with_hooks` (no safelens cache) for
the first-order estimates; TransformerLens' setter patching `attn.hook_k` / `hook_q`
one cell at a time, with the patched pattern read from its `hook_pattern`, for the QK
fix; the exact sweeps for `verify_top_k`. Tiny random-weight Llama (grouped-query,
rotary) and GPT-2 bridges. Runs in both CI environments.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import transformers
from bridge_models import bridge
from hf_models import CONFIGS, tokenizer
from transformer_lens.model_bridge import TransformerBridge

import safelens
from safelens import PatchingError, attribution_patch

TOL = 1e-4


def linear_metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 3].sum() - logits[:, -1, 5].sum()


def setup(lm) -> tuple[torch.Tensor, object]:
    generator = torch.Generator().manual_seed(3)
    clean, corrupted = (torch.randint(1, 50, (2, 6), generator=generator) for _ in "ab")
    _, clean_cache = lm.run_with_cache(clean)
    return corrupted, clean_cache


def autograd(lm, corrupted, names: list[str]):
    """The corrupted run's metric, activations and their gradients, by `run_with_hooks`."""
    captured: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(tensor: torch.Tensor, hook=None) -> torch.Tensor:
            captured[name] = tensor
            return tensor

        return hook

    with torch.enable_grad():
        logits = lm.run_with_hooks(corrupted, fwd_hooks=[(name, keep(name)) for name in names])
        value = linear_metric(logits)
        grads = torch.autograd.grad(value, [captured[name] for name in names])
    return value.detach(), captured, dict(zip(names, grads, strict=True))


SITES = {  # activation -> the bridge's TransformerLens hook name under blocks.{layer}.
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


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_first_order_estimates_equal_autograd_through_the_bridge(family):
    lm = bridge(family)
    corrupted, clean_cache = setup(lm)
    result = attribution_patch(
        lm, corrupted, clean_cache, linear_metric, activations=list(SITES), qk_fix=False
    )
    names = {
        (a, layer): f"blocks.{layer}.{hook}" for a, hook in SITES.items() for layer in range(2)
    }
    baseline, captured, grads = autograd(lm, corrupted, list(names.values()))
    torch.testing.assert_close(result.baseline, baseline, atol=1e-5, rtol=1e-5)
    for (activation, layer), name in names.items():
        product = grads[name] * (clean_cache[name] - captured[name].detach())
        # pattern: [layer, head, dest, src], as get_act_patch_attn_head_pattern_dest_src_pos
        expected = product.sum(0) if activation == "pattern" else product.sum(dim=(0, -1))
        got = result.estimates[activation][layer]
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected + baseline, atol=TOL, rtol=TOL)
    for activation in "kv":
        heads = 2 if family == "llama" else 4  # key/value heads
        assert result.estimates[activation].shape == (2, 6, heads)


def capped_gemma2(cap: float = 0.004) -> TransformerBridge:
    """A Gemma-2 bridge whose scores its soft cap flattens (`cap · tanh(x / cap)`)."""
    torch.manual_seed(0)
    config = CONFIGS["gemma2"](2)
    config.attn_logit_softcapping = cap
    return boot(transformers.AutoModelForCausalLM.from_config(config))


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2-capped"])
@pytest.mark.parametrize("activation", ["k", "q"])
def test_the_qk_fix_equals_the_patched_pattern_linearised_from_there(family, activation):
    """Each cell: TransformerLens patches the clean k (or q) in, its `hook_pattern` gives
    the patched pattern, and the effect is dmetric/dpattern · (patched - corrupted)."""
    lm = capped_gemma2() if family == "gemma2-capped" else bridge(family)
    corrupted, clean_cache = setup(lm)
    result = attribution_patch(lm, corrupted, clean_cache, linear_metric, activations=[activation])
    layers = range(lm.cfg.n_layers)
    names = [f"blocks.{layer}.attn.hook_pattern" for layer in layers]
    baseline, captured, grads = autograd(lm, corrupted, names)
    grid = result.estimates[activation]
    for layer, pos, head in [(0, 2, 1), (1, 4, 0), (1, 5, 1), (0, 0, 0)]:
        site = f"blocks.{layer}.attn.hook_{activation}"

        def patch(tensor: torch.Tensor, hook=None, pos=pos, head=head, site=site):
            tensor = tensor.clone()
            tensor[:, pos, head] = clean_cache[site][:, pos, head]
            return tensor

        patched: dict[str, torch.Tensor] = {}

        def read(tensor: torch.Tensor, hook=None, patched=patched) -> None:
            patched["pattern"] = tensor.detach()

        lm.run_with_hooks(corrupted, fwd_hooks=[(site, patch), (names[layer], read)])
        pattern = names[layer]
        effect = (grads[pattern] * (patched["pattern"] - captured[pattern].detach())).sum()
        torch.testing.assert_close(grid[layer, pos, head], baseline + effect, atol=TOL, rtol=TOL)


EXACT = {
    "k": "attn_head_k_by_pos",
    "v": "attn_head_v_by_pos",
    "pattern": "attn_head_pattern_dest_src_pos",
    "resid_pre": "resid_pre",
    "resid_mid": "resid_mid",
    "attn_out": "attn_out",
    "mlp_out": "mlp_out",
}


def test_verification_gives_the_exact_sweeps_values():
    lm = bridge("llama")
    corrupted, clean_cache = setup(lm)
    result = attribution_patch(
        lm, corrupted, clean_cache, linear_metric, activations=list(EXACT), verify_top_k=4
    )

    def batched(logits: torch.Tensor) -> torch.Tensor:
        return (logits[:, -1, 3] - logits[:, -1, 5]).reshape(-1, 2).sum(-1)

    for name, sweep in EXACT.items():
        exact = getattr(safelens, f"get_act_patch_{sweep}")(
            lm, corrupted, clean_cache, batched, progress=False
        )
        assert result.estimates[name].shape == exact.shape
        verified = result.exact[name].isfinite()
        assert int(verified.sum()) == 4
        torch.testing.assert_close(
            result.exact[name][verified], exact[verified], atol=TOL, rtol=TOL
        )
        effect = (result.estimates[name] - result.baseline).abs()
        assert effect[verified].min() >= effect[~verified].max()


def test_the_bridge_keeps_no_hooks_and_no_gradients():
    lm = bridge("llama")
    corrupted, clean_cache = setup(lm)
    before = {name: id(parameter) for name, parameter in lm.named_parameters()}
    hooks = {name: dict(module._forward_hooks) for name, module in lm.named_modules()}
    attribution_patch(lm, corrupted, clean_cache, linear_metric, verify_top_k=2)
    assert all(not point._forward_hooks for point in lm.hook_dict.values())
    assert {name: dict(module._forward_hooks) for name, module in lm.named_modules()} == hooks
    assert all(parameter.grad is None for parameter in lm.parameters())
    assert {name: id(parameter) for name, parameter in lm.named_parameters()} == before


def test_frozen_parameters_still_give_gradients():
    lm = boot(transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"](2)))
    corrupted, clean_cache = setup(lm)
    expected = attribution_patch(lm, corrupted, clean_cache, linear_metric)
    for parameter in lm.parameters():
        parameter.requires_grad_(False)
    got = attribution_patch(lm, corrupted, clean_cache, linear_metric)
    for name in "kvqz":
        torch.testing.assert_close(got.estimates[name], expected.estimates[name])
    assert (expected.estimates["v"] - expected.baseline).abs().max() > 1e-3


def boot(hf_model) -> TransformerBridge:
    with tempfile.TemporaryDirectory() as folder:
        tokenizer().save_pretrained(folder)
        booted = TransformerBridge.boot_transformers(folder, hf_model=hf_model, device="cpu")
    return booted.eval()


def test_the_qk_fix_is_refused_where_scores_are_no_multiple_of_q_dot_k():
    """A hook of the user's that adds a position bias to the scores: the fix cannot
    recompute them from q and k, so it refuses; values and head outputs need no fix."""
    lm = bridge("llama")
    corrupted, clean_cache = setup(lm)

    def bias(scores: torch.Tensor, hook=None) -> torch.Tensor:
        return scores + torch.arange(scores.shape[-1], dtype=scores.dtype) * 0.5

    lm.add_hook("blocks.1.attn.hook_attn_scores", bias)
    try:
        with pytest.raises(
            PatchingError, match=r"layer 1's attention scores .*no fixed multiple of q·k"
        ):
            attribution_patch(lm, corrupted, clean_cache, linear_metric)
        plain = attribution_patch(lm, corrupted, clean_cache, linear_metric, qk_fix=False)
        values = attribution_patch(
            lm, corrupted, clean_cache, linear_metric, activations=["v", "z"]
        )
    finally:
        lm.reset_hooks()
    assert plain.estimates["k"].shape == (2, 6, 2)
    torch.testing.assert_close(values.estimates["v"], plain.estimates["v"])


def test_a_bridge_that_never_fires_the_rotated_keys_refuses_the_qk_fix():
    lm = bridge("phi3")
    corrupted, clean_cache = setup(lm)
    with pytest.raises(PatchingError, match=r"fired no blocks.0.attn.hook_rot_[qk].*qk_fix=False"):
        attribution_patch(lm, corrupted, clean_cache, linear_metric)
    plain = attribution_patch(lm, corrupted, clean_cache, linear_metric, qk_fix=False)
    assert set(plain.estimates) == {"k", "v", "q", "z"}


def test_a_bridge_in_training_mode_with_dropout_is_refused():
    config = CONFIGS["llama"](2)
    config.attention_dropout = 0.1
    lm = boot(transformers.AutoModelForCausalLM.from_config(config))
    corrupted, clean_cache = setup(lm)
    lm.train()
    try:
        with pytest.raises(PatchingError, match=r"training mode with dropout 0.1.*model.eval\(\)"):
            attribution_patch(lm, corrupted, clean_cache, linear_metric)
    finally:
        lm.eval()
    assert (
        attribution_patch(lm, corrupted, clean_cache, linear_metric).estimates["v"].isfinite().all()
    )
