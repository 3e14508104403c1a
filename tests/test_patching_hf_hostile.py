"""Hostile, careless and unusual use of the patching sweeps on bridges and HuggingFace models.

What a user may do that the other patching tests do not: model families and settings
they do not use (Mistral and Gemma-2 bridges, sliding windows shorter than the prompt,
1-layer models, float64 and bfloat16, a model in `train()` mode), odd inputs (one-token
and full-context prompts, a batch of none, a metric that lies about what it reads),
hooks of the user's own (on the bridge's hook points, on modules, an instance
`forward` as accelerate installs, a hook that raises or reads positions by index), and
threads. References: `transformer_lens.patching` on the same bridge (with the same user
hooks attached), and on plain HuggingFace models `test_patching_hf.reference`, a loop of
torch-hooked forwards without safelens. A failed call must leave the model as found:
every module's torch hooks and pre-hooks, its instance `forward` attributes, the
bridge's hook points and context level, its parameters, and safelens' own bookkeeping.
"""

from __future__ import annotations

import copy
import threading
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import transformers
from bridge_models import bridge
from hf_models import CONFIGS, ids, logits, model
from test_patching_hf import ANSWER, WRONG, reference
from transformer_lens import patching

import safelens
from safelens import PatchingError, SafelensError, run_with_patching_cache
from safelens.backends import _override
from safelens.backends._families import backend_of
from safelens.backends.bridge import _cache_pass
from safelens.backends.hf import _skip
from safelens.patching import _hf_passes
from safelens.patching._limits import rows_within

TOL = 1e-5


def metric(logits: torch.Tensor) -> torch.Tensor:
    """TransformerLens-style: one run's logits to a scalar."""
    return (logits[:, -1, ANSWER] - logits[:, -1, WRONG]).mean()


class LastOnly:
    """A batched logit difference (batch 1) that says it reads only the last position."""

    last_position_only = True

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(logits.shape))
        return logits[:, -1, ANSWER] - logits[:, -1, WRONG]


