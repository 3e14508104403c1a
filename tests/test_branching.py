"""Branching a cache: fork, expand, crop, select, clone and `with cache.frozen()`."""

from __future__ import annotations

import pytest
import torch
from models import make_model, ones_mask, tokens

from safelens import CacheShapeError, KeyValueCache, KeyValueCacheEntry


def _prefix(model, length: int = 6, batch: int = 1, seed: int = 1) -> KeyValueCache:
    cache = KeyValueCache.init_cache(model.cfg, "cpu", batch_size=batch)
    prompt = tokens(batch, length, seed=seed)
    model(prompt, past_kv_cache=cache, attention_mask=ones_mask(batch, length))
    return cache


def _small(batch: int = 1, length: int = 4) -> KeyValueCache:
    generator = torch.Generator().manual_seed(3)
    entries = [
        KeyValueCacheEntry(
            torch.randn(batch, length, 2, 4, generator=generator),
            torch.randn(batch, length, 2, 4, generator=generator),
        )
        for _ in range(2)
    ]
    return KeyValueCache(entries, torch.ones(batch, length, dtype=torch.long))


def _state(cache: KeyValueCache) -> list[torch.Tensor]:
    tensors = [t.clone() for entry in cache for t in (entry.keys, entry.values)]
    return tensors + [cache.previous_attention_mask.clone()]


def _same(cache: KeyValueCache, state: list[torch.Tensor]) -> bool:
    now = _state(cache)
    return len(now) == len(state) and all(
        a.shape == b.shape and torch.equal(a, b) for a, b in zip(now, state, strict=True)
    )


def _step(cache: KeyValueCache, value: float) -> None:
    for entry in cache:
        new = torch.full((cache.batch_size, 1, 2, 4), value)
        entry.append(new, new)
    cache.append_attention_mask(torch.ones(cache.batch_size, 1, dtype=torch.long))


# -- fork -------------------------------------------------------------------------------


def test_fork_isolation_both_ways() -> None:
    parent = _small()
    before = _state(parent)
    first, second = parent.fork(), parent.fork()
    _step(first, 1.0)
    _step(first, 1.5)
    assert _same(parent, before)
    assert second.sequence_length == 4
    _step(second, 2.0)
    assert torch.equal(first[0].keys[:, 4:5], torch.full((1, 1, 2, 4), 1.0))
    assert torch.equal(second[0].keys[:, 4:], torch.full((1, 1, 2, 4), 2.0))
    first_state = _state(first)
    _step(parent, 3.0)
    assert _same(first, first_state)
    assert second.sequence_length == 5 and parent.sequence_length == 5
    assert torch.equal(parent[1].values[:, 4:], torch.full((1, 1, 2, 4), 3.0))
    assert torch.equal(second[1].values[:, 4:], torch.full((1, 1, 2, 4), 2.0))


def test_fork_of_a_frozen_prefix_runs_a_multi_step_continuation() -> None:
    model = make_model("rotary")
    full = tokens(1, 12)
    reference = model(full)
    prefix = KeyValueCache.init_cache(model.cfg, "cpu")
    model(full[:, :6], past_kv_cache=prefix, attention_mask=ones_mask(1, 6))
    prefix.freeze()
    before = _state(prefix)
    branch = prefix.fork()
    assert not branch.frozen
    for start in range(6, 12, 2):
        logits = model(
            full[:, start : start + 2], past_kv_cache=branch, attention_mask=ones_mask(1, 2)
        )
        torch.testing.assert_close(logits, reference[:, start : start + 2], atol=1e-5, rtol=1e-5)
    assert branch.sequence_length == 12
    assert _same(prefix, before)


def test_fork_matches_transformer_lens_own_cache() -> None:
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

    model = make_model("rotary")
    prompt, more = tokens(1, 6), tokens(1, 3, seed=9)
    ours = _prefix(model).fork()
    theirs = TransformerLensKeyValueCache.init_cache(model.cfg, "cpu", 1)
    model(prompt, past_kv_cache=theirs, attention_mask=ones_mask(1, 6))
    got = model(more, past_kv_cache=ours, attention_mask=ones_mask(1, 3))
    want = model(more, past_kv_cache=theirs, attention_mask=ones_mask(1, 3))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


# -- expand -----------------------------------------------------------------------------


