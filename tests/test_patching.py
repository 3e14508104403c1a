"""The cached sweeps against transformer_lens.patching on real models."""

from __future__ import annotations

import itertools
import threading

import pandas as pd
import pytest
import torch
import transformer_lens.patching as tl_patching
from devices import DTYPES, TOLERANCE
from models import D_VOCAB, make_model, tokens
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformers import PreTrainedTokenizerFast

import safelens
from safelens import PatchingError, TokenError, logit_diff_metric

SWEEPS = [
    "get_act_patch_resid_pre",
    "get_act_patch_attn_out",
    "get_act_patch_mlp_out",
    "get_act_patch_attn_head_out_by_pos",
    "get_act_patch_attn_head_q_by_pos",
    "get_act_patch_attn_head_k_by_pos",
    "get_act_patch_attn_head_v_by_pos",
    "get_act_patch_attn_head_out_all_pos",
    "get_act_patch_attn_head_q_all_pos",
    "get_act_patch_attn_head_k_all_pos",
    "get_act_patch_attn_head_v_all_pos",
]
MODELS = {"standard": ("standard", None), "rotary-gqa": ("rotary", 2)}


def setup(kind: str, batch: int = 1, length: int = 6, dtype: torch.dtype = torch.float32):
    model = make_model(*MODELS[kind], dtype=dtype)
    clean, corrupted = tokens(batch, length, seed=1), tokens(batch, length, seed=2)
    clean_logits, clean_cache = model.run_with_cache(clean)
    corrupted_logits = model(corrupted)
    metric = logit_diff_metric(clean_logits, corrupted_logits, 3, torch.arange(batch) + 5)
    return model, corrupted, clean_cache, metric


CASES = [("rotary-gqa", name) for name in SWEEPS] + [
    ("standard", name) for name in SWEEPS if "by_pos" in name or "resid" in name
]


