"""generate from a frozen prefix against TransformerLens' generate and uncached runs."""

from __future__ import annotations

import pytest
import torch
from models import make_model, tokens
from test_prefix import assert_unchanged, reference_log_probs, snapshot

from safelens import (
    CacheConfigError,
    FrozenCacheError,
    TokenError,
    generate,
    prefill,
    sample_logits,
    score_continuations,
)


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


BAD_GENERATE_CALLS = [
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be a positive int, got 0"),
    ({"max_new_tokens": 2.0}, TypeError, "max_new_tokens must be a positive int, got float 2.0"),
    ({"max_new_tokens": True}, TypeError, "max_new_tokens must be a positive int, got bool True"),
    (
        {"max_new_tokens": 253},
        TokenError,
        r"max_new_tokens=253 after a prefix of 4 positions makes 257 positions, more than the model's context n_ctx=256; generate at most 252 new tokens",
    ),
    ({"n_samples": 0}, ValueError, "n_samples must be a positive int, got 0"),
    ({"n_samples": False}, TypeError, "n_samples must be a positive int, got bool False"),
    ({"do_sample": 1}, TypeError, "do_sample must be True or False, got int 1"),
    ({"temperature": float("nan")}, ValueError, "temperature must be a finite number, got nan"),
    ({"temperature": float("inf")}, ValueError, "temperature must be a finite number, got inf"),
    (
        {"temperature": -1},
        ValueError,
        "temperature must be >= 0 .*got -1; a negative temperature would .* pick the least likely",
    ),
    ({"temperature": "1"}, TypeError, "temperature must be a number, got str '1'"),
    ({"temperature": True}, TypeError, "temperature must be a number, got bool True"),
    ({"top_k": 0}, ValueError, "top_k must be a positive int or None, got 0"),
    ({"top_k": 1.5}, TypeError, "top_k must be a positive int or None, got float 1.5"),
    ({"top_k": True}, TypeError, "top_k must be a positive int or None, got bool True"),
    ({"top_p": 0}, ValueError, r"top_p must be in \(0, 1\] or None, got 0"),
    ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\] or None, got 1.5"),
    ({"top_p": float("nan")}, ValueError, "top_p must be a finite number, got nan"),
    ({"top_p": True}, TypeError, "top_p must be a number, got bool True"),
    ({"seed": 1.5}, TypeError, "seed must be an int or None, got float 1.5"),
    ({"seed": True}, TypeError, "seed must be an int or None, got bool True"),
    ({"seed": 2**64}, ValueError, r"seed must be in \[-2\*\*63, 2\*\*64\)"),
    (
        {"stop_tokens": [-1]},
        TokenError,
        r"stop_tokens holds token id -1 at index \(0,\); ids must be in \[0, d_vocab=61\)",
    ),
    ({"stop_tokens": [3, 61]}, TokenError, r"stop_tokens holds token id 61 at index \(1,\)"),
    (
        {"stop_tokens": [True]},
        TokenError,
        "stop_tokens must hold integer token ids .*got dtype torch.bool",
    ),
    ({"stop_tokens": 5}, TokenError, r"stop_tokens must be rank 1 token ids, got shape \(\)"),
    ({"pad_token": -1}, TokenError, r"pad_token holds token id -1 at index \(0,\)"),
    ({"pad_token": 61}, TokenError, r"pad_token holds token id 61 at index \(0,\)"),
    (
        {"pad_token": True},
        TokenError,
        "pad_token must hold integer token ids .*got dtype torch.bool",
    ),
    (
        {"pad_token": 1.5},
        TokenError,
        "pad_token must hold integer token ids .*got dtype torch.float32",
    ),
    (
        {"model": None},
        TypeError,
        "generate needs a TransformerLens HookedTransformer as model, got NoneType",
    ),
]


@pytest.mark.parametrize(("arguments", "error", "match"), BAD_GENERATE_CALLS)
def test_bad_arguments_leave_the_prefix_unchanged(arguments: dict, error, match: str) -> None:
    model = make_model("rotary")
    prefix = prefill(model, tokens(1, 4))
    before = snapshot(prefix.cache)
    call = {"model": model, "prefix": prefix, "max_new_tokens": 2, **arguments}
    with pytest.raises(error, match=match):
        generate(**call)
    assert_unchanged(prefix.cache, before)


