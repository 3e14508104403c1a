"""`KeyValueCache`: lazy and fixed entries, init_cache, attention mask, freezing, branching."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformer_lens import HookedTransformerConfig
from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

import safelens
from safelens import CacheConfigError, CacheShapeError, KeyValueCache, KeyValueCacheEntry


def kv(batch: int = 1, pos: int = 3, heads: int = 2, d_head: int = 4, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, pos, heads, d_head)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def filled(n_layers: int = 2, batch: int = 1, pos: int = 3) -> KeyValueCache:
    cache = KeyValueCache(
        [KeyValueCacheEntry(*kv(batch, pos, seed=layer)) for layer in range(n_layers)],
        torch.ones(batch, pos, dtype=torch.int),
    )
    return cache


def state(cache: KeyValueCache) -> list[torch.Tensor]:
    mask = cache.previous_attention_mask
    return [t.clone() for e in cache for t in (e.keys, e.values)] + [mask.clone()]


def assert_state(cache: KeyValueCache, before: list[torch.Tensor]) -> None:
    after = state(cache)
    assert len(after) == len(before)
    for a, b in zip(after, before, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


# -- entries --------------------------------------------------------------------------


def test_spec_example_exactly():
    cache = KeyValueCache()
    cache.append(0, keys=[[[1]]], values=[[[2]]])
    cache.append(0, keys=[[[3]]], values=[[[4]]])
    assert cache[0].keys == [[[1], [3]]]
    assert cache[0].sequence_length == 2


def test_lazy_entries_are_created_on_access_and_inherit_frozen():
    cache = KeyValueCache()
    assert len(cache) == 0
    entry = cache[3]
    assert len(cache) == 1 and cache[3] is entry and entry.layer == 3
    assert not entry.frozen and entry.sequence_length == 0
    assert entry.hook_k_new.name == "blocks.3.kv_cache.hook_k_new"
    cache.freeze()
    assert cache[3].frozen and cache[7].frozen
    cache.unfreeze()
    assert not cache[7].frozen and not cache[9].frozen
    assert [e.layer for e in cache] == [3, 7, 9]
    with pytest.raises(IndexError, match="layer must be >= 0 in a lazily filled cache"):
        cache[-1]
    with pytest.raises(TypeError, match="layer must be an int, got str"):
        cache["0"]  # type: ignore[index]


def test_fixed_entries():
    entries = [KeyValueCacheEntry(*kv(seed=i)) for i in range(3)]
    cache = KeyValueCache(entries)
    assert len(cache) == 3 and cache.entries == entries
    assert cache[-1] is entries[2] and [e.layer for e in cache] == [0, 1, 2]
    with pytest.raises(IndexError, match="layer 3 is out of range for a cache of 3 layers"):
        cache[3]
    with pytest.raises(TypeError, match=r"entries\[1\] must be a KeyValueCacheEntry"):
        KeyValueCache([entries[0], "x"])  # type: ignore[list-item]


@pytest.mark.parametrize("dim", [1, -3])
def test_cache_append_is_entry_append(dim):
    cache = filled()
    keys, values = kv(seed=5)
    expected = torch.cat([cache[1].keys, keys], dim=dim)
    full_keys, full_values = cache.append(1, keys, values, dim=dim)
    assert torch.equal(full_keys, expected) and torch.equal(cache[1].keys, expected)
    assert full_values.shape == expected.shape


@pytest.mark.parametrize("dim", [0, 2, 3, -1, -2, -4, 4, 1.0, True, "1"])
def test_a_tensor_cache_grows_along_pos_only(dim):
    cache = filled()
    before = [(e.keys.clone(), e.values.clone()) for e in cache]
    keys, values = kv(seed=5)
    with pytest.raises(
        CacheShapeError, match=r"layer 1: dim=.*grows along pos only \(dim=1 or dim=-3"
    ):
        cache.append(1, keys, values, dim=dim)
    for entry, (k, v) in zip(cache, before, strict=True):
        assert torch.equal(entry.keys, k) and torch.equal(entry.values, v)


def test_nested_lists_still_append_along_any_axis():
    cache = KeyValueCache()
    cache.append(0, keys=[[[1]]], values=[[[2]]], dim=0)
    cache.append(0, keys=[[[3]]], values=[[[4]]], dim=0)
    assert cache[0].keys == [[[1]], [[3]]] and cache[0].values == [[[2]], [[4]]]


def test_numpy_into_a_tensor_cache():
    cache = filled()
    keys, values = kv(pos=1, seed=8)
    full_keys, _ = cache.append(0, keys.numpy(), values.numpy())
    assert isinstance(full_keys, torch.Tensor) and full_keys.dtype == torch.float32
    assert torch.equal(cache[0].keys[:, -1:], keys)


def test_sequence_length_and_batch_size():
    assert KeyValueCache().sequence_length == 0 and KeyValueCache().batch_size == 0
    assert filled(batch=2, pos=5).sequence_length == 5
    assert filled(batch=2, pos=5).batch_size == 2
    masked = KeyValueCache(previous_attention_mask=torch.ones(3, 4, dtype=torch.int))
    assert masked.sequence_length == 4 and masked.batch_size == 3


def test_to_dict():
    cache = filled()
    view = cache.to_dict()
    assert list(view) == [0, 1]
    assert torch.equal(view[1]["keys"], cache[1].keys)
    assert torch.equal(view[1]["values"], cache[1].values)
    assert view[1]["sequence_length"] == 3
    assert KeyValueCache().to_dict() == {}


def test_transformer_lens_names_are_safelens_classes():
    assert safelens.TransformerLensKeyValueCache is KeyValueCache
    assert safelens.HookedTransformerKeyValueCache is KeyValueCache
    assert safelens.TransformerLensKeyValueCacheEntry is KeyValueCacheEntry
    assert safelens.HookedTransformerKeyValueCacheEntry is KeyValueCacheEntry


# -- init_cache -------------------------------------------------------------------------


@pytest.mark.parametrize("n_kv_heads", [None, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_init_cache_matches_transformer_lens(n_kv_heads, dtype):
    cfg = HookedTransformerConfig(
        n_layers=3, d_model=32, n_ctx=8, d_head=8, n_heads=4, n_key_value_heads=n_kv_heads,
        d_vocab=5, act_fn="gelu", dtype=dtype, device="cpu",
    )  # fmt: skip
    ours = KeyValueCache.init_cache(cfg, cfg.device, batch_size=2)
    theirs = TransformerLensKeyValueCache.init_cache(cfg, cfg.device, batch_size=2)
    assert len(ours) == len(theirs.entries) == 3
    for mine, reference in zip(ours, theirs.entries, strict=True):
        for a, b in [(mine.keys, reference.past_keys), (mine.past_values, reference.past_values)]:
            assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)
    mask, reference_mask = ours.previous_attention_mask, theirs.previous_attention_mask
    assert (
        (mask.shape, mask.dtype)
        == (reference_mask.shape, reference_mask.dtype)
        == ((2, 0), torch.int)
    )
    assert not ours.frozen and ours.sequence_length == 0 and ours.batch_size == 2


@pytest.mark.parametrize(
    ("cfg", "shape", "dtype"),
    [
        (SimpleNamespace(n_layer=2, n_head=4, n_embd=32), (1, 0, 4, 8), torch.float32),
        (
            SimpleNamespace(
                num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                head_dim=16, torch_dtype=torch.float16,
            ),
            (1, 0, 2, 16),
            torch.float16,
        ),
        (
            SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, torch_dtype="bfloat16"),
            (1, 0, 4, 16),
            torch.bfloat16,
        ),
        (
            SimpleNamespace(n_layers=2, n_heads=4, d_head=4, dtype="torch.float16"),
            (1, 0, 4, 4),
            torch.float16,
        ),
    ],
)  # fmt: skip
def test_init_cache_reads_hf_style_configs(cfg, shape, dtype):
    cache = KeyValueCache.init_cache(cfg, "cpu")
    assert len(cache) == 2
    for entry in cache:
        assert entry.keys.shape == entry.values.shape == shape
        assert entry.keys.dtype == entry.values.dtype == dtype


def test_init_cache_device_defaults_to_cfg_device():
    cfg = SimpleNamespace(n_layers=1, n_heads=2, d_head=4, device="cpu")
    assert KeyValueCache.init_cache(cfg)[0].keys.device == torch.device("cpu")


def test_init_cache_errors():
    with pytest.raises(
        CacheConfigError, match="has no layer count: expected one of the attributes"
    ):
        KeyValueCache.init_cache(SimpleNamespace(n_heads=2, d_head=4), "cpu")
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        KeyValueCache.init_cache(SimpleNamespace(n_layers=1, n_heads=2, d_head=4), "cpu", 0)


# -- attention mask ---------------------------------------------------------------------


def test_append_attention_mask_extends_the_last_axis():
    cache = KeyValueCache.init_cache(SimpleNamespace(n_layers=1, n_heads=2, d_head=4), "cpu", 2)
    first = cache.append_attention_mask(torch.tensor([[0, 1], [1, 1]]))
    assert first.dtype == torch.int64 and first.tolist() == [[0, 1], [1, 1]]
    full = cache.append_attention_mask(np.array([[1], [0]]))
    assert full.tolist() == [[0, 1, 1], [1, 1, 0]]
    assert torch.equal(cache.previous_attention_mask, full)


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize(
    "dtypes",
    [(torch.int64, torch.int32), (torch.int32, torch.int64), (torch.bool, torch.int16)],
    ids=str,
)
def test_the_mask_takes_transformer_lens_dtypes(dtypes, frozen):
    """`init_cache`'s int32 mask, promoted by what is appended as TL's `torch.cat` does."""
    cfg = HookedTransformerConfig(
        n_layers=1, d_model=8, n_ctx=8, d_head=4, n_heads=2, d_vocab=5, act_fn="gelu", device="cpu"
    )
    ours = KeyValueCache.init_cache(cfg, "cpu", 2)
    theirs = TransformerLensKeyValueCache.init_cache(cfg, "cpu", 2)
    for cache in (ours, theirs):
        cache.frozen = frozen
    for dtype in dtypes:
        mask = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=dtype)
        full, reference = ours.append_attention_mask(mask), theirs.append_attention_mask(mask)
        assert full.dtype == reference.dtype and torch.equal(full, reference)
        held, their_held = ours.previous_attention_mask, theirs.previous_attention_mask
        assert held.dtype == their_held.dtype and torch.equal(held, their_held)


@pytest.mark.parametrize(
    "mask", [torch.tensor([[1, 1, 0]]), np.array([[1, 1, 0]]), [[1, 1, 0]]], ids=type
)
def test_append_attention_mask_without_a_previous_mask(mask):
    cache = KeyValueCache()
    assert cache.previous_attention_mask is None
    full = cache.append_attention_mask(mask)
    assert type(full) is type(mask) and np.asarray(full).tolist() == [[1, 1, 0]]
    again = cache.append_attention_mask(mask)
    assert type(again) is type(mask)
    assert np.asarray(again).tolist() == [[1, 1, 0, 1, 1, 0]]
    assert np.asarray(cache.previous_attention_mask).tolist() == [[1, 1, 0, 1, 1, 0]]


def test_bad_attention_mask_changes_nothing():
    cache = filled(batch=2)
    before = state(cache)
    with pytest.raises(CacheShapeError, match=r"attention_mask of shape \(3, 1\).*batch=2"):
        cache.append_attention_mask(torch.ones(3, 1, dtype=torch.int))
    assert_state(cache, before)


# -- freezing ---------------------------------------------------------------------------


def test_freeze_propagates_and_frozen_stores_nothing_bitwise():
    cache = filled()
    cache.freeze()
    assert cache.frozen and all(e.frozen for e in cache)
    before = state(cache)
    pointers = cache.storages()
    keys, values = kv(pos=2, seed=4)
    full_keys, full_values = cache.append(0, keys, values)
    assert torch.equal(full_keys, torch.cat([before[0], keys], dim=1))
    assert torch.equal(full_values, torch.cat([before[1], values], dim=1))
    full_mask = cache.append_attention_mask(torch.tensor([[1, 0]]))
    assert full_mask.tolist() == [[1, 1, 1, 1, 0]]
    assert_state(cache, before)
    assert cache.storages() == pointers and cache.sequence_length == 3
    cache.unfreeze()
    assert not cache.frozen and not any(e.frozen for e in cache)
    cache.append(0, keys, values)
    assert cache[0].sequence_length == 5


def test_frozen_property_setter_and_context():
    cache = filled()
    cache.frozen = True
    assert all(e.frozen for e in cache)
    cache.frozen = False
    with pytest.raises(RuntimeError, match="inside"), cache.frozen():
        assert all(e.frozen for e in cache)
        raise RuntimeError("inside")
    assert not cache.frozen and not any(e.frozen for e in cache)
    constructed = KeyValueCache([KeyValueCacheEntry(*kv())], frozen=True)
    assert constructed.frozen and constructed[0].frozen


# -- branching and the growing buffer ----------------------------------------------------


def grow(cache: KeyValueCache, steps: int, seed: int) -> None:
    for step in range(steps):
        for layer in range(len(cache)):
            cache.append(layer, *kv(pos=1, seed=seed + step))
        cache.append_attention_mask(torch.ones(1, 1, dtype=torch.int))


def test_one_token_appends_do_not_copy_the_cache():
    cache = KeyValueCache.init_cache(SimpleNamespace(n_layers=2, n_heads=2, d_head=4), "cpu")
    grow(cache, 1, seed=0)
    reallocations = 0
    pointers = cache.storages()
    for step in range(1, 1024):
        grow(cache, 1, seed=step)
        if cache.storages() != pointers:
            reallocations += 1
            pointers = cache.storages()
    # A doubling buffer reallocates about log2(1024) times, not once per token.
    assert reallocations <= 11
    assert cache[0].keys.shape == (1, 1024, 2, 4)
    assert cache.previous_attention_mask.shape == (1, 1024)


@pytest.mark.parametrize("branch", ["fork", "crop", "expand"])
def test_views_survive_branch_then_append(branch):
    cache = filled()
    grow(cache, 2, seed=10)
    handed = [(cache[0].keys, cache[0].keys.clone()), (cache[1].values, cache[1].values.clone())]
    derived = {
        "fork": cache.fork,
        "crop": lambda: cache.crop(3),
        "expand": lambda: cache.expand(1),
    }[branch]()
    assert not derived.frozen
    assert derived.storages() <= cache.storages()
    before = state(cache)
    grow(derived, 3, seed=20)
    assert_state(cache, before)
    grow(cache, 3, seed=30)
    for view, copy in handed:
        assert torch.equal(view, copy)
    assert derived.sequence_length == (3 if branch == "crop" else 5) + 3
    assert torch.equal(
        derived[0].keys[:, -3:], torch.cat([kv(pos=1, seed=20 + s)[0] for s in range(3)], 1)
    )
    assert torch.equal(
        cache[0].keys[:, -3:], torch.cat([kv(pos=1, seed=30 + s)[0] for s in range(3)], 1)
    )


def test_two_forks_never_see_each_other():
    prefix = filled()
    prefix.freeze()
    before = state(prefix)
    left, right = prefix.fork(), prefix.fork()
    grow(left, 2, seed=1)
    grow(right, 4, seed=2)
    assert left.sequence_length == 5 and right.sequence_length == 7
    assert torch.equal(
        left[0].keys[:, 3:], torch.cat([kv(pos=1, seed=1 + s)[0] for s in range(2)], 1)
    )
    assert torch.equal(
        right[0].keys[:, 3:5], torch.cat([kv(pos=1, seed=2 + s)[0] for s in range(2)], 1)
    )
    assert_state(prefix, before)


def test_clone_shares_nothing_and_keeps_frozen():
    cache = filled()
    cache.freeze()
    copy = cache.clone()
    assert copy.frozen and not (copy.storages() & cache.storages())
    assert_state(copy, state(cache))
    select = cache.select([0])
    assert not select.frozen and not (select.storages() & cache.storages())


# -- construction: validated, and never changing what the caller owns ---------------------


def test_entries_of_another_cache_are_branched_not_relabelled():
    source = filled()
    before = state(source)
    swapped = KeyValueCache([source[1], source[0]], torch.ones(1, 3, dtype=torch.int))
    assert [e.layer for e in source] == [0, 1]
    assert swapped[0] is not source[1] and torch.equal(swapped[0].keys, source[1].keys)
    assert swapped[0].hook_k_new.name == "blocks.0.kv_cache.hook_k_new"
    swapped.append(0, *kv(pos=1, seed=9))
    swapped.append_attention_mask(torch.ones(1, 1, dtype=torch.int))
    assert all(torch.equal(a, b) for a, b in zip(state(source), before, strict=True))
    assert source[1].hook_k_new.name == "blocks.1.kv_cache.hook_k_new"


def test_one_entry_named_for_two_layers_becomes_two_independent_layers():
    entry = KeyValueCacheEntry(*kv())
    cache = KeyValueCache([entry, entry])
    assert cache[0] is entry and cache[1] is not entry
    cache.append(1, *kv(pos=1, seed=3))
    assert entry.sequence_length == 3 and cache[1].sequence_length == 4


@pytest.mark.parametrize(
    "entries, mask, match",
    [
        (
            [KeyValueCacheEntry(*kv(pos=3)), KeyValueCacheEntry(*kv(pos=4))],
            None,
            r"every layer needs the same batch and pos_so_far, got layer 0: batch=1, pos=3, "
            r"layer 1: batch=1, pos=4",
        ),
        (
            [KeyValueCacheEntry(*kv(batch=1)), KeyValueCacheEntry(*kv(batch=2))],
            None,
            "layer 1: batch=2, pos=3",
        ),
        (
            [KeyValueCacheEntry(*kv(pos=3))],
            torch.ones(1, 5, dtype=torch.int),
            r"previous_attention_mask of shape \(1, 5\) does not fit the entries \[batch=1, "
            r"pos_so_far=3\]",
        ),
        ([KeyValueCacheEntry(*kv(batch=2))], torch.ones(1, 3, dtype=torch.int), r"\(1, 3\)"),
        ([KeyValueCacheEntry(*kv())], torch.ones(3), r"must be \[batch, pos_so_far\], got \(3,\)"),
        (
            [KeyValueCacheEntry(*kv())],
            torch.ones(1, 3),
            "integer 0/1 values, got dtype torch.float32",
        ),
    ],
)
def test_constructor_refuses_parts_that_do_not_fit(entries, mask, match):
    with pytest.raises(CacheShapeError, match=match):
        KeyValueCache(entries, mask)


def test_constructor_refuses_what_is_not_a_list_of_entries():
    with pytest.raises(TypeError, match="entries must be a list of KeyValueCacheEntry"):
        KeyValueCache(KeyValueCacheEntry(*kv()))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"entries\[1\] must be a KeyValueCacheEntry, got Tensor"):
        KeyValueCache([KeyValueCacheEntry(*kv()), kv()[0]])  # type: ignore[list-item]


def test_a_failed_constructor_leaves_the_entries_as_they_were():
    free = KeyValueCacheEntry(*kv(pos=3))
    with pytest.raises(CacheShapeError):
        KeyValueCache([free, KeyValueCacheEntry(*kv(pos=4))])
    assert free.layer is None
    assert KeyValueCache([free])[0] is free
