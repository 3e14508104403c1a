"""`attribution_patch_dataset` against a loop of single-pair `attribution_patch` runs.

Per pair, the estimates must equal `attribution_patch` on that pair alone (its own clean
cache, the metric of its row); the mean and standard error those of the loop's values;
chunks of any size the same. On a HookedTransformer (every site, QK fix), a bridge (QK
fix) and plain HuggingFace Llama and GPT-2 (every site, QK fix).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from bridge_models import bridge
from hf_models import ids, model

from safelens import (
    PatchingError,
    attribution_patch,
    attribution_patch_dataset,
    run_with_patching_cache,
)

EVERY = ["k", "v", "q", "z", "pattern", "resid_pre", "resid_mid", "attn_out", "mlp_out"]
ANSWERS = torch.tensor([3, 7, 2, 9, 4])
WRONG = torch.tensor([5, 1, 8, 6, 11])


def metric(logits: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    last = logits[:, -1]
    rows = torch.arange(len(pairs))
    return last[rows, ANSWERS[pairs]] - last[rows, WRONG[pairs]]


def loop(lm, clean, corrupted, activations, qk_fix) -> tuple[torch.Tensor, dict]:
    """Per pair: `attribution_patch` on that pair alone."""
    baselines, grids = [], {name: [] for name in activations}
    for i in range(clean.shape[0]):
        pair = torch.tensor([i])
        if isinstance(lm, transformers.PreTrainedModel):
            _, clean_cache = run_with_patching_cache(lm, clean[i : i + 1])
        else:
            _, clean_cache = lm.run_with_cache(clean[i : i + 1])
        result = attribution_patch(
            lm,
            corrupted[i : i + 1],
            clean_cache,
            lambda logits, pair=pair: metric(logits, pair).sum(),
            activations=activations,
            qk_fix=qk_fix,
        )
        baselines.append(result.baseline)
        for name in activations:
            grids[name].append(result.estimates[name])
    return torch.stack(baselines), {name: torch.stack(g) for name, g in grids.items()}


def check(lm, clean, corrupted, activations, qk_fix, **kwargs) -> None:
    result = attribution_patch_dataset(
        lm,
        clean,
        corrupted,
        metric,
        activations=activations,
        qk_fix=qk_fix,
        progress=False,
        **kwargs,
    )
    baselines, grids = loop(lm, clean, corrupted, activations, qk_fix)
    torch.testing.assert_close(result.baseline.per_pair, baselines, atol=1e-5, rtol=1e-5)
    pairs = clean.shape[0]
    for name in activations:
        got, expected = result.estimates[name], grids[name]
        torch.testing.assert_close(got.per_pair, expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.mean, expected.mean(0), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.std_err, expected.std(0) / pairs**0.5, atol=1e-4, rtol=1e-4)
        assert bool(
            (got.ci_low <= got.mean + 1e-6).all() and (got.mean <= got.ci_high + 1e-6).all()
        )
        assert (expected - expected.mean(0)).abs().max() > 1e-4  # pairs differ


@pytest.mark.parametrize("max_bytes", [2**30, 1])  # one chunk; one pair per chunk
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_huggingface_pairs_equal_single_pair_attribution(family, max_bytes):
    lm = model(family)
    clean, corrupted = ids(5, 6, seed=11), ids(5, 6, seed=12)
    check(lm, clean, corrupted, EVERY, True, max_bytes=max_bytes)


def test_bridge_pairs_equal_single_pair_attribution_with_the_qk_fix():
    lm = bridge("llama")
    clean, corrupted = ids(4, 6, seed=11), ids(4, 6, seed=12)
    check(lm, clean, corrupted, ["k", "q", "v", "resid_mid"], True)


@pytest.mark.hooked_transformer
def test_hooked_transformer_pairs_equal_single_pair_attribution_at_every_site():
    from models import make_model

    lm = make_model(positional="rotary", n_kv_heads=2)
    clean, corrupted = ids(4, 6, seed=11), ids(4, 6, seed=12)
    check(lm, clean, corrupted, EVERY, True, max_bytes=1)


def test_bad_arguments_are_refused_naming_them():
    lm = model("llama")
    clean, corrupted = ids(3, 6, seed=11), ids(3, 6, seed=12)
    with pytest.raises(PatchingError, match=r"clean_tokens \(3, 5\) and corrupted_tokens \(3, 6\)"):
        attribution_patch_dataset(lm, clean[:, :5], corrupted, metric, activations=["v"])
    with pytest.raises(PatchingError, match=r"one differentiable value per pair, \[3\]"):
        attribution_patch_dataset(
            lm, clean, corrupted, lambda logits, pairs: logits[:, -1, 0].sum(), activations=["v"]
        )
    with pytest.raises(PatchingError, match=r"confidence must be in \(0, 1\)"):
        attribution_patch_dataset(lm, clean, corrupted, metric, activations=["v"], confidence=2.0)
