"""prefill and score_continuations against TransformerLens' uncached forward."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import D_VOCAB, make_model, tokens

from safelens import (
    CacheConfigError,
    CacheShapeError,
    FrozenCacheError,
    KeyValueCache,
    Prefix,
    TokenError,
    prefill,
    score_continuations,
)

N_CTX = 256


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


@pytest.mark.parametrize(
    ("tokens_or_text", "error", "match"),
    [
        (
            torch.zeros(1, 4),
            TokenError,
            r"tokens_or_text must hold integer token ids \(torch.long\), got dtype torch.float32",
        ),
        (
            torch.ones(1, 4, dtype=torch.bool),
            TokenError,
            "got dtype torch.bool. Token ids index the embedding",
        ),
        (
            torch.tensor([[3, -1]]),
            TokenError,
            r"token id -1 at index \(0, 1\); ids must be in \[0, d_vocab=61\)",
        ),
        (
            torch.tensor([[3, 61]]),
            TokenError,
            r"token id 61 at index \(0, 1\); ids must be in \[0, d_vocab=61\)",
        ),
        ([[1, 2], [3]], TokenError, "tokens_or_text must be integer token ids, got list"),
        (
            torch.zeros(1, N_CTX + 1, dtype=torch.long),
            TokenError,
            "257 positions: 257 in all, more than the model's context n_ctx=256",
        ),
        (
            torch.zeros(1, 0, dtype=torch.long),
            TokenError,
            r"must hold at least one position, got shape \(1, 0\)",
        ),
        (
            torch.zeros(0, 3, dtype=torch.long),
            TokenError,
            r"\[batch, pos\] \(or \[pos\]\) with batch >= 1, got shape \(0, 3\)",
        ),
        (
            torch.zeros(1, 2, 3, dtype=torch.long),
            TokenError,
            r"\[batch, pos\] \(or \[pos\]\) with batch >= 1, got shape \(1, 2, 3\)",
        ),
        (["text", 3], TypeError, "tokens_or_text mixes text and token ids"),
    ],
)
def test_prefill_refuses_bad_tokens(tokens_or_text, error, match: str) -> None:
    with pytest.raises(error, match=match):
        prefill(make_model("rotary"), tokens_or_text)


@pytest.mark.parametrize(
    ("mask", "error", "match"),
    [
        (torch.ones(1, 5), CacheShapeError, r"does not fit the tokens \[batch=1, pos=4\]"),
        (torch.tensor([[1, 1, 1, 0]]), CacheShapeError, "must be left-padded"),
        (
            torch.tensor([[0, 2, 1, 1]]),
            CacheShapeError,
            r"only 0 \(padding\) and 1 \(real token\), got values \[0, 1, 2\]",
        ),
        (
            torch.tensor([[1.0, float("nan"), 1.0, 1.0]]),
            CacheShapeError,
            "only 0 .* and 1 .*, got values",
        ),
        ("ones", CacheShapeError, "attention_mask must be a .* tensor of 0s and 1s, got str"),
    ],
)
def test_prefill_refuses_bad_masks(mask, error, match: str) -> None:
    with pytest.raises(error, match=match):
        prefill(make_model("rotary"), tokens(1, 4), attention_mask=mask)


def test_prefill_accepts_bool_and_float_masks_of_zeros_and_ones() -> None:
    model = make_model("rotary")
    batch = tokens(2, 5)
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    expected = prefill(model, batch, attention_mask=mask)
    for other in (mask.bool(), mask.float()):
        got = prefill(model, batch, attention_mask=other)
        assert torch.equal(got.attention_mask, expected.attention_mask)
        torch.testing.assert_close(got.last_logits, expected.last_logits)


def test_prefill_refuses_bad_model_and_flags() -> None:
    with pytest.raises(
        TypeError, match="prefill needs a TransformerLens HookedTransformer as model, got str"
    ):
        prefill("gpt2", tokens(1, 4))
    with pytest.raises(TypeError, match="keep_residuals must be True or False, got int 1"):
        prefill(make_model("rotary"), tokens(1, 4), keep_residuals=1)  # type: ignore[arg-type]


def test_prefill_at_the_context_limit_matches_transformer_lens() -> None:
    model = make_model("rotary")
    prompt = tokens(1, N_CTX - 1)[0]
    prefix = prefill(model, prompt)
    continuation = tokens(1, 1, seed=4)[0]
    scores = score_continuations(model, prefix, [continuation])
    expected = reference_log_probs(model, prompt, continuation)
    torch.testing.assert_close(scores.log_probs[0], expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(
        TokenError,
        match="continuations\\[0\\] has 2 positions after 255 cached positions: 257 in all",
    ):
        score_continuations(model, prefix, [tokens(1, 2, seed=4)[0]])


BAD_SCORE_CALLS = [
    (
        {"continuations": [[3, -1]]},
        TokenError,
        r"continuations\[0\] holds token id -1 at index \(1,\); ids must be in \[0, d_vocab=61\)",
    ),
    (
        {"continuations": [[2], [61]]},
        TokenError,
        r"continuations\[1\] holds token id 61 at index \(0,\)",
    ),
    (
        {"continuations": [[True, False]]},
        TokenError,
        r"continuations\[0\] must hold integer token ids \(torch.long\), got dtype torch.bool",
    ),
    (
        {"continuations": torch.ones(2, 3, dtype=torch.bool)},
        TokenError,
        r"continuations must hold integer token ids \(torch.long\), got dtype torch.bool",
    ),
    (
        {"continuations": torch.tensor([[1, 2], [3, 99]])},
        TokenError,
        r"continuations holds token id 99 at index \(1, 1\)",
    ),
    (
        {"continuations": [[1.0, 2.0]]},
        TokenError,
        r"continuations\[0\] must hold integer token ids \(torch.long\), got dtype torch.float32",
    ),
    (
        {"continuations": [list(range(50)) * 5]},
        TokenError,
        r"continuations\[0\] has 250 positions after 8 cached positions: 258 in all, more than the model's context n_ctx=256",
    ),
    (
        {"continuations": [[1], []]},
        TokenError,
        r"continuations\[1\] must hold at least one position, got shape \(0,\)",
    ),
    (
        {"continuations": [[[1, 2]]]},
        TokenError,
        r"continuations\[0\] must be rank 1 token ids, got shape \(1, 2\)",
    ),
    (
        {"continuations": torch.zeros(2, 3, 4, dtype=torch.long)},
        TokenError,
        r"as one tensor must be \[n, new_tokens\], got shape \(2, 3, 4\); pass a list",
    ),
    ({"continuations": []}, ValueError, "continuations is empty"),
    ({"continuations": "abc"}, TypeError, "continuations must be a list of 1-D token tensors"),
    ({"batch_size": 0}, ValueError, "batch_size must be a positive int or None, got 0"),
    ({"batch_size": -2}, ValueError, "batch_size must be a positive int or None, got -2"),
    ({"batch_size": True}, TypeError, "batch_size must be a positive int or None, got bool True"),
    ({"batch_size": 2.0}, TypeError, "batch_size must be a positive int or None, got float 2.0"),
    ({"batch_size": "2"}, TypeError, "batch_size must be a positive int or None, got str '2'"),
    (
        {"memory_budget": 0},
        ValueError,
        r"memory_budget must be a positive int \(bytes\) or None, got 0",
    ),
    (
        {"memory_budget": -1},
        ValueError,
        r"memory_budget must be a positive int \(bytes\) or None, got -1",
    ),
    (
        {"memory_budget": False},
        TypeError,
        r"memory_budget must be a positive int \(bytes\) or None, got bool False",
    ),
    (
        {"memory_budget": 1e9},
        TypeError,
        r"memory_budget must be a positive int \(bytes\) or None, got float 1000000000.0",
    ),
    (
        {"memory_budget": "1GB"},
        TypeError,
        r"memory_budget must be a positive int \(bytes\) or None, got str '1GB'",
    ),
    ({"progress": 1}, TypeError, "progress must be True or False or None, got int 1"),
    ({"progress": "yes"}, TypeError, "progress must be True or False or None, got str 'yes'"),
    (
        {"model": "gpt2"},
        TypeError,
        "score_continuations needs a TransformerLens HookedTransformer as model, got str",
    ),
]


@pytest.mark.parametrize(("arguments", "error", "match"), BAD_SCORE_CALLS)
def test_bad_score_arguments_leave_the_prefix_unchanged(arguments: dict, error, match: str) -> None:
    model = make_model("rotary")
    prefix = prefill(model, tokens(1, 8))
    before = snapshot(prefix.cache)
    call = {"model": model, "prefix": prefix, "continuations": [[1, 2]], **arguments}
    with pytest.raises(error, match=match):
        score_continuations(**call)
    assert_unchanged(prefix.cache, before)


def test_negative_token_id_is_not_read_as_the_last_vocabulary_entry() -> None:
    model = make_model("rotary")
    prefix = prefill(model, tokens(1, 5))
    with pytest.raises(TokenError, match="token id -1"):
        score_continuations(model, prefix, [[-1]])
    with pytest.raises(TokenError, match="token id -1"):
        prefill(model, torch.tensor([4, -1]))


@pytest.mark.parametrize(
    ("other", "match"),
    [
        (
            {"d_model": 32},
            r"score_continuations: the prefix was made by another model; the cache does not fit the model config: d_head: cfg expects 16, cache has 8",
        ),
        (
            {"n_layers": 3},
            r"the prefix was made by another model; .*layers: cfg expects 2, cache has 3",
        ),
        (
            {"n_kv_heads": 2},
            r"the prefix was made by another model; .*n_kv_heads: cfg expects 4, cache has 2",
        ),
        (
            {"dtype": torch.bfloat16},
            r"the prefix was made by another model; .*dtype: cfg expects torch.float32, cache has torch.bfloat16",
        ),
    ],
)
def test_prefix_from_another_model_is_refused(other: dict, match: str) -> None:
    model = make_model("rotary")
    prefix = prefill(make_model("rotary", **other), tokens(1, 6))
    before = snapshot(prefix.cache)
    with pytest.raises(CacheConfigError, match=match):
        score_continuations(model, prefix, [[1, 2]])
    assert_unchanged(prefix.cache, before)


def test_prefix_with_logits_of_another_vocabulary_is_refused() -> None:
    model = make_model("rotary")
    prefix = prefill(model, tokens(1, 6))
    narrow = Prefix(prefix.cache, prefix.tokens, prefix.attention_mask, prefix.last_logits[:, :50])
    with pytest.raises(
        CacheConfigError,
        match="made by another model; last_logits: cfg expects d_vocab_out=61, prefix has 50",
    ):
        score_continuations(model, narrow, [[1, 2]])


def test_prefix_parts_must_agree() -> None:
    model = make_model("rotary")
    prefix = prefill(model, tokens(1, 6))
    cache, toks, mask, last = prefix.cache, prefix.tokens, prefix.attention_mask, prefix.last_logits
    with pytest.raises(
        CacheShapeError,
        match=r"Prefix.cache has shape \(1, 6\); expected \[batch=1, pos_so_far=5\] to match the prefix tokens \[batch=1, pos=5\]",
    ):
        Prefix(cache, toks[:, :5], mask[:, :5], last)
    with pytest.raises(
        CacheShapeError,
        match=r"Prefix.attention_mask has shape \(1, 5\); expected \[batch=1, pos=6\]",
    ):
        Prefix(cache, toks, mask[:, :5], last)
    with pytest.raises(
        CacheShapeError,
        match=r"Prefix.last_logits has shape \(61,\); expected \[batch=1, d_vocab\]",
    ):
        Prefix(cache, toks, mask, last[0])
    with pytest.raises(
        CacheShapeError,
        match=r"Prefix.residuals\[1\] has shape \(1, 4, 64\); expected \[batch=1, pos=6, d_model\]",
    ):
        Prefix(cache, toks, mask, last, (prefix.residuals[0], prefix.residuals[1][:, :4]))
    with pytest.raises(TokenError, match="Prefix.tokens must hold integer token ids"):
        Prefix(cache, toks.float(), mask, last)
    with pytest.raises(
        TypeError, match=r"a Prefix holds a KeyValueCache and tensors .*got \['list'"
    ):
        Prefix([], toks, mask, last)  # type: ignore[arg-type]
    unfrozen = cache.fork()
    with pytest.raises(
        FrozenCacheError, match=r"Prefix.cache is not frozen, .* call prefix.cache.freeze\(\)"
    ):
        Prefix(unfrozen, toks, mask, last)


def test_prefix_changed_after_it_was_made_is_refused() -> None:
    model = make_model("rotary")
    prefix = prefill(model, tokens(1, 6))
    prefix.cache.unfreeze()
    with pytest.raises(FrozenCacheError, match="Prefix.cache is not frozen"):
        score_continuations(model, prefix, [[1, 2]])
    new = torch.zeros(1, 1, 4, 16)
    for layer in range(model.cfg.n_layers):
        prefix.cache.append(layer, new, new)
    prefix.cache.freeze()
    with pytest.raises(
        CacheShapeError,
        match=r"Prefix.cache has shape \(1, 7\); expected \[batch=1, pos_so_far=6\]",
    ):
        score_continuations(model, prefix, [[1, 2]])


@pytest.mark.parametrize(
    ("row", "error", "match"),
    [
        (True, TypeError, "row must be an int, got bool True"),
        (0.0, TypeError, "row must be an int, got float 0.0"),
        ("0", TypeError, "row must be an int, got str '0'"),
        (2, IndexError, "row 2 is out of range for a prefix of batch 2"),
        (-3, IndexError, "row -3 is out of range for a prefix of batch 2"),
    ],
)
def test_select_refuses_bad_rows(row, error, match: str) -> None:
    prefix = prefill(make_model("rotary"), tokens(2, 4))
    before = snapshot(prefix.cache)
    with pytest.raises(error, match=match):
        prefix.select(row)
    assert_unchanged(prefix.cache, before)


def test_select_negative_rows() -> None:
    prefix = prefill(make_model("rotary"), tokens(3, 4))
    for row in (-1, -2, -3):
        assert torch.equal(prefix.select(row).tokens, prefix.tokens[row][None])


def test_batch_of_prefixes_needs_select() -> None:
    model = make_model("rotary")
    prefix = prefill(model, tokens(2, 4))
    with pytest.raises(CacheShapeError, match=r"batch-1 prefix, got batch 2; use prefix.select"):
        score_continuations(model, prefix, [[1]])
    with pytest.raises(TypeError, match="needs a Prefix"):
        score_continuations(model, prefix.cache, [[1]])  # type: ignore[arg-type]


def test_prefill_keeps_only_its_own_threads_residuals() -> None:
    import threading

    from transformer_lens import HookedTransformer

    model = HookedTransformer(make_model().cfg)  # a model of its own: hooks are added here
    prompt, other = tokens(1, 6, seed=21), tokens(2, 4, seed=22)
    paused, resume = threading.Event(), threading.Event()
    prefill_thread: list[int] = []

    def pause(tensor, hook):
        if threading.get_ident() in prefill_thread:
            paused.set()
            resume.wait(timeout=30)

    model.add_hook("blocks.1.hook_resid_pre", pause)
    result: list[Prefix] = []

    def run() -> None:
        prefill_thread.append(threading.get_ident())
        result.append(prefill(model, prompt))

    worker = threading.Thread(target=run)
    worker.start()
    try:
        assert paused.wait(timeout=30)
        model(other)  # another thread's forward while prefill is inside its pass
    finally:
        resume.set()
        worker.join()
    model.reset_hooks()
    _, reference = model.run_with_cache(prompt)
    assert result[0].residuals is not None
    for layer, resid in enumerate(result[0].residuals):
        assert torch.equal(resid, reference[f"blocks.{layer}.hook_resid_pre"])


@pytest.mark.parametrize("pad", ["w0", "w2"])  # w2 is also the BOS, which stays attended
@pytest.mark.parametrize("rows", [1, 2])
def test_a_tokenizers_left_padding_is_masked_in_every_batch_as_transformer_lens_masks_it(
    pad: str, rows: int
) -> None:
    """TransformerLens' forward masks a left-padding tokenizer's leading pads, a lone prompt's too."""
    from test_patching import left_padding_tokenizer
    from transformer_lens import HookedTransformer

    base = make_model("rotary")
    model = HookedTransformer(
        base.cfg, tokenizer=left_padding_tokenizer(pad), default_padding_side="left"
    )
    model.load_state_dict(base.state_dict())
    model.eval()
    p = model.tokenizer.pad_token_id
    full = torch.tensor([[p, p, 2, 5, 6, 7, 8, 9], [2, 11, 12, 13, 14, 15, 16, 17]])[:rows]
    full = full.to(model.cfg.device)
    with torch.no_grad():
        expected = model(full).log_softmax(-1)
    prefix = prefill(model, full[:, :6])
    for row in range(rows):
        scores = score_continuations(model, prefix.select(row), [full[row, 6:]])
        want = expected[row, 5:7].gather(-1, full[row, 6:, None])[:, 0]
        torch.testing.assert_close(scores.log_probs[0], want, atol=1e-5, rtol=1e-5)


