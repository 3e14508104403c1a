"""The q, z, pattern and resid_mid sweeps, and the head bundles, on plain HuggingFace models.

Reference: one uncached forward per patch with hooks written here, without safelens, on
every family of `hf_models` (weights of std 0.2, as `test_patching_every_hf`'s, so
patterns differ between prompts): queries patched at the query projection's output,
before the rotary embedding (Phi-3's and GPT-2's joint projections: their query
columns); head outputs at the output projection's input; `resid_mid` as the layer's
input plus what the layer adds to it from its attention (the attention output, Gemma-2's
normalised one), the addend patched so that the sum is the clean one; patterns by the
family's own `eager_attention_forward` (the model switched to eager attention for the
reference), its weights patched and applied to the values here. On a TransformerBridge
over the same weights, `transformer_lens.patching` on the bridge. Runs in both CI
environments.
"""

from __future__ import annotations

import copy
import sys

import pandas as pd
import pytest
import torch
import transformers
from bridge_models import bridge, reference
from hf_models import CONFIGS
from test_patching_every_hf import batched, last_position, metric, prompts, sharp_model
from test_patching_hf import OTHER_ATTENTION, _d_head, _forward, _layers
from test_patching_hf import reference as hf_reference
from transformer_lens import patching

import safelens
from safelens import PatchingError, run_with_patching_cache

TOL = 1e-4
FAMILIES = list(CONFIGS)


def _attention(block: torch.nn.Module) -> torch.nn.Module:
    return block.self_attn if hasattr(block, "self_attn") else block.attn


def _query_columns(lm, layer: int) -> torch.nn.Module:
    """The module whose output's first `n_heads * d_head` columns are the pre-rotary queries."""
    attention = _attention(_layers(lm)[layer])
    for name in ("q_proj", "qkv_proj", "c_attn"):
        if hasattr(attention, name):
            return getattr(attention, name)
    raise AssertionError(type(attention))


def _output_projection(lm, layer: int) -> torch.nn.Module:
    attention = _attention(_layers(lm)[layer])
    return attention.o_proj if hasattr(attention, "o_proj") else attention.c_proj


def _residual_addend(lm, layer: int) -> torch.nn.Module:
    """The module whose output the layer adds to its input before the MLP's norm."""
    block = _layers(lm)[layer]
    if hasattr(block, "pre_feedforward_layernorm"):  # Gemma-2 normalises attention's output
        return block.post_attention_layernorm
    return _attention(block)


def _columns(lm, head: int | None) -> slice:
    d_head = _d_head(lm)
    return slice(None) if head is None else slice(head * d_head, (head + 1) * d_head)


def vector_reference(lm, activation, indices, clean, corrupted):
    """One hooked forward per `(layer, pos, head)` (`pos` None: every position) of q or z."""
    site = {"q": (_query_columns, False), "z": (_output_projection, True)}[activation]
    mask = torch.ones_like(clean)
    captured = {}
    hooks = [
        (site[0](lm, layer), site[1], lambda t, layer=layer: captured.setdefault(layer, t.clone()))
        for layer in range(lm.config.num_hidden_layers)
    ]
    _forward(lm, clean, mask, hooks)
    values = []
    for layer, pos, head in indices:
        at = slice(None) if pos is None else pos
        columns = _columns(lm, head)

        def patch(t, layer=layer, at=at, columns=columns):
            t = t.clone()
            t[:, at, columns] = captured[layer][:, at, columns]
            return t

        values.append(metric(_forward(lm, corrupted, mask, [(site[0](lm, layer), site[1], patch)])))
    return torch.stack(values)


