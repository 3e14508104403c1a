"""The shortcuts of the sweeps on TransformerBridges and HuggingFace models.

A patched run there starts at the layer of its patch (the layers before it skipped on
the sweep's thread, the corrupted run's residual stream entering it) and, for a metric
that reads only the last position, runs the last layer's MLP and the unembedding on that
position alone (`safelens.patching._hf_shortcuts`). References: TransformerLens'
`patching` on the bridge, the torch-hooked loop of `test_patching_hf` on HuggingFace
models, and the same sweep with the shortcuts turned off. Four-layer models, so that
passes start at the first, middle and last layers; every family of the HF backend.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import transformers
from bridge_models import bridge
from hf_models import ids, model, run
from test_patching_hf import ANSWER, TOL, WRONG, _own_hooks, reference
from transformer_lens import patching

import safelens
from safelens import run_with_patching_cache
from safelens.backends import _override
from safelens.backends._families import backend_of
from safelens.backends.hf import _skip
from safelens.backends.hf._sites import decoder_layers
from safelens.patching import _hf_passes, _hf_shortcuts, _hf_sweeps

LAYERS, LENGTH = 4, 10


def last_only(batch: int):
    """A batched logit difference that says it reads only the last position."""

    def metric(logits: torch.Tensor) -> torch.Tensor:
        assert logits.shape[1] == 1  # the sweeps hand it the last position alone
        return (logits[:, -1, ANSWER] - logits[:, -1, WRONG]).reshape(-1, batch).mean(-1)

    metric.last_position_only = True  # type: ignore[attr-defined]
    return metric


def every_position(logits: torch.Tensor) -> torch.Tensor:
    """A TransformerLens-style metric that reads every position."""
    return logits[:, :, ANSWER].mean() - logits[:, -1, WRONG].mean()


def pair(batch: int, padded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    clean = ids(batch, LENGTH, seed=5)
    if padded:
        clean[0, :3] = 0
    corrupted = clean.clone()
    corrupted[:, 3] = 7
    corrupted[:, 6] = 13
    return clean, corrupted


@pytest.fixture
def taken(monkeypatch):
    """The shortcuts each sweep took, in order."""
    chosen = []
    of = _hf_shortcuts.Shortcuts.of.__func__

    def spy(cls, *args, **kwargs):
        chosen.append(of(cls, *args, **kwargs))
        return chosen[-1]

    monkeypatch.setattr(_hf_shortcuts.Shortcuts, "of", classmethod(spy))
    return chosen


def without_shortcuts(monkeypatch, sweep, *args):
    """`sweep(*args)` with every shortcut turned off."""
    with monkeypatch.context() as patched:
        plain = _hf_shortcuts.Shortcuts.of.__func__

        def off(cls, backend, activation, metric, inputs, forms, check, *rest):
            return plain(cls, backend, activation, metric, inputs, forms, lambda *a: False, *rest)

        patched.setattr(_hf_shortcuts.Shortcuts, "of", classmethod(off))
        return sweep(*args, progress=False)


def hooks_of(lm) -> dict[str, tuple[list, list]]:
    """Every module's torch forward hooks and pre-hooks (a bridge keeps some of its own)."""
    return {
        name: (list(m._forward_hooks.values()), list(m._forward_pre_hooks.values()))
        for name, m in lm.named_modules()
    }


def assert_left_as_found(lm, hooks: dict | None = None) -> None:
    if hooks is None:
        assert not any(_own_hooks(m) for m in lm.modules())
    else:
        assert hooks_of(lm) == hooks
    assert all("forward" not in m.__dict__ for m in lm.modules())
    assert not _override._INSTALLED


HF_SWEEPS = {
    "get_act_patch_attn_head_k_by_pos": "k",
    "get_act_patch_attn_head_v_by_pos": "v",
    "get_act_patch_resid_pre": "resid_pre",
    "get_act_patch_attn_out": "attn_out",
    "get_act_patch_mlp_out": "mlp_out",
}


