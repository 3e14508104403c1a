"""prefill and score_continuations against TransformerLens' uncached forward."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import D_VOCAB, make_model, tokens

from safelens import (
    CacheShapeError,
    KeyValueCache,
    Prefix,
    prefill,
    score_continuations,
)


def snapshot(cache: KeyValueCache) -> list[torch.Tensor]:
    out = [t.clone() for e in cache for t in (e.keys, e.values)]
    return out + [cache.previous_attention_mask.clone()]


def assert_unchanged(cache: KeyValueCache, before: list[torch.Tensor]) -> None:
    after = snapshot(cache)
    assert len(after) == len(before)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert bool(cache.frozen)


def reference_log_probs(model, prefix: torch.Tensor, continuation: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of `continuation` from one uncached run of prefix + continuation."""
    full = torch.cat([prefix, continuation])[None]
    logits = model(full).float().log_softmax(-1)[0]
    start = len(prefix) - 1
    return logits[start : start + len(continuation)].gather(-1, continuation[:, None])[:, 0]


def ragged(count: int, seed: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (count,), generator=generator).tolist()
    return [torch.randint(0, D_VOCAB, (n,), generator=generator) for n in lengths]


@pytest.mark.parametrize(
    "model_args",
    [
        {"positional": "rotary"},
        {"positional": "standard"},
        {"positional": "rotary", "n_kv_heads": 2},
    ],
)
def test_scores_equal_uncached_runs(model_args: dict) -> None:
    model = make_model(**model_args)
    prompt = tokens(1, 12)[0]
    prefix = prefill(model, prompt)
    before = snapshot(prefix.cache)
    continuations = ragged(7)
    scores = score_continuations(model, prefix, continuations, batch_size=3)
    for i, (continuation, got) in enumerate(
        zip(continuations, scores.per_continuation(), strict=True)
    ):
        expected = reference_log_probs(model, prompt, continuation)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(scores.sums[i], expected.sum(), atol=1e-4, rtol=1e-5)
    assert scores.mask.sum().item() == sum(len(c) for c in continuations)
    assert_unchanged(prefix.cache, before)


def test_batch_split_does_not_change_scores() -> None:
    model = make_model("rotary")
    prefix = prefill(model, tokens(1, 10))
    continuations = ragged(9, seed=5)
    whole = score_continuations(model, prefix, continuations)
    tiny_budget = score_continuations(model, prefix, continuations, memory_budget=1)
    in_twos = score_continuations(model, prefix, continuations, batch_size=2, progress=False)
    for other in (tiny_budget, in_twos):
        torch.testing.assert_close(other.log_probs, whole.log_probs, atol=1e-5, rtol=1e-5)
        assert torch.equal(other.mask, whole.mask)


def test_tensor_of_continuations_and_lists_agree() -> None:
    model = make_model("rotary")
    prefix = prefill(model, tokens(1, 6).tolist()[0])
    block = tokens(4, 3, seed=9)
    a = score_continuations(model, prefix, block)
    b = score_continuations(model, prefix, block.tolist())
    torch.testing.assert_close(a.log_probs, b.log_probs)


def test_left_padded_batch_of_prefixes() -> None:
    model = make_model("rotary")
    short, long = tokens(1, 5, seed=2)[0], tokens(1, 9, seed=4)[0]
    batch = torch.zeros(2, 9, dtype=torch.long)
    batch[0, 4:], batch[1] = short, long
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :4] = 0
    prefix = prefill(model, batch, attention_mask=mask)
    assert prefix.batch_size == 2 and prefix.cache.batch_size == 2
    before = snapshot(prefix.cache)
    continuations = ragged(4, seed=11)
    for row, unpadded in ((0, short), (1, long)):
        scores = score_continuations(model, prefix.select(row), continuations)
        for continuation, got in zip(continuations, scores.per_continuation(), strict=True):
            expected = reference_log_probs(model, unpadded, continuation)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert_unchanged(prefix.cache, before)


def test_bfloat16_model_within_tolerance() -> None:
    model = make_model("rotary", dtype=torch.bfloat16)
    prompt = tokens(1, 10)[0]
    prefix = prefill(model, prompt)
    assert prefix.cache[0].keys.dtype == torch.bfloat16
    continuations = ragged(3)
    scores = score_continuations(model, prefix, continuations)
    for continuation, got in zip(continuations, scores.per_continuation(), strict=True):
        expected = reference_log_probs(model, prompt, continuation)
        torch.testing.assert_close(got, expected, atol=0.1, rtol=0.05)


def test_residuals_are_kept_or_not() -> None:
    model = make_model("rotary")
    kept = prefill(model, tokens(1, 6))
    assert kept.residuals is not None and len(kept.residuals) == model.cfg.n_layers
    _, tl_cache = model.run_with_cache(tokens(1, 6))
    torch.testing.assert_close(kept.residuals[1], tl_cache["blocks.1.hook_resid_pre"])
    assert prefill(model, tokens(1, 6), keep_residuals=False).residuals is None


@settings(max_examples=8, deadline=None)
@given(
    prefix_length=st.integers(1, 10),
    lengths=st.lists(st.integers(1, 5), min_size=1, max_size=5),
    seed=st.integers(0, 1000),
)
def test_property_cached_continuations_equal_uncached(
    prefix_length: int, lengths: list[int], seed: int
) -> None:
    model = make_model("rotary")
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, D_VOCAB, (prefix_length,), generator=generator)
    continuations = [torch.randint(0, D_VOCAB, (n,), generator=generator) for n in lengths]
    with torch.no_grad():
        prefix = prefill(model, prompt)
        before = snapshot(prefix.cache)
        scores = score_continuations(model, prefix, continuations, batch_size=2)
        for continuation, got in zip(continuations, scores.per_continuation(), strict=True):
            expected = reference_log_probs(model, prompt, continuation)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert_unchanged(prefix.cache, before)


def test_text_without_tokenizer_is_refused() -> None:
    with pytest.raises(ValueError, match="model has no tokenizer; pass token ids"):
        prefill(make_model("rotary"), "hello world")


def test_bad_prefix_inputs() -> None:
    model = make_model("rotary")
    with pytest.raises(CacheShapeError, match=r"integer token ids \[batch, pos\]"):
        prefill(model, torch.zeros(1, 4))
    with pytest.raises(CacheShapeError, match=r"does not fit the tokens \[batch=1, pos=4\]"):
        prefill(model, tokens(1, 4), attention_mask=torch.ones(1, 5))
    with pytest.raises(CacheShapeError, match="must be left-padded"):
        prefill(model, tokens(1, 4), attention_mask=torch.tensor([[1, 1, 1, 0]]))


def test_bad_continuation_inputs() -> None:
    model = make_model("rotary")
    prefix = prefill(model, tokens(2, 4))
    with pytest.raises(CacheShapeError, match=r"batch-1 prefix, got batch 2; use prefix.select"):
        score_continuations(model, prefix, [[1]])
    one = prefix.select(0)
    with pytest.raises(TypeError, match="needs a Prefix"):
        score_continuations(model, one.cache, [[1]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="continuations is empty"):
        score_continuations(model, one, [])
    with pytest.raises(CacheShapeError, match=r"continuations\[1\] must be a non-empty 1-D"):
        score_continuations(model, one, [[1], []])
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        score_continuations(model, one, [[1]], batch_size=0)
    assert isinstance(one, Prefix)
