"""The replacements inside a sweep's passes on HuggingFace models (`_hf_lean`).

Shared rows (the first layer's attention maps one run's rows), the last query (the last
layer's query and output projections map the last position alone) and the chunked MLP
(a CPU pass maps an MLP's input a few rows at a time). Each test makes every replacement
act (chunks of 4 positions, so that the tiny models' passes are chunked), records what
acted, and compares the sweep with a loop of hooked forwards (`test_patching_hf`) and
with the same sweep without shortcuts.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
import transformers
from hf_models import SIZES, SPECIAL, model
from test_patching_hf import ANSWER, TOL, WRONG, reference
from test_patching_hf_shortcuts import (
    HF_SWEEPS,
    LAYERS,
    assert_equals_references,
    assert_left_as_found,
    last_only,
    pair,
    without_shortcuts,
)

import safelens
from safelens import run_with_patching_cache
from safelens.backends.hf import _override
from safelens.backends.hf._override import overriding
from safelens.patching import _hf_lean


@pytest.fixture
def acted(monkeypatch):
    """What each replacement did: `Counter` of `(kind, "lean" or "own")`."""
    counts: Counter = Counter()
    monkeypatch.setattr(_hf_lean, "_CHUNK_TOKENS", 4)

    def spying(kind, replacement):
        def forward(own, *args, **kwargs):
            called = []

            def counted(*a, **k):
                called.append(a[0].shape if a else None)
                return own(*a, **k)

            result = replacement(counted, *args, **kwargs)
            full = args[0].shape if args else None
            counts[kind, "own" if called == [full] else "lean"] += 1
            return result

        return forward

    shared = _hf_lean._shared_rows
    monkeypatch.setattr(_hf_lean, "_chunked", spying("chunked", _hf_lean._chunked))
    monkeypatch.setattr(_hf_lean, "_last_position", spying("last", _hf_lean._last_position))
    monkeypatch.setattr(_hf_lean, "_shared_rows", lambda runs: spying("shared", shared(runs)))
    return counts


def _prompts(name: str):
    """A four-layer `name` model, a one-row prompt pair and the clean cache."""
    lm = model(name, layers=LAYERS)
    clean, corrupted = pair(1)
    return lm, corrupted, run_with_patching_cache(lm, clean)[1]


def _logits_of(lm, seed: int):
    """`(tokens, lm's logits on them)`: what other runs of the model must keep giving."""
    tokens = torch.randint(1, 50, (2, 7), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return tokens, lm(tokens).logits


def _metric(logits):
    return (logits[:, -1, ANSWER] - logits[:, -1, WRONG]).mean()


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2", "mistral", "gemma2", "phi3"])
def test_each_replacement_acts_and_the_sweeps_equal_a_loop_of_hooked_forwards(
    name, acted, monkeypatch
):
    lm = model(name, layers=LAYERS)
    clean, corrupted = pair(2)
    mask = torch.ones_like(clean)
    _, clean_cache = run_with_patching_cache(lm, clean)
    for sweep_name, activation in HF_SWEEPS.items():
        acted.clear()
        sweep = getattr(safelens, sweep_name)
        got = sweep(lm, corrupted, clean_cache, last_only(2), progress=False)
        assert acted["chunked", "lean"] > 0, (name, sweep_name)
        # GPT-2 and Phi-3 join their query projection to the keys' and values'.
        assert (acted["last", "lean"] > 0) == (name not in ("gpt2", "phi3")), (name, sweep_name)
        if name != "gpt2":  # `Conv1D`, not `nn.Linear`: GPT-2's attention maps every row
            # A patch of the layer's input makes its rows differ: then every row is mapped.
            assert (acted["shared", "lean"] > 0) == (activation != "resid_pre"), sweep_name
            # A key or value patch changes what the output projection maps, in each run.
            differ = activation in ("k", "v", "resid_pre")
            assert (acted["shared", "own"] > 0) == differ, sweep_name
        assert_equals_references(monkeypatch, sweep, activation, got, lm, (clean, corrupted, mask))
    assert_left_as_found(lm)


def test_a_mixture_of_experts_is_not_chunked_and_its_sweep_equals_hooked_forwards(
    acted, monkeypatch
):
    config = transformers.MixtralConfig(
        **SIZES, num_hidden_layers=LAYERS, **SPECIAL, num_key_value_heads=2, num_local_experts=4
    )
    torch.manual_seed(0)
    lm = transformers.MixtralForCausalLM(config).eval()
    clean, corrupted = pair(1)
    _, clean_cache = run_with_patching_cache(lm, clean)
    got = safelens.get_act_patch_attn_head_v_by_pos(
        lm, corrupted, clean_cache, last_only(1), progress=False
    )
    assert not any(kind == "chunked" for kind, _ in acted)
    assert acted["shared", "lean"] > 0 and acted["last", "lean"] > 0
    indices = [(layer, pos, 0) for layer in range(LAYERS) for pos in (2, 3, 8)]
    with monkeypatch.context() as patched:
        patched.setattr("test_patching_hf.metric", _metric)
        expected = reference(lm, "v", indices, clean, corrupted, torch.ones_like(clean))
    assert (got[tuple(torch.tensor(indices).T)] - expected).abs().max() <= TOL
    assert (got - got.flatten()[0]).abs().max() > 1e-6


def test_a_metric_of_every_position_keeps_every_query(acted):
    lm, corrupted, clean_cache = _prompts("llama")

    def every_position(logits):
        return logits[:, :, ANSWER].mean() - logits[:, -1, WRONG].mean()

    got = safelens.get_act_patch_attn_head_k_by_pos(
        lm, corrupted, clean_cache, every_position, progress=False
    )
    assert acted["last", "lean"] == 0 and acted["chunked", "lean"] > 0
    expected = safelens.get_act_patch_attn_head_k_by_pos(
        lm, corrupted, clean_cache, every_position, progress=False, max_batch=1
    )
    assert (got - expected).abs().max() <= TOL


def test_other_threads_run_the_modules_own_forward_during_a_lean_pass(acted, monkeypatch):
    lm, corrupted, clean_cache = _prompts("llama")
    tokens, expected = _logits_of(lm, 3)
    seen = []
    chunked = _hf_lean._chunked

    def meanwhile(own, *args, **kwargs):
        if not seen:  # once, inside the first lean pass
            worker = threading.Thread(target=lambda: seen.append(lm(tokens).logits))
            worker.start()
            worker.join()
        return chunked(own, *args, **kwargs)

    monkeypatch.setattr(_hf_lean, "_chunked", meanwhile)
    got = safelens.get_act_patch_attn_head_v_by_pos(
        lm, corrupted, clean_cache, last_only(1), progress=False
    )
    assert len(seen) == 1 and torch.equal(seen[0], expected)
    assert acted["shared", "lean"] > 0
    exact = without_shortcuts(
        monkeypatch,
        safelens.get_act_patch_attn_head_v_by_pos,
        lm,
        corrupted,
        clean_cache,
        last_only(1),
    )
    assert (got - exact).abs().max() <= TOL
    assert_left_as_found(lm)


def test_a_chunked_module_that_returns_more_than_a_tensor_is_run_whole():
    calls = []

    def own(x):
        calls.append(x.shape[0])
        return x * 2, "router logits"

    x = torch.randn(600, 1, 8)
    out, extra = _hf_lean._chunked(own, x)
    assert torch.equal(out, x * 2) and extra == "router logits"
    assert calls[-1] == 600  # after one chunk, the whole input


def test_shared_rows_map_every_row_unless_all_runs_rows_are_equal():
    linear = torch.nn.Linear(8, 5)
    forward = _hf_lean._shared_rows(3)
    same = torch.randn(2, 4, 8).repeat(3, 1, 1)
    assert torch.allclose(forward(linear.forward, same), linear(same), atol=1e-6)
    differ = same.clone()
    differ[5, 2, 0] += 1e-3
    rows = []
    out = forward(lambda x: rows.append(x.shape[0]) or linear(x), differ)
    assert rows == [6] and torch.allclose(out, linear(differ))


def test_a_module_is_overridden_once_at_a_time_on_a_thread_and_put_back():
    linear = torch.nn.Linear(4, 4)
    own = lambda x: x + 1  # noqa: E731 - an instance `forward` of the user's
    linear.forward = own
    with overriding({linear: lambda forward, x: forward(x) * 10}):
        assert torch.equal(linear(torch.zeros(1, 4)), torch.full((1, 4), 10.0))
        with pytest.raises(RuntimeError, match="once at a time"):
            with overriding({linear: lambda forward, x: x}):
                pass
        assert torch.equal(linear(torch.zeros(1, 4)), torch.full((1, 4), 10.0))
    assert linear.__dict__["forward"] is own and not _override._INSTALLED


def test_a_hook_of_the_users_anywhere_turns_every_replacement_off(acted):
    lm, corrupted, clean_cache = _prompts("llama")
    seen = []
    handle = lm.model.layers[1].mlp.down_proj.register_forward_hook(
        lambda module, args, output: seen.append(output.shape)
    )
    try:
        got = safelens.get_act_patch_attn_head_k_by_pos(
            lm, corrupted, clean_cache, last_only(1), progress=False
        )
    finally:
        handle.remove()
    assert not acted and seen  # the hook saw the passes, whole
    expected = safelens.get_act_patch_attn_head_k_by_pos(
        lm, corrupted, clean_cache, last_only(1), progress=False
    )
    assert acted["shared", "lean"] > 0
    assert (got - expected).abs().max() <= TOL


def test_a_sweep_interrupted_inside_a_replacement_puts_every_module_back(monkeypatch):
    lm, corrupted, clean_cache = _prompts("qwen2")
    tokens, before = _logits_of(lm, 4)
    calls = []
    last_position = _hf_lean._last_position

    def interrupt(own, *args, **kwargs):
        calls.append(1)
        if len(calls) == 9:  # inside a patched pass, after the checks
            raise KeyboardInterrupt
        return last_position(own, *args, **kwargs)

    monkeypatch.setattr(_hf_lean, "_last_position", interrupt)
    with pytest.raises(KeyboardInterrupt):
        safelens.get_act_patch_attn_head_k_by_pos(
            lm, corrupted, clean_cache, last_only(1), progress=False
        )
    assert_left_as_found(lm)
    with torch.no_grad():
        assert torch.equal(lm(tokens).logits, before)


def test_a_projection_shared_with_another_layer_is_not_trimmed(acted):
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **SIZES, num_hidden_layers=LAYERS, **SPECIAL, num_key_value_heads=2
        )
    ).eval()
    for layer in lm.model.layers[:-1]:  # one query projection for every layer
        layer.self_attn.q_proj = lm.model.layers[-1].self_attn.q_proj
    clean, corrupted = pair(1)
    _, clean_cache = run_with_patching_cache(lm, clean)
    got = safelens.get_act_patch_attn_head_v_by_pos(
        lm, corrupted, clean_cache, last_only(1), progress=False
    )
    assert acted["last", "lean"] == 0 and acted["shared", "lean"] > 0
    indices = [(layer, pos, 0) for layer in range(LAYERS) for pos in (2, 3, 8)]
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr("test_patching_hf.metric", _metric)
        expected = reference(lm, "v", indices, clean, corrupted, torch.ones_like(clean))
    assert (got[tuple(torch.tensor(indices).T)] - expected).abs().max() <= TOL