def test_expand_runs_batched_continuations_like_the_uncached_model() -> None:
    model = make_model("rotary", n_kv_heads=2)
    prompt = tokens(1, 6)
    continuations = tokens(5, 3, seed=7)
    reference = model(torch.cat([prompt.expand(5, 6), continuations], dim=1))
    prefix = _prefix(model)
    prefix.freeze()
    before = _state(prefix)
    expanded = prefix.expand(5)
    logits = model(continuations, past_kv_cache=expanded, attention_mask=ones_mask(5, 3))
    torch.testing.assert_close(logits, reference[:, 6:], atol=1e-5, rtol=1e-5)
    assert _same(prefix, before)
    assert expanded.previous_attention_mask.shape == (5, 9)


def test_expand_shares_the_prefix_storage_and_mask() -> None:
    prefix = _small()
    expanded = prefix.expand(8)
    assert prefix.storages() == expanded.storages()
    assert expanded[0].keys.shape == (8, 4, 2, 4)
    assert expanded[0].keys.stride(0) == 0
    assert expanded.previous_attention_mask.shape == (8, 4)
    assert torch.equal(expanded.previous_attention_mask, torch.ones(8, 4, dtype=torch.long))
    _step(expanded, 1.0)
    assert prefix.storages() <= expanded.storages()
    assert prefix.sequence_length == 4 and prefix.batch_size == 1


def test_n_branches_hold_the_prefix_once() -> None:
    prefix = _prefix(make_model("rotary"), length=12)
    prefix.freeze()
    branches = [prefix.fork() for _ in range(16)]
    for index, branch in enumerate(branches):
        _step_model_shaped(branch, float(index))
    shared = prefix.storages()
    assert all(shared <= branch.storages() for branch in branches)
    own = [branch.storages() - shared for branch in branches]
    assert all(own[i].isdisjoint(own[j]) for i in range(16) for j in range(i))
    expanded = prefix.expand(16)
    assert expanded.storages() == shared


def _step_model_shaped(cache: KeyValueCache, value: float) -> None:
    for entry in cache:
        new = torch.full((cache.batch_size, 1, *entry.keys.shape[2:]), value)
        entry.append(new, new)


@pytest.mark.parametrize(
    ("n", "error", "match"),
    [
        (0, ValueError, "n must be a positive int, got 0"),
        (2.0, ValueError, "n must be a positive int, got 2.0"),
        (True, ValueError, "n must be a positive int, got True"),
    ],
)
def test_expand_bad_n(n, error, match) -> None:
    cache = _small()
    before = _state(cache)
    with pytest.raises(error, match=match):
        cache.expand(n)
    assert _same(cache, before)


def test_expand_needs_batch_one() -> None:
    cache = _small(batch=2)
    before = _state(cache)
    with pytest.raises(CacheShapeError, match="needs a batch-1 cache; this cache has batch 2"):
        cache.expand(3)
    assert _same(cache, before)


# -- crop -------------------------------------------------------------------------------


@pytest.mark.parametrize(("length", "kept"), [(0, 0), (2, 2), (4, 4), (-1, 3), (-4, 0)])
def test_crop(length: int, kept: int) -> None:
    cache = _small()
    before = _state(cache)
    cropped = cache.crop(length)
    assert cropped.sequence_length == kept
    assert torch.equal(cropped[1].values, before[3][:, :kept])
    assert torch.equal(cropped.previous_attention_mask, before[-1][:, :kept])
    assert _same(cache, before)


def test_crop_of_a_longer_run_then_continue_equals_the_shorter_run() -> None:
    model = make_model("rotary")
    full = tokens(1, 10)
    reference = model(full[:, :8])
    cache = _prefix(model, length=10)
    cropped = cache.crop(-4)
    logits = model(full[:, 6:8], past_kv_cache=cropped, attention_mask=ones_mask(1, 2))
    torch.testing.assert_close(logits, reference[:, 6:8], atol=1e-5, rtol=1e-5)
    assert cache.sequence_length == 10


@pytest.mark.parametrize(
    ("length", "error", "match"),
    [
        (5, ValueError, r"length must be in \[-4, 4\] for a cache of 4 positions, got 5"),
        (-5, ValueError, r"length must be in \[-4, 4\].*got -5"),
        (1.0, TypeError, "length must be an int, got float"),
        (True, TypeError, "length must be an int, got bool"),
    ],
)
def test_crop_bad_length(length, error, match) -> None:
    cache = _small()
    before = _state(cache)
    with pytest.raises(error, match=match):
        cache.crop(length)
    assert _same(cache, before)


