"""The patching sweeps on a TransformerBridge and on plain HuggingFace causal LMs.

References: on a bridge, `transformer_lens.patching` itself on the same bridge (one
`run_with_hooks` per patch, TransformerLens' pre-rotary `attn.hook_k`, where safelens
patches the post-rotary keys at the cache seam); on a plain HuggingFace model, a loop
written here of one torch-hooked forward per patch, patching keys at `k_proj` (before
the rotary embedding) and the rest at module inputs and outputs, without safelens.
Tiny random-weight models: Llama (grouped-query, rotary), GPT-2 (raw keys) and
Gemma-2 (sliding window, soft-capping); plain and left-padded prompts. Runs in both CI
environments (TransformerLens 3.9 and 4.x).
"""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import transformers
from bridge_models import bridge
from devices import TOLERANCE
from hf_models import ids, model
from transformer_lens import patching

import safelens
from safelens import PatchingError, run_with_patching_cache
from safelens.backends.hf._seams import ATTENTION_MODULES
from safelens.patching import _hf_passes

TOL = 1e-4
ANSWER, WRONG = 3, 5


def _own_hooks(module: torch.nn.Module) -> list:
    """`module`'s forward hooks, without the output-capturing ones transformers itself
    installs for good on the first call with `output_attentions` (any caller's)."""
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    return [h for h in hooks if "install_output_capuring_hook" not in h.__qualname__]


def metric(logits: torch.Tensor) -> torch.Tensor:
    """TransformerLens-style: one run's logits to a scalar."""
    return (logits[:, -1, ANSWER] - logits[:, -1, WRONG]).mean()


def batched(batch: int):
    def per_run(logits: torch.Tensor) -> torch.Tensor:
        return (logits[:, -1, ANSWER] - logits[:, -1, WRONG]).reshape(-1, batch).mean(-1)

    return per_run