@pytest.mark.parametrize(("kind", "name"), CASES)
def test_sweep_equals_transformer_lens(kind: str, name: str) -> None:
    model, corrupted, clean_cache, metric = setup(kind, length=6)
    expected = getattr(tl_patching, name)(model, corrupted, clean_cache, metric)
    result = getattr(safelens, name)(model, corrupted, clean_cache, metric, progress=False)
    assert result.shape == expected.shape
    assert result.dtype == expected.dtype and result.device == expected.device
    assert expected.std() > 0
    torch.testing.assert_close(result, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", [name for name in SWEEPS if "_k_" in name or "_v_" in name])
def test_key_value_sweeps_equal_transformer_lens_in_each_dtype(name: str, dtype) -> None:
    model, corrupted, clean_cache, metric = setup("rotary-gqa", length=6, dtype=dtype)
    expected = getattr(tl_patching, name)(model, corrupted, clean_cache, metric)
    result = getattr(safelens, name)(model, corrupted, clean_cache, metric, progress=False)
    assert expected.std() > 0
    torch.testing.assert_close(result, expected, **TOLERANCE[dtype])


def every_position(logits: torch.Tensor) -> torch.Tensor:
    """A batched metric that reads the logits at every position (no shortcut declared)."""
    return logits[..., 3].sum(-1) - logits[..., 5].mean(-1)


@pytest.mark.parametrize(("kind", "name"), CASES)
def test_sweep_with_a_metric_of_every_position_equals_transformer_lens(
    kind: str, name: str
) -> None:
    model, corrupted, clean_cache, _ = setup(kind, length=6)
    expected = getattr(tl_patching, name)(model, corrupted, clean_cache, every_position)
    result = getattr(safelens, name)(model, corrupted, clean_cache, every_position, progress=False)
    assert expected.std() > 0
    torch.testing.assert_close(result, expected, atol=1e-4, rtol=0)


def test_grouped_query_keys_index_kv_heads() -> None:
    model, corrupted, clean_cache, metric = setup("rotary-gqa")
    result = safelens.get_act_patch_attn_head_k_by_pos(
        model, corrupted, clean_cache, metric, progress=False
    )
    assert result.shape == (2, 6, 2)

    def patch(tensor: torch.Tensor, hook: object) -> torch.Tensor:
        tensor[:, 3, 1] = clean_cache["blocks.1.attn.hook_k"][:, 3, 1]
        return tensor

    logits = model.run_with_hooks(corrupted, fwd_hooks=[("blocks.1.attn.hook_k", patch)])
    torch.testing.assert_close(result[1, 3, 1], metric(logits)[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["get_act_patch_attn_head_v_by_pos", "get_act_patch_resid_pre"])
def test_batch_of_prompts_and_small_batches(name: str) -> None:
    model, corrupted, clean_cache, metric = setup("rotary-gqa", batch=2, length=5)
    expected = getattr(tl_patching, name)(model, corrupted, clean_cache, metric)
    result = getattr(safelens, name)(
        model, corrupted, clean_cache, metric, max_batch=3, progress=False
    )
    torch.testing.assert_close(result, expected, atol=1e-4, rtol=0)


def test_scalar_metric_is_called_per_run() -> None:
    model, corrupted, clean_cache, _ = setup("standard")

    def scalar_metric(logits: torch.Tensor) -> torch.Tensor:
        assert logits.shape[0] == 1
        return logits[0, -1].log_softmax(-1)[3]

    expected = tl_patching.get_act_patch_attn_head_q_by_pos(
        model, corrupted, clean_cache, scalar_metric
    )
    result = safelens.get_act_patch_attn_head_q_by_pos(
        model,
        corrupted,
        clean_cache,
        lambda logits: logits[:, -1].log_softmax(-1)[:, 3].mean(),
        progress=False,
    )
    assert result.shape == expected.shape
    per_run = safelens.get_act_patch_attn_head_q_by_pos(
        model, corrupted, clean_cache, lambda x: x[:, -1].log_softmax(-1)[0, 3], progress=False
    )
    torch.testing.assert_close(per_run, expected, atol=1e-4, rtol=0)


def test_memory_budget_bounds_the_batch_without_changing_numbers() -> None:
    model, corrupted, clean_cache, metric = setup("standard")
    wide = safelens.get_act_patch_attn_head_out_by_pos(
        model, corrupted, clean_cache, metric, progress=False
    )
    narrow = safelens.get_act_patch_attn_head_out_by_pos(
        model, corrupted, clean_cache, metric, max_bytes=1, progress=False
    )
    torch.testing.assert_close(narrow, wide, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", MODELS)
def test_generic_with_index_df_equals_transformer_lens(kind: str) -> None:
    model, corrupted, clean_cache, metric = setup(kind)
    index_df = pd.DataFrame({"layer": [1, 0, 1], "pos": [5, 2, 0]})

    def setter(corrupted_act, index, clean_act):
        layer, pos = index
        corrupted_act[:, pos:] = 0.5 * (corrupted_act[:, pos:] + clean_act[:, pos:])
        return corrupted_act

    expected = tl_patching.generic_activation_patch(
        model, corrupted, clean_cache, metric, setter, "resid_mid", index_df=index_df
    )
    result, df = safelens.generic_activation_patch(
        model,
        corrupted,
        clean_cache,
        metric,
        setter,
        "resid_mid",
        index_df=index_df,
        return_index_df=True,
        progress=False,
    )
    assert df is index_df
    torch.testing.assert_close(result, expected, atol=1e-4, rtol=0)


def test_patching_identical_activations_is_a_no_op() -> None:
    model = make_model("rotary", 2)
    corrupted = tokens(1, 6, seed=2)
    logits, cache = model.run_with_cache(corrupted)
    metric = lambda x: x[:, -1, 3]  # noqa: E731
    result = safelens.get_act_patch_attn_head_k_by_pos(
        model, corrupted, cache, metric, progress=False
    )
    torch.testing.assert_close(result, logits[0, -1, 3].expand_as(result), atol=1e-5, rtol=0)


def test_errors_name_the_argument() -> None:
    model, corrupted, clean_cache, metric = setup("standard")
    with pytest.raises(TokenError, match="corrupted_tokens must hold integer token ids"):
        safelens.get_act_patch_resid_pre(model, corrupted.float(), clean_cache, metric)
    with pytest.raises(PatchingError, match="same length"):
        safelens.get_act_patch_resid_pre(model, corrupted[:, :4], clean_cache, metric)
    with pytest.raises(PatchingError, match="no activation 'blocks.0.hook_resid_pre'"):
        safelens.get_act_patch_resid_pre(model, corrupted, {}, metric)
    with pytest.raises(PatchingError, match=r"returned shape \(2,\)"):
        safelens.get_act_patch_resid_pre(
            model, corrupted, clean_cache, lambda x: x[:, -1, :2].sum(0), progress=False
        )
    with pytest.raises(PatchingError, match="max_batch must be a positive int"):
        safelens.get_act_patch_resid_pre(model, corrupted, clean_cache, metric, max_batch=0)
    with pytest.raises(PatchingError, match="exactly one of index_axis_names"):
        safelens.generic_activation_patch(
            model, corrupted, clean_cache, metric, lambda a, i, c: a, "resid_pre"
        )


def test_sweep_removes_only_its_own_hooks() -> None:
    model, corrupted, clean_cache, metric = setup("rotary-gqa")
    seen: list[str] = []
    model.add_hook("blocks.1.attn.hook_k", lambda tensor, hook: seen.append(hook.name))
    try:
        safelens.get_act_patch_attn_head_k_by_pos(
            model, corrupted, clean_cache, metric, progress=False
        )
        assert len(model.hook_dict["blocks.1.attn.hook_k"].fwd_hooks) == 1
        assert seen  # the user's hook saw the sweep's forward passes
        assert not model.hook_dict["blocks.0.attn.hook_k"].fwd_hooks
    finally:
        model.reset_hooks()


class LastPositionRecorder:
    """`logit_diff_metric` that records the logits' shapes it is given."""

    def __init__(self, metric, last_position_only) -> None:
        self.metric = metric
        self.last_position_only = last_position_only
        self.shapes: set[tuple[int, ...]] = set()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        self.shapes.add(tuple(logits.shape[1:]))
        return self.metric(logits)


@pytest.mark.parametrize("name", SWEEPS)
def test_a_declared_last_position_metric_gets_only_the_last_position(name: str) -> None:
    model, corrupted, clean_cache, metric = setup("rotary-gqa", length=6)
    expected = getattr(tl_patching, name)(model, corrupted, clean_cache, metric)
    declared = LastPositionRecorder(metric, True)
    result = getattr(safelens, name)(model, corrupted, clean_cache, declared, progress=False)
    torch.testing.assert_close(result, expected, atol=1e-4, rtol=0)
    assert declared.shapes == {(1, model.cfg.d_vocab)}
    undeclared = LastPositionRecorder(metric, "yes")  # only True declares it
    getattr(safelens, name)(model, corrupted, clean_cache, undeclared, progress=False)
    assert undeclared.shapes == {(6, model.cfg.d_vocab)}


# -- hostile input -------------------------------------------------------------------


def hook_state(model) -> dict[str, tuple[list[int], int]]:
    """Every hook point's PyTorch hook ids and TransformerLens hook count."""
    return {
        name: (list(point._forward_hooks), len(point.fwd_hooks))
        for name, point in model.hook_dict.items()
    }


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (lambda t: t.bool(), "must hold integer token ids"),
        (lambda t: t + D_VOCAB, f"ids must be in \\[0, d_vocab={D_VOCAB}\\)"),
        (lambda t: t - 100, "holds token id -"),
        (lambda t: t.repeat(1, 50), "more than the model's context n_ctx=256"),
        (lambda t: t[None], r"must be \[batch, pos\] token ids, got shape \(1, 1, 6\)"),
    ],
)
def test_corrupted_tokens_are_checked_before_anything_runs(bad, match) -> None:
    model, corrupted, clean_cache, metric = setup("standard")
    before = hook_state(model)
    with pytest.raises(TokenError, match=match):
        safelens.get_act_patch_resid_pre(model, bad(corrupted), clean_cache, metric)
    assert hook_state(model) == before


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("max_bytes", 0),
        ("max_bytes", -1),
        ("max_bytes", 1.5),
        ("max_bytes", "1000"),
        ("max_bytes", True),
        ("max_batch", 0),
        ("max_batch", -3),
        ("max_batch", 2.0),
        ("max_batch", "4"),
        ("max_batch", True),
        ("progress", "no"),
    ],
)
def test_budgets_and_batch_sizes_must_be_positive_ints(argument: str, value) -> None:
    model, corrupted, clean_cache, metric = setup("standard")
    with pytest.raises(PatchingError, match=f"^{argument} must be "):
        safelens.get_act_patch_resid_pre(model, corrupted, clean_cache, metric, **{argument: value})
    with pytest.raises(PatchingError, match=f"^{argument} must be "):
        safelens.generic_activation_patch(
            model,
            corrupted,
            clean_cache,
            metric,
            tl_patching.layer_pos_patch_setter,
            "resid_pre",
            ("layer", "pos"),
            **{argument: value},
        )


