"""Bridge sweeps whose patched passes run on the bridge's plain HuggingFace model.

Reference: `transformer_lens.patching` on the same bridge, every patch of the grid.
Which model ran the passes is read from the sweep's `_Pass` (`hf`: the plain model,
`bridge`: the bridge itself).
"""

from __future__ import annotations

import itertools

import pandas as pd
import pytest
import torch
from bridge_models import _hf_model, bridge
from hf_models import tokenizer
from test_patching_hf import SWEEPS, batched, metric
from transformer_lens import patching
from transformer_lens.model_bridge import TransformerBridge

import safelens
from safelens.backends.bridge._backend import BridgeBackend
from safelens.backends.bridge._plain import plain_model
from safelens.backends.hf._backend import HFBackend
from safelens.patching import _hf_passes

TOL = 1e-5
SITES = [
    "get_act_patch_attn_head_k_by_pos",
    "get_act_patch_attn_head_v_by_pos",
    "get_act_patch_resid_pre",
    "get_act_patch_attn_out",
    "get_act_patch_mlp_out",
]


@pytest.fixture
def passes_on(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The family of the model each sweep's patched passes ran on, in order."""
    families: list[str] = []
    original = _hf_passes.Pass.__init__

    def spy(self, backend, *args, **kwargs):
        families.append(backend.family)
        original(self, backend, *args, **kwargs)

    monkeypatch.setattr(_hf_passes.Pass, "__init__", spy)
    return families


def pair() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    clean, corrupted = (torch.randint(1, 50, (2, 6), generator=generator) for _ in "ab")
    return clean, corrupted


def transformer_lens_grid(lm, sweep: str, corrupted, clean_cache, shape) -> torch.Tensor:
    """`transformer_lens.patching` at every index of a `shape` grid."""
    activation, setter, columns, _ = SWEEPS[sweep]
    index_df = pd.DataFrame(list(itertools.product(*map(range, shape))), columns=columns)
    result = patching.generic_activation_patch(
        lm, corrupted, clean_cache, metric, setter, activation, index_df=index_df
    )
    return result.reshape(shape)


def check_sweeps(lm, sweeps: list[str]) -> None:
    clean, corrupted = pair()
    _, clean_cache = lm.run_with_cache(clean)
    for sweep in sweeps:
        got = getattr(safelens, sweep)(lm, corrupted, clean_cache, batched(2), progress=False)
        expected = transformer_lens_grid(lm, sweep, corrupted, clean_cache, got.shape)
        assert (got - expected).abs().max() <= TOL, sweep
        assert expected.abs().max() > 1e-3, sweep  # the patches matter


# Gemma-2's bridge reads attn_out and mlp_out after the norms HuggingFace applies
# outside the modules (`post_attention_layernorm`, `post_feedforward_layernorm`): the
# plain model's values there differ, so those sweeps stay on the bridge. GPT-2's bridge
# holds split query/key/value weights of its own: no plain model.
ON_PLAIN = {
    "llama": SITES,
    "qwen2": SITES,
    "mistral": SITES,
    "gemma2": SITES[:3],
    "gpt2": [],
}


@pytest.mark.parametrize("family", list(ON_PLAIN))
def test_sweeps_equal_transformer_lens_on_whichever_model_runs_them(family, passes_on):
    check_sweeps(bridge(family), SITES)
    expected = ["hf" if sweep in ON_PLAIN[family] else "bridge" for sweep in SITES]
    assert passes_on == expected


def test_the_plain_model_shares_the_bridges_tensors_and_leaves_it_as_it_was():
    lm = bridge("llama")
    before = {name: id(module) for name, module in lm.named_modules()}
    hooks_before = {
        name: (len(module._forward_hooks), len(module._forward_pre_hooks))
        for name, module in lm.named_modules()
    }
    plain = plain_model(lm)
    assert plain is not None and type(plain) is type(lm.original_model)
    assert {id(p) for p in plain.parameters()} == {id(p) for p in lm.parameters()}
    assert not any("_original_component" in name for name, _ in plain.named_modules())
    tokens = pair()[1]
    with torch.no_grad():
        assert (plain(tokens).logits - lm(tokens)).abs().max() <= TOL
    # A hook on the plain model's modules never fires on the bridge's.
    fired = []
    layer = plain.model.layers[0]
    handle = layer.register_forward_hook(lambda *args: fired.append(1))
    try:
        with torch.no_grad():
            lm(tokens)
        assert not fired
    finally:
        handle.remove()
    assert {name: id(module) for name, module in lm.named_modules()} == before
    assert {
        name: (len(module._forward_hooks), len(module._forward_pre_hooks))
        for name, module in lm.named_modules()
    } == hooks_before


def test_weights_of_the_bridges_own_give_no_plain_model():
    assert plain_model(bridge("gpt2")) is None
    assert plain_model(bridge("llama")) is not None


def fresh_llama_bridge() -> TransformerBridge:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        tokenizer().save_pretrained(folder)
        booted = TransformerBridge.boot_transformers(
            folder, hf_model=_hf_model("llama"), device="cpu"
        )
    return booted.eval()


def test_an_edit_of_the_bridges_weights_reaches_the_passes(passes_on):
    lm = fresh_llama_bridge()
    with torch.no_grad():
        for parameter in lm.blocks[1].attn.parameters():
            parameter.mul_(3.0)
    check_sweeps(lm, SITES[:2])
    assert passes_on == ["hf", "hf"]


def test_compatibility_mode_sweeps_equal_transformer_lens(passes_on):
    lm = fresh_llama_bridge()
    lm.enable_compatibility_mode()
    check_sweeps(lm, SITES)
    assert len(passes_on) == len(SITES)


def test_a_plain_model_that_computes_otherwise_is_not_used(monkeypatch, passes_on):
    """The plain model's corrupted run must give the bridge's logits and site values."""
    lm = bridge("llama")
    other = _hf_model("llama")
    with torch.no_grad():
        for parameter in other.model.layers[1].mlp.parameters():
            parameter.mul_(1.5)  # the last layer's MLP: the site values of k and v agree
    monkeypatch.setattr(BridgeBackend, "plain", lambda self: HFBackend(other))
    check_sweeps(lm, SITES[:3])
    assert passes_on == ["bridge"] * 3


def test_a_users_hook_keeps_the_passes_on_the_bridge(passes_on):
    lm = bridge("llama")
    clean, corrupted = pair()
    _, clean_cache = lm.run_with_cache(clean)
    expected = safelens.get_act_patch_attn_head_k_by_pos(
        lm, corrupted, clean_cache, batched(2), progress=False
    )
    lm.blocks[0].hook_resid_pre.add_hook(lambda tensor, hook: tensor)
    try:
        got = safelens.get_act_patch_attn_head_k_by_pos(
            lm, corrupted, clean_cache, batched(2), progress=False
        )
    finally:
        lm.reset_hooks()
    assert (got - expected).abs().max() <= TOL
    assert passes_on == ["hf", "bridge"]


def test_threads_sweeping_one_bridge_on_its_plain_model_get_the_serial_result(passes_on):
    import threading

    lm = bridge("llama")
    clean, corrupted = pair()
    _, clean_cache = lm.run_with_cache(clean)
    sweeps = [safelens.get_act_patch_attn_head_v_by_pos, safelens.get_act_patch_resid_pre]
    serial = [sweep(lm, corrupted, clean_cache, batched(2), progress=False) for sweep in sweeps]
    config = lm.original_model.config._attn_implementation_internal
    results: list = []

    def work(sweep) -> None:
        try:
            for _ in range(3):
                results.append(
                    (sweep, sweep(lm, corrupted, clean_cache, batched(2), progress=False))
                )
        except Exception as error:  # noqa: BLE001 - the assertion below reports it
            results.append((sweep, error))

    threads = [threading.Thread(target=work, args=(sweep,)) for sweep in sweeps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 6
    for sweep, got in results:
        assert isinstance(got, torch.Tensor) and torch.equal(got, serial[sweeps.index(sweep)])
    assert set(passes_on) == {"hf"}
    assert lm.original_model.config._attn_implementation_internal == config


def test_a_plain_model_that_cannot_run_the_pass_leaves_the_sweep_on_the_bridge(
    monkeypatch, passes_on
):
    lm = bridge("llama")
    other = _hf_model("llama")

    def broken(*args, **kwargs):
        raise RuntimeError("this model cannot run here")

    monkeypatch.setattr(other.model.layers[0], "forward", broken)
    monkeypatch.setattr(BridgeBackend, "plain", lambda self: HFBackend(other))
    check_sweeps(lm, SITES[:2])
    assert passes_on == ["bridge"] * 2