def prompts(batch: int, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(clean, corrupted) prompts of 6 tokens, differing at positions 2 and 4."""
    clean = ids(batch, 6, seed=3)
    if padded:
        clean[0, :2] = 0  # left padding (pad id 0) in the first row
    corrupted = clean.clone()
    corrupted[:, 2] = 9
    corrupted[:, 4] = 11
    return clean, corrupted


# sweep: (activation, TransformerLens' setter, index columns, indices checked)
BY_POS_HEAD = (["layer", "pos", "head_index"], [(0, 2, 1), (1, 5, 0)])
BY_POS = (["layer", "pos"], [(0, 2), (1, 4)])
ALL_POS = (["layer", "head_index"], [(0, 1), (1, 0)])
SWEEPS = {
    "get_act_patch_attn_head_k_by_pos": (
        "k",
        patching.layer_pos_head_vector_patch_setter,
        *BY_POS_HEAD,
    ),
    "get_act_patch_attn_head_v_by_pos": (
        "v",
        patching.layer_pos_head_vector_patch_setter,
        *BY_POS_HEAD,
    ),
    "get_act_patch_attn_head_q_by_pos": (
        "q",
        patching.layer_pos_head_vector_patch_setter,
        *BY_POS_HEAD,
    ),
    "get_act_patch_attn_head_out_by_pos": (
        "z",
        patching.layer_pos_head_vector_patch_setter,
        *BY_POS_HEAD,
    ),
    "get_act_patch_resid_pre": ("resid_pre", patching.layer_pos_patch_setter, *BY_POS),
    "get_act_patch_resid_mid": ("resid_mid", patching.layer_pos_patch_setter, *BY_POS),
    "get_act_patch_attn_out": ("attn_out", patching.layer_pos_patch_setter, *BY_POS),
    "get_act_patch_mlp_out": ("mlp_out", patching.layer_pos_patch_setter, *BY_POS),
    "get_act_patch_attn_head_k_all_pos": ("k", patching.layer_head_vector_patch_setter, *ALL_POS),
    "get_act_patch_attn_head_out_all_pos": ("z", patching.layer_head_vector_patch_setter, *ALL_POS),
}


def checked(result: torch.Tensor, sweep: str) -> torch.Tensor:
    """A full sweep's values at the indices checked against TransformerLens."""
    return result[tuple(torch.tensor(SWEEPS[sweep][3]).T)]


def transformer_lens_patching(lm, sweep, corrupted, clean_cache):
    """`transformer_lens.patching` at the sweep's checked indices: one run_with_hooks each."""
    activation, setter, columns, indices = SWEEPS[sweep]
    index_df = pd.DataFrame(indices, columns=columns)
    return patching.generic_activation_patch(
        lm, corrupted, clean_cache, metric, setter, activation, index_df=index_df
    )


@pytest.mark.parametrize(
    ("name", "padded", "sweeps"),
    [
        ("llama", False, list(SWEEPS)),
        ("gpt2", False, ["get_act_patch_attn_head_k_by_pos", "get_act_patch_attn_head_v_by_pos"]),
        ("llama", True, ["get_act_patch_attn_head_k_by_pos"]),
    ],
)
def test_bridge_sweeps_equal_transformer_lens_patching(name, padded, sweeps):
    """On the bridge, TransformerLens' forward takes left padding as tokens; so do the sweeps."""
    lm = bridge(name)
    clean, corrupted = prompts(2, padded)
    _, clean_cache = lm.run_with_cache(clean)
    for sweep in sweeps:
        got = getattr(safelens, sweep)(lm, corrupted, clean_cache, batched(2), progress=False)
        expected = transformer_lens_patching(lm, sweep, corrupted, clean_cache)
        assert got.shape[0] == 2, sweep
        assert (checked(got, sweep) - expected).abs().max() <= TOL, sweep
        assert (got - got.flatten()[0]).abs().max() > 1e-6, sweep  # the patches matter


def test_bridge_sweep_takes_a_transformer_lens_style_metric_and_max_batch():
    lm = bridge("llama")
    clean, corrupted = prompts(1, False)
    _, clean_cache = lm.run_with_cache(clean)
    sweep = "get_act_patch_attn_head_v_by_pos"
    expected = transformer_lens_patching(lm, sweep, corrupted, clean_cache)
    got = safelens.get_act_patch_attn_head_v_by_pos(
        lm, corrupted, clean_cache, metric, max_batch=5, progress=False
    )
    assert got.shape == (2, 6, 2)  # n_kv_heads under grouped-query attention
    assert (checked(got, sweep) - expected).abs().max() <= TOL


def test_bridge_sweep_batches_patches_and_leaves_no_hooks(monkeypatch):
    lm = bridge("llama")
    clean, corrupted = prompts(1, False)
    _, clean_cache = lm.run_with_cache(clean)
    passes = []
    forward = lm.forward

    def counted(*args, **kwargs):  # not a hook: a hook would make every pass run whole
        passes.append(1)
        return forward(*args, **kwargs)

    patched = []
    logits = _hf_passes.Pass.logits

    def counted_patched(self, *args, **kwargs):
        patched.append(self.backend.family)
        return logits(self, *args, **kwargs)

    monkeypatch.setattr(_hf_passes.Pass, "logits", counted_patched)
    lm.forward = counted
    try:
        safelens.get_act_patch_attn_head_k_by_pos(
            lm, corrupted, clean_cache, batched(1), progress=False
        )
    finally:
        del lm.forward
    # 2 layers * 6 positions * 2 heads = 24 patches: one corrupted pass through the bridge
    # (then again on its plain HuggingFace model, which runs the rest), three passes that
    # check the layer-skipping and staggered shortcuts, and one pass for every patch
    # (each run entering at its layer; on a model this small one pass covers every
    # position), not one per patch.
    assert len(passes) == 1
    assert patched == ["hf"] * 4
    assert all(not point._forward_hooks for point in lm.hook_dict.values())


# -- plain HuggingFace models: against a loop of torch-hooked forwards -------------------


def _layers(lm):
    if hasattr(lm, "gpt_neox"):
        return lm.gpt_neox.layers
    if hasattr(lm, "transformer"):
        return lm.transformer.h
    return lm.model.decoder.layers if hasattr(lm.model, "decoder") else lm.model.layers  # OPT


def _d_head(lm) -> int:
    config = lm.config
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _keys_values(lm, layer: int, activation: str):
    """(module, first column of its output) holding `activation` of every key/value head, pre-rotary."""
    block = _layers(lm)[layer]
    if hasattr(block, "attn"):  # GPT-2: c_attn gives [q | k | v]
        d_model = lm.config.n_embd
        return block.attn.c_attn, d_model if activation == "k" else 2 * d_model
    attn = block.self_attn
    if hasattr(attn, "qkv_proj"):  # Phi-3: qkv_proj gives [q | k | v], k and v of KV heads
        config = lm.config
        queries = config.num_attention_heads * _d_head(lm)
        keys = config.num_key_value_heads * _d_head(lm)
        return attn.qkv_proj, queries if activation == "k" else queries + keys
    return (attn.k_proj if activation == "k" else attn.v_proj), 0


def _site(lm, activation: str, layer: int):
    """(module, pre-hook?, head width or 0, column offset) of a sweep's activation."""
    block = _layers(lm)[layer]
    if activation in ("k", "v"):
        module, offset = _keys_values(lm, layer, activation)
        return module, False, _d_head(lm), offset
    if activation == "resid_pre":
        return block, True, 0, 0
    child = {"attn_out": ATTENTION_MODULES, "mlp_out": ("mlp",)}[activation]
    return next(getattr(block, c) for c in child if hasattr(block, c)), False, 0, 0


def _forward(lm, tokens, mask, hooks):
    """Logits of one plain forward with torch hooks `[(module, pre, fn)]`, positions from `mask`."""
    handles = []
    for module, pre, fn in hooks:
        if pre:
            handles.append(
                module.register_forward_pre_hook(
                    lambda m, args, kwargs, fn=fn: (
                        ((fn(args[0]), *args[1:]), kwargs)
                        if args
                        else (args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])})
                    ),
                    with_kwargs=True,
                )
            )
        else:

            def out_hook(m, args, output, fn=fn):
                if isinstance(output, tuple):
                    return (fn(output[0]), *output[1:])
                return fn(output)

            handles.append(module.register_forward_hook(out_hook))
    try:
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        return lm(tokens, attention_mask=mask, position_ids=positions).logits
    finally:
        for handle in handles:
            handle.remove()


