"""The replacements inside a sweep's passes on HuggingFace models (`_hf_lean`).

Shared rows (the first layer's attention maps and MLP map one run's rows), the last
query (the last layer's query and output projections map the last position alone), the
chunked MLP (a CPU pass maps an MLP's input a few rows at a time) and the fused
activation (GPT-2's `gelu_new` as PyTorch's one kernel). Each test makes
every replacement act (chunks of 4 positions, so that the tiny models' passes are
chunked), records what acted, and compares the sweep with a loop of hooked forwards
(`test_patching_hf`; head outputs: `test_patching_hf_sites`) and with the same sweep
without shortcuts. GPT-2's linear maps are `Conv1D`s, its query projection joined to
the keys' and values' (`c_attn`); Llama's are `nn.Linear`s.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
import transformers
from hf_models import SIZES, SPECIAL, model
from test_patching_hf import ANSWER, TOL, WRONG, _layers, reference
from test_patching_hf_shortcuts import (
    HF_SWEEPS,
    LAYERS,
    assert_equals_references,
    assert_left_as_found,
    last_only,
    pair,
    without_shortcuts,
)
from test_patching_hf_sites import vector_reference

import safelens
from safelens import run_with_patching_cache
from safelens.backends import _override
from safelens.backends._override import overriding
from safelens.backends.hf._sites import decoder_layers
from safelens.patching import _hf_lean


def _positions(shape) -> int:
    return 0 if shape is None else shape[:-1].numel()


def _counting(counts: Counter, key, replacement):
    """`replacement`, each call counted in `counts[key, "own" or "lean"]` ("own": it ran
    the module's own forward once on its whole input), and the positions it was handed
    and the module's own forward mapped in `counts[key, "rows"]`, `counts[key, "mapped"]`."""

    def forward(own, *args, **kwargs):
        called = []

        def counted(*a, **k):
            called.append(a[0].shape if a else None)
            return own(*a, **k)

        result = replacement(counted, *args, **kwargs)
        full = args[0].shape if args else None
        counts[key, "own" if called == [full] else "lean"] += 1
        counts[key, "rows"] += _positions(full)
        counts[key, "mapped"] += sum(_positions(shape) for shape in called)
        return result

    return forward


@pytest.fixture
def acted(monkeypatch):
    """What each replacement did: `Counter` of `(kind, "lean" or "own")`."""
    counts: Counter = Counter()
    monkeypatch.setattr(_hf_lean, "_CHUNK_TOKENS", 4)

    def spying(kind, replacement):
        return _counting(counts, kind, replacement)

    shared, live = _hf_lean._shared_rows, _hf_lean._live_positions

    def live_spied(*args):
        replacement = live(*args)  # `None` where gathering would not pay
        return None if replacement is None else spying("live", replacement)

    monkeypatch.setattr(_hf_lean, "_live_positions", live_spied)
    monkeypatch.setattr(_hf_lean, "_chunked", spying("chunked", _hf_lean._chunked))
    monkeypatch.setattr(_hf_lean, "_last_position", spying("last", _hf_lean._last_position))
    monkeypatch.setattr(_hf_lean, "_shared_rows", lambda *args: spying("shared", shared(*args)))
    monkeypatch.setattr(_hf_lean, "_tanh_gelu", spying("gelu", _hf_lean._tanh_gelu))
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
        # GPT-2's `gelu_new` runs fused; the others' activations are their own.
        assert (acted["gelu", "lean"] > 0) == (name == "gpt2"), (name, sweep_name)
        # The output projection at least (GPT-2 and Phi-3 join their query projection to
        # the keys' and values', which map every position).
        assert acted["last", "lean"] > 0, (name, sweep_name)
        # Each run's positions that differ from the first run's are mapped, no others; a
        # patch of a layer's input leaves nothing there to share.
        if activation == "resid_pre":
            assert not acted["shared", "rows"], sweep_name
        else:
            assert acted["shared", "lean"] > 0, sweep_name
            assert acted["shared", "mapped"] < acted["shared", "rows"], sweep_name
        # Each MLP maps the positions from each run's patch on, and some passes start
        # before a run's patch: fewer positions than it is handed.
        assert acted["live", "lean"] > 0, sweep_name
        assert acted["live", "mapped"] < acted["live", "rows"], sweep_name
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
    assert not any(kind in ("chunked", "live") for kind, _ in acted)
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


def test_shared_rows_map_the_first_runs_rows_and_the_others_positions_that_differ():
    linear = torch.nn.Linear(8, 5)
    forward = _hf_lean._shared_rows(3)
    same = torch.randn(2, 4, 8).repeat(3, 1, 1)  # 3 runs of 2 rows, 4 positions
    mapped = []

    def own(x):
        mapped.append(tuple(x.shape))
        return linear(x)

    assert torch.allclose(forward(own, same), linear(same), atol=1e-6)
    assert mapped == [(2, 4, 8)]
    differ = same.clone()
    differ[5, 2, 0] += 1e-3  # the third run's second row, at position 2
    differ[2, 0, 1] = float("nan")  # the second run's first row, at position 0
    mapped.clear()
    out = forward(own, differ)
    assert mapped == [(2, 4, 8), (2, 1, 8)]
    assert torch.allclose(out, linear(differ), atol=1e-6, equal_nan=True)
    assert out[2, 0].isnan().all() and not out[2, 1:].isnan().any()
    # Most positions differ (a residual patch's, after the attention): every row is mapped.
    differ[2:, 1:] += 1.0
    mapped.clear()
    assert torch.allclose(forward(own, differ), linear(differ), atol=1e-6, equal_nan=True)
    assert mapped == [(6, 4, 8)]


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
    assert acted["last", "lean"] > 0 and acted["shared", "lean"] > 0
    # The output projection, the last layer's own, maps the last position alone; the
    # shared query projection maps every position (other layers read them all).
    lean = _hf_lean.Lean(decoder_layers(lm, LAYERS)[1])
    assert lean.last == [lm.model.layers[-1].self_attn.o_proj]
    indices = [(layer, pos, 0) for layer in range(LAYERS) for pos in (2, 3, 8)]
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr("test_patching_hf.metric", _metric)
        expected = reference(lm, "v", indices, clean, corrupted, torch.ones_like(clean))
    assert (got[tuple(torch.tensor(indices).T)] - expected).abs().max() <= TOL


def test_only_an_mlp_of_one_layer_has_its_corrupted_output_kept():
    """`recorded`: each layer's own MLP; one MLP object in several layers
    would give one output per layer, so it is left out (its passes map every position)."""
    lm = model("llama", layers=LAYERS)
    layers = list(decoder_layers(lm, LAYERS)[1])
    assert _hf_lean.recorded(layers) == [layer.mlp for layer in layers]
    torch.manual_seed(0)
    shared = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **SIZES, num_hidden_layers=LAYERS, **SPECIAL, num_key_value_heads=2
        )
    ).eval()
    for layer in shared.model.layers[:-1]:
        layer.mlp = shared.model.layers[-1].mlp
    assert _hf_lean.recorded(list(shared.model.layers)) == []