@pytest.fixture
def passes(monkeypatch):
    """The `(first layer, first position, runs)` of each sweep's passes, in order."""
    planned = []
    plan = _hf_sweeps.passes

    def spy(*args):
        planned.append(plan(*args))
        return planned[-1]

    monkeypatch.setattr(_hf_sweeps, "passes", spy)
    return planned


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2", "mistral", "gemma2", "phi3"])
def test_hf_sweeps_take_the_shortcuts_and_equal_a_loop_of_hooked_forwards(
    name, taken, passes, monkeypatch
):
    lm = model(name, layers=LAYERS)
    clean, corrupted = pair(2, padded=name == "llama")
    mask = torch.ones_like(clean)
    if name == "llama":
        monkeypatch.setattr(lm, "tokenizer", SimpleNamespace(pad_token_id=0), raising=False)
        mask[0, :3] = 0
    _, clean_cache = run_with_patching_cache(lm, clean)
    for sweep_name, activation in HF_SWEEPS.items():
        sweep = getattr(safelens, sweep_name)
        got = sweep(lm, corrupted, clean_cache, last_only(2), progress=False)
        shortcuts = taken[-1]
        assert shortcuts.skips and shortcuts.trim, (name, sweep_name)
        # Sites before the attention's output: one pass holds runs patched at several
        # layers, each entering at its own; the others: one layer's runs per pass, whose
        # first layer the pass replacements share.
        staggered = activation in ("k", "v", "resid_pre")
        assert shortcuts.stagger == staggered, (name, sweep_name)
        several = any(len({run[1] for run in runs}) > 1 for _, _, runs in passes[-1])
        assert several == staggered, sweep_name
        assert shortcuts.trim_mlp == (activation != "mlp_out")
        # Passes that patch nothing in the last layer run its MLP at the last position
        # alone, whatever the site (the MLP output's own patches included).
        assert shortcuts.trim_mlp_early, (name, sweep_name)
        # Last-layer patches run the last position alone, whatever their own, except those
        # of the residual stream entering the layer (its keys and values change).
        late = [run[2] for first, start, runs in passes[-1] for run in runs if start == LENGTH - 1]
        assert any(pos < LENGTH - 1 for pos in late) == (activation != "resid_pre"), sweep_name
        assert_equals_references(monkeypatch, sweep, activation, got, lm, (clean, corrupted, mask))
    assert_left_as_found(lm)


def assert_equals_references(monkeypatch, sweep, activation, got, lm, prompts) -> None:
    """`got`, `sweep`'s grid with `last_only(2)`, equals a loop of hooked forwards (some
    cells) and the sweep without shortcuts, and is not constant."""
    clean, corrupted, mask = prompts
    _, clean_cache = run_with_patching_cache(lm, clean)
    indices = [(layer, pos, 1)[: got.dim()] for layer in range(LAYERS) for pos in (3, 6, 9)]

    def metric(logits):
        return (logits[:, -1, ANSWER] - logits[:, -1, WRONG]).mean()

    with monkeypatch.context() as patched:
        patched.setattr("test_patching_hf.metric", metric)
        expected = reference(lm, activation, indices, clean, corrupted, mask)
    name = sweep.__name__
    assert (got[tuple(torch.tensor(indices).T)] - expected).abs().max() <= TOL, name
    exact = without_shortcuts(monkeypatch, sweep, lm, corrupted, clean_cache, last_only(2))
    assert (got - exact).abs().max() <= TOL, name
    assert (got - got.flatten()[0]).abs().max() > 1e-6, name


def test_hf_sweep_with_a_metric_of_every_position_skips_layers_only(taken, monkeypatch):
    lm = model("gemma2", layers=LAYERS)
    clean, corrupted = pair(1)
    _, clean_cache = run_with_patching_cache(lm, clean)
    sweep = safelens.get_act_patch_attn_head_v_by_pos
    got = sweep(lm, corrupted, clean_cache, every_position, progress=False)
    assert taken[-1].skips and not taken[-1].trim
    exact = without_shortcuts(monkeypatch, sweep, lm, corrupted, clean_cache, every_position)
    assert (got - exact).abs().max() <= TOL
    assert (got - got.flatten()[0]).abs().max() > 1e-6