def reference(lm, activation, indices, clean, corrupted, mask):
    """One torch-hooked forward per index, clean activations captured by the same hooks.

    An index is `(layer, pos, head)`, `(layer, pos)` or `(layer, head)` as the sweep's.
    """
    n_layers = lm.config.num_hidden_layers
    captured = {}
    hooks = []
    for layer in range(n_layers):
        module, pre, _, _ = _site(lm, activation, layer)
        # A copy kept, the tensor itself handed on: Falcon adds attention to its MLP's
        # output in place, which would change a copy handed on as the output.
        hooks.append(
            (module, pre, lambda t, layer=layer: (captured.setdefault(layer, t.clone()), t)[1])
        )
    _forward(lm, clean, mask, hooks)
    values = []
    for index in indices:
        layer = index[0]
        module, pre, d_head, offset = _site(lm, activation, layer)
        pos = index[1] if len(index) == 3 or not d_head else slice(None)
        if d_head:
            first = offset + index[-1] * d_head
            columns = slice(first, first + d_head)
        else:
            columns = slice(None)

        def patch(tensor, layer=layer, pos=pos, columns=columns):
            tensor = tensor.clone()
            tensor[:, pos, columns] = captured[layer][:, pos, columns]
            return tensor

        values.append(metric(_forward(lm, corrupted, mask, [(module, pre, patch)])))
    return torch.stack(values)


HEADS = [(0, 2, 1), (1, 5, 0)]
POSITIONS = [(0, 2), (1, 4)]
HF_SWEEPS = [
    ("get_act_patch_attn_head_k_by_pos", "k", HEADS),
    ("get_act_patch_attn_head_v_by_pos", "v", HEADS),
    ("get_act_patch_resid_pre", "resid_pre", POSITIONS),
    ("get_act_patch_attn_out", "attn_out", POSITIONS),
    ("get_act_patch_mlp_out", "mlp_out", POSITIONS),
    ("get_act_patch_attn_head_k_all_pos", "k", [(0, 1), (1, 0)]),
    ("get_act_patch_attn_head_v_all_pos", "v", [(0, 0), (1, 1)]),
]