def resid_mid_reference(lm, indices, clean, corrupted):
    """One hooked forward per `(layer, pos)`: the addend patched so that input + addend is clean."""
    mask = torch.ones_like(clean)
    inputs, addends = {}, {}

    def keeping(store, layer):
        return lambda t: (store.__setitem__(layer, t.clone()), t)[1]

    hooks = []
    for layer in range(lm.config.num_hidden_layers):
        hooks.append((_layers(lm)[layer], True, keeping(inputs, layer)))
        hooks.append((_residual_addend(lm, layer), False, keeping(addends, layer)))
    _forward(lm, clean, mask, hooks)
    clean_mid = {layer: inputs[layer] + addends[layer] for layer in inputs}
    values = []
    for layer, pos in indices:
        seen = {}

        def patch(t, layer=layer, pos=pos, seen=seen):
            t = t.clone()
            t[:, pos] = clean_mid[layer][:, pos] - seen["input"][:, pos]
            return t

        hooks = [
            (_layers(lm)[layer], True, keeping(seen, "input")),
            (_residual_addend(lm, layer), False, patch),
        ]
        values.append(metric(_forward(lm, corrupted, mask, hooks)))
    return torch.stack(values)


def pattern_reference(lm, indices, clean, corrupted, monkeypatch):
    """One eager forward per `(layer, head, dest, src)` (`None`: every one) of the pattern."""
    block = _attention(_layers(lm)[0])
    modeling = sys.modules[type(block).__module__]
    own = modeling.eager_attention_forward
    edits = {}

    def attention(module, query, key, value, attention_mask, **kwargs):
        output, weights = own(module, query, key, value, attention_mask, **kwargs)
        edit = edits.get(module.layer_idx)
        if edit is None:
            return output, weights
        weights = edit(weights.clone())
        values = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
        return torch.matmul(weights, values).transpose(1, 2).contiguous(), weights

    monkeypatch.setattr(modeling, "eager_attention_forward", attention)
    monkeypatch.setattr(lm.config, "_attn_implementation", "eager")
    captured = {}
    for layer in range(lm.config.num_hidden_layers):
        edits[layer] = lambda w, layer=layer: (captured.__setitem__(layer, w.clone()), w)[1]
    with torch.no_grad():
        lm(clean)
    values = []
    for layer, head, dest, src in indices:
        at = tuple(slice(None) if i is None else i for i in (head, dest, src))

        def patch(w, layer=layer, at=at):
            w[(slice(None), *at)] = captured[layer][(slice(None), *at)]
            return w

        edits.clear()
        edits[layer] = patch
        with torch.no_grad():
            values.append(metric(lm(corrupted).logits))
    edits.clear()
    return torch.stack(values)


# (sweep, reference kind, indices of the reference, the same cells of the sweep's result)
VECTOR_SWEEPS = [
    ("get_act_patch_attn_head_q_by_pos", "q", [(0, 2, 1), (1, 4, 3), (1, 5, 0)]),
    ("get_act_patch_attn_head_out_by_pos", "z", [(0, 2, 1), (1, 4, 3), (1, 5, 0)]),
    ("get_act_patch_attn_head_q_all_pos", "q", [(0, None, 2), (1, None, 1)]),
    ("get_act_patch_attn_head_out_all_pos", "z", [(0, None, 2), (1, None, 1)]),
]


def _cells(indices):
    return tuple(torch.tensor([[i for i in index if i is not None] for index in indices]).T)


@pytest.mark.parametrize("name", FAMILIES)
def test_q_z_and_resid_mid_sweeps_equal_a_loop_of_hooked_forwards(name):
    lm = sharp_model(name)
    clean, corrupted = prompts()
    _, clean_cache = run_with_patching_cache(lm, clean)
    for sweep, activation, indices in VECTOR_SWEEPS:
        got = getattr(safelens, sweep)(lm, corrupted, clean_cache, batched, progress=False)
        expected = vector_reference(lm, activation, indices, clean, corrupted)
        assert (got[_cells(indices)] - expected).abs().max() <= TOL, sweep
        assert (got - got.flatten()[0]).abs().max() > 1e-3, sweep  # the patches matter
    indices = [(0, 2), (0, 4), (1, 4), (1, 5)]
    for chosen in (batched, last_position):
        got = safelens.get_act_patch_resid_mid(lm, corrupted, clean_cache, chosen, progress=False)
        expected = resid_mid_reference(lm, indices, clean, corrupted)
        assert (got[_cells(indices)] - expected).abs().max() <= TOL
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in lm.modules())


