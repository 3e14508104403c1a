"""The cached sweeps against transformer_lens.patching on real models."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import transformer_lens.patching as tl_patching
from models import make_model, tokens

import safelens
from safelens import PatchingError, logit_diff_metric

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


def setup(kind: str, batch: int = 1, length: int = 6):
    model = make_model(*MODELS[kind])
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
    with pytest.raises(PatchingError, match="corrupted_tokens must be an integer tensor"):
        safelens.get_act_patch_resid_pre(model, corrupted.float(), clean_cache, metric)
    with pytest.raises(PatchingError, match="same length"):
        safelens.get_act_patch_resid_pre(model, corrupted[:, :4], clean_cache, metric)
    with pytest.raises(PatchingError, match="no activation 'blocks.0.hook_resid_pre'"):
        safelens.get_act_patch_resid_pre(model, corrupted, {}, metric)
    with pytest.raises(PatchingError, match=r"returned shape \(1,\)"):
        safelens.get_act_patch_resid_pre(
            model, corrupted, clean_cache, lambda x: x[:1, -1, 0], progress=False
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