@pytest.mark.parametrize(
    ("name", "padded", "dtype"),
    [
        ("llama", False, "float32"),
        ("llama", True, "float32"),
        ("gpt2", True, "float32"),
        ("gemma2", False, "float32"),
        ("gpt_oss", True, "float32"),
        ("llama", True, "bfloat16"),
    ],
)
def test_hf_sweeps_equal_a_loop_of_hooked_forwards(name, padded, dtype, monkeypatch):
    """Keys patched post-rotary at the cache seam equal keys patched pre-rotary at k_proj."""
    lm = model(name, getattr(torch, dtype))
    tol = TOL if dtype == "float32" else TOLERANCE[torch.bfloat16]["atol"]
    clean, corrupted = prompts(2, padded)
    mask = torch.ones_like(clean)
    if padded:
        monkeypatch.setattr(lm, "tokenizer", SimpleNamespace(pad_token_id=0), raising=False)
        mask[0, :2] = 0
    _, clean_cache = run_with_patching_cache(lm, clean)
    for sweep, activation, indices in HF_SWEEPS:
        got = getattr(safelens, sweep)(lm, corrupted, clean_cache, batched(2), progress=False)
        expected = reference(lm, activation, indices, clean, corrupted, mask)
        assert (got[tuple(torch.tensor(indices).T)] - expected).abs().max() <= tol, sweep
        # The patches matter (in bfloat16, a whole key/value head's effect on this tiny
        # model is below the metric's resolution; per-position patches still show).
        if dtype == "float32" or "all_pos" not in sweep:
            assert (got - got.flatten()[0]).abs().max() > 1e-6, sweep
    assert not any(_own_hooks(m) for m in lm.modules())


def test_hf_clean_cache_holds_what_the_sweeps_patch():
    lm = model("llama")
    tokens = ids(2, 5)
    logits, clean_cache = run_with_patching_cache(lm, tokens)
    assert torch.allclose(logits, lm(tokens).logits, atol=1e-5)
    assert clean_cache["model.layers.1.kv_cache.hook_k_new"].shape == (2, 2, 5, 8)
    for name in ("hook_resid_pre", "hook_attn_out", "hook_mlp_out"):
        assert clean_cache[f"blocks.1.{name}"].shape == (2, 5, 32)


# -- bad input ----------------------------------------------------------------------------


def test_hf_sweeps_refuse_resid_mid_where_attention_and_mlp_run_in_parallel():
    """GPT-NeoX (parallel residual) has no residual stream between attention and MLP."""
    config = OTHER_ATTENTION["gpt_neox"]
    config.update(dict(vocab_size=50, bos_token_id=0, eos_token_id=None, pad_token_id=None))
    lm = transformers.AutoModelForCausalLM.from_config(config).eval()
    clean, corrupted = prompts(1, False)
    _, clean_cache = run_with_patching_cache(lm, clean)
    assert "blocks.0.hook_resid_mid" not in clean_cache
    with pytest.raises(PatchingError, match=r"in parallel .*use_parallel_residual=True"):
        safelens.get_act_patch_resid_mid(lm, corrupted, clean_cache, batched(1), progress=False)


def test_sweeps_name_a_clean_cache_that_does_not_fit():
    lm = model("llama")
    clean, corrupted = prompts(1, False)
    _, clean_cache = run_with_patching_cache(lm, clean)
    sweep = safelens.get_act_patch_attn_head_k_by_pos
    with pytest.raises(PatchingError, match=r"clean_cache has no activation 'model.layers.0.kv_"):
        sweep(lm, corrupted, {}, batched(1), progress=False)
    with pytest.raises(PatchingError, match=r"expected \[batch=1, 2, 5, 8\].*same length"):
        sweep(lm, corrupted[:, :5], clean_cache, batched(1), progress=False)
    with pytest.raises(PatchingError, match="max_batch"):
        sweep(lm, corrupted, clean_cache, batched(1), max_batch=0)
    with pytest.raises(safelens.TokenError, match="corrupted_tokens"):
        sweep(lm, corrupted + 100, clean_cache, batched(1), progress=False)
    with pytest.raises(PatchingError, match=r"patching_metric returned shape \(3,\)"):
        sweep(lm, corrupted, clean_cache, lambda logits: torch.zeros(3), progress=False)