PATTERN_SWEEPS = [
    ("get_act_patch_attn_head_pattern_by_pos", [(0, 1, 4, None), (1, 3, 2, None), (1, 0, 5, None)]),
    ("get_act_patch_attn_head_pattern_all_pos", [(0, 2, None, None), (1, 1, None, None)]),
    ("get_act_patch_attn_head_pattern_dest_src_pos", [(0, 1, 4, 2), (1, 3, 5, 4), (1, 0, 3, 1)]),
]


@pytest.mark.parametrize("name", FAMILIES)
def test_pattern_sweeps_equal_a_loop_of_eager_forwards(name, monkeypatch):
    lm = sharp_model(name)
    clean, corrupted = prompts()
    _, clean_cache = run_with_patching_cache(lm, clean)
    results = {
        sweep: getattr(safelens, sweep)(lm, corrupted, clean_cache, last_position, progress=False)
        for sweep, _ in PATTERN_SWEEPS
    }
    for sweep, indices in PATTERN_SWEEPS:
        expected = pattern_reference(lm, indices, clean, corrupted, monkeypatch)
        got = results[sweep]
        assert (got[_cells(indices)] - expected).abs().max() <= TOL, sweep
        assert (got - got.flatten()[0]).abs().max() > 1e-3, sweep


def test_a_pattern_with_attention_sinks_is_the_models_own_eager_attention_weights():
    """GPT-OSS: a learned logit per head joins each softmax; its share attends to nothing."""
    lm = sharp_model("gpt_oss")
    clean, _ = prompts()
    _, clean_cache = run_with_patching_cache(lm, clean)
    with torch.no_grad():  # a copy: `output_attentions` leaves hooks on the model it runs
        own = copy.deepcopy(lm)(clean, output_attentions=True).attentions
    for layer, weights in enumerate(own):
        pattern = clean_cache[f"blocks.{layer}.attn.hook_pattern"]
        torch.testing.assert_close(pattern, weights, atol=1e-6, rtol=1e-5)
        assert (pattern.sum(-1) < 1 - 1e-3).any()  # the sinks take a share


def test_attention_sinks_of_another_form_are_refused_for_scores_and_patterns():
    lm = copy.deepcopy(sharp_model("gpt_oss"))
    attention = _attention(_layers(lm)[0])
    # One sink per head still, as a column: the model's own attention reshapes it.
    attention.sinks = torch.nn.Parameter(attention.sinks.detach().reshape(-1, 1))
    clean, corrupted = prompts()
    with pytest.raises(PatchingError, match="GptOssAttention's attention takes s_aux"):
        run_with_patching_cache(lm, clean)
    _, clean_cache = run_with_patching_cache(
        lm, clean, names_filter=lambda name: "pattern" not in name and "scores" not in name
    )
    keys = safelens.get_act_patch_attn_head_k_by_pos(
        lm, corrupted, clean_cache, batched, progress=False
    )
    expected = hf_reference(
        lm, "k", [(0, 2, 1), (1, 4, 0)], clean, corrupted, torch.ones_like(clean)
    )
    assert (keys[0, 2, 1] - expected[0]).abs() <= TOL and (keys[1, 4, 0] - expected[1]).abs() <= TOL


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_head_bundles_stack_the_single_sweeps(name):
    lm = sharp_model(name)
    clean, corrupted = prompts()
    _, clean_cache = run_with_patching_cache(lm, clean)
    singles = {
        "get_act_patch_attn_head_all_pos_every": [
            "get_act_patch_attn_head_out_all_pos",
            "get_act_patch_attn_head_q_all_pos",
            "get_act_patch_attn_head_k_all_pos",
            "get_act_patch_attn_head_v_all_pos",
            "get_act_patch_attn_head_pattern_all_pos",
        ],
    }
    for bundle, sweeps in singles.items():
        got = getattr(safelens, bundle)(lm, corrupted, clean_cache, batched, progress=False)
        for row, sweep in zip(got, sweeps, strict=True):
            single = getattr(safelens, sweep)(lm, corrupted, clean_cache, batched, progress=False)
            assert (row[..., : single.shape[-1]] - single).abs().max() <= 1e-6, sweep
            assert not row[..., single.shape[-1] :].any()  # k and v: zeros past n_kv_heads
    by_pos = safelens.get_act_patch_attn_head_by_pos_every(
        lm, corrupted, clean_cache, batched, progress=False
    )
    assert by_pos.shape == (5, 2, 6, 4)
    pattern = safelens.get_act_patch_attn_head_pattern_by_pos(
        lm, corrupted, clean_cache, batched, progress=False
    )
    assert (by_pos[4] - pattern.transpose(-1, -2)).abs().max() <= 1e-6