@pytest.fixture
def lean_calls(monkeypatch):
    """What each module's replacement did in passes of several runs: `_counting`'s counts,
    keyed by `(module, the layer where runs enter, their number, the number of runs that
    entered before)` for the modules of a layer where several enter, and by `(module,
    first layer of the pass, runs, None)` for the others."""
    calls: Counter = Counter()
    replacements = _hf_lean.Lean.replacements

    def spy(self, entries, trim, *rest):
        chosen = replacements(self, entries, trim, *rest)
        if len(entries) == 1:  # the shortcuts' checks (`_hf_shortcuts`): nothing shared
            return chosen
        keys = {m: (m, entries[0], len(entries), None) for m in chosen}
        for layer in set(entries):
            runs, before = entries.count(layer), sum(entry < layer for entry in entries)
            for m in self.layers[layer].modules():
                if m in chosen and runs > 1:
                    keys[m] = (m, layer, runs, before)
        return {m: _counting(calls, keys[m], r) for m, r in chosen.items()}

    monkeypatch.setattr(_hf_lean.Lean, "replacements", spy)
    return calls


# family -> (attention module, the linear maps of its input, its output projection, the
# projections a last-position pass trims), as its code names them; GPT-2 joins its query
# projection to the keys' and values' (`c_attn`), which map every position
ATTENTION_MAPS = {
    "gpt2": ("attn", ("c_attn",), "c_proj", ("c_proj",)),
    "llama": ("self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj", ("q_proj", "o_proj")),
}
# activation -> of the entering layer's attention input maps, output projection and MLP,
# which see every run's rows equal to the first run's (True), which some positions that
# differ (False), and which are not shared (None: their rows differ from the patch on,
# or, for a patch of the layer's input, from its first map)
EQUAL_ROWS = {
    "mlp_out": (True, True, True),
    "attn_out": (True, True, False),
    "k": (True, None, None),
    "z": (True, None, None),
    "resid_pre": (None, None, None),
}
# activation -> (sweep, whether its grid has a head axis)
LEAN_SWEEPS = {
    "resid_pre": ("get_act_patch_resid_pre", False),
    "attn_out": ("get_act_patch_attn_out", False),
    "mlp_out": ("get_act_patch_mlp_out", False),
    "k": ("get_act_patch_attn_head_k_by_pos", True),
    "z": ("get_act_patch_attn_head_out_by_pos", True),
}