def pair(length: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(clean, corrupted) prompts differing at every odd position."""
    clean = ids(batch, length, seed=3)
    corrupted = clean.clone()
    corrupted[:, 1::2] = 9
    return clean, corrupted


def clean_cache_of(lm, clean: torch.Tensor):
    if hasattr(lm, "hook_dict"):
        return lm.run_with_cache(clean)[1]
    return run_with_patching_cache(lm, clean)[1]


def fresh(name: str, layers: int = 2, **settings) -> torch.nn.Module:
    """A HuggingFace model of its own (not `hf_models.model`'s cached one), `settings` set."""
    torch.manual_seed(0)
    config = CONFIGS[name](layers)
    for key, value in settings.items():
        setattr(config, key, value)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def snapshot(lm) -> dict:
    """Everything a failed sweep must leave as it was (see the module notes)."""
    return {
        "hooks": {
            name: (list(m._forward_hooks.values()), list(m._forward_pre_hooks.values()))
            for name, m in lm.named_modules()
        },
        "forwards": {name: m.__dict__.get("forward") for name, m in lm.named_modules()},
        "training": [m.training for m in lm.modules()],
        "params": [p.clone() for p in lm.parameters()],
        "context_level": getattr(lm, "context_level", None),
    }


def assert_as_found(lm, before: dict) -> None:
    after = snapshot(lm)
    assert after["hooks"] == before["hooks"]
    assert after["forwards"] == before["forwards"]
    assert after["training"] == before["training"]
    assert after["context_level"] == before["context_level"]
    assert all(torch.equal(a, b) for a, b in zip(after["params"], before["params"], strict=True))
    assert not _override._INSTALLED and _skip.skipped_layers() == frozenset()
    assert not _cache_pass._ALIASED


def transformer_lens_cells(lm, corrupted, clean_cache, activation, setter, cells, columns):
    """`transformer_lens.patching` on the bridge at `cells` only: one run_with_hooks each."""
    index_df = pd.DataFrame(cells, columns=columns)
    return patching.generic_activation_patch(
        lm, corrupted, clean_cache, metric, setter, activation, index_df=index_df
    )


# -- configurations the other tests do not use -------------------------------------------

BY_POS = ["layer", "pos"]
BY_HEAD = ["layer", "pos", "head_index"]
CELLS = {
    "get_act_patch_attn_head_k_by_pos": ("k", patching.layer_pos_head_vector_patch_setter),
    "get_act_patch_attn_head_q_by_pos": ("q", patching.layer_pos_head_vector_patch_setter),
    "get_act_patch_attn_head_out_by_pos": ("z", patching.layer_pos_head_vector_patch_setter),
    "get_act_patch_resid_mid": ("resid_mid", patching.layer_pos_patch_setter),
    "get_act_patch_mlp_out": ("mlp_out", patching.layer_pos_patch_setter),
}


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_sliding_window_and_softcapping_bridges_equal_transformer_lens(name):
    """A window of 4 on a prompt of 9; Gemma-2 alternates sliding and global layers."""
    lm = bridge(name)
    clean, corrupted = pair(9)
    clean_cache = clean_cache_of(lm, clean)
    for sweep, (activation, setter) in CELLS.items():
        got = getattr(safelens, sweep)(lm, corrupted, clean_cache, metric, progress=False)
        cells = [(0, 3, 1), (1, 5, 0), (1, 8, 1)]
        columns = BY_HEAD if got.dim() == 3 else BY_POS
        cells = [cell[: got.dim()] for cell in cells]
        expected = transformer_lens_cells(
            lm, corrupted, clean_cache, activation, setter, cells, columns
        )
        assert (got[tuple(torch.tensor(cells).T)] - expected).abs().max() <= TOL, sweep
        assert (got - got.flatten()[0]).abs().max() > 1e-7, sweep


@pytest.mark.parametrize("family", ["hf", "bridge"])
@pytest.mark.parametrize("length", [1, 64])
def test_one_token_and_full_context_prompts(family, length):
    """GPT-2's context is 64 positions; one more is refused naming the limit."""
    lm = model("gpt2", layers=1) if family == "hf" else bridge("gpt2", layers=1)
    clean, corrupted = pair(length)
    corrupted[:, -1] = 7
    clean_cache = clean_cache_of(lm, clean)
    got = safelens.get_act_patch_resid_pre(lm, corrupted, clean_cache, metric, progress=False)
    cells = [(0, 0), (0, length - 1)]
    if family == "hf":
        expected = reference(lm, "resid_pre", cells, clean, corrupted, torch.ones_like(clean))
    else:
        expected = transformer_lens_cells(
            lm, corrupted, clean_cache, "resid_pre", patching.layer_pos_patch_setter, cells, BY_POS
        )
    assert (got[tuple(torch.tensor(cells).T)] - expected).abs().max() <= TOL
    with pytest.raises(safelens.TokenError, match=r"more than the model's context n_ctx=64"):
        safelens.get_act_patch_resid_pre(lm, ids(1, 65), clean_cache, metric, progress=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_float64_and_bfloat16_models_equal_a_loop_of_hooked_forwards(dtype):
    lm = model("qwen2", dtype=dtype)
    clean, corrupted = pair(7)
    clean_cache = clean_cache_of(lm, clean)
    for sweep, activation in [
        ("get_act_patch_attn_head_k_by_pos", "k"),
        ("get_act_patch_resid_pre", "resid_pre"),
    ]:
        got = getattr(safelens, sweep)(lm, corrupted, clean_cache, LastOnly(), progress=False)
        assert got.dtype == torch.float32
        cells = [(layer, pos, 1)[: got.dim()] for layer in range(2) for pos in (1, 3, 6)]
        expected = reference(lm, activation, cells, clean, corrupted, torch.ones_like(clean))
        tolerance = TOL if dtype == torch.float64 else 2e-2 * float(expected.abs().max())
        assert (got[tuple(torch.tensor(cells).T)] - expected.float()).abs().max() <= tolerance


def test_a_model_in_train_mode_without_dropout_gives_the_eval_numbers():
    lm = fresh("llama", layers=3)  # attention_dropout = 0: train() changes nothing
    clean, corrupted = pair(8)
    clean_cache = clean_cache_of(lm, clean)
    sweep = safelens.get_act_patch_attn_head_v_by_pos
    evaluated = sweep(lm, corrupted, clean_cache, metric, progress=False)
    lm.train()
    trained = sweep(lm, corrupted, clean_cache, metric, progress=False)
    assert lm.training
    assert (trained - evaluated).abs().max() <= TOL


def test_a_model_in_train_mode_with_dropout_is_refused():
    lm = fresh("gpt2")  # GPT-2's configs default to dropout 0.1
    clean, corrupted = pair(6)
    clean_cache = clean_cache_of(lm, clean)
    lm.train()
    before = snapshot(lm)
    with pytest.raises(PatchingError, match=r"training mode with dropout 0\.1 .*model\.eval\(\)"):
        safelens.get_act_patch_resid_pre(lm, corrupted, clean_cache, metric, progress=False)
    assert lm.training
    assert_as_found(lm, before)


def test_a_bos_that_shares_the_pad_id_is_attended(monkeypatch):
    """TransformerLens unmasks such a BOS (`get_attention_mask`); a prompt alone is not
    masked either."""
    lm = model("gpt2")
    tokenizer = SimpleNamespace(pad_token_id=0, bos_token_id=0, eos_token_id=0, padding_side="left")
    monkeypatch.setattr(lm, "tokenizer", tokenizer, raising=False)
    clean, corrupted = pair(7, batch=2)
    clean[:, 0] = corrupted[:, 0] = 0  # BOS, no padding
    clean_cache = clean_cache_of(lm, clean)
    got = safelens.get_act_patch_resid_pre(lm, corrupted, clean_cache, metric, progress=False)
    cells = [(layer, pos) for layer in range(2) for pos in (0, 3, 6)]
    expected = reference(lm, "resid_pre", cells, clean, corrupted, torch.ones_like(clean))
    assert (got[tuple(torch.tensor(cells).T)] - expected).abs().max() <= TOL


@pytest.mark.parametrize("bos", [0, 1])
def test_left_padding_is_masked_and_a_bos_that_shares_the_pad_id_kept(monkeypatch, bos):
    """Pad id 0 (also the end-of-text id, as Llama users often set it): a row's leading
    pads are masked; where the BOS shares the id, the last of them is the BOS, attended."""
    lm = model("llama")
    tokenizer = SimpleNamespace(pad_token_id=0, bos_token_id=bos, eos_token_id=0)
    monkeypatch.setattr(lm, "tokenizer", tokenizer, raising=False)
    clean, corrupted = pair(8, batch=2)
    for tokens in (clean, corrupted):
        tokens[tokens == 0] = 2  # no pad id but where placed here
        tokens[0, :3] = torch.tensor([0, 0, bos])  # two pads, then the BOS
        tokens[1, 0] = bos  # the BOS, no padding
    mask = torch.ones_like(clean)
    mask[0, :2] = 0
    assert torch.equal(backend_of(lm).default_mask(clean), mask)
    clean_cache = clean_cache_of(lm, clean)
    got = safelens.get_act_patch_resid_pre(lm, corrupted, clean_cache, metric, progress=False)
    cells = [(layer, pos) for layer in range(2) for pos in (3, 5, 7)]
    expected = reference(lm, "resid_pre", cells, clean, corrupted, mask)
    assert (got[tuple(torch.tensor(cells).T)] - expected).abs().max() <= TOL


def test_an_instance_forward_of_the_users_is_kept_and_run():
    """accelerate installs each layer's `forward` as an instance attribute."""
    lm = fresh("llama", layers=3)
    for layer in lm.model.layers:
        own = layer.forward

        def scaled(*args, _own=own, **kwargs):
            output = _own(*args, **kwargs)
            return output * 1.1 if isinstance(output, torch.Tensor) else (output[0] * 1.1,)

        layer.forward = scaled
    installed = [layer.__dict__["forward"] for layer in lm.model.layers]
    clean, corrupted = pair(9)
    clean_cache = clean_cache_of(lm, clean)
    got = safelens.get_act_patch_resid_pre(lm, corrupted, clean_cache, LastOnly(), progress=False)
    cells = [(layer, pos) for layer in range(3) for pos in (1, 5, 8)]
    expected = reference(lm, "resid_pre", cells, clean, corrupted, torch.ones_like(clean))
    assert (got[tuple(torch.tensor(cells).T)] - expected).abs().max() <= TOL
    assert [layer.__dict__["forward"] for layer in lm.model.layers] == installed


def test_phi3_bridge_key_sweep_equals_transformer_lens():
    lm = bridge("phi3")
    clean, corrupted = pair(7)
    clean_cache = clean_cache_of(lm, clean)
    got = safelens.get_act_patch_attn_head_k_by_pos(
        lm, corrupted, clean_cache, metric, progress=False
    )
    expected = patching.get_act_patch_attn_head_k_by_pos(lm, corrupted, clean_cache, metric)
    assert (got - expected).abs().max() <= TOL


def test_pattern_sweep_on_a_bridge_with_an_ablated_layer_equals_transformer_lens():
    lm = bridge("llama", layers=1)  # its weights are edited below, and put back
    clean, corrupted = pair(6)
    attention = lm.original_model.model.layers[0].self_attn.o_proj
    kept = attention.weight.clone()
    attention.weight.zero_()
    try:
        clean_cache = clean_cache_of(lm, clean)
        expected = patching.get_act_patch_attn_head_pattern_by_pos(
            lm, corrupted, clean_cache, metric
        )
        got = safelens.get_act_patch_attn_head_pattern_by_pos(
            lm, corrupted, clean_cache, metric, progress=False
        )
    finally:
        attention.weight.copy_(kept)
    assert (got - expected).abs().max() <= TOL


# -- the user's own hooks ------------------------------------------------------------------


def test_user_hooks_on_bridge_hook_points_act_as_under_transformer_lens():
    """Hooks attached before the sweep (one returning a tensor, one editing in place) act
    on every patched run, as in `transformer_lens.patching`, and stay attached."""
    lm = bridge("llama")
    clean, corrupted = pair(8)

    def scale(tensor, hook):
        return tensor * 1.5

    def shift(tensor, hook):
        tensor[..., :4] += 0.3

    lm.add_hook("blocks.1.hook_resid_pre", scale)
    lm.add_hook("blocks.0.attn.hook_z", shift)
    try:
        clean_cache = clean_cache_of(lm, clean)
        for sweep in ("get_act_patch_attn_head_out_by_pos", "get_act_patch_attn_head_v_by_pos"):
            got = getattr(safelens, sweep)(lm, corrupted, clean_cache, metric, progress=False)
            expected = getattr(patching, sweep)(lm, corrupted, clean_cache, metric)
            assert (got - expected).abs().max() <= TOL, sweep
        assert len(lm.hook_dict["blocks.1.hook_resid_pre"]._forward_hooks) == 1
        assert len(lm.hook_dict["blocks.0.attn.hook_z"]._forward_hooks) == 1
    finally:
        lm.reset_hooks()


def test_user_ablations_of_a_head_and_of_attention_to_position_0_act_as_under_transformer_lens():
    """Index a head, or a *key* position (every pass sees every key): unlike a query or
    residual position (below), these mean the same in a pass that starts after 0."""
    lm = bridge("llama")
    clean, corrupted = pair(20)

    def no_attention_to_position_0(pattern, hook):
        pattern = pattern.clone()
        pattern[..., 0] = 0
        return pattern

    def no_head_1(z, hook):
        z[:, :, 1] = 0

    lm.add_hook("blocks.0.attn.hook_pattern", no_attention_to_position_0)
    lm.add_hook("blocks.1.attn.hook_z", no_head_1)
    try:
        clean_cache = clean_cache_of(lm, clean)
        got = safelens.get_act_patch_resid_pre(lm, corrupted, clean_cache, metric, progress=False)
        expected = patching.get_act_patch_resid_pre(lm, corrupted, clean_cache, metric)
    finally:
        lm.reset_hooks()
    assert (got - expected).abs().max() <= TOL
    assert (got - got.flatten()[0]).abs().max() > 1e-6


@pytest.mark.parametrize("family", ["hf", "bridge"])
def test_a_user_hook_that_edits_position_0_gives_the_reference_numbers(family):
    """A prompt of 20: the runs patched at layer 0 after position 16 share a pass that
    starts at 16, where the hook's `[:, 0]` is position 16."""
    lm = model("llama") if family == "hf" else bridge("llama")
    clean, corrupted = pair(20)
    cells = [(0, 17), (0, 19), (1, 18)]

    def module_hook(module, args, output) -> None:  # in place; returns nothing
        output[:, 0] += 1.0

    def hook_point_hook(tensor, hook) -> None:
        tensor[:, 0] += 1.0

    if family == "hf":
        handle = lm.model.layers[0].mlp.register_forward_hook(module_hook)
    else:
        lm.add_hook("blocks.0.hook_mlp_out", hook_point_hook)
    try:
        clean_cache = clean_cache_of(lm, clean)
        got = safelens.get_act_patch_resid_pre(lm, corrupted, clean_cache, metric, progress=False)
        if family == "hf":
            expected = reference(lm, "resid_pre", cells, clean, corrupted, torch.ones_like(clean))
        else:
            expected = transformer_lens_cells(
                lm,
                corrupted,
                clean_cache,
                "resid_pre",
                patching.layer_pos_patch_setter,
                cells,
                BY_POS,
            )
    finally:
        if family == "hf":
            handle.remove()
        else:
            lm.reset_hooks()
    assert (got[tuple(torch.tensor(cells).T)] - expected).abs().max() <= TOL


@pytest.mark.parametrize("family", ["hf", "bridge"])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_user_hook_raising_in_a_patched_pass_leaves_the_model_as_found(family, error):
    lm = model("llama", layers=3) if family == "hf" else bridge("llama", layers=3)
    clean, corrupted = pair(10)
    clean_cache = clean_cache_of(lm, clean)
    calls = []

    def raising(module, args, output):
        calls.append(_skip.skipped_layers())
        if len(calls) == 6:  # after the corrupted pass and the checks: a patched pass
            raise error("the user's hook")

    hf = lm if family == "hf" else lm.original_model
    handle = hf.model.layers[2].mlp.register_forward_hook(raising)
    before = snapshot(lm)
    try:
        with pytest.raises(error, match="the user's hook"):
            safelens.get_act_patch_attn_head_v_by_pos(
                lm, corrupted, clean_cache, metric, progress=False
            )
    finally:
        handle.remove()
    assert any(calls)  # some pass before it skipped layers
    handle = hf.model.layers[2].mlp.register_forward_hook(raising)
    try:
        assert_as_found(lm, before)
    finally:
        handle.remove()


def test_an_error_in_a_users_hook_reaches_the_caller():
    lm = model("llama", layers=3)
    clean, corrupted = pair(10)
    clean_cache = clean_cache_of(lm, clean)
    calls = []

    def raising(module, args, output):
        calls.append(1)
        if len(calls) == 2:  # the first pass after the corrupted one
            raise RuntimeError("the user's hook")

    handle = lm.model.layers[2].register_forward_hook(raising)
    try:
        with pytest.raises(RuntimeError, match="the user's hook"):
            safelens.get_act_patch_resid_pre(lm, corrupted, clean_cache, metric, progress=False)
    finally:
        handle.remove()


# -- the metric ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["hf", "bridge"])
def test_a_metric_interrupted_or_raising_leaves_the_model_as_found(family):
    lm = model("gemma2", layers=3) if family == "hf" else bridge("gpt2", layers=3)
    clean, corrupted = pair(8)
    clean_cache = clean_cache_of(lm, clean)
    before = snapshot(lm)
    for error in (KeyboardInterrupt, ZeroDivisionError):

        def raising(logits, error=error):
            raise error("the user's metric")

        with pytest.raises(error, match="the user's metric"):
            safelens.get_act_patch_resid_pre(lm, corrupted, clean_cache, raising, progress=False)
        assert_as_found(lm, before)


@pytest.mark.parametrize("family", ["hf", "bridge"])
def test_a_metric_that_says_it_reads_the_last_position_gets_that_position_alone(family):
    """Documented: such a metric reading position 0 reads the last position."""
    lm = model("llama") if family == "hf" else bridge("llama")
    clean, corrupted = pair(8)
    clean_cache = clean_cache_of(lm, clean)
    told = LastOnly()
    got = safelens.get_act_patch_resid_pre(lm, corrupted, clean_cache, told, progress=False)
    assert told.shapes and all(shape[1:] == (1, 50) for shape in told.shapes)
    plain = safelens.get_act_patch_resid_pre(lm, corrupted, clean_cache, metric, progress=False)
    assert (got - plain).abs().max() <= TOL


def test_a_metric_returning_a_one_element_tensor_is_taken_as_transformer_lens_takes_it():
    lm = bridge("llama")
    clean, corrupted = pair(6)
    clean_cache = clean_cache_of(lm, clean)

    def one_element(logits):
        return (logits[:, -1, ANSWER] - logits[:, -1, WRONG]).mean(0, keepdim=True)

    # TransformerLens 3.9 takes the one-element result itself (`.item()`), 4.x only a scalar.
    scalar = lambda logits: one_element(logits)[0]  # noqa: E731
    expected = patching.get_act_patch_resid_pre(lm, corrupted, clean_cache, scalar)
    got = safelens.get_act_patch_resid_pre(lm, corrupted, clean_cache, one_element, progress=False)
    assert (got - expected).abs().max() <= TOL


@pytest.mark.parametrize("family", ["hf", "bridge"])
def test_a_metric_that_runs_the_model_sees_it_unhooked(family):
    lm = model("llama") if family == "hf" else bridge("llama")
    clean, corrupted = pair(8)
    clean_cache = clean_cache_of(lm, clean)
    probe = ids(1, 5, seed=7)
    plain = logits(lm, probe)
    seen = []

    def probing(patched):
        seen.append(float((logits(lm, probe) - plain).abs().max()))
        return metric(patched)

    got = safelens.get_act_patch_resid_pre(lm, corrupted, clean_cache, probing, progress=False)
    expected = safelens.get_act_patch_resid_pre(lm, corrupted, clean_cache, metric, progress=False)
    assert seen and max(seen) == 0.0
    assert torch.equal(got, expected)


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["hf", "bridge"])
def test_bad_input_is_refused_naming_it_and_leaves_everything_as_found(family):
    lm = model("llama") if family == "hf" else bridge("llama")
    clean, corrupted = pair(6)
    clean_cache = clean_cache_of(lm, clean)
    snapshot_of_cache = {name: tensor.clone() for name, tensor in clean_cache.items()}
    before = snapshot(lm)
    sweep = safelens.get_act_patch_attn_head_k_by_pos
    refused = [
        (corrupted.float(), clean_cache, metric, {}, safelens.TokenError, "torch.long"),
        (corrupted - 50, clean_cache, metric, {}, safelens.TokenError, r"in \[0, d_vocab=50\)"),
        (corrupted[None], clean_cache, metric, {}, safelens.TokenError, r"\[batch, pos\]"),
        (corrupted[:, :0], clean_cache, metric, {}, safelens.TokenError, "at least one position"),
        (
            corrupted,
            None,
            metric,
            {},
            PatchingError,
            "clean_cache must be the clean run.s activations by hook name",
        ),
        (corrupted[:, :1], clean_cache, metric, {}, PatchingError, "same length"),
        (corrupted, clean_cache, None, {}, PatchingError, "patching_metric must be a function"),
        (corrupted, clean_cache, lambda logits: None, {}, PatchingError, "returned None"),
        (corrupted, clean_cache, lambda logits: logits[:, -1, :2], {}, PatchingError, "shape"),
        (corrupted, clean_cache, metric, {"max_batch": True}, PatchingError, "max_batch"),
        (corrupted, clean_cache, metric, {"max_bytes": 1e9}, PatchingError, "max_bytes"),
        (corrupted, clean_cache, metric, {"progress": 1}, PatchingError, "progress"),
    ]
    for tokens, cache, fn, limits, error, match in refused:
        with pytest.raises(error, match=match):
            sweep(lm, tokens, cache, fn, **{"progress": False, **limits})
        assert_as_found(lm, before)
    assert all(torch.equal(clean_cache[name], held) for name, held in snapshot_of_cache.items())


def test_corrupted_tokens_with_no_rows_are_refused():
    lm = model("llama")
    clean, corrupted = pair(6)
    clean_cache = clean_cache_of(lm, clean)
    with pytest.raises(SafelensError, match="corrupted_tokens"):
        safelens.get_act_patch_resid_pre(lm, corrupted[:0], clean_cache, metric, progress=False)


@pytest.mark.parametrize("family", ["hf", "bridge"])
def test_token_ids_of_a_dtype_the_embedding_refuses_are_refused_naming_them(family):
    lm = model("llama") if family == "hf" else bridge("llama")
    clean, corrupted = pair(6)
    clean_cache = clean_cache_of(lm, clean)
    with pytest.raises(safelens.TokenError, match="corrupted_tokens"):
        safelens.get_act_patch_resid_pre(
            lm, corrupted.to(torch.uint8), clean_cache, metric, progress=False
        )


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_clean_cache_of_another_float_dtype_is_cast_as_transformer_lens_casts_it(dtype):
    lm = bridge("llama")
    clean, corrupted = pair(6)
    cast = {name: tensor.to(dtype) for name, tensor in clean_cache_of(lm, clean).items()}
    expected = patching.get_act_patch_resid_pre(lm, corrupted, cast, metric)
    got = safelens.get_act_patch_resid_pre(lm, corrupted, cast, metric, progress=False)
    assert (got - expected).abs().max() <= TOL


def test_a_model_of_no_family_is_told_every_family_the_sweeps_take():
    clean, corrupted = pair(6)
    with pytest.raises(PatchingError, match="TransformerBridge"):
        safelens.get_act_patch_resid_pre(None, corrupted, {}, metric, progress=False)


def test_patch_dataset_refuses_a_seed_that_is_not_an_int():
    lm = model("llama")
    clean, corrupted = pair(5, batch=2)
    with pytest.raises(PatchingError, match="seed"):
        safelens.patch_dataset(
            safelens.get_act_patch_resid_pre,
            lm,
            clean,
            corrupted,
            lambda logits, pairs: logits[:, -1, ANSWER],
            seed="0",
            progress=False,
        )


@pytest.mark.parametrize("family", ["hf", "bridge"])
def test_tiny_budgets_and_a_progress_bar_give_the_same_numbers(family, capsys):
    lm = model("phi3") if family == "hf" else bridge("gpt2")
    clean, corrupted = pair(7, batch=2)
    clean_cache = clean_cache_of(lm, clean)
    sweep = safelens.get_act_patch_attn_head_v_by_pos
    plain = sweep(lm, corrupted, clean_cache, metric, progress=False)
    for limits in ({"max_batch": 1}, {"max_bytes": 1}):
        assert torch.equal(
            sweep(lm, corrupted, clean_cache, metric, progress=False, **limits), plain
        )
    assert torch.equal(sweep(lm, corrupted, clean_cache, metric, progress=True), plain)
    assert "patching" in capsys.readouterr().err


def test_a_memory_budget_caps_the_runs_of_each_pass(monkeypatch):
    lm = model("llama")
    clean, corrupted = pair(7)
    clean_cache = clean_cache_of(lm, clean)
    sweep = safelens.get_act_patch_resid_pre
    plain = sweep(lm, corrupted, clean_cache, metric, progress=False)
    config = lm.config

    def rows(budget, new):  # the one estimate every sweep takes
        return rows_within(
            budget,
            d_vocab=config.vocab_size,
            d_model=config.hidden_size,
            d_mlp=config.intermediate_size,
            n_heads=config.num_attention_heads,
            new=new,
            length=7,
            dtype=torch.float32,
        )

    budget = 3 * (2**40 // rows(2**40, 7))  # three rows of a pass over every position
    assert rows(budget, 7) == 3
    passes = []
    logits = _hf_passes.Pass.logits

    def counted(self, shortcuts, chunk, first, start, *args, **kwargs):
        if chunk:
            passes.append((start, len(chunk)))
        return logits(self, shortcuts, chunk, first, start, *args, **kwargs)

    monkeypatch.setattr(_hf_passes.Pass, "logits", counted)
    capped = sweep(lm, corrupted, clean_cache, metric, max_bytes=budget, progress=False)
    assert torch.allclose(capped, plain, atol=1e-5)
    assert all(runs <= rows(budget, 7 - start) for start, runs in passes)
    assert sum(runs for _, runs in passes) > max(runs for _, runs in passes)


# -- threads ----------------------------------------------------------------------------------


def _in_another_thread(module, action, when=lambda: True):
    """A forward hook on `module` that, in a pass of the calling thread for which `when()`
    holds, runs `action()` in another thread and waits for it: a deterministic
    interleaving of the two threads."""
    me = threading.get_ident()

    def hook(*args):
        if threading.get_ident() == me and when():
            worker = threading.Thread(target=action)
            worker.start()
            worker.join()

    return module.register_forward_hook(hook)


@pytest.mark.parametrize(
    ("family", "sweep"),
    [
        ("hf", "get_act_patch_resid_pre"),
        ("hf", "get_act_patch_attn_head_k_by_pos"),
        ("bridge", "get_act_patch_attn_head_k_by_pos"),
    ],
)
def test_another_threads_forward_during_a_sweep_is_plain(family, sweep):
    lm = model("llama", layers=3) if family == "hf" else bridge("llama", layers=3)
    clean, corrupted = pair(9)
    clean_cache = clean_cache_of(lm, clean)
    probe = ids(2, 5, seed=7)
    plain = logits(lm, probe)
    hf = lm if family == "hf" else lm.original_model
    # With a hook of the user's attached, as below, so that both take the same passes (a
    # bridge runs them itself, not on its plain model, while a user hook is attached).
    idle = _in_another_thread(hf.lm_head, lambda: None, when=lambda: False)
    try:
        serial = getattr(safelens, sweep)(lm, corrupted, clean_cache, metric, progress=False)
    finally:
        idle.remove()
    seen: list = []
    handle = _in_another_thread(hf.lm_head, lambda: seen.append(logits(lm, probe)))
    try:
        got = getattr(safelens, sweep)(lm, corrupted, clean_cache, metric, progress=False)
    finally:
        handle.remove()
    assert len(seen) >= 4  # the corrupted pass, the checks and patched passes
    assert all(torch.equal(logits, plain) for logits in seen)
    assert torch.equal(got, serial)


def test_a_sweep_and_a_clean_cache_in_another_thread_during_a_hf_sweep_are_serial():
    """Each of the outer sweep's passes runs, in another thread, a whole sweep and a
    clean-cache run of the same HuggingFace model, mid-pass."""
    lm = model("llama", layers=3)
    clean, corrupted = pair(9)
    clean_logits, clean_cache = run_with_patching_cache(lm, clean)
    sweeps = [safelens.get_act_patch_attn_head_v_by_pos, safelens.get_act_patch_resid_pre]
    serial = [sweep(lm, corrupted, clean_cache, LastOnly(), progress=False) for sweep in sweeps]
    inner: list = []

    def other() -> None:
        try:
            with torch.no_grad():
                logits, cache = run_with_patching_cache(lm, clean)
                swept = sweeps[1](lm, corrupted, cache, LastOnly(), progress=False)
            inner.append((logits, swept))
        except Exception as error:  # noqa: BLE001 - the assertion below reports it
            inner.append(error)

    before = snapshot(lm)
    handle = _in_another_thread(lm.lm_head, other)
    try:
        outer = sweeps[0](lm, corrupted, clean_cache, LastOnly(), progress=False)
    finally:
        handle.remove()
    # The hook that starts the other thread is a hook of the user's: every pass runs whole.
    assert (outer - serial[0]).abs().max() <= TOL
    assert len(inner) >= 4 and all(isinstance(result, tuple) for result in inner), inner
    for inner_logits, swept in inner:
        assert torch.equal(inner_logits, clean_logits) and (swept - serial[1]).abs().max() <= TOL
    assert_as_found(lm, before)


def test_another_threads_forward_during_a_bridge_hook_point_sweep_is_plain():
    lm = bridge("llama", layers=3)
    clean, corrupted = pair(9)
    clean_cache = clean_cache_of(lm, clean)
    probe = ids(32, 9, seed=7)  # rows enough for the sweep's indices: no error, wrong logits
    plain = lm(probe)
    seen: list = []

    def forward():
        try:
            with torch.no_grad():
                seen.append(lm(probe))
        except Exception as error:  # noqa: BLE001 - the assertion below reports it
            seen.append(error)

    handle = _in_another_thread(lm.original_model.lm_head, forward)
    try:
        safelens.get_act_patch_attn_head_out_by_pos(
            lm, corrupted, clean_cache, metric, progress=False
        )
    finally:
        handle.remove()
    assert len(seen) >= 4
    assert all(isinstance(logits, torch.Tensor) and torch.equal(logits, plain) for logits in seen)


def test_two_threads_sweeping_one_bridge_get_the_serial_results():
    lm = bridge("llama", layers=3)
    clean, corrupted = pair(9)
    clean_cache = clean_cache_of(lm, clean)
    sweeps = [safelens.get_act_patch_attn_head_out_by_pos, safelens.get_act_patch_resid_pre]
    # With a hook of the user's attached, as below, so that the passes are the same ones.
    idle = _in_another_thread(lm.original_model.lm_head, lambda: None, when=lambda: False)
    try:
        serial = [sweep(lm, corrupted, clean_cache, metric, progress=False) for sweep in sweeps]
    finally:
        idle.remove()
    inner: list = []

    def other_sweep():
        try:
            inner.append(sweeps[1](lm, corrupted, clean_cache, metric, progress=False))
        except Exception as error:  # noqa: BLE001 - the assertion below reports it
            inner.append(error)

    handle = _in_another_thread(lm.original_model.lm_head, other_sweep)
    try:
        outer = sweeps[0](lm, corrupted, clean_cache, metric, progress=False)
    finally:
        handle.remove()
    assert torch.equal(outer, serial[0])
    assert len(inner) >= 4
    assert all(isinstance(got, torch.Tensor) and torch.equal(got, serial[1]) for got in inner)


def test_layers_that_share_one_module_are_refused_naming_both_and_left_as_found():
    """A module object used by two layers: a hook on it fires in both, so neither the
    clean cache nor a sweep can hook one layer's share; the error names both places."""
    lm = fresh("llama", layers=3)
    lm.model.layers[2].mlp = lm.model.layers[1].mlp
    clean, corrupted = pair(6)
    before = snapshot(lm)
    shared = r"'model.layers.2.mlp' is the same module object as 'model.layers.1.mlp'"
    with pytest.raises(safelens.HookError, match=shared + ".*copy.deepcopy"):
        run_with_patching_cache(lm, clean)
    identity = [("model.layers.2.mlp", lambda tensor, hook: tensor)]
    with pytest.raises(safelens.HookError, match=shared):
        safelens.run_with_hooks(lm, corrupted, cache=safelens.HFKeyValueCache(), fwd_hooks=identity)
    assert_as_found(lm, before)
    # A filter of no known type is still told what a filter may be.
    for bad in (3, None):
        with pytest.raises(safelens.HookError, match="a hook name filter must be a name"):
            safelens.run_with_hooks(
                lm, corrupted, cache=safelens.HFKeyValueCache(), fwd_hooks=[(bad, identity[0][1])]
            )
    # A name of no module is still told the names it may have meant.
    typo = [("model.layers.2.mpl", lambda tensor, hook: tensor)]
    with pytest.raises(safelens.HookError, match="unknown hook name 'model.layers.2.mpl'"):
        safelens.run_with_hooks(lm, corrupted, cache=safelens.HFKeyValueCache(), fwd_hooks=typo)
    # Given its own module, the layer is hooked and swept as any other.
    lm.model.layers[2].mlp = copy.deepcopy(lm.model.layers[1].mlp)
    _, clean_cache = run_with_patching_cache(lm, clean)
    ours = safelens.get_act_patch_mlp_out(lm, corrupted, clean_cache, metric, progress=False)
    cells = [(layer, pos) for layer in range(3) for pos in range(6)]
    expected = reference(lm, "mlp_out", cells, clean, corrupted, torch.ones_like(clean))
    torch.testing.assert_close(ours.flatten(), expected, atol=TOL, rtol=TOL)