@pytest.mark.parametrize(
    ("sweep", "activation", "setter", "columns", "indices"),
    [
        (
            "get_act_patch_attn_head_q_by_pos",
            "q",
            patching.layer_pos_head_vector_patch_setter,
            ["layer", "pos", "head_index"],
            [(0, 2, 1), (1, 4, 3)],
        ),
        (
            "get_act_patch_attn_head_out_by_pos",
            "z",
            patching.layer_pos_head_vector_patch_setter,
            ["layer", "pos", "head_index"],
            [(0, 2, 1), (1, 4, 3)],
        ),
        (
            "get_act_patch_resid_mid",
            "resid_mid",
            patching.layer_pos_patch_setter,
            ["layer", "pos"],
            [(0, 2), (1, 4)],
        ),
        (
            "get_act_patch_attn_head_pattern_by_pos",
            "pattern",
            patching.layer_head_pos_pattern_patch_setter,
            ["layer", "head_index", "dest_pos"],
            [(0, 1, 4), (1, 3, 2)],
        ),
    ],
)
def test_hf_sweeps_equal_transformer_lens_patching_on_a_bridge_of_the_same_weights(
    sweep, activation, setter, columns, indices
):
    """Queries after the rotary embedding (HF) against TransformerLens' `hook_q` before it."""
    lm, twin = reference("llama"), bridge("llama")
    clean, corrupted = prompts()
    _, clean_cache = run_with_patching_cache(lm, clean)
    got = getattr(safelens, sweep)(lm, corrupted, clean_cache, batched, progress=False)
    _, bridge_cache = twin.run_with_cache(clean)
    index_df = pd.DataFrame(indices, columns=columns)
    expected = patching.generic_activation_patch(
        twin, corrupted, bridge_cache, metric, setter, activation, index_df=index_df
    )
    assert (got[_cells(indices)] - expected).abs().max() <= TOL


