"""`patch_dataset` on a TransformerBridge and on plain HuggingFace causal LMs.

References, pair by pair: on a bridge, `transformer_lens.patching` on that bridge with
each pair alone and that pair's metric (TransformerLens patches the pre-rotary
`attn.hook_k` where safelens patches post-rotary keys at the cache seam: the same patch
at one position); on a HuggingFace model, the same safelens sweep run on each pair
alone, and that run against `test_patching_hf.reference`, a loop of torch-hooked
forwards without safelens. The mean and standard error are recomputed with numpy, the
bootstrap interval with an independent resampling. Runs under TransformerLens 3.9 and
4.x (no `HookedTransformer` here).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from bridge_models import bridge
from hf_models import ids, model
from test_patching_hf import ANSWER, WRONG, reference
from transformer_lens import patching

import safelens
from safelens import PatchingError, TokenError, patch_dataset, run_with_patching_cache

LENGTH = 5
ANSWERS = torch.tensor([3, 7, 1, 9, 4, 12])


def pair_metric(logits: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """Logit of each pair's own answer token at the last position, less the mean logit."""
    last = logits[:, -1]
    return last[torch.arange(last.shape[0]), ANSWERS[pairs]] - last.mean(-1)


def last_only(fn):
    """`fn`, saying it reads only the last position (the sweeps' shortcut)."""

    @functools.wraps(fn)
    def wrapped(logits: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        return fn(logits, pairs)

    wrapped.last_position_only = True  # type: ignore[attr-defined]
    return wrapped


def logit_diff(logits: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """`test_patching_hf.metric` row by row: the same for every pair."""
    return logits[:, -1, ANSWER] - logits[:, -1, WRONG]


def pairs_of(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` clean prompts and corrupted ones differing at positions 1 and 3."""
    clean = ids(n, LENGTH, seed=4)
    corrupted = clean.clone()
    corrupted[:, 1] = ids(n, 1, seed=5)[:, 0]
    corrupted[:, 3] = ids(n, 1, seed=6)[:, 0]
    return clean, corrupted


def check_summary(result: safelens.PatchingResult, values: torch.Tensor) -> None:
    """Mean and standard error against numpy; the interval against a resampling of our own."""
    values64 = values.numpy().astype(np.float64)
    pairs = values64.shape[0]
    torch.testing.assert_close(
        result.mean, torch.from_numpy(values64.mean(0)).float(), atol=1e-5, rtol=1e-5
    )
    std_err = values64.std(0, ddof=1) / np.sqrt(pairs)
    torch.testing.assert_close(
        result.std_err, torch.from_numpy(std_err).float(), atol=1e-5, rtol=1e-4
    )
    draws = np.random.default_rng(1).integers(0, pairs, size=(result.n_bootstrap, pairs))
    low, high = np.quantile(values64[draws].mean(1), [0.025, 0.975], axis=0)
    spread = values64.max(0) - values64.min(0)
    assert np.all(np.abs(result.ci_low.numpy() - low) <= 0.15 * spread + 1e-6)
    assert np.all(np.abs(result.ci_high.numpy() - high) <= 0.15 * spread + 1e-6)
    assert torch.all(result.ci_low <= result.mean + 1e-6)
    assert torch.all(result.mean <= result.ci_high + 1e-6)


def no_hooks(lm: torch.nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in lm.modules())


# -- TransformerBridge: against transformer_lens.patching on each pair -------------------

# sweep: (TransformerLens' activation, setter, index columns, cells checked or None: all)
BRIDGE = {
    "get_act_patch_attn_head_k_by_pos": (
        "k",
        patching.layer_pos_head_vector_patch_setter,
        ["layer", "pos", "head_index"],
        [(0, 1, 1), (0, 3, 0), (1, 4, 1)],
    ),
    "get_act_patch_attn_head_out_by_pos": (
        "z",
        patching.layer_pos_head_vector_patch_setter,
        ["layer", "pos", "head_index"],
        [(0, 1, 2), (1, 3, 3), (1, 4, 0)],
    ),
    "get_act_patch_resid_pre": ("resid_pre", patching.layer_pos_patch_setter, None, None),
}


def transformer_lens_per_pair(lm, sweep: str, clean, corrupted, metric) -> torch.Tensor:
    """TransformerLens' patching of `sweep`'s cells, each pair alone: `[pairs, cells]`."""
    activation, setter, columns, cells = BRIDGE[sweep]
    values = []
    for i in range(clean.shape[0]):
        _, clean_cache = lm.run_with_cache(clean[i : i + 1])

        def scalar(logits: torch.Tensor, i: int = i) -> torch.Tensor:
            return metric(logits, torch.tensor([i])).squeeze(0)

        if cells is None:
            result = getattr(patching, sweep)(lm, corrupted[i : i + 1], clean_cache, scalar)
            values.append(result.flatten())
        else:
            values.append(
                patching.generic_activation_patch(
                    lm,
                    corrupted[i : i + 1],
                    clean_cache,
                    scalar,
                    setter,
                    activation,
                    index_df=pd.DataFrame(cells, columns=columns),
                )
            )
    return torch.stack(values)


@pytest.mark.parametrize(
    ("name", "sweep", "metric"),
    [
        ("llama", "get_act_patch_attn_head_k_by_pos", pair_metric),
        ("llama", "get_act_patch_attn_head_out_by_pos", last_only(pair_metric)),
        ("gpt2", "get_act_patch_resid_pre", last_only(pair_metric)),
    ],
)
def test_bridge_per_pair_values_equal_transformer_lens_on_each_pair(name, sweep, metric):
    lm = bridge(name)
    clean, corrupted = pairs_of(3)
    result = patch_dataset(getattr(safelens, sweep), lm, clean, corrupted, metric, progress=False)
    cells = BRIDGE[sweep][3]
    assert result.per_pair.shape[:3] == (3, 2, LENGTH)
    got = (
        result.per_pair.flatten(1)
        if cells is None
        else result.per_pair[(slice(None), *torch.tensor(cells).T)]
    )
    expected = transformer_lens_per_pair(lm, sweep, clean, corrupted, metric)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert (got - got[0]).abs().max() > 1e-3  # pairs differ
    check_summary(result, result.per_pair)
    assert all(not point._forward_hooks for point in lm.hook_dict.values())


# -- HuggingFace models: each pair's own sweep, and that against torch-hooked forwards ---

# sweep: (activation, cells checked against the torch-hooked loop)
HF = {
    "get_act_patch_attn_head_k_by_pos": ("k", [(0, 1, 1), (1, 4, 0)]),
    "get_act_patch_attn_head_v_all_pos": ("v", [(0, 0), (1, 1)]),
    "get_act_patch_attn_out": ("attn_out", [(0, 3), (1, 4)]),
    "get_act_patch_resid_pre": ("resid_pre", [(0, 1), (1, 3)]),
}


def padded(lm, clean, corrupted, monkeypatch) -> torch.Tensor:
    """Left padding (pad id 0) in pairs 0 and 2, one and two positions: their mask."""
    monkeypatch.setattr(lm, "tokenizer", SimpleNamespace(pad_token_id=0), raising=False)
    mask = torch.ones_like(clean)
    for pair, width in ((0, 1), (2, 2)):
        clean[pair, :width] = corrupted[pair, :width] = 0
        mask[pair, :width] = 0
    return mask


def alone(lm, run, clean, corrupted, metric, i: int, copies: int) -> torch.Tensor:
    """Sweep `run` on pair `i` alone: `copies` rows of it, their mean."""
    rows = [i] * copies
    _, clean_cache = run_with_patching_cache(lm, clean[rows])

    def per_run(logits: torch.Tensor) -> torch.Tensor:
        return metric(logits, torch.full((logits.shape[0],), i)).reshape(-1, copies).mean(-1)

    return run(lm, corrupted[rows], clean_cache, per_run, progress=False)


@pytest.mark.parametrize(
    ("name", "sweep", "pad", "metric"),
    [
        ("llama", "get_act_patch_attn_head_k_by_pos", False, logit_diff),
        ("llama", "get_act_patch_attn_head_v_all_pos", False, last_only(logit_diff)),
        ("gemma2", "get_act_patch_attn_out", False, last_only(logit_diff)),
        ("gpt2", "get_act_patch_resid_pre", True, logit_diff),
    ],
)
def test_hf_per_pair_values_equal_each_pair_alone_and_hooked_forwards(
    name, sweep, pad, metric, monkeypatch
):
    lm = model(name)
    clean, corrupted = pairs_of(6)
    mask = padded(lm, clean, corrupted, monkeypatch) if pad else torch.ones_like(clean)
    run = getattr(safelens, sweep)
    result = patch_dataset(run, lm, clean, corrupted, metric, max_batch=3, progress=False)
    activation, cells = HF[sweep]
    for i in range(clean.shape[0]):
        # A HuggingFace model masks left padding in a batch of several prompts, not in
        # one: a padded pair runs alone as two copies.
        expected = alone(lm, run, clean, corrupted, metric, i, 2 if pad else 1)
        torch.testing.assert_close(result.per_pair[i], expected, atol=1e-5, rtol=1e-5)
        hooked = reference(
            lm, activation, cells, clean[i : i + 1], corrupted[i : i + 1], mask[i : i + 1]
        )
        torch.testing.assert_close(
            result.per_pair[i][tuple(torch.tensor(cells).T)], hooked, atol=1e-4, rtol=1e-4
        )
    assert (result.per_pair - result.per_pair[0]).abs().max() > 1e-3  # pairs differ
    check_summary(result, result.per_pair)
    assert no_hooks(lm)


def test_hf_chunks_of_one_pair_give_the_values_of_larger_chunks(monkeypatch):
    """Padded pairs too: a lone pair is masked as it is among others."""
    lm = model("gpt2")
    clean, corrupted = pairs_of(5)
    mask = padded(lm, clean, corrupted, monkeypatch)
    sweep = safelens.get_act_patch_attn_head_k_by_pos
    whole = patch_dataset(sweep, lm, clean, corrupted, logit_diff, progress=False)
    split = patch_dataset(sweep, lm, clean, corrupted, logit_diff, max_bytes=8_000, progress=False)
    torch.testing.assert_close(split.per_pair, whole.per_pair, atol=1e-5, rtol=1e-5)
    cells = [(0, 1, 2), (0, 3, 1), (1, 4, 0)]
    hooked = reference(lm, "k", cells, clean[2:3], corrupted[2:3], mask[2:3])
    torch.testing.assert_close(
        split.per_pair[2][tuple(torch.tensor(cells).T)], hooked, atol=1e-4, rtol=1e-4
    )


def test_hf_bundle_keeps_its_padding_rows_zero():
    lm = model("llama")
    clean, corrupted = pairs_of(3)
    sweep = safelens.get_act_patch_block_every
    result = patch_dataset(sweep, lm, clean, corrupted, last_only(pair_metric), progress=False)
    assert result.per_pair.shape == (3, 3, 2, LENGTH)  # [pairs, patch_type, layer, pos]
    for i in range(3):
        _, alone_cache = run_with_patching_cache(lm, clean[i : i + 1])
        alone = sweep(
            lm,
            corrupted[i : i + 1],
            alone_cache,
            lambda logits, i=i: pair_metric(logits, torch.full((logits.shape[0],), i)),
            progress=False,
        )
        torch.testing.assert_close(result.per_pair[i], alone, atol=1e-5, rtol=1e-5)


# -- bad input ----------------------------------------------------------------------------


def test_a_model_of_no_family_is_refused_naming_it():
    clean, corrupted = pairs_of(2)
    with pytest.raises(
        PatchingError,
        match=r"model must be a HookedTransformer, a TransformerBridge or a HuggingFace causal "
        r"LM .*got Linear",
    ):
        patch_dataset(
            safelens.get_act_patch_resid_pre,
            torch.nn.Linear(2, 2),
            clean,
            corrupted,
            pair_metric,
            progress=False,
        )


@pytest.mark.parametrize("family", ["hf", "bridge"])
def test_bad_inputs_are_refused_naming_them_and_leave_no_hooks(family):
    lm = model("llama") if family == "hf" else bridge("llama")
    clean, corrupted = pairs_of(2)
    sweep = safelens.get_act_patch_attn_head_k_by_pos
    with pytest.raises(PatchingError, match=r"clean_tokens \(2, 5\) and corrupted_tokens \(2, 4\)"):
        patch_dataset(sweep, lm, clean, corrupted[:, :4], pair_metric, progress=False)
    with pytest.raises(TokenError, match=r"clean_tokens must be \[batch, pos\] token ids"):
        patch_dataset(sweep, lm, clean[0], corrupted[0], pair_metric, progress=False)
    with pytest.raises(TokenError, match="clean_tokens"):
        patch_dataset(sweep, lm, clean + 100, corrupted, pair_metric, progress=False)
    with pytest.raises(PatchingError, match=r"expected one value per row"):
        patch_dataset(
            sweep, lm, clean, corrupted, lambda logits, pairs: logits[:1, -1, 0], progress=False
        )
    if family == "hf":  # a query sweep runs on a plain model too, pair by pair
        queries = patch_dataset(
            safelens.get_act_patch_attn_head_q_by_pos,
            lm,
            clean,
            corrupted,
            pair_metric,
            n_bootstrap=10,
            progress=False,
        )
        _, clean_cache = run_with_patching_cache(lm, clean[:1])
        single = safelens.get_act_patch_attn_head_q_by_pos(
            lm,
            corrupted[:1],
            clean_cache,
            lambda logits: pair_metric(logits, torch.zeros(len(logits), dtype=torch.long)),
            progress=False,
        )
        assert (queries.per_pair[0] - single).abs().max() <= 1e-5
        assert no_hooks(lm)
    else:
        assert all(not point._forward_hooks for point in lm.hook_dict.values())
