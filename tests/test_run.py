"""`run_with_hooks` checks a pass before running it, and undoes a failed one."""

from __future__ import annotations

import pytest
import torch

import safelens
from safelens import CacheShapeError, HookError, KeyValueCache, TokenError
from tests.models import D_VOCAB, make_model, ones_mask, tokens

PREFIX = 6


def _prefilled(model) -> KeyValueCache:
    cache = KeyValueCache.init_cache(model.cfg)
    model(tokens(1, PREFIX), past_kv_cache=cache, attention_mask=ones_mask(1, PREFIX))
    return cache


def _stored(cache: KeyValueCache) -> list[torch.Tensor]:
    return [t.clone() for e in cache.entries for t in (e.keys, e.values)] + [
        cache.previous_attention_mask.clone()
    ]


def _same(cache: KeyValueCache, before: list[torch.Tensor]) -> bool:
    now = _stored(cache)
    return all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(now, before, strict=True))


@pytest.mark.parametrize(
    "bad, match",
    [
        (
            torch.tensor([[1, -1]]),
            rf"input holds token id -1 at index \(0, 1\); ids must be in \[0, d_vocab={D_VOCAB}\)",
        ),
        (torch.tensor([[1, D_VOCAB]]), f"input holds token id {D_VOCAB}"),
        (
            torch.tensor([[True, False]]),
            "input must hold integer token ids .* got dtype torch.bool",
        ),
        (torch.tensor([[1.0, 2.0]]), "got dtype torch.float32"),
        (
            torch.zeros(1, 251, dtype=torch.long),
            r"251 positions after 6 cached positions: 257 in all, more than the model's context n_ctx=256",
        ),
        (torch.zeros(1, 1, 2, dtype=torch.long), r"input must be token ids \[batch, pos\]"),
        (torch.zeros(2, 1, dtype=torch.long), "input has batch 2 but the cache holds batch 1"),
    ],
)
def test_bad_tokens_are_refused_before_the_pass(bad, match) -> None:
    model = make_model()
    cache = _prefilled(model)
    before = _stored(cache)
    with pytest.raises((TokenError, CacheShapeError), match=match):
        safelens.run_with_hooks(model, bad, cache=cache)
    with pytest.raises((TokenError, CacheShapeError), match=match):
        safelens.run_with_cache_capture(model, bad, cache=cache)
    assert _same(cache, before)


def test_a_mask_that_does_not_fit_the_input_is_refused() -> None:
    model = make_model()
    cache = _prefilled(model)
    with pytest.raises(
        CacheShapeError, match=r"attention_mask must be \[batch, new_tokens\] = \(1, 2\)"
    ):
        safelens.run_with_hooks(
            model, tokens(1, 2), cache=cache, attention_mask=ones_mask(1, PREFIX + 2)
        )
    assert cache.sequence_length == PREFIX


@pytest.mark.parametrize(
    "args", [dict(stop_at_layer=1), dict(stop_at_layer=-1), dict(start_at_layer=0)]
)
def test_a_pass_that_skips_layers_is_refused_on_an_unfrozen_cache(args) -> None:
    model = make_model()
    cache = _prefilled(model)
    before = _stored(cache)
    which = next(iter(args))
    value = args[which]
    toks = tokens(1, 2) if which == "stop_at_layer" else torch.zeros(1, 2, model.cfg.d_model)
    with pytest.raises(
        CacheShapeError, match=f"{which}={value} with an unfrozen cache would store"
    ):
        safelens.run_with_hooks(model, toks, cache=cache, **args)
    assert _same(cache, before)


def test_stop_at_layer_on_a_frozen_cache_reads_it_and_stores_nothing() -> None:
    model = make_model()
    cache = _prefilled(model)
    before = _stored(cache)
    toks = tokens(2, PREFIX + 2)[:1]
    with cache.frozen():
        resid = safelens.run_with_hooks(model, toks[:, PREFIX:], cache=cache, stop_at_layer=1)
    assert _same(cache, before)
    _, reference = model.run_with_cache(torch.cat([tokens(1, PREFIX), toks[:, PREFIX:]], dim=1))
    torch.testing.assert_close(
        resid, reference["blocks.1.hook_resid_pre"][:, PREFIX:], atol=1e-5, rtol=1e-5
    )
    # And the next full pass still lines up with TransformerLens.
    full = torch.cat([tokens(1, PREFIX), toks[:, PREFIX:]], dim=1)
    logits = safelens.run_with_hooks(model, toks[:, PREFIX:], cache=cache)
    torch.testing.assert_close(logits, model(full)[:, PREFIX:], atol=1e-5, rtol=1e-5)


def test_fwd_hooks_must_be_a_list_of_pairs() -> None:
    model = make_model()
    cache = KeyValueCache.init_cache(model.cfg)
    pair = ("blocks.0.attn.hook_z", lambda t, hook: None)
    with pytest.raises(HookError, match="got one pair .* wrap it in a list"):
        safelens.run_with_hooks(model, tokens(1, 2), cache=cache, fwd_hooks=pair)
    with pytest.raises(HookError, match=r"fwd_hooks\[0\] must be a \(names, fn\) pair"):
        safelens.run_with_hooks(model, tokens(1, 2), cache=cache, fwd_hooks=[("a", "b", "c")])
    with pytest.raises(HookError, match="must be callable as fn\\(tensor, hook\\), got int"):
        safelens.run_with_hooks(model, tokens(1, 2), cache=cache, fwd_hooks=[("hook_embed", 3)])
    assert cache.sequence_length == 0
    assert not any(point.fwd_hooks for point in model.hook_dict.values())