def every_position_metric(batch: int):
    """A batched metric that reads every position's logits (no last-position trims)."""

    def metric(logits: torch.Tensor) -> torch.Tensor:
        values = logits[:, :, ANSWER].mean(1) - logits[:, -1, WRONG]
        return values.reshape(-1, batch).mean(-1)

    return metric


def _every_position_of_one_run(logits: torch.Tensor) -> torch.Tensor:
    return (logits[:, :, ANSWER].mean(1) - logits[:, -1, WRONG]).mean()


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("last", [True, False], ids=["last_position", "every_position"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_lean_sweeps_of_gpt2_and_llama_equal_a_loop_of_hooked_forwards(
    name, last, batch, acted, monkeypatch
):
    lm = model(name, layers=LAYERS)
    clean, corrupted = pair(batch)
    mask = torch.ones_like(clean)
    _, clean_cache = run_with_patching_cache(lm, clean)
    metric = last_only(batch) if last else every_position_metric(batch)
    for activation, (sweep_name, heads) in LEAN_SWEEPS.items():
        acted.clear()
        sweep = getattr(safelens, sweep_name)
        got = sweep(lm, corrupted, clean_cache, metric, progress=False)
        assert acted["shared", "lean"] > 0 or activation == "resid_pre", sweep_name
        assert (acted["last", "lean"] > 0) == last, sweep_name
        indices = [(layer, pos, 1)[: 2 + heads] for layer in range(LAYERS) for pos in (3, 6, 9)]
        with monkeypatch.context() as patched:
            one_run = _metric if last else _every_position_of_one_run
            patched.setattr("test_patching_hf.metric", one_run)
            patched.setattr("test_patching_hf_sites.metric", one_run)
            if activation == "z":
                expected = vector_reference(lm, "z", indices, clean, corrupted)
            else:
                expected = reference(lm, activation, indices, clean, corrupted, mask)
        assert (got[tuple(torch.tensor(indices).T)] - expected).abs().max() <= TOL, sweep_name
        exact = without_shortcuts(monkeypatch, sweep, lm, corrupted, clean_cache, metric)
        assert (got - exact).abs().max() <= TOL, sweep_name
        assert (got - got.flatten()[0]).abs().max() > 1e-6, sweep_name
    assert_left_as_found(lm)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_first_layers_maps_and_mlp_share_rows_and_the_last_output_projection_is_trimmed(
    name, lean_calls
):
    lm = model(name, layers=LAYERS)
    clean, corrupted = pair(2)
    _, clean_cache = run_with_patching_cache(lm, clean)
    attention, inputs, output, trimmed = ATTENTION_MAPS[name]

    def roles(layer: int) -> tuple[list[torch.nn.Module], ...]:
        block = _layers(lm)[layer]
        seen = getattr(block, attention)
        return [getattr(seen, n) for n in inputs], [getattr(seen, output)], [block.mlp]

    # A metric of every position: no last-position trims, passes from every layer share.
    for activation, equal in EQUAL_ROWS.items():
        lean_calls.clear()
        sweep = getattr(safelens, LEAN_SWEEPS[activation][0])
        sweep(lm, corrupted, clean_cache, every_position_metric(2), progress=False)
        # Staggered passes: runs enter at every layer, several at a time.
        passes = {key[1:] for key, _ in lean_calls if key[3] is not None}
        assert {layer for layer, _, _ in passes} == set(range(LAYERS)), activation
        for role, shared in zip(range(3), equal, strict=True):
            for first, runs, before in passes:
                for module in roles(first)[role]:
                    key = (module, first, runs, before)
                    rows, mapped = lean_calls[key, "rows"], lean_calls[key, "mapped"]
                    if shared is None:  # every position it is handed, mapped; by an
                        # MLP, those from each run's patch on (`_live_positions`)
                        assert mapped <= rows if role == 2 else mapped == rows, (activation, role)
                        continue
                    assert rows, (activation, role)
                    # The rows of runs that entered before are mapped as they are; of
                    # the runs entering here, equal rows: the first run's alone; else
                    # those and the others' that differ (every row, where most differ).
                    entering = rows * runs // (runs + before)
                    if shared:
                        assert mapped == rows - entering + entering // runs, activation
                        assert before or not lean_calls[key, "own"], activation
                    else:
                        assert rows - entering + entering // runs < mapped <= rows, (
                            activation,
                            role,
                            first,
                        )
    # A last-position metric: in passes below the last layer, its query and output
    # projections map the last position alone; its keys' and values' maps, every position.
    lean_calls.clear()
    sweep = safelens.get_act_patch_mlp_out
    sweep(lm, corrupted, clean_cache, last_only(2), progress=False)
    last = getattr(_layers(lm)[-1], attention)
    below = {key for key, _ in lean_calls if key[1] < LAYERS - 1 and key[0] in set(last.children())}
    assert {key[0] for key in below} == {getattr(last, n) for n in trimmed}
    # (A pass of the last position alone maps it as it is.)
    for module in {key[0] for key in below}:
        assert sum(lean_calls[key, "lean"] for key in below if key[0] is module)
    assert_left_as_found(lm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_fused_activation_equals_transformers_own_to_float_rounding(dtype):
    from transformers.activations import ACT2FN

    own = ACT2FN["gelu_new"]
    x = (torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    fused = _hf_lean._tanh_gelu(own, x)
    assert fused.dtype == dtype and fused.shape == x.shape
    if dtype in (torch.bfloat16, torch.float16):
        # The kernel rounds once, transformers' own at each of seven steps: they differ by
        # more than rounding, so half precision keeps the model's own, bitwise.
        assert torch.equal(fused, own(x))
        return
    # float32 and float64: a unit or two in the last place.
    scale = own(x).abs().clamp_min(1.0)
    assert ((fused - own(x)).abs() / scale).max() <= 4 * torch.finfo(dtype).eps
    assert not torch.equal(fused, own(x)) or dtype == torch.float64
    # Called otherwise than with one tensor: the module's own forward, bitwise.
    assert torch.equal(_hf_lean._tanh_gelu(own, input=x), own(x))


def test_a_model_of_tanh_gelus_in_every_layer_gets_them_fused_from_its_first_layer_on():
    lm = model("gpt2", layers=LAYERS)
    lean = _hf_lean.Lean(decoder_layers(lm, LAYERS)[1], "resid_pre")
    acts = [layer.mlp.act for layer in decoder_layers(lm, LAYERS)[1]]
    assert lean.gelus == [[act] for act in acts]
    chosen = lean.replacements([2, 3], trim=False)
    assert set(acts[2:]) <= set(chosen) and not set(acts[:2]) & set(chosen)
    llama = _hf_lean.Lean(decoder_layers(model("llama", layers=LAYERS), LAYERS)[1], "k")
    assert llama.gelus == [[], [], [], []]


def test_gelu_fast_whose_constant_is_rounded_is_left_as_it_is():
    from hf_models import CONFIGS

    config = CONFIGS["gpt2"](LAYERS)
    config.activation_function = "gelu_fast"
    lm = transformers.AutoModelForCausalLM.from_config(config)
    assert _hf_lean.Lean(decoder_layers(lm, LAYERS)[1], "k").gelus == [[], [], [], []]


def test_overriding_an_attribute_acts_on_this_thread_only_and_puts_it_back():
    module = torch.nn.Module()
    module.act_fn = torch.tanh
    seen: dict[str, torch.Tensor] = {}

    def other() -> None:
        seen["other"] = module.act_fn(torch.ones(1))

    with overriding({module: lambda own, x: own(x) * 0 + 7}, "act_fn"):
        seen["mine"] = module.act_fn(torch.ones(1))
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        with pytest.raises(RuntimeError, match="once at a time"):
            with overriding({module: lambda own, x: own(x)}, "act_fn"):
                pass
        with overriding({module: lambda own, *a: own(*a)}):  # its forward: another key
            pass
    assert seen["mine"].item() == 7 and seen["other"].item() == torch.tanh(torch.ones(1)).item()
    assert module.__dict__["act_fn"] is torch.tanh and not _override._INSTALLED