def test_the_clean_cache_holds_every_site_in_transformer_lens_layout():
    lm = sharp_model("llama")
    clean, _ = prompts()
    logits, cache = run_with_patching_cache(lm, clean)
    assert torch.allclose(logits, lm(clean).logits, atol=1e-5)
    assert cache["blocks.1.attn.hook_q"].shape == (2, 6, 4, 8)  # [batch, pos, n_heads, d_head]
    assert cache["blocks.1.attn.hook_z"].shape == (2, 6, 4, 8)
    for name in ("hook_pattern", "hook_attn_scores"):
        assert cache[f"blocks.1.attn.{name}"].shape == (2, 4, 6, 6)
    pattern = cache["blocks.0.attn.hook_pattern"]
    assert torch.allclose(pattern.sum(-1), torch.ones(2, 4, 6))
    assert not pattern.triu(1).any()  # causal
    assert torch.allclose(cache["blocks.0.attn.hook_attn_scores"].softmax(-1), pattern)
    assert torch.equal(cache["blocks.0.hook_resid_post"], cache["blocks.1.hook_resid_pre"])
    mid = cache["blocks.0.hook_resid_pre"] + cache["blocks.0.hook_attn_out"]
    assert torch.allclose(cache["blocks.0.hook_resid_mid"], mid, atol=1e-6)
    kept = run_with_patching_cache(lm, clean, names_filter=lambda name: "hook_q" in name)[1]
    assert sorted(kept) == ["blocks.0.attn.hook_q", "blocks.1.attn.hook_q"]
    with pytest.raises(PatchingError, match="names_filter must be a name, a list of names"):
        run_with_patching_cache(lm, clean, names_filter=[3])


# -- generic_activation_patch on plain HuggingFace models ---------------------------------


def smear_tail(corrupted_activation, index, clean_activation):
    """A new tensor, clean from position `pos` on (a setter that does not edit in place)."""
    layer, pos = index
    return torch.cat([corrupted_activation[:, :pos], clean_activation[:, pos:]], dim=1)


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma2"])
def test_generic_on_hf_equals_a_loop_of_hooked_forwards(name, monkeypatch):
    lm = sharp_model(name)
    clean, corrupted = prompts()
    _, clean_cache = run_with_patching_cache(lm, clean)

    def generic(activation, setter, columns, indices):
        index_df = pd.DataFrame(indices, columns=columns)
        return safelens.generic_activation_patch(
            lm, corrupted, clean_cache, metric, setter, activation, index_df=index_df
        )

    vectors = [(0, 2, 1), (1, 4, 3)]
    for activation in ("q", "z"):
        got = generic(
            activation,
            patching.layer_pos_head_vector_patch_setter,
            ["layer", "pos", "head_index"],
            vectors,
        )
        expected = vector_reference(lm, activation, vectors, clean, corrupted)
        assert (got - expected).abs().max() <= TOL, activation
    got = generic("resid_mid", smear_tail, ["layer", "pos"], [(0, 2), (1, 4)])
    tails = [(0, slice(2, None)), (1, slice(4, None))]
    assert (got - resid_mid_reference(lm, tails, clean, corrupted)).abs().max() <= TOL
    heads = [(0, 1), (1, 3)]
    expected = pattern_reference(
        lm, [(*head, None, None) for head in heads], clean, corrupted, monkeypatch
    )
    for activation in ("pattern", "attn_scores"):  # a head's scores give its pattern
        got = generic(
            activation, patching.layer_head_pattern_patch_setter, ["layer", "head_index"], heads
        )
        assert (got - expected).abs().max() <= TOL, activation
    monkeypatch.undo()
    # resid_post of layer 0 is resid_pre of layer 1
    got = generic("resid_post", patching.layer_pos_patch_setter, ["layer", "pos"], [(0, 2), (0, 4)])
    expected = hf_reference(
        lm, "resid_pre", [(1, 2), (1, 4)], clean, corrupted, torch.ones_like(clean)
    )
    assert (got - expected).abs().max() <= TOL
    keys = [(0, 2, 1), (1, 4, 0)]
    got = generic(
        "k", patching.layer_pos_head_vector_patch_setter, ["layer", "pos", "head_index"], keys
    )
    expected = hf_reference(lm, "k", keys, clean, corrupted, torch.ones_like(clean))
    assert (got - expected).abs().max() <= TOL
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in lm.modules())


