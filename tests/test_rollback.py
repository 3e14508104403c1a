"""A failed forward pass leaves the cache exactly as it was: `safelens.core._rollback`."""

from __future__ import annotations

import threading

import pytest
import torch

import safelens
from safelens import KeyValueCache
from tests.models import make_model, ones_mask, tokens

PREFIX = 6


class Boom(Exception):
    pass


def _stored(cache: KeyValueCache) -> list[torch.Tensor]:
    return [t.clone() for e in cache.entries for t in (e.keys, e.values)] + [
        cache.previous_attention_mask.clone()
    ]


def _same(cache: KeyValueCache, before: list[torch.Tensor]) -> bool:
    now = _stored(cache)
    return len(now) == len(before) and all(
        a.shape == b.shape and torch.equal(a, b) for a, b in zip(now, before, strict=True)
    )


def _raise_at_layer_1(tensor, hook):
    if hook.layer() == 1:
        raise Boom("layer 1")


@pytest.mark.parametrize("name", ["attn.hook_z", "kv_cache.hook_k_new", "kv_cache.hook_v_full"])
def test_a_plain_forward_that_fails_inside_hooks_leaves_the_cache_as_it_was(name) -> None:
    model = make_model(positional="rotary", n_kv_heads=2)
    toks = tokens(1, PREFIX + 2)
    cache = KeyValueCache.init_cache(model.cfg)
    model(toks[:, :PREFIX], past_kv_cache=cache, attention_mask=ones_mask(1, PREFIX))
    before = _stored(cache)
    hook_names = [f"blocks.{layer}.{name}" for layer in range(2)]
    with pytest.raises(Boom):
        with safelens.hooks(model, cache, [(hook_names, _raise_at_layer_1)]):
            model(toks[:, PREFIX:], past_kv_cache=cache, attention_mask=ones_mask(1, 2))
    assert _same(cache, before)
    # The cache still works, and gives TransformerLens' numbers.
    logits = model(toks[:, PREFIX:], past_kv_cache=cache, attention_mask=ones_mask(1, 2))
    torch.testing.assert_close(logits, model(toks)[:, PREFIX:], atol=1e-5, rtol=1e-5)


def test_a_failure_caught_inside_the_block_is_undone_at_once() -> None:
    model = make_model()
    toks = tokens(1, PREFIX + 1)
    cache = KeyValueCache.init_cache(model.cfg)
    model(toks[:, :PREFIX], past_kv_cache=cache, attention_mask=ones_mask(1, PREFIX))
    before = _stored(cache)
    names = ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"]
    with safelens.hooks(model, cache, [(names, _raise_at_layer_1)]):
        with pytest.raises(Boom):
            model(toks[:, PREFIX:], past_kv_cache=cache, attention_mask=ones_mask(1, 1))
        assert _same(cache, before)
    assert not any(point.fwd_hooks for point in model.hook_dict.values())
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_successful_passes_inside_the_block_are_kept() -> None:
    model = make_model()
    toks = tokens(1, PREFIX + 2)
    cache = KeyValueCache.init_cache(model.cfg)
    with pytest.raises(Boom):
        with safelens.hooks(model, cache, []):
            model(toks[:, :PREFIX], past_kv_cache=cache, attention_mask=ones_mask(1, PREFIX))
            raise Boom("after a pass that completed")
    assert cache.sequence_length == PREFIX
    assert all(entry.sequence_length == PREFIX for entry in cache)


def test_an_interrupt_is_undone_when_the_block_exits() -> None:
    model = make_model()
    toks = tokens(1, PREFIX + 1)
    cache = KeyValueCache.init_cache(model.cfg)
    model(toks[:, :PREFIX], past_kv_cache=cache, attention_mask=ones_mask(1, PREFIX))
    before = _stored(cache)

    def interrupt(tensor, hook):
        if hook.layer() == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with safelens.hooks(model, cache, [("blocks.1.attn.hook_z", interrupt)]):
            model(toks[:, PREFIX:], past_kv_cache=cache, attention_mask=ones_mask(1, 1))
    assert _same(cache, before)


def test_another_threads_passes_are_not_guarded_by_this_block() -> None:
    model = make_model()
    toks = tokens(1, PREFIX + 1)
    mine, theirs = KeyValueCache.init_cache(model.cfg), KeyValueCache.init_cache(model.cfg)
    entered, release = threading.Event(), threading.Event()

    def hold_block() -> None:
        with safelens.hooks(model, mine, []):
            entered.set()
            release.wait(timeout=30)

    holder = threading.Thread(target=hold_block)
    holder.start()
    entered.wait(timeout=30)
    try:
        model(toks[:, :PREFIX], past_kv_cache=theirs, attention_mask=ones_mask(1, PREFIX))
    finally:
        release.set()
        holder.join()
    assert theirs.sequence_length == PREFIX and mine.sequence_length == 0