def test_bad_prefixes_are_refused_before_generating() -> None:
    model = make_model("rotary")
    with pytest.raises(TypeError, match="generate needs a Prefix"):
        generate(model, prefill(model, tokens(1, 4)).cache, 2)  # type: ignore[arg-type]
    foreign = prefill(make_model("rotary", d_model=32), tokens(1, 4))
    before = snapshot(foreign.cache)
    with pytest.raises(
        CacheConfigError,
        match="generate: the prefix was made by another model; .*d_head: cfg expects 16, cache has 8",
    ):
        generate(model, foreign, 2)
    assert_unchanged(foreign.cache, before)
    thawed = prefill(model, tokens(1, 4))
    thawed.cache.unfreeze()
    with pytest.raises(FrozenCacheError, match="Prefix.cache is not frozen"):
        generate(model, thawed, 2)


def test_generation_up_to_the_context_limit_matches_transformer_lens() -> None:
    model = make_model("rotary")
    prompt = tokens(1, 250)[0]
    out = generate(model, prefill(model, prompt), 6)
    assert torch.equal(out.tokens[0], tl_greedy(model, prompt, 6))


def test_stop_tokens_as_a_tensor_or_empty() -> None:
    model = make_model("rotary")
    prefix = prefill(model, tokens(1, 9))
    free = generate(model, prefix, 8)
    stop = int(free.tokens[0, 2])
    as_list = generate(model, prefix, 8, stop_tokens=[stop])
    as_tensor = generate(model, prefix, 8, stop_tokens=torch.tensor([stop]))
    assert torch.equal(as_list.tokens, as_tensor.tokens)
    assert torch.equal(as_list.lengths, as_tensor.lengths)
    assert torch.equal(generate(model, prefix, 8, stop_tokens=[]).tokens, free.tokens)


LOGITS = torch.tensor([[0.0, 3.0, 2.9, -5.0]])


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"temperature": -1}, ValueError, "temperature must be >= 0 .*least likely tokens"),
        ({"temperature": float("nan")}, ValueError, "temperature must be a finite number, got nan"),
        ({"top_k": 0}, ValueError, "top_k must be a positive int or None, got 0"),
        ({"top_p": -0.5}, ValueError, r"top_p must be in \(0, 1\] or None, got -0.5"),
        (
            {"logits": LOGITS[0]},
            ValueError,
            r"logits must be \[batch, d_vocab\] .*got shape \(4,\); for one row pass logits\[None\]",
        ),
        (
            {"logits": torch.zeros(1, 0)},
            ValueError,
            r"logits must be \[batch, d_vocab\] with batch, d_vocab >= 1, got shape \(1, 0\)",
        ),
        (
            {"logits": torch.tensor([[1, 2]])},
            TypeError,
            "logits must be a floating tensor .*got torch.int64",
        ),
        ({"logits": [[0.0, 1.0]]}, TypeError, "logits must be a floating tensor .*got list"),
        ({"logits": torch.tensor([[0.0, float("nan")]])}, ValueError, "logits hold NaN or \\+inf"),
        ({"logits": torch.tensor([[0.0, float("inf")]])}, ValueError, "logits hold NaN or \\+inf"),
        ({"logits": torch.full((1, 3), float("-inf"))}, ValueError, "a row with no finite logit"),
        ({"generator": 0}, TypeError, "generator must be a torch.Generator or None, got int"),
    ],
)
def test_sample_logits_refuses_bad_arguments(arguments: dict, error, match: str) -> None:
    with pytest.raises(error, match=match):
        sample_logits(**{"logits": LOGITS, **arguments})


def test_sample_logits_top_k_past_the_vocabulary_keeps_every_token() -> None:
    logits = torch.tensor([[0.0, 0.1, 0.2]]).expand(300, -1)
    drawn = sample_logits(logits, top_k=10, generator=torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) == {0, 1, 2}