def test_run_with_patching_cache_refuses_a_bridge():
    with pytest.raises(PatchingError, match=r"bridge.run_with_cache\(clean_tokens\)"):
        run_with_patching_cache(bridge("llama"), ids(1, 4))


def test_generic_activation_patch_names_a_clean_cache_without_the_activation():
    lm = model("llama")
    clean, corrupted = prompts(1, False)
    with pytest.raises(
        PatchingError, match="clean_cache has no activation 'blocks.0.hook_resid_pre'"
    ):
        safelens.generic_activation_patch(
            lm, corrupted, {}, batched(1), lambda a, i, c: a, "resid_pre", ["layer", "pos"]
        )


def test_a_sweep_interrupted_inside_a_patched_pass_leaves_no_hooks_behind():
    lm = model("llama")
    clean, corrupted = prompts(1, False)
    _, clean_cache = run_with_patching_cache(lm, clean)
    calls = []

    def interrupt(module, args, output):
        calls.append(1)
        if len(calls) == 2:  # the first patched pass, after the corrupted one
            raise KeyboardInterrupt

    handle = lm.lm_head.register_forward_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            safelens.get_act_patch_resid_pre(lm, corrupted, clean_cache, batched(1), progress=False)
    finally:
        handle.remove()
    assert len(calls) == 2
    assert not any(_own_hooks(m) for m in lm.modules())


def test_a_family_without_an_mlp_module_gets_every_other_sweep(monkeypatch):
    """OPT computes its MLP in the decoder layer itself: no `mlp_out`, the rest as usual."""
    config = transformers.OPTConfig(
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        max_position_embeddings=64,
        vocab_size=50,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    lm = transformers.OPTForCausalLM(config).eval()
    clean, corrupted = ids(2, 7, seed=3), ids(2, 7, seed=4)
    mask = torch.ones_like(clean)
    logits, clean_cache = run_with_patching_cache(lm, clean)
    assert torch.allclose(logits, lm(clean).logits, atol=1e-5)
    assert not any("mlp_out" in name for name in clean_cache)
    for name, activation, indices in HF_SWEEPS:
        sweep = getattr(safelens, name)
        if activation == "mlp_out":
            with pytest.raises(PatchingError, match="has no mlp or block_sparse_moe or ffn module"):
                sweep(lm, corrupted, clean_cache, metric, progress=False)
            continue
        got = sweep(lm, corrupted, clean_cache, metric, progress=False)
        if "all_pos" in name:
            continue  # every position of a head: the by-position sweeps cover the site
        expected = reference(lm, activation, indices, clean, corrupted, mask)
        assert (got[tuple(torch.tensor(indices).T)] - expected).abs().max() <= TOL, name


OTHER_ATTENTION = {
    "gpt_neox": transformers.GPTNeoXConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    ),
    "falcon": transformers.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
}


@pytest.mark.parametrize("name", OTHER_ATTENTION)
def test_families_that_name_their_attention_otherwise_get_the_module_sweeps(name):
    """GPT-NeoX's `attention` and Falcon's `self_attention`: their output is `attn_out`."""
    config = OTHER_ATTENTION[name]
    config.update(dict(vocab_size=50, bos_token_id=0, eos_token_id=None, pad_token_id=None))
    torch.manual_seed(0)
    lm = transformers.AutoModelForCausalLM.from_config(config).eval()
    clean, corrupted = ids(2, 7, seed=3), ids(2, 7, seed=4)
    mask = torch.ones_like(clean)
    _, clean_cache = run_with_patching_cache(lm, clean)
    for sweep_name, activation, indices in HF_SWEEPS:
        if activation not in ("resid_pre", "attn_out", "mlp_out"):
            continue  # keys and values: their joint projection has no reference hook here
        got = getattr(safelens, sweep_name)(lm, corrupted, clean_cache, metric, progress=False)
        expected = reference(lm, activation, indices, clean, corrupted, mask)
        assert (got[tuple(torch.tensor(indices).T)] - expected).abs().max() <= TOL, sweep_name
        assert (got - got.flatten()[0]).abs().max() > 1e-6, sweep_name
