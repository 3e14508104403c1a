"""`patch_dataset` against TransformerLens' patching looped over the pairs.

Per-pair values must equal `transformer_lens.patching` run on each pair alone with
that pair's metric; the mean and standard error are recomputed here with numpy, and
the bootstrap interval with an independent resampling loop.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import transformer_lens.patching as tl_patching

import safelens
from safelens import PatchingError, TokenError, patch_dataset
from tests.models import make_model, tokens

PAIRS, LENGTH = 5, 6
ANSWERS = torch.tensor([3, 7, 1, 9, 4])


def pair_metric(logits: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """Logit of each pair's own answer token at the last position."""
    last = logits[:, -1]
    return last[torch.arange(last.shape[0]), ANSWERS[pairs]] - last.mean(-1)


def pair_metric_last_only(logits: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    return pair_metric(logits, pairs)


pair_metric_last_only.last_position_only = True  # type: ignore[attr-defined]


def loop_transformer_lens(name: str, model, clean, corrupted) -> torch.Tensor:
    """TransformerLens' sweep `name`, run on each pair alone: `[pairs, *grid]`."""
    values = []
    for i in range(clean.shape[0]):
        _, clean_cache = model.run_with_cache(clean[i : i + 1])
        metric = functools.partial(
            lambda logits, i: pair_metric(logits, torch.tensor([i])).squeeze(0), i=i
        )
        values.append(getattr(tl_patching, name)(model, corrupted[i : i + 1], clean_cache, metric))
    return torch.stack(values)


@pytest.mark.parametrize(
    ("name", "model_kwargs", "metric"),
    [
        ("get_act_patch_attn_head_k_by_pos", {}, pair_metric),
        ("get_act_patch_resid_pre", {}, pair_metric_last_only),
        ("get_act_patch_attn_head_v_all_pos", {"n_kv_heads": 2}, pair_metric),
        ("get_act_patch_attn_head_by_pos_every", {"n_kv_heads": 2}, pair_metric_last_only),
    ],
)
def test_per_pair_values_equal_transformer_lens_on_each_pair(name, model_kwargs, metric) -> None:
    model = make_model(**model_kwargs)
    clean, corrupted = tokens(PAIRS, LENGTH, seed=1), tokens(PAIRS, LENGTH, seed=2)
    result = patch_dataset(getattr(safelens, name), model, clean, corrupted, metric, progress=False)
    reference = loop_transformer_lens(name, model, clean, corrupted)
    assert result.per_pair.shape == reference.shape
    torch.testing.assert_close(result.per_pair, reference, atol=1e-4, rtol=1e-4)
    values = reference.numpy().astype(np.float64)
    torch.testing.assert_close(
        result.mean, torch.from_numpy(values.mean(0)).float(), atol=1e-5, rtol=1e-5
    )
    std_err = values.std(0, ddof=1) / np.sqrt(PAIRS)
    torch.testing.assert_close(
        result.std_err, torch.from_numpy(std_err).float(), atol=1e-5, rtol=1e-4
    )


def test_chunks_under_a_small_memory_budget_give_the_same_values() -> None:
    model = make_model()
    clean, corrupted = tokens(PAIRS, LENGTH, seed=1), tokens(PAIRS, LENGTH, seed=2)
    sweep = safelens.get_act_patch_attn_head_out_by_pos
    whole = patch_dataset(sweep, model, clean, corrupted, pair_metric, progress=False)
    split = patch_dataset(
        sweep, model, clean, corrupted, pair_metric, max_bytes=200_000, progress=False
    )
    torch.testing.assert_close(split.per_pair, whole.per_pair, atol=1e-5, rtol=1e-5)


def test_bootstrap_interval_matches_an_independent_resampling() -> None:
    generator = np.random.default_rng(0)
    values = torch.from_numpy(generator.normal(size=(40, 3, 2))).float()
    from safelens.patching._dataset import summary

    result = summary(values, n_bootstrap=4000, confidence=0.9, seed=0)
    draws = generator.integers(0, 40, size=(4000, 40))
    means = values.numpy()[draws].mean(1)
    low, high = np.quantile(means, [0.05, 0.95], axis=0)
    # Two independent resamplings agree to well within the interval's width.
    width = high - low
    assert np.all(np.abs(result.ci_low.numpy() - low) < 0.1 * width)
    assert np.all(np.abs(result.ci_high.numpy() - high) < 0.1 * width)
    assert torch.all(result.ci_low < result.mean) and torch.all(result.mean < result.ci_high)
    again = summary(values, n_bootstrap=4000, confidence=0.9, seed=0)
    assert torch.equal(again.ci_low, result.ci_low)


def test_one_pair_has_nan_standard_error_and_a_point_interval() -> None:
    model = make_model()
    result = patch_dataset(
        safelens.get_act_patch_resid_pre,
        model,
        tokens(1, 4, seed=1),
        tokens(1, 4, seed=2),
        pair_metric,
        progress=False,
    )
    assert torch.isnan(result.std_err).all()
    assert torch.equal(result.ci_low, result.per_pair[0])
    assert torch.equal(result.ci_high, result.per_pair[0])


def test_bad_inputs_are_refused_naming_them() -> None:
    model = make_model()
    clean = tokens(2, 4, seed=1)
    sweep = safelens.get_act_patch_resid_pre
    with pytest.raises(PatchingError, match=r"clean_tokens \(2, 4\) and corrupted_tokens \(2, 5\)"):
        patch_dataset(sweep, model, clean, tokens(2, 5), pair_metric, progress=False)
    with pytest.raises(PatchingError, match=r"expected one value per row, \[\d+\]"):
        patch_dataset(
            sweep,
            model,
            clean,
            tokens(2, 4),
            lambda logits, pairs: logits[:1, -1, 0],
            progress=False,
        )
    with pytest.raises(PatchingError, match="confidence must be in"):
        patch_dataset(sweep, model, clean, tokens(2, 4), pair_metric, confidence=1.5)
    with pytest.raises(TokenError, match="clean_tokens"):
        patch_dataset(sweep, model, clean + 100, tokens(2, 4), pair_metric)