BRIDGE_SWEEPS = {
    "get_act_patch_attn_head_k_by_pos": ("k", patching.layer_pos_head_vector_patch_setter),
    "get_act_patch_attn_head_v_by_pos": ("v", patching.layer_pos_head_vector_patch_setter),
    "get_act_patch_attn_head_q_by_pos": ("q", patching.layer_pos_head_vector_patch_setter),
    "get_act_patch_attn_head_out_by_pos": ("z", patching.layer_pos_head_vector_patch_setter),
    "get_act_patch_resid_pre": ("resid_pre", patching.layer_pos_patch_setter),
    "get_act_patch_resid_mid": ("resid_mid", patching.layer_pos_patch_setter),
    "get_act_patch_attn_out": ("attn_out", patching.layer_pos_patch_setter),
    "get_act_patch_mlp_out": ("mlp_out", patching.layer_pos_patch_setter),
    "get_act_patch_attn_head_v_all_pos": ("v", patching.layer_head_vector_patch_setter),
}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_bridge_sweeps_take_the_shortcuts_and_equal_transformer_lens_patching(name, taken):
    lm = bridge(name, layers=LAYERS)
    clean, corrupted = pair(1)
    _, clean_cache = lm.run_with_cache(clean)
    hooks = hooks_of(lm)  # with the hooks a bridge adds to itself at its first passes
    metric = last_only(1)
    for sweep_name, (activation, setter) in BRIDGE_SWEEPS.items():
        got = getattr(safelens, sweep_name)(lm, corrupted, clean_cache, metric, progress=False)
        assert taken[-1].skips and taken[-1].trim, sweep_name
        index = torch.stack(torch.unravel_index(torch.arange(0, got.numel(), 3), got.shape), 1)
        columns = ["layer", "pos", "head_index"] if got.dim() == 3 else ["layer", "pos"]
        if "all_pos" in sweep_name:
            columns = ["layer", "head_index"]
        expected = patching.generic_activation_patch(
            lm,
            corrupted,
            clean_cache,
            lambda logits: metric(logits[:, -1:])[0],  # one run: a scalar
            setter,
            activation,
            index_df=pd.DataFrame(index.tolist(), columns=columns),
        )
        assert (got[tuple(index.T)] - expected).abs().max() <= TOL, sweep_name
        assert (got - got.flatten()[0]).abs().max() > 1e-6, sweep_name
    assert all(not point._forward_hooks for point in lm.hook_dict.values())
    assert_left_as_found(lm, hooks)


def test_a_family_that_carries_state_between_layers_is_caught_and_not_skipped(taken, monkeypatch):
    """State handed from layer 0 to layer 2 beside the residual stream fails the check.

    Hooks stand in for such a family: layer 0's output leaves a value that layer 2 adds
    to its input. A pass that skips layer 0 would hand layer 2 another value.
    """
    lm = model("llama", layers=LAYERS)
    clean, corrupted = pair(1)
    _, clean_cache = run_with_patching_cache(lm, clean)
    sweep = safelens.get_act_patch_attn_head_v_by_pos
    exact = without_shortcuts(monkeypatch, sweep, lm, corrupted, clean_cache, last_only(1))
    state = {}
    layers = lm.model.layers
    handles = [
        # per position, so that passes of fewer positions carry the same state
        layers[0].register_forward_hook(lambda m, a, out: state.update(carried=out[..., :1])),
        layers[2].register_forward_pre_hook(lambda m, args: (args[0] + state["carried"],)),
    ]
    try:
        carried = without_shortcuts(monkeypatch, sweep, lm, corrupted, clean_cache, last_only(1))
        got = sweep(lm, corrupted, clean_cache, last_only(1), progress=False)
    finally:
        for handle in handles:
            handle.remove()
    assert (carried - exact).abs().max() > 1e-3  # the carried state matters
    # Hooks are attached, so passes run every position; the skip is checked and dropped.
    assert not taken[-1].skips and not taken[-1].partial
    assert (got - carried).abs().max() <= TOL
    assert_left_as_found(lm)


def test_a_staggered_pass_that_would_join_wrong_rows_is_caught_and_not_taken(
    taken, passes, monkeypatch
):
    """Runs that join a pass with other hidden states than the corrupted run's fail the check.

    A stand-in for a family whose layers need more than the residual stream entering
    them: the joining rows are scaled, so a staggered pass would give other logits.
    """
    lm = model("llama", layers=LAYERS)
    clean, corrupted = pair(2)
    _, clean_cache = run_with_patching_cache(lm, clean)
    sweep = safelens.get_act_patch_resid_pre
    exact = without_shortcuts(monkeypatch, sweep, lm, corrupted, clean_cache, last_only(2))
    joining = _skip.joining

    def scaled(layers, first, rows, joins):
        return joining(layers, first, rows, {layer: 1.5 * h for layer, h in joins.items()})

    monkeypatch.setattr(_hf_shortcuts, "joining", scaled)
    got = sweep(lm, corrupted, clean_cache, last_only(2), progress=False)
    assert taken[-1].skips and not taken[-1].stagger
    assert all(len({run[1] for run in runs}) == 1 for _, _, runs in passes[-1])
    assert (got - exact).abs().max() <= TOL
    assert_left_as_found(lm)