def test_a_family_whose_attention_skips_the_attention_functions_is_refused_its_queries():
    """Falcon computes attention itself up to transformers 5.24: no q or pattern there.

    Later versions route it through `ALL_ATTENTION_FUNCTIONS`, and its q sweep runs.
    """
    import inspect

    config = OTHER_ATTENTION["falcon"]
    config.update(dict(vocab_size=50, bos_token_id=0, eos_token_id=None, pad_token_id=None))
    torch.manual_seed(0)
    lm = transformers.AutoModelForCausalLM.from_config(config).eval()
    forward = inspect.unwrap(type(lm.transformer.h[0].self_attention).forward)
    routed = "ALL_ATTENTION_FUNCTIONS" in forward.__code__.co_names
    clean, corrupted = prompts()
    _, clean_cache = run_with_patching_cache(lm, clean)
    assert ("blocks.0.attn.hook_q" in clean_cache) == routed
    assert "blocks.0.attn.hook_z" in clean_cache
    for sweep in ("get_act_patch_attn_head_q_by_pos", "get_act_patch_attn_head_pattern_by_pos"):
        if routed:
            getattr(safelens, sweep)(lm, corrupted, clean_cache, batched, progress=False)
            continue
        with pytest.raises(PatchingError, match="FalconAttention computes its attention without"):
            getattr(safelens, sweep)(lm, corrupted, clean_cache, batched, progress=False)
    with pytest.raises(PatchingError, match=r"in parallel .*\(parallel_attn=True\)"):
        safelens.get_act_patch_resid_mid(lm, corrupted, clean_cache, batched, progress=False)
    got = safelens.get_act_patch_attn_head_out_by_pos(
        lm, corrupted, clean_cache, batched, progress=False
    )
    assert got.shape == (2, 6, 4)


def test_threads_patching_queries_and_patterns_meanwhile_leave_each_other_alone():
    """The attention-function seam acts on its own thread: other passes run as they would."""
    import threading

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    lm = sharp_model("llama")
    clean, corrupted = prompts()
    _, clean_cache = run_with_patching_cache(lm, clean)
    sweeps = ("get_act_patch_attn_head_q_by_pos", "get_act_patch_attn_head_pattern_all_pos")
    serial = {
        sweep: getattr(safelens, sweep)(lm, corrupted, clean_cache, batched, progress=False)
        for sweep in sweeps
    }
    with torch.no_grad():
        plain = lm(corrupted).logits
    results, errors, plains = {}, [], []

    def sweep_in_thread(sweep):
        try:
            results[sweep] = getattr(safelens, sweep)(
                lm, corrupted, clean_cache, batched, progress=False
            )
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    def forward_in_thread():
        with torch.no_grad():
            for _ in range(5):
                plains.append(lm(corrupted).logits)

    threads = [threading.Thread(target=sweep_in_thread, args=(sweep,)) for sweep in sweeps]
    threads.append(threading.Thread(target=forward_in_thread))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for sweep in sweeps:
        assert torch.equal(results[sweep], serial[sweep]), sweep
    assert all((logits - plain).abs().max() <= 1e-6 for logits in plains)
    assert "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping  # the seam is gone


def test_bridge_resid_mid_is_the_residual_streams_in_either_grad_mode():
    """With autograd on (outside the suite's `no_grad`), `transformer_lens.patching`'s
    `resid_mid` on this bridge gives numbers near the corrupted run's (cell (0, 2):
    -0.1275 where the patched stream gives -0.1206); safelens' sweep patches the stream
    in both modes, as on the plain model."""
    lm, twin = reference("llama"), bridge("llama")
    clean, corrupted = prompts()
    _, bridge_cache = twin.run_with_cache(clean)
    indices = [(0, 2), (1, 4), (1, 5)]
    expected = resid_mid_reference(lm, indices, clean, corrupted)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            got = safelens.get_act_patch_resid_mid(
                twin, corrupted, bridge_cache, metric, progress=False
            )
        assert (got[_cells(indices)] - expected).abs().max() <= TOL, grad
    assert (expected - expected[0]).abs().max() > 1e-3  # the patches matter
