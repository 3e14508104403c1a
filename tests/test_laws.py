"""Laws of the cache operations, checked on random shapes, dtypes and bad inputs.

crop undoes append; branches never see each other's appends; expand then select gives
the prefix row back; save then load is the identity; and a call that raised left the
cache bitwise as it was (and still working).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from safelens import CacheShapeError, KeyValueCache, KeyValueCacheEntry

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
laws = settings(max_examples=40, deadline=None)


@dataclass(frozen=True)
class Shape:
    n_layers: int
    batch: int
    length: int
    n_kv_heads: int
    d_head: int
    dtype: torch.dtype
    seed: int


shapes = st.builds(
    Shape,
    n_layers=st.integers(1, 3),
    batch=st.integers(1, 3),
    length=st.integers(0, 6),
    n_kv_heads=st.integers(1, 3),
    d_head=st.integers(1, 5),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)


def _random(shape: Shape, batch: int, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    size = (batch, length, shape.n_kv_heads, shape.d_head)
    return torch.randn(size, generator=generator).to(shape.dtype)


def _cache(shape: Shape, batch: int | None = None) -> KeyValueCache:
    batch = shape.batch if batch is None else batch
    entries = [
        KeyValueCacheEntry(
            _random(shape, batch, shape.length, shape.seed + 2 * layer),
            _random(shape, batch, shape.length, shape.seed + 2 * layer + 1),
        )
        for layer in range(shape.n_layers)
    ]
    generator = torch.Generator().manual_seed(shape.seed)
    mask = torch.randint(0, 2, (batch, shape.length), generator=generator)
    return KeyValueCache(entries, mask)


def _append(cache: KeyValueCache, shape: Shape, count: int, seed: int) -> None:
    for layer in range(shape.n_layers):
        new = _random(shape, cache.batch_size, count, seed + layer)
        cache.append(layer, new, -new)
    cache.append_attention_mask(torch.ones(cache.batch_size, count, dtype=torch.long))


def _state(cache: KeyValueCache) -> list[torch.Tensor]:
    tensors = [t.clone() for entry in cache for t in (entry.keys, entry.values)]
    return tensors + [cache.previous_attention_mask.clone()]


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1), b.view(-1))


def _unchanged(cache: KeyValueCache, state: list[torch.Tensor]) -> bool:
    now = _state(cache)
    return len(now) == len(state) and all(map(_bitwise, now, state))


@laws
@given(shapes, st.integers(1, 5), st.integers(0, 2**16))
def test_crop_undoes_append(shape: Shape, count: int, seed: int) -> None:
    cache = _cache(shape)
    before = _state(cache)
    _append(cache, shape, count, seed)
    assert cache.sequence_length == shape.length + count
    assert _unchanged(cache.crop(shape.length), before)
    assert _unchanged(cache.crop(-count), before)


@laws
@given(shapes, st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**16))
def test_fork_isolation(shape: Shape, branch_count: int, parent_count: int, seed: int) -> None:
    parent = _cache(shape)
    before = _state(parent)
    first, second = parent.fork(), parent.fork()
    _append(first, shape, branch_count, seed)
    assert _unchanged(parent, before) and _unchanged(second, before)
    first_state = _state(first)
    _append(parent, shape, parent_count, seed + 100)
    assert _unchanged(first, first_state) and _unchanged(second, before)
    assert _unchanged(first.crop(shape.length), before)


@laws
@given(shapes, st.integers(1, 6), st.data())
def test_expand_then_select_is_the_prefix(shape: Shape, n: int, data: st.DataObject) -> None:
    prefix = _cache(shape, batch=1)
    before = _state(prefix)
    row = data.draw(st.integers(-n, n - 1))
    expanded = prefix.expand(n)
    assert expanded.batch_size == n
    assert _unchanged(expanded.select(row), before)
    assert _unchanged(expanded.select([row]), before)
    assert expanded.storages() == prefix.storages()
    _append(expanded, shape, 2, shape.seed)
    assert _unchanged(prefix, before)


@laws
@given(shapes, st.booleans())
def test_save_then_load_is_the_identity(shape: Shape, frozen: bool) -> None:
    cache = _cache(shape)
    if frozen:
        cache.freeze()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "cache.safetensors"
        cache.save(path)
        loaded = KeyValueCache.load(path, device=["cpu"] * shape.n_layers)
    assert _unchanged(loaded, _state(cache))
    assert bool(loaded.frozen) is frozen
    assert len(loaded) == shape.n_layers


def _bad_tensors(shape: Shape) -> st.SearchStrategy[object]:
    good = (shape.batch, 1, shape.n_kv_heads, shape.d_head)
    resized = st.sampled_from([0, 2, 3]).flatmap(
        lambda axis: st.integers(1, 3).map(
            lambda extra: torch.ones(*good[:axis], good[axis] + extra, *good[axis + 1 :])
        )
    )
    return st.one_of(
        resized,
        st.just(torch.ones(good[:3])),
        st.just(torch.ones(*good, 1)),
        st.just(torch.ones(good, dtype=torch.long)),
        st.just(torch.ones(shape.batch, 2, shape.n_kv_heads + 1, shape.d_head)),
        st.just("not a tensor"),
        st.just(None),
    )


def _still_appends(cache: KeyValueCache, shape: Shape, before: list[torch.Tensor]) -> bool:
    _append(cache, shape, 1, shape.seed + 7)
    return _unchanged(cache.crop(shape.length), before) and (
        cache.sequence_length == shape.length + 1
    )


@laws
@given(shapes, st.data(), st.booleans())
def test_failed_append_leaves_the_cache_unchanged(
    shape: Shape, data: st.DataObject, bad_values: bool
) -> None:
    cache = _cache(shape)
    before = _state(cache)
    bad = data.draw(_bad_tensors(shape))
    good = _random(shape, shape.batch, 1, 0)
    layer = data.draw(st.integers(0, shape.n_layers - 1))
    try:
        cache.append(layer, good if bad_values else bad, bad if bad_values else good)
    except CacheShapeError as error:
        assert f"layer {layer}: {'values' if bad_values else 'keys'}" in str(error)
    else:
        raise AssertionError(f"append accepted {bad!r}")
    assert _unchanged(cache, before)
    assert _still_appends(cache, shape, before)


@laws
@given(
    shapes,
    st.sampled_from(
        [
            lambda b: torch.ones(b + 1, 1, dtype=torch.long),
            lambda b: torch.ones(b, 1, 1, dtype=torch.long),
            lambda b: torch.ones(1, dtype=torch.long),
            lambda b: "mask",
            lambda b: None,
        ]
    ),
)
def test_failed_mask_append_leaves_the_cache_unchanged(shape: Shape, make_bad) -> None:
    cache = _cache(shape)
    before = _state(cache)
    try:
        cache.append_attention_mask(make_bad(shape.batch))
    except CacheShapeError as error:
        assert "attention_mask" in str(error)
    else:
        raise AssertionError("append_attention_mask accepted a bad mask")
    assert _unchanged(cache, before)
    assert _still_appends(cache, shape, before)


bad_calls = st.one_of(
    st.tuples(st.just("crop"), st.sampled_from([1.5, True, None, "2", 10**6, -(10**6)])),
    st.tuples(
        st.just("select"),
        st.sampled_from([True, 99, -99, [0, 99], [], 1.5, "0", torch.tensor([0.5])]),
    ),
    st.tuples(st.just("expand"), st.sampled_from([0, -1, 1.5, True, None, "2"])),
)


@laws
@given(shapes, bad_calls, st.booleans())
def test_failed_branching_call_leaves_the_cache_unchanged(
    shape: Shape, call: tuple[str, object], frozen: bool
) -> None:
    name, argument = call
    cache = _cache(shape)
    if frozen:
        cache.freeze()
    before = _state(cache)
    storages = cache.storages()
    try:
        getattr(cache, name)(argument)
    except (CacheShapeError, ValueError, TypeError, IndexError):
        pass
    else:
        raise AssertionError(f"{name}({argument!r}) was accepted")
    assert _unchanged(cache, before)
    assert cache.storages() == storages
    assert bool(cache.frozen) is frozen
    cache.unfreeze()
    assert _still_appends(cache, shape, before)