def test_a_pre_hook_of_the_users_acts_once_on_a_layer_a_pass_starts_at(taken, monkeypatch):
    lm = model("mistral", layers=LAYERS)
    clean, corrupted = pair(1)
    _, clean_cache = run_with_patching_cache(lm, clean)
    sweep = safelens.get_act_patch_attn_head_k_by_pos
    handle = lm.model.layers[2].register_forward_pre_hook(lambda m, args: (args[0] * 1.5,))
    try:
        exact = without_shortcuts(monkeypatch, sweep, lm, corrupted, clean_cache, last_only(1))
        got = sweep(lm, corrupted, clean_cache, last_only(1), progress=False)
    finally:
        handle.remove()
    assert taken[-1].skips
    assert (got - exact).abs().max() <= TOL


def test_other_threads_run_every_layer_while_a_sweep_skips(taken):
    lm = model("qwen2", layers=LAYERS)
    clean, corrupted = pair(1)
    _, clean_cache = run_with_patching_cache(lm, clean)
    tokens = ids(3, 7, seed=9)
    with torch.no_grad():
        expected = lm(tokens).logits
    seen, stop = [], threading.Event()

    def other() -> None:
        with torch.no_grad():
            while not stop.is_set():
                seen.append(float((lm(tokens).logits - expected).abs().max()))

    worker = threading.Thread(target=other)
    worker.start()
    try:
        for _ in range(3):
            safelens.get_act_patch_resid_pre(
                lm, corrupted, clean_cache, last_only(1), progress=False
            )
    finally:
        stop.set()
        worker.join()
    assert taken[-1].skips and taken[-1].trim_mlp
    assert seen and max(seen) <= 1e-5
    assert_left_as_found(lm)


def test_a_sweep_interrupted_in_a_skipping_pass_puts_every_layer_back():
    lm = model("phi3", layers=LAYERS)
    clean, corrupted = pair(1)
    _, clean_cache = run_with_patching_cache(lm, clean)
    skipped = []

    def interrupt(module, args, output):
        skipped.append(_skip.skipped_layers())
        if sum(map(bool, skipped)) == 3:  # after the two checks, a patched pass that skips
            raise KeyboardInterrupt

    handle = lm.model.layers[-1].register_forward_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            safelens.get_act_patch_attn_head_v_by_pos(
                lm, corrupted, clean_cache, last_only(1), progress=False
            )
    finally:
        handle.remove()
    assert _skip.skipped_layers() == frozenset()
    assert_left_as_found(lm)
    tokens = ids(1, 5)
    with torch.no_grad():
        cache = backend_of(lm, "test").empty_cache(1)
        assert torch.allclose(lm(tokens).logits, run(lm, tokens, cache), atol=1e-5)