# -- select -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "picked"),
    [
        (2, [2]),
        (-1, [3]),
        ([0, 2], [0, 2]),
        ([3, 3, 0], [3, 3, 0]),
        (slice(1, 3), [1, 2]),
        (torch.tensor([1, 0]), [1, 0]),
        (torch.tensor([True, False, False, True]), [0, 3]),
        ([True, False, True, False], [0, 2]),
        (None, torch.arange(4)[None].reshape(-1).tolist()),  # torch's meaning: every row
    ],
)
def test_select(rows, picked: list[int]) -> None:
    cache = _small(batch=4)
    before = _state(cache)
    chosen = cache.select(rows)
    assert chosen.batch_size == len(picked)
    assert torch.equal(chosen[0].keys, before[0][picked])
    assert torch.equal(chosen.previous_attention_mask, before[-1][picked])
    assert chosen.storages().isdisjoint(cache.storages())
    assert _same(cache, before)


def test_selected_rows_continue_like_the_uncached_model() -> None:
    model = make_model("rotary")
    prompts = tokens(3, 6)
    more = tokens(2, 2, seed=4)
    reference = model(torch.cat([prompts[[2, 0]], more], dim=1))
    chosen = _prefix(model, batch=3).select([2, 0])
    logits = model(more, past_kv_cache=chosen, attention_mask=ones_mask(2, 2))
    torch.testing.assert_close(logits, reference[:, 6:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("rows", "error", "match"),
    [
        (4, IndexError, "rows 4 do not index a batch of 4 rows"),
        ([0, 9], IndexError, r"rows \[0, 9\] do not index a batch of 4 rows"),
        (
            torch.tensor([0.5]),
            TypeError,
            "integer \\(or bool mask\\) tensor, got dtype torch.float32",
        ),
        ([1.7], TypeError, r"list of ints or an integer tensor, got \[1.7\]; torch would read"),
        ([1, True], TypeError, r"got \[1, True\]"),
        ([], IndexError, r"rows \[\] select no row of a batch of 4"),
        (torch.tensor([False] * 4), IndexError, "select no row"),
        (
            True,
            TypeError,
            "rows must be an int, a slice, a list of ints or an integer tensor, got True",
        ),
        (1.0, TypeError, "got 1.0"),
        ("0", TypeError, "got '0'"),
    ],
)
def test_select_bad_rows(rows, error, match) -> None:
    cache = _small(batch=4)
    before = _state(cache)
    with pytest.raises(error, match=match):
        cache.select(rows)
    assert _same(cache, before)


# -- clone ------------------------------------------------------------------------------


def test_clone_is_independent() -> None:
    cache = _small()
    cache.freeze()
    copy = cache.clone()
    assert copy.frozen
    assert copy.storages().isdisjoint(cache.storages())
    assert _same(copy, _state(cache))
    copy.unfreeze()
    cache.unfreeze()
    before = _state(cache)
    _step(copy, 5.0)
    copy[0].keys.add_(1.0)
    assert _same(cache, before)
    copy_state = _state(copy)
    _step(cache, 6.0)
    assert _same(copy, copy_state)


def test_clone_of_an_expanded_cache_owns_every_row() -> None:
    expanded = _small().expand(3)
    copy = expanded.clone()
    assert copy[0].keys.stride(0) != 0
    copy[0].keys[0].zero_()
    assert not torch.equal(expanded[0].keys[0], copy[0].keys[0])


# -- frozen() ---------------------------------------------------------------------------


def test_frozen_block_stores_nothing_and_restores() -> None:
    model = make_model("rotary")
    cache = _prefix(model)
    before = _state(cache)
    with cache.frozen():
        assert cache.frozen and all(entry.frozen for entry in cache)
        model(tokens(1, 2, seed=5), past_kv_cache=cache, attention_mask=ones_mask(1, 2))
    assert not cache.frozen and not any(entry.frozen for entry in cache)
    assert _same(cache, before)


@pytest.mark.parametrize("was_frozen", [False, True])
def test_frozen_block_restores_when_it_raises(was_frozen: bool) -> None:
    cache = _small()
    if was_frozen:
        cache.freeze()
    with pytest.raises(RuntimeError, match="inside"):
        with cache.frozen():
            raise RuntimeError("inside")
    assert bool(cache.frozen) is was_frozen
    assert all(bool(entry.frozen) is was_frozen for entry in cache)


def test_branches_of_a_frozen_block_are_unfrozen() -> None:
    cache = _small()
    with cache.frozen():
        assert not cache.fork().frozen
        assert not cache.expand(2).frozen
        assert not cache.crop(2).frozen
        assert not cache.select(0).frozen
        assert cache.clone().frozen