@pytest.mark.parametrize(
    ("returned", "match"),
    [
        (lambda logits: None, "patching_metric returned None for logits"),
        (lambda logits: "high", "patching_metric returned str 'high'"),
        (lambda logits: logits[:2, -1, :3], r"patching_metric returned shape \(2, 3\)"),
        (lambda logits: logits[:, -1, 0] * 1j, "complex"),
    ],
)
def test_a_metric_returning_the_wrong_thing_is_named(returned, match) -> None:
    model, corrupted, clean_cache, _ = setup("rotary-gqa")
    before = hook_state(model)
    with pytest.raises(PatchingError, match=match) as error:
        safelens.get_act_patch_attn_head_k_by_pos(
            model, corrupted, clean_cache, returned, progress=False
        )
    assert "expected a real tensor [" in str(error.value)
    assert hook_state(model) == before
    assert not any("forward" in block.attn.__dict__ for block in model.blocks)


def failing_on_second_call(metric):
    """`metric`, raising `RuntimeError("metric failed")` on its second call."""
    calls: list[int] = []

    def failing(logits: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("metric failed")
        return metric(logits)

    return failing


def test_a_metric_that_raises_leaves_the_model_and_its_hooks_as_they_were() -> None:
    model, corrupted, clean_cache, metric = setup("rotary-gqa")
    plain = model(corrupted)
    seen: list[str] = []
    model.add_hook("blocks.1.hook_resid_pre", lambda tensor, hook: seen.append(hook.name))
    try:
        before = hook_state(model)
        failing = failing_on_second_call(metric)
        with pytest.raises(RuntimeError, match="metric failed"):
            safelens.get_act_patch_attn_head_out_by_pos(
                model, corrupted, clean_cache, failing, max_batch=2, progress=False
            )
        assert hook_state(model) == before
        assert not any("forward" in block.attn.__dict__ for block in model.blocks)
    finally:
        model.reset_hooks()
    assert torch.equal(model(corrupted), plain)


def test_a_scalar_metric_first_seen_on_a_single_run_is_still_per_run() -> None:
    model, corrupted, clean_cache, _ = setup("standard")
    index_df = pd.DataFrame({"layer": [0, 1, 1, 0], "pos": [0, 4, 5, 5]})

    def scalar(logits: torch.Tensor) -> torch.Tensor:
        return logits[0, -1, 3] - logits[0, -1, 5]

    expected = tl_patching.generic_activation_patch(
        model,
        corrupted,
        clean_cache,
        scalar,
        tl_patching.layer_pos_patch_setter,
        "resid_pre",
        index_df=index_df,
    )
    result = safelens.generic_activation_patch(
        model,
        corrupted,
        clean_cache,
        scalar,
        tl_patching.layer_pos_patch_setter,
        "resid_pre",
        index_df=index_df,
        progress=False,
    )
    torch.testing.assert_close(result, expected, atol=1e-4, rtol=0)


# -- configurations whose shortcuts could go wrong ------------------------------------


def tiny(**overrides) -> HookedTransformer:
    """A fresh 2-layer d_model=32 model (not cached: tests may change it)."""
    cfg = {
        "n_layers": 2,
        "d_model": 32,
        "n_ctx": 16,
        "d_head": 8,
        "n_heads": 4,
        "d_vocab": D_VOCAB,
        "act_fn": "gelu",
        "normalization_type": "LN",
        "seed": 0,
        "device": "cpu",
    }
    model = HookedTransformer(HookedTransformerConfig(**(cfg | overrides)))
    model.eval()
    return model


def one_bidirectional_layer() -> HookedTransformer:
    model = tiny(positional_embedding_type="rotary", n_key_value_heads=2)
    model.blocks[1].attn._attention_dir_override = "bidirectional"
    return model


def with_attention_sinks() -> HookedTransformer:
    model = tiny(use_attention_sinks=True)
    generator = torch.Generator().manual_seed(3)
    for block in model.blocks:
        block.attn.sinks.copy_(torch.randn(block.attn.sinks.shape, generator=generator))
    return model


CONFIGS = {
    "bidirectional": lambda: tiny(attention_dir="bidirectional"),
    "one-bidirectional-layer": one_bidirectional_layer,
    "local-window": lambda: tiny(
        positional_embedding_type="rotary", attn_types=["local", "global"], window_size=2
    ),
    "qk-norm": lambda: tiny(
        positional_embedding_type="rotary", n_key_value_heads=2, use_qk_norm=True
    ),
    "alibi": lambda: tiny(positional_embedding_type="alibi"),
    "parallel-attn-mlp": lambda: tiny(parallel_attn_mlp=True),
    "dynamic-ntk": lambda: tiny(
        positional_embedding_type="rotary", use_dynamic_ntk_rope=True, train_seq_length=2
    ),
    "logn-scaling": lambda: tiny(
        positional_embedding_type="rotary", use_logn_attn=True, train_seq_length=2
    ),
    "attention-sinks": with_attention_sinks,
    "soft-capped": lambda: tiny(attn_scores_soft_cap=2.0, output_logits_soft_cap=3.0),
    "attn-result": lambda: tiny(use_attn_result=True),
}
SHORTCUT_SWEEPS = [
    "get_act_patch_resid_pre",
    "get_act_patch_mlp_out",
    "get_act_patch_attn_head_out_by_pos",
    "get_act_patch_attn_head_k_by_pos",
]


def against_transformer_lens(model, name: str, batch: int = 1, length: int = 6) -> None:
    """`name` equals TransformerLens' with a last-position metric and an every-position one."""
    clean, corrupted = tokens(batch, length, seed=1), tokens(batch, length, seed=2)
    clean_logits, clean_cache = model.run_with_cache(clean)
    last = logit_diff_metric(clean_logits, model(corrupted), 3, torch.arange(batch) + 5)
    for metric in (last, every_position):
        expected = getattr(tl_patching, name)(model, corrupted, clean_cache, metric)
        result = getattr(safelens, name)(model, corrupted, clean_cache, metric, progress=False)
        assert expected.std() > 0
        torch.testing.assert_close(result, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", SHORTCUT_SWEEPS)
@pytest.mark.parametrize("config", CONFIGS)
def test_configurations_equal_transformer_lens(config: str, name: str) -> None:
    against_transformer_lens(CONFIGS[config](), name)


@pytest.mark.parametrize("name", [name for name in SWEEPS if name not in SHORTCUT_SWEEPS])
def test_every_sweep_on_a_bidirectional_model_equals_transformer_lens(name: str) -> None:
    against_transformer_lens(CONFIGS["bidirectional"](), name)


UNGROUPED = [
    ("get_act_patch_attn_head_k_by_pos", "k", tl_patching.layer_pos_head_vector_patch_setter),
    ("get_act_patch_attn_head_v_by_pos", "v", tl_patching.layer_pos_head_vector_patch_setter),
    ("get_act_patch_attn_head_k_all_pos", "k", tl_patching.layer_head_vector_patch_setter),
    ("get_act_patch_attn_head_v_all_pos", "v", tl_patching.layer_head_vector_patch_setter),
]


@pytest.mark.parametrize(("name", "activation", "setter"), UNGROUPED)
def test_ungrouped_grouped_query_keys_and_values_index_every_head(name, activation, setter):
    model = tiny(
        positional_embedding_type="rotary",
        n_key_value_heads=2,
        ungroup_grouped_query_attention=True,
    )
    clean, corrupted = tokens(1, 6, seed=1), tokens(1, 6, seed=2)
    clean_logits, clean_cache = model.run_with_cache(clean)
    assert clean_cache[f"blocks.0.attn.hook_{activation}"].shape[2] == 4  # hook_k: every head
    metric = logit_diff_metric(clean_logits, model(corrupted), 3, torch.tensor([5]))
    result = getattr(safelens, name)(model, corrupted, clean_cache, metric, progress=False)
    assert result.shape[-1] == 4
    # TransformerLens' own sweep covers only the first n_key_value_heads of them,
    expected = getattr(tl_patching, name)(model, corrupted, clean_cache, metric)
    torch.testing.assert_close(result[..., :2], expected, atol=1e-4, rtol=0)
    # and its generic sweep, asked for every head, gives the rest.
    axes = ["layer", "pos", "head_index"] if "by_pos" in name else ["layer", "head_index"]
    index_df = pd.DataFrame(
        [list(index) for index in itertools.product(*map(range, result.shape))], columns=axes
    )
    every_head = tl_patching.generic_activation_patch(
        model, corrupted, clean_cache, metric, setter, activation, index_df=index_df
    )
    torch.testing.assert_close(result.reshape(-1), every_head, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["get_act_patch_attn_head_q_by_pos", "get_act_patch_resid_pre"])
def test_ungrouped_grouped_query_other_sweeps_equal_transformer_lens(name: str) -> None:
    model = tiny(
        positional_embedding_type="rotary",
        n_key_value_heads=2,
        ungroup_grouped_query_attention=True,
    )
    against_transformer_lens(model, name)


def left_padding_tokenizer(pad: str) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of `w0 … w60` (BOS w2, padding `pad`) that pads on the left."""
    vocab = {f"w{i}": i for i in range(D_VOCAB)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab=vocab, unk_token="w1")),
        pad_token=pad,
        bos_token="w2",
        eos_token="w3",
        unk_token="w1",
        name_or_path="word-level",
        add_bos_token=True,
    )


@pytest.mark.parametrize("name", [*SHORTCUT_SWEEPS, "get_act_patch_attn_head_pattern_by_pos"])
@pytest.mark.parametrize(
    ("positional", "pad"), [("standard", "w0"), ("rotary", "w0"), ("rotary", "w2")]
)
def test_left_padded_prompts_are_masked_as_transformer_lens_masks_them(positional, pad, name):
    model = HookedTransformer(
        HookedTransformerConfig(
            n_layers=2,
            d_model=32,
            n_ctx=16,
            d_head=8,
            d_vocab=D_VOCAB,
            act_fn="gelu",
            positional_embedding_type=positional,
            seed=0,
            device="cpu",
        ),
        tokenizer=left_padding_tokenizer(pad),
        default_padding_side="left",
    )
    p = model.tokenizer.pad_token_id  # w2 is also BOS: TransformerLens keeps the last one
    clean = torch.tensor([[p, p, 2, 5, 6, 7], [2, 9, 10, 11, 12, 13]])
    corrupted = torch.tensor([[p, p, 2, 8, 6, 7], [2, 9, 14, 11, 15, 13]])
    clean_logits, clean_cache = model.run_with_cache(clean)
    metric = logit_diff_metric(clean_logits, model(corrupted), 3, torch.tensor([5, 6]))
    expected = getattr(tl_patching, name)(model, corrupted, clean_cache, metric)
    result = getattr(safelens, name)(model, corrupted, clean_cache, metric, progress=False)
    torch.testing.assert_close(result, expected, atol=1e-4, rtol=0)


# -- generic sweeps ---------------------------------------------------------------------


def generic_both(model, corrupted, clean_cache, metric, setter, activation, **index):
    expected = tl_patching.generic_activation_patch(
        model, corrupted, clean_cache, metric, setter, activation, **index
    )
    result = safelens.generic_activation_patch(
        model, corrupted, clean_cache, metric, setter, activation, progress=False, **index
    )
    return result, expected


@pytest.mark.parametrize(
    ("activation", "columns", "setter"),
    [
        (
            "pattern",
            ["layer", "head_index", "pos"],
            tl_patching.layer_head_pos_pattern_patch_setter,
        ),
        (
            "attn_scores",
            ["layer", "head_index", "pos"],
            tl_patching.layer_head_pos_pattern_patch_setter,
        ),
        ("rot_k", ["layer", "pos", "head_index"], tl_patching.layer_pos_head_vector_patch_setter),
    ],
)
def test_a_pos_column_on_activations_of_every_key_position_equals_transformer_lens(
    activation: str, columns: list[str], setter
) -> None:
    model, corrupted, clean_cache, metric = setup("rotary-gqa")
    heads = 2 if activation == "rot_k" else 4
    grid = itertools.product(range(2), range(6), range(heads))
    rows = [(layer, pos, head) for layer, pos, head in grid if (pos + head) % 3 == 0]
    if columns[1] == "head_index":
        rows = [(layer, head, pos) for layer, pos, head in rows]
    index_df = pd.DataFrame(rows, columns=columns)
    result, expected = generic_both(
        model, corrupted, clean_cache, metric, setter, activation, index_df=index_df
    )
    assert expected.std() > 0
    torch.testing.assert_close(result, expected, atol=1e-4, rtol=0)


def test_negative_positions_and_in_place_setters_equal_transformer_lens() -> None:
    model, corrupted, clean_cache, metric = setup("rotary-gqa")

    def in_place(corrupted_act, index, clean_act) -> None:
        corrupted_act[:, index[1]] = clean_act[:, index[1]]

    index_df = pd.DataFrame({"layer": [0, 1, 1, 0], "pos": [-1, -3, 2, -6]})
    result, expected = generic_both(
        model, corrupted, clean_cache, metric, in_place, "resid_mid", index_df=index_df
    )
    torch.testing.assert_close(result, expected, atol=1e-4, rtol=0)


def test_a_setter_that_changes_earlier_positions_is_refused() -> None:
    model, corrupted, clean_cache, metric = setup("standard")

    def up_to(corrupted_act, index, clean_act):
        corrupted_act[:, : index[1] + 1] = clean_act[:, : index[1] + 1]
        return corrupted_act

    with pytest.raises(PatchingError, match="patch_setter changed positions before 4"):
        safelens.generic_activation_patch(
            model,
            corrupted,
            clean_cache,
            metric,
            up_to,
            "resid_pre",
            ("layer", "pos"),
            progress=False,
        )
    with pytest.raises(PatchingError, match=r"patch_setter returned shape \(1, 5, 64\)"):
        safelens.generic_activation_patch(
            model,
            corrupted,
            clean_cache,
            metric,
            lambda act, index, clean: act[:, :5],
            "resid_pre",
            ("layer", "pos"),
            progress=False,
        )
    assert not any(point._forward_hooks for point in model.hook_dict.values())


@pytest.mark.parametrize(
    ("index_df", "match"),
    [
        (
            pd.DataFrame({"layer": [0, 2], "pos": [1, 1]}),
            r"column 'layer' holds 2; expected a layer index in \[0, 2\)",
        ),
        (pd.DataFrame({"layer": [0, -1], "pos": [1, 1]}), r"column 'layer' holds -1"),
        (
            pd.DataFrame({"layer": [0, 1], "pos": [1, 6]}),
            r"column 'pos' holds 6; expected a pos index in \[-6, 6\)",
        ),
        (
            pd.DataFrame({"layer": [0, 1], "pos": [1.0, 2.5]}),
            "column 'pos' holds float64; expected integer",
        ),
        (pd.DataFrame(), "index_df has no columns"),
        ([[0, 1]], "index_df must be a pandas DataFrame"),
    ],
)
def test_index_df_is_checked(index_df, match: str) -> None:
    model, corrupted, clean_cache, metric = setup("standard")
    with pytest.raises(PatchingError, match=match):
        safelens.generic_activation_patch(
            model,
            corrupted,
            clean_cache,
            metric,
            tl_patching.layer_pos_patch_setter,
            "resid_pre",
            index_df=index_df,
            progress=False,
        )


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        (
            dict(index_axis_names="layer"),
            r"index_axis_names must be a sequence of axis names such as \('layer', 'pos'\), got "
            r"str 'layer'; for one axis pass \('layer',\)",
        ),
        (
            dict(index_axis_names=("layer", "pos", "pos")),
            r"index_axis_names \('layer', 'pos', 'pos'\) names an axis more than once",
        ),
        (
            dict(activation_name=None),
            "activation_name must be a str such as 'resid_pre', 'z' or 'k', as get_act_name "
            "spells it, got NoneType None",
        ),
        (dict(patching_metric=None), "patching_metric must be a function of the logits, got None"),
    ],
)
def test_generic_arguments_of_the_wrong_kind_are_named(arguments, match: str) -> None:
    model, corrupted, clean_cache, metric = setup("standard")
    given = dict(
        patching_metric=metric,
        patch_setter=tl_patching.layer_pos_patch_setter,
        activation_name="resid_pre",
        index_axis_names=("layer", "pos"),
    )
    with pytest.raises(PatchingError, match=match):
        safelens.generic_activation_patch(
            model, corrupted, clean_cache, **{**given, **arguments}, progress=False
        )
    assert not any(point._forward_hooks for point in model.hook_dict.values())


def test_activations_a_model_lacks_are_named() -> None:
    attn_only = make_model("standard", attn_only=True, d_model=32)
    clean, corrupted = tokens(1, 5, seed=1), tokens(1, 5, seed=2)
    _, clean_cache = attn_only.run_with_cache(clean)
    metric = lambda logits: logits[:, -1, 3]  # noqa: E731
    with pytest.raises(PatchingError, match="the model is attention-only .* has no MLP"):
        safelens.get_act_patch_mlp_out(attn_only, corrupted, clean_cache, metric)
    model, corrupted, clean_cache, metric = setup("standard")
    with pytest.raises(PatchingError, match="'blocks.0.hook_embed'.*for the embeddings patch"):
        safelens.generic_activation_patch(
            model,
            corrupted,
            clean_cache,
            metric,
            tl_patching.layer_pos_patch_setter,
            "embed",
            ("layer", "pos"),
        )
    with pytest.raises(PatchingError, match="never fires it .*use_attn_result=True"):
        safelens.generic_activation_patch(
            model,
            corrupted,
            clean_cache,
            metric,
            tl_patching.layer_pos_head_vector_patch_setter,
            "result",
            ("layer", "pos", "head_index"),
        )
    parallel = tiny(parallel_attn_mlp=True)
    _, parallel_cache = parallel.run_with_cache(clean)
    with pytest.raises(PatchingError, match="in parallel .*no residual stream lies between"):
        safelens.generic_activation_patch(
            parallel,
            corrupted,
            parallel_cache,
            metric,
            tl_patching.layer_pos_patch_setter,
            "resid_mid",
            ("layer", "pos"),
        )


# -- threads ------------------------------------------------------------------------------


def test_sweeps_and_continuations_from_threads_give_the_serial_results() -> None:
    model = make_model("rotary", 2, d_model=32)
    clean, corrupted = tokens(1, 6, seed=1), tokens(1, 6, seed=2)
    clean_logits, clean_cache = model.run_with_cache(clean)
    metric = logit_diff_metric(clean_logits, model(corrupted), 3, torch.tensor([5]))
    prefix = safelens.prefill(model, tokens(1, 5, seed=3))
    continuations = [tokens(1, n, seed=10 + n)[0] for n in (1, 3, 2)]
    plain = tokens(2, 7, seed=9)
    jobs = {
        "keys": lambda: safelens.get_act_patch_attn_head_k_by_pos(
            model, corrupted, clean_cache, metric, progress=False
        ),
        "residual": lambda: safelens.get_act_patch_resid_pre(
            model, corrupted, clean_cache, every_position, progress=False
        ),
        "continuations": lambda: (
            safelens.score_continuations(model, prefix, continuations).log_probs
        ),
        "plain": lambda: model(plain),
    }
    serial = {name: job() for name, job in jobs.items()}
    failures: list[str] = []

    def work(name: str) -> None:
        try:
            with torch.no_grad():
                for _ in range(4):
                    out = jobs[name]()
                    same = torch.equal if name == "plain" else torch.allclose
                    if not same(out, serial[name]):
                        failures.append(name)
        except BaseException as error:  # noqa: BLE001 - reported to the test
            failures.append(repr(error))

    threads = [threading.Thread(target=work, args=(name,)) for name in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert not any("forward" in block.attn.__dict__ for block in model.blocks)
    assert not any(point._forward_hooks or point.fwd_hooks for point in model.hook_dict.values())
    assert torch.equal(model(plain), serial["plain"])


@pytest.mark.parametrize("declared", [False, True])
def test_a_users_hook_that_indexes_positions_acts_as_under_transformer_lens(declared) -> None:
    """With a hook attached, every pass runs every position: `[:, 0]` is position 0."""
    model = make_model("rotary", 2)
    clean, corrupted = tokens(1, 12, seed=3), tokens(1, 12, seed=4)

    def first_position(tensor: torch.Tensor, hook: object) -> None:
        tensor[:, 0, :8] += 1.0

    model.add_hook("blocks.0.hook_mlp_out", first_position)
    try:
        clean_logits, clean_cache = model.run_with_cache(clean)
        metric = logit_diff_metric(clean_logits, model(corrupted), 3, 5)
        plain = (lambda logits: metric(logits)) if not declared else metric
        for name in ("get_act_patch_resid_pre", "get_act_patch_attn_head_out_by_pos"):
            got = getattr(safelens, name)(model, corrupted, clean_cache, plain, progress=False)
            expected = getattr(tl_patching, name)(model, corrupted, clean_cache, metric)
            assert (got - expected).abs().max() <= 1e-4, name
        assert len(model.hook_dict["blocks.0.hook_mlp_out"]._forward_hooks) == 1
    finally:
        model.reset_hooks()


# -- GPT-2's gelu_new, fused inside the passes -----------------------------------------


@pytest.mark.parametrize("name", SHORTCUT_SWEEPS)
def test_gelu_new_runs_fused_in_the_passes_and_the_sweep_equals_transformer_lens(
    name: str, monkeypatch
) -> None:
    from transformer_lens.utilities.activation_functions import gelu_new

    from safelens.patching import _grid

    model = tiny(act_fn="gelu_new")
    fused: list[tuple[int, ...]] = []

    def spying(own, *args, **kwargs):
        fused.append(tuple(args[0].shape))
        return _grid.tanh_gelu(own, *args, **kwargs)

    monkeypatch.setattr(_grid, "_fused_activations", _spied(_grid._fused_activations, spying))
    against_transformer_lens(model, name)
    assert fused  # the passes ran it fused; the corrupted run, TransformerLens' own
    assert all(block.mlp.__dict__["act_fn"] is gelu_new for block in model.blocks)


def _spied(choose, replacement):
    def chosen(model):
        return {mlp: replacement for mlp in choose(model)}

    return chosen


def _bfloat16_pair(model):
    clean, corrupted = tokens(1, 6, seed=1), tokens(1, 6, seed=2)
    clean_logits, clean_cache = model.run_with_cache(clean)
    return model, corrupted, clean_cache, logit_diff_metric(clean_logits, model(corrupted), 3, 5)


def test_gelu_new_stays_transformer_lens_own_in_bfloat16_and_under_a_users_hook() -> None:
    from safelens.patching import _grid

    half = tiny(act_fn="gelu_new", dtype=torch.bfloat16)
    # Overridden, but `tanh_gelu` runs TransformerLens' own in half precision: bitwise.
    got = safelens.get_act_patch_mlp_out(*_bfloat16_pair(half), progress=False)
    unfused = _grid._fused_activations
    try:
        _grid._fused_activations = lambda model: {}
        own = safelens.get_act_patch_mlp_out(*_bfloat16_pair(half), progress=False)
    finally:
        _grid._fused_activations = unfused
    assert torch.equal(got, own) and got.float().std() > 0
    assert _grid._fused_activations(tiny(act_fn="gelu")) == {}
    model = tiny(act_fn="gelu_new")
    assert set(_grid._fused_activations(model)) == {block.mlp for block in model.blocks}
    calls: list[int] = []
    model.add_hook("blocks.1.mlp.hook_post", lambda tensor, hook: calls.append(1))
    try:
        own = model.blocks[0].mlp.act_fn
        seen: list[object] = []
        model.blocks[0].mlp.hook_pre.add_hook(
            lambda tensor, hook: seen.append(model.blocks[0].mlp.act_fn)
        )
        against_transformer_lens(model, "get_act_patch_mlp_out")
    finally:
        model.reset_hooks()
    assert calls and seen and all(act is own for act in seen)  # never overridden


def test_a_gelu_new_sweep_that_raises_or_runs_beside_plain_forwards_leaves_act_fn_as_found():
    from transformer_lens.utilities.activation_functions import gelu_new

    model = tiny(act_fn="gelu_new", positional_embedding_type="rotary")
    clean, corrupted = tokens(1, 6, seed=1), tokens(1, 6, seed=2)
    clean_logits, clean_cache = model.run_with_cache(clean)
    metric = logit_diff_metric(clean_logits, model(corrupted), 3, 5)
    with pytest.raises(RuntimeError, match="metric failed"):
        safelens.get_act_patch_mlp_out(
            model,
            corrupted,
            clean_cache,
            failing_on_second_call(metric),
            max_batch=2,
            progress=False,
        )
    assert all(block.mlp.__dict__["act_fn"] is gelu_new for block in model.blocks)
    # Another thread's plain forwards during the sweeps run TransformerLens' own gelu_new.
    plain = tokens(2, 7, seed=9)
    serial_plain = model(plain)
    serial = safelens.get_act_patch_resid_pre(model, corrupted, clean_cache, metric, progress=False)
    failures: list[str] = []

    def sweeps() -> None:
        for _ in range(3):
            got = safelens.get_act_patch_resid_pre(
                model, corrupted, clean_cache, metric, progress=False
            )
            if not torch.equal(got, serial):
                failures.append("sweep")

    def forwards() -> None:
        with torch.no_grad():
            for _ in range(20):
                if not torch.equal(model(plain), serial_plain):
                    failures.append("plain")

    threads = [threading.Thread(target=sweeps), threading.Thread(target=forwards)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert all(block.mlp.__dict__["act_fn"] is gelu_new for block in model.blocks)


def test_a_blocks_ln1_is_computed_once_per_tensor_it_is_handed() -> None:
    from safelens.core._thread_hooks import thread_hooks
    from safelens.patching import _grid

    norm = tiny().blocks[0].ln1
    calls: list[int] = []

    def own(*args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return norm.forward(*args, **kwargs)

    once = _grid._once(norm)
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(0))
    first = once(own, x)
    assert once(own, x) is first and once(own, x) is first and len(calls) == 1
    torch.testing.assert_close(first, norm(x), rtol=0, atol=0)
    x[0, 0] += 1.0  # edited in place: computed again
    assert not torch.equal(once(own, x), first) and len(calls) == 2
    assert once(own, x.clone()) is not None and len(calls) == 3  # another tensor
    with thread_hooks([(norm.hook_normalized, lambda tensor, hook: None)]):
        once(own, x), once(own, x)  # a hook inside: every call runs, so the hook fires
    assert len(calls) == 5
    once(own, x=x)  # not one positional tensor: its own forward
    assert len(calls) == 6


def test_a_sweep_takes_every_id_the_model_embeds() -> None:
    # cfg.d_vocab_out < cfg.d_vocab: corrupted tokens are bounded by the embedding, not the
    # logits' width, and the sweep equals TransformerLens' own.
    cfg = HookedTransformerConfig(
        n_layers=2, d_model=32, n_ctx=32, d_head=8, d_vocab=30, d_vocab_out=10, act_fn="gelu"
    )
    model = HookedTransformer(cfg).eval()
    clean, corrupted = torch.tensor([[1, 25, 3, 29]]), torch.tensor([[1, 27, 3, 12]])
    _, clean_cache = model.run_with_cache(clean)
    metric = lambda logits: logits[:, -1, 3]  # noqa: E731
    got = safelens.get_act_patch_resid_pre(model, corrupted, clean_cache, metric, progress=False)
    expected = tl_patching.get_act_patch_resid_pre(model, corrupted, clean_cache, metric)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(TokenError, match=r"token id 30 .*d_vocab=30"):
        safelens.get_act_patch_resid_pre(model, clean + 5, clean_cache, metric, progress=False)