def test_two_threads_sweeping_one_model_get_the_serial_results(taken):
    lm = model("gemma2", layers=LAYERS)
    clean, corrupted = pair(1)
    _, clean_cache = run_with_patching_cache(lm, clean)
    sweeps = [safelens.get_act_patch_attn_head_k_by_pos, safelens.get_act_patch_resid_pre]
    serial = [sweep(lm, corrupted, clean_cache, last_only(1), progress=False) for sweep in sweeps]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def run_sweep(index: int) -> None:
        try:
            for _ in range(2):
                results[index] = sweeps[index](
                    lm, corrupted, clean_cache, last_only(1), progress=False
                )
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    workers = [threading.Thread(target=run_sweep, args=(index,)) for index in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors
    assert all(shortcuts.skips for shortcuts in taken)
    for index in range(2):
        assert (results[index] - serial[index]).abs().max() <= 1e-6
    assert_left_as_found(lm)


def test_an_mlp_out_sweep_trims_the_last_mlp_only_in_passes_below_the_last_layer(
    taken, monkeypatch
):
    lm = model("llama", layers=LAYERS)
    clean, corrupted = pair(2)
    _, clean_cache = run_with_patching_cache(lm, clean)
    trimmed: list[tuple[int, bool, bool]] = []
    last_mlp = decoder_layers(lm, LAYERS)[1][-1].mlp
    taken_of = _hf_shortcuts.Shortcuts.taken

    @contextmanager
    def spy(self, first, start, runs, last_patched=True, positions=None):
        with taken_of(self, first, start, runs, last_patched, positions):
            # The trim is a pre-hook on the last MLP, registered for the pass.
            trimmed.append((first, last_patched, bool(last_mlp._forward_pre_hooks)))
            yield

    monkeypatch.setattr(_hf_shortcuts.Shortcuts, "taken", spy)
    got = safelens.get_act_patch_mlp_out(lm, corrupted, clean_cache, last_only(2), progress=False)
    assert taken[-1].trim and not taken[-1].trim_mlp and taken[-1].trim_mlp_early
    below = [trim for first, patched, trim in trimmed if first < LAYERS - 1 and not patched]
    assert below and all(below)
    # The last layer's own patches keep their MLP whole (its output is what they patch).
    own = [trim for first, patched, trim in trimmed if patched]
    assert own and not any(own)
    assert_equals_references(
        monkeypatch,
        safelens.get_act_patch_mlp_out,
        "mlp_out",
        got,
        lm,
        (clean, corrupted, torch.ones_like(clean)),
    )
    assert_left_as_found(lm)


MORE_FAMILIES = {
    # (config, whether a staggered pass holds there)
    "gpt_neox": (
        lambda: transformers.GPTNeoXConfig(
            hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=64
        ),
        True,
    ),
    "gemma3": (
        lambda: transformers.Gemma3TextConfig(
            hidden_size=32,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=64,
            sliding_window=4,
        ),
        True,
    ),
    "mixtral": (
        lambda: transformers.MixtralConfig(
            hidden_size=32,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        True,
    ),
    # Falcon hands its layers batch-wide arguments a staggered pass does not fit: the
    # check finds it, and its passes hold the runs of one layer.
    "falcon": (
        lambda: transformers.FalconConfig(
            hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, alibi=True
        ),
        False,
    ),
}


@pytest.mark.parametrize("name", sorted(MORE_FAMILIES))
def test_staggered_passes_on_more_families_equal_the_sweep_without_shortcuts(
    name, taken, monkeypatch
):
    config, staggers = MORE_FAMILIES[name]
    torch.manual_seed(0)
    lm = transformers.AutoModelForCausalLM.from_config(config()).eval()
    clean, corrupted = pair(2)
    _, clean_cache = run_with_patching_cache(lm, clean)
    for sweep in (safelens.get_act_patch_resid_pre, safelens.get_act_patch_attn_out):
        got = sweep(lm, corrupted, clean_cache, last_only(2), progress=False)
        assert taken[-1].skips
        if sweep is safelens.get_act_patch_resid_pre:
            assert taken[-1].stagger == staggers
        exact = without_shortcuts(monkeypatch, sweep, lm, corrupted, clean_cache, last_only(2))
        assert (got - exact).abs().max() <= TOL, (name, sweep.__name__)
        assert (got - got.flatten()[0]).abs().max() > 1e-6
    assert_left_as_found(lm)


@pytest.fixture
def checks(monkeypatch):
    """How many unpatched passes (the shortcuts' checks) each sweep ran, in order."""
    counts: list[int] = []
    logits = _hf_passes.Pass.logits

    def spy(self, shortcuts, chunk, *args):
        if not chunk:
            counts[-1] += 1
        return logits(self, shortcuts, chunk, *args)

    monkeypatch.setattr(_hf_passes.Pass, "logits", spy)
    return counts


def test_a_model_checked_once_is_not_checked_again_until_it_changes(taken, checks, monkeypatch):
    """The checks' verdicts are kept per model (`_hf_checked`), and dropped by a change.

    A second sweep on the same model and prompt shape runs no check and gives the same
    grid; one on another prompt length checks again, and so does one after a layer is
    given a forward of its own (as a wrapper such as nnsight's gives it), whose grid
    equals the sweep's without shortcuts.
    """
    lm = model("llama", layers=LAYERS)
    clean, corrupted = pair(1)
    _, clean_cache = run_with_patching_cache(lm, clean)
    sweep = safelens.get_act_patch_resid_pre
    grids = []
    for _ in range(2):
        checks.append(0)
        grids.append(sweep(lm, corrupted, clean_cache, last_only(1), progress=False))
    assert checks[0] > 0 and checks[1] == 0 and taken[0].skips and taken[1].skips
    assert torch.equal(grids[0], grids[1])
    checks.append(0)
    _, shorter = run_with_patching_cache(lm, clean[:, :-1])
    sweep(lm, corrupted[:, :-1], shorter, last_only(1), progress=False)
    assert checks[-1] > 0
    layer = lm.model.layers[2]
    own = type(layer).forward

    def scaled(hidden, *args, **kwargs):
        return own(layer, 1.5 * hidden, *args, **kwargs)

    layer.forward = scaled
    try:
        checks.append(0)
        got = sweep(lm, corrupted, clean_cache, last_only(1), progress=False)
        assert checks[-1] > 0
        checks.append(0)
        exact = without_shortcuts(monkeypatch, sweep, lm, corrupted, clean_cache, last_only(1))
    finally:
        del layer.forward
    assert (got - grids[0]).abs().max() > 1e-3  # the new forward matters
    assert (got - exact).abs().max() <= TOL
    assert_left_as_found(lm)