def test_a_model_whose_attention_reads_later_positions_is_refused() -> None:
    """Its prefix's keys and values depend on the tokens after it: no continuation can
    reuse them. Without the refusal, continuations scored 0.2-0.6 off an uncached run."""
    import copy

    from transformer_lens import HookedTransformer

    both_ways = HookedTransformer(make_model().cfg.to_dict() | {"attention_dir": "bidirectional"})
    one_layer = copy.deepcopy(make_model())
    one_layer.blocks[1].attn._attention_dir_override = "bidirectional"
    causal_prefix = prefill(make_model(), tokens(1, 5))
    for model, why in (
        (both_ways, r"cfg.attention_dir='bidirectional'"),
        (one_layer, r"blocks.1.attn attends 'bidirectional'"),
    ):
        with pytest.raises(CacheConfigError, match=rf"prefill: .*reads later positions \({why}\)"):
            prefill(model, tokens(1, 5))
        with pytest.raises(CacheConfigError, match=r"score_continuations: .*reads later"):
            score_continuations(model, causal_prefix, [[1, 2]])


def test_token_ids_are_bounded_by_the_embedding_and_scored_ids_by_the_logits() -> None:
    # An output vocabulary narrower than the input one (cfg.d_vocab_out < cfg.d_vocab): a
    # prompt may hold every id the model embeds; a continuation, which is also scored,
    # only ids the logits have.
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(
        n_layers=2, d_model=32, n_ctx=32, d_head=8, d_vocab=30, d_vocab_out=10, act_fn="gelu"
    )
    model = HookedTransformer(cfg).eval()
    prompt = torch.tensor([1, 25, 3, 29])
    prefix = prefill(model, prompt)
    torch.testing.assert_close(prefix.last_logits[0], model(prompt[None])[0, -1])
    scores = score_continuations(model, prefix, [[4, 7], [9]])
    for continuation, got in zip([[4, 7], [9]], scores.per_continuation(), strict=True):
        expected = reference_log_probs(model, prompt, torch.tensor(continuation))
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(TokenError, match=r"token id 30 .*d_vocab=30"):
        prefill(model, torch.tensor([1, 30]))
    with pytest.raises(TokenError, match=r"token id 25 .*d_vocab=10"):
        score_continuations(model, prefix, [[4, 25]])
