"""`KeyValueCacheEntry`: one layer's keys and values, appends, freezing and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformer_lens.cache.key_value_cache_entry import TransformerLensKeyValueCacheEntry

from safelens import CacheShapeError, KeyValueCacheEntry


def kv(batch: int = 1, pos: int = 3, heads: int = 2, d_head: int = 4, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, pos, heads, d_head)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def snapshot(entry: KeyValueCacheEntry) -> tuple[torch.Tensor, torch.Tensor]:
    return entry.keys.clone(), entry.values.clone()


def assert_same(entry: KeyValueCacheEntry, before: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(entry.keys, before[0])
    assert torch.equal(entry.values, before[1])


# -- construction and the TransformerLens names ------------------------------------------


def test_constructor_accepts_either_spelling():
    keys, values = kv()
    plain = KeyValueCacheEntry(keys, values)
    named = KeyValueCacheEntry(past_keys=keys, past_values=values)
    for entry in (plain, named):
        assert torch.equal(entry.keys, keys) and torch.equal(entry.past_keys, keys)
        assert torch.equal(entry.values, values) and torch.equal(entry.past_values, values)
        assert entry.sequence_length == 3 and not entry.frozen


def test_constructor_refuses_both_spellings():
    keys, values = kv()
    with pytest.raises(TypeError, match="pass keys= or past_keys=, not both"):
        KeyValueCacheEntry(keys, values, past_keys=keys)


def test_past_keys_and_past_values_are_writable():
    entry = KeyValueCacheEntry(*kv())
    new_keys, new_values = kv(pos=5, seed=1)
    entry.past_keys = new_keys
    entry.past_values = new_values
    assert torch.equal(entry.keys, new_keys) and torch.equal(entry.values, new_values)
    assert entry.sequence_length == 5
    entry.keys, entry.values = kv(pos=2, seed=2)
    assert torch.equal(entry.past_keys, kv(pos=2, seed=2)[0])


@pytest.mark.hooked_transformer
def test_init_cache_entry_matches_transformer_lens():
    from transformer_lens import HookedTransformerConfig

    cfg = HookedTransformerConfig(
        n_layers=1, d_model=32, n_ctx=8, d_head=8, n_heads=4, n_key_value_heads=2,
        d_vocab=5, act_fn="gelu", dtype=torch.bfloat16, device="cpu",
    )  # fmt: skip
    ours = KeyValueCacheEntry.init_cache_entry(cfg, "cpu", batch_size=3)
    theirs = TransformerLensKeyValueCacheEntry.init_cache_entry(cfg, "cpu", batch_size=3)
    for a, b in [(ours.keys, theirs.past_keys), (ours.values, theirs.past_values)]:
        assert a.shape == b.shape == (3, 0, 2, 8)
        assert a.dtype == b.dtype == torch.bfloat16
    assert ours.sequence_length == 0


# -- appending ------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [1, -3])
def test_append_returns_old_plus_new_and_stores_it(dim):
    keys, values = kv()
    entry = KeyValueCacheEntry(keys, values)
    reference = TransformerLensKeyValueCacheEntry(keys, values)
    for step in range(5):
        new_keys, new_values = kv(pos=1 + step % 2, seed=10 + step)
        full_keys, full_values = entry.append(new_keys, new_values, dim=dim)
        ref_keys, ref_values = reference.append(new_keys, new_values)
        assert torch.equal(full_keys, ref_keys) and torch.equal(full_values, ref_values)
        assert torch.equal(entry.keys, ref_keys) and torch.equal(entry.values, ref_values)
        assert entry.sequence_length == ref_keys.shape[1]


@pytest.mark.parametrize("dim", [0, 2, 3, -1, -2, -4])
def test_tensor_entries_refuse_other_axes(dim):
    keys, values = kv()
    entry = KeyValueCacheEntry(keys, values)
    with pytest.raises(CacheShapeError, match=f"entry: dim={dim}, but a tensor cache grows"):
        entry.append(keys + 1, values + 1, dim=dim)
    assert torch.equal(entry.keys, keys) and torch.equal(entry.values, values)


@pytest.mark.parametrize(
    "keys, values, match",
    [
        (
            torch.zeros(1, 3, 2, 4),
            torch.zeros(1, 4, 2, 4),
            r"keys of shape \(1, 3, 2, 4\) and values of shape \(1, 4, 2, 4\)",
        ),
        (torch.zeros(1, 3, 2, 4), torch.zeros(2, 3, 2, 4), "same batch, pos and n_heads"),
        (torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 4), "same rank"),
        (torch.zeros(1, 3, 2, 4), None, "values is None but the other is not"),
        (None, torch.zeros(1, 3, 2, 4), "keys is None but the other is not"),
        (torch.zeros(1, 3, 2, 4), np.zeros((1, 3, 2, 4)), "keys are Tensor but values are ndarray"),
    ],
)
def test_constructor_refuses_keys_and_values_that_do_not_pair(keys, values, match):
    with pytest.raises(CacheShapeError, match=match):
        KeyValueCacheEntry(keys, values)


def test_append_refuses_keys_and_values_set_to_different_lengths():
    keys, values = kv()
    entry = KeyValueCacheEntry(keys, values)
    entry.values = kv(pos=5)[1]
    with pytest.raises(CacheShapeError, match="holds 3 key positions but 5 value positions"):
        entry.append(*kv(pos=1))
    assert torch.equal(entry.keys, keys)


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2, -3])
def test_append_numpy_arrays_along_any_axis(dim):
    keys, values = (t.numpy() for t in kv())
    entry = KeyValueCacheEntry(keys, values)
    full_keys, _ = entry.append(keys * 2, values * 2, dim=dim)
    assert isinstance(full_keys, np.ndarray) and isinstance(entry.values, np.ndarray)
    np.testing.assert_array_equal(entry.keys, np.concatenate([keys, keys * 2], axis=dim))
    assert entry.sequence_length == entry.keys.shape[1]


def test_append_nested_lists():
    entry = KeyValueCacheEntry()
    entry.append([[[1]]], [[[2]]])
    keys, values = entry.append([[[3]]], [[[4]]])
    assert keys == entry.keys == [[[1], [3]]]
    assert values == entry.past_values == [[[2], [4]]]
    assert entry.sequence_length == 2
    keys, _ = entry.append([[[5], [6]]], [[[7], [8]]], dim=-1)
    assert keys == entry.keys == [[[1, 5], [3, 6]]]
    assert entry.values == [[[2, 7], [4, 8]]]
    assert entry.sequence_length == 2


def test_sequence_length_when_no_shape_is_known():
    assert KeyValueCacheEntry().sequence_length == 0
    assert KeyValueCacheEntry([1, 2], [3, 4]).sequence_length == 0
    assert KeyValueCacheEntry([], []).sequence_length == 0
    assert KeyValueCacheEntry([[]], [[]]).sequence_length == 0
    assert KeyValueCacheEntry([[[]], [[]]], [[[]], [[]]]).sequence_length == 1
    assert KeyValueCacheEntry(np.zeros((2, 7)), np.zeros((2, 7))).sequence_length == 7


def test_mixed_inputs_are_converted_to_what_is_cached():
    keys, values = kv()
    entry = KeyValueCacheEntry(keys.to(torch.bfloat16), values.to(torch.bfloat16))
    new_keys, new_values = kv(pos=1, seed=5)
    full_keys, full_values = entry.append(new_keys.numpy(), new_values.double())
    assert full_keys.dtype == full_values.dtype == torch.bfloat16
    assert torch.equal(full_keys[:, -1:], new_keys.to(torch.bfloat16))
    assert torch.equal(full_values[:, -1:], new_values.to(torch.bfloat16))
    listed, _ = entry.append(new_keys.tolist(), new_values.tolist())
    assert listed.shape == (1, 5, 2, 4) and entry.sequence_length == 5


def test_to_dict():
    keys, values = kv()
    view = KeyValueCacheEntry(keys, values).to_dict()
    assert set(view) == {"keys", "values", "sequence_length"}
    assert torch.equal(view["keys"], keys) and view["sequence_length"] == 3


# -- freezing -------------------------------------------------------------------------


def test_frozen_entry_returns_the_concatenation_and_stores_nothing():
    entry = KeyValueCacheEntry(*kv(), frozen=True)
    before = snapshot(entry)
    storage = entry.storages()
    for seed in range(3):
        new_keys, new_values = kv(pos=2, seed=seed)
        full_keys, full_values = entry.append(new_keys, new_values)
        assert torch.equal(full_keys, torch.cat([before[0], new_keys], dim=1))
        assert torch.equal(full_values, torch.cat([before[1], new_values], dim=1))
        assert_same(entry, before)
        assert entry.sequence_length == 3 and entry.storages() == storage
    entry.unfreeze()
    entry.append(*kv(pos=1))
    assert entry.sequence_length == 4
    entry.freeze()
    assert bool(entry.frozen)


def test_frozen_context_restores_even_on_error():
    entry = KeyValueCacheEntry(*kv())
    with pytest.raises(RuntimeError, match="boom"), entry.frozen():
        assert entry.frozen
        raise RuntimeError("boom")
    assert not entry.frozen


def test_frozen_list_entry_stores_nothing():
    entry = KeyValueCacheEntry([[[1]]], [[[2]]], frozen=True)
    keys, _ = entry.append([[[3]]], [[[4]]])
    assert keys == [[[1], [3]]] and entry.keys == [[[1]]]


# -- cheap appends and stable views ---------------------------------------------------


def test_one_token_append_writes_in_place_with_amortised_growth():
    entry = KeyValueCacheEntry(*kv(pos=0))
    reallocations = 0
    pointer = None
    for step in range(300):
        keys, _ = entry.append(*kv(pos=1, seed=step))
        current = entry.storages()[0]
        if current != pointer:
            reallocations += 1
            pointer = current
        assert keys.shape[1] == entry.sequence_length == step + 1
        assert entry.keys.shape == (1, step + 1, 2, 4)
        assert entry.keys.data_ptr() == keys.data_ptr()  # a view, not a copy
    assert reallocations <= 10  # capacity doubles: 1, 4, 10, 22, 46, 94, 190, 382


def test_views_handed_out_are_never_overwritten():
    entry = KeyValueCacheEntry(*kv(pos=0))
    handed = []
    for step in range(40):
        keys, values = entry.append(*kv(pos=1, seed=step))
        handed.append((keys, keys.clone(), entry.past_values, values.clone()))
    for keys, copy, values, values_copy in handed:
        assert torch.equal(keys, copy) and torch.equal(values, values_copy)
    assert torch.equal(entry.keys, handed[-1][1])


def test_frozen_append_does_not_touch_spare_capacity():
    entry = KeyValueCacheEntry(*kv(pos=0))
    entry.append(*kv(pos=2))
    entry.freeze()
    entry.append(*kv(pos=1, seed=9))
    entry.unfreeze()
    keys, _ = entry.append(*kv(pos=1, seed=7))
    assert torch.equal(keys[:, 2:], kv(pos=1, seed=7)[0])


# -- bad input ------------------------------------------------------------------------


GOOD = kv(pos=1, seed=3)


@pytest.mark.parametrize(
    ("keys", "values", "match"),
    [
        (
            torch.zeros(1, 1, 3, 4),
            GOOD[1],
            r"layer 5: keys of shape \(1, 1, 3, 4\) do not fit the cache; "
            r"expected \[batch=1, pos=any, n_heads=2, d_head=4\]$",
        ),
        (
            GOOD[0],
            torch.zeros(2, 1, 2, 4),
            r"layer 5: values of shape \(2, 1, 2, 4\) do not fit the cache; expected \[batch=1,",
        ),
        (GOOD[0], torch.zeros(1, 1, 8), r"layer 5: values of shape \(1, 1, 8\)"),
        (
            torch.zeros(1, 2, 3, 4),
            GOOD[1],
            r"keys of shape \(1, 2, 3, 4\).*looks like head-major \[batch, heads, pos, d_head\]"
            r".*keys.transpose\(1, 2\)",
        ),
        (
            GOOD[0],
            torch.zeros(1, 1, 2, 4, dtype=torch.long),
            r"layer 5: values have dtype torch.int64; expected a floating dtype",
        ),
        (
            torch.zeros(1, 1, 2, 4, device="meta"),
            GOOD[1],
            r"layer 5: keys on meta cannot be moved to the cache's device cpu",
        ),
        (GOOD[0], "abc", r"layer 5: values of type str cannot be converted to a torch.float32"),
        (GOOD[0], [[1.0, 2.0]], r"layer 5: values of shape \(1, 2\) do not fit"),
    ],
)
def test_bad_input_names_the_layer_and_changes_nothing(keys, values, match):
    entry = KeyValueCacheEntry(*kv(), layer=5)
    entry.append(*kv(pos=1, seed=1))
    before = snapshot(entry)
    with pytest.raises(CacheShapeError, match=match):
        entry.append(keys, values)
    assert_same(entry, before)
    assert entry.sequence_length == 4
    full_keys, _ = entry.append(*GOOD)
    assert torch.equal(full_keys, torch.cat([before[0], GOOD[0]], dim=1))


def test_bad_input_on_other_axes_changes_nothing():
    entry = KeyValueCacheEntry(*kv(), layer=1)
    before = snapshot(entry)
    with pytest.raises(CacheShapeError, match=r"layer 1: dim=2, but a tensor cache grows"):
        entry.append(torch.zeros(1, 3, 2, 4), torch.zeros(1, 2, 2, 4), dim=2)
    assert_same(entry, before)


def test_bad_list_input_changes_nothing():
    entry = KeyValueCacheEntry([[[1]]], [[[2]]], layer=0)
    with pytest.raises(CacheShapeError, match=r"layer 0: cannot concatenate"):
        entry.append([[[3]]], [[[4]], [[5]]], dim=1)
    assert entry.keys == [[[1]]] and entry.values == [[[2]]]
