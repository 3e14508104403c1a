"""generate from a frozen prefix against TransformerLens' generate and uncached runs."""

from __future__ import annotations

import pytest
import torch
from models import make_model, tokens
from test_prefix import assert_unchanged, reference_log_probs, snapshot

from safelens import generate, prefill, sample_logits, score_continuations


def tl_greedy(model, prompt: torch.Tensor, new: int, cached: bool = True) -> torch.Tensor:
    out = model.generate(
        input=prompt[None],
        max_new_tokens=new,
        do_sample=False,
        use_past_kv_cache=cached,
        verbose=False,
        stop_at_eos=False,
    )
    return out[0, len(prompt) :]


@pytest.mark.parametrize(
    ("model_args", "cached"),
    [
        ({"positional": "rotary"}, True),
        ({"positional": "rotary", "n_kv_heads": 2}, True),
        # TransformerLens' cached generate drifts from its uncached one on this model;
        # the uncached run is the reference.
        ({"positional": "standard", "n_kv_heads": 2}, False),
    ],
)
def test_greedy_matches_transformer_lens_generate(model_args: dict, cached: bool) -> None:
    model = make_model(**model_args)
    prompt = tokens(1, 9)[0]
    prefix = prefill(model, prompt)
    before = snapshot(prefix.cache)
    out = generate(model, prefix, 12, n_samples=2)
    expected = tl_greedy(model, prompt, 12, cached=cached)
    assert torch.equal(out.tokens[0], expected) and torch.equal(out.tokens[1], expected)
    assert out.lengths.tolist() == [12, 12]
    assert_unchanged(prefix.cache, before)


def test_log_probs_equal_scores_and_uncached_run() -> None:
    model = make_model("rotary")
    prompt = tokens(1, 7)[0]
    prefix = prefill(model, prompt)
    out = generate(model, prefix, 6, n_samples=3, do_sample=True, seed=4, temperature=1.5)
    scores = score_continuations(model, prefix, out.tokens)
    torch.testing.assert_close(out.log_probs, scores.log_probs, atol=1e-5, rtol=1e-5)
    for row, log_probs in zip(out.tokens, out.log_probs, strict=True):
        expected = reference_log_probs(model, prompt, row)
        torch.testing.assert_close(log_probs, expected, atol=1e-5, rtol=1e-5)


def test_sampling_is_reproducible_from_a_seed() -> None:
    model = make_model("rotary")
    prefix = prefill(model, tokens(1, 5))
    a = generate(model, prefix, 10, n_samples=4, do_sample=True, seed=7, top_p=0.9)
    b = generate(model, prefix, 10, n_samples=4, do_sample=True, seed=7, top_p=0.9)
    c = generate(model, prefix, 10, n_samples=4, do_sample=True, seed=8, top_p=0.9)
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens, c.tokens)
    assert len({tuple(row) for row in a.tokens.tolist()}) > 1


def test_top_k_one_and_zero_temperature_are_greedy() -> None:
    model = make_model("rotary")
    prefix = prefill(model, tokens(1, 5))
    greedy = generate(model, prefix, 8)
    top1 = generate(model, prefix, 8, n_samples=3, do_sample=True, top_k=1, seed=0)
    cold = generate(model, prefix, 8, do_sample=True, temperature=0.0)
    assert torch.equal(top1.tokens, greedy.tokens.expand(3, -1))
    assert torch.equal(cold.tokens, greedy.tokens)


def test_sample_logits_filters() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -5.0]]).expand(200, -1)
    generator = torch.Generator().manual_seed(0)
    top2 = sample_logits(logits, top_k=2, generator=generator)
    assert set(top2.tolist()) == {1, 2}
    nucleus = sample_logits(logits, top_p=0.3, generator=generator)
    assert set(nucleus.tolist()) == {1}


def test_stop_tokens_finish_samples_and_pad() -> None:
    model = make_model("rotary")
    prompt = tokens(1, 9)[0]
    prefix = prefill(model, prompt)
    free = generate(model, prefix, 12)
    stop = int(free.tokens[0, 3])
    first = free.tokens[0].tolist().index(stop)
    out = generate(model, prefix, 12, stop_tokens=[stop], pad_token=60)
    assert out.lengths.tolist() == [first + 1]
    assert torch.equal(out.tokens[0, : first + 1], free.tokens[0, : first + 1])
    assert (out.tokens[0, first + 1 :] == 60).all()
    assert (out.log_probs[0, first + 1 :] == 0).all()


def test_left_padded_batch_of_prefixes() -> None:
    model = make_model("rotary")
    short, long = tokens(1, 4, seed=2)[0], tokens(1, 8, seed=3)[0]
    batch = torch.zeros(2, 8, dtype=torch.long)
    batch[0, 4:], batch[1] = short, long
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :4] = 0
    prefix = prefill(model, batch, attention_mask=mask)
    before = snapshot(prefix.cache)
    out = generate(model, prefix, 6, n_samples=2)
    assert out.tokens.shape == (4, 6)
    for rows, unpadded in ((slice(0, 2), short), (slice(2, 4), long)):
        assert (out.tokens[rows] == tl_greedy(model, unpadded, 6)).all()
    single = generate(model, prefix, 6)
    assert torch.equal(single.tokens, out.tokens[::2])
    assert_unchanged(prefix.cache, before)


def test_bfloat16_greedy() -> None:
    model = make_model("rotary", dtype=torch.bfloat16)
    prompt = tokens(1, 6)[0]
    out = generate(model, prefill(model, prompt), 5)
    assert torch.equal(out.tokens[0], tl_greedy(model, prompt, 5))


def test_bad_arguments() -> None:
    model = make_model("rotary")
    prefix = prefill(model, tokens(1, 4))
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int, got 0"):
        generate(model, prefix, 0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        generate(model, prefix, 2, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        generate(model, prefix, 2, do_sample=True, temperature=-1)
    with pytest.raises(TypeError, match="generate needs a Prefix"):
        generate(model, prefix.cache, 2)  # type: ignore[arg-type]
