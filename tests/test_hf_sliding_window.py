"""Sliding-window layers of `HFKeyValueCache(config=)` hold what `DynamicCache(config=)` holds.

Mistral (every layer slides) and Gemma-2 (every other layer) with a window of 4, run past
it: the same logits, keys, values, mask sizes and bytes held as `DynamicCache`, and the
features that need evicted positions (`cropped`, `save`, safelens' experiments) refuse a
cache that evicted them, while `HFKeyValueCache()` without a config keeps every position.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import ids, model, run
from test_hf_cache import GENERATE, assert_state, state
from torch.utils import _pytree as pytree
from transformers import DynamicCache

from safelens import CacheShapeError, Prefix, prefill
from safelens.backends.hf._cache import HFKeyValueCache
from safelens.backends.hf._model import hf_cache_argument

FAMILIES = ["mistral", "gemma2"]
CHUNKS = [(0, 7), (7, 8), (8, 9), (9, 13)]


def held_bytes(cache, sliding: bool = True) -> int:
    """Bytes of the storage a cache's sliding (or other) layers keep alive, each once."""
    storages = {}
    for layer in cache.layers:
        if layer.is_sliding != sliding:
            continue
        for tensor in (layer.keys, layer.values):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def assert_same_layers(ours: HFKeyValueCache, theirs: DynamicCache) -> None:
    assert ours.is_sliding == theirs.is_sliding
    for mine, hf in zip(ours.layers, theirs.layers, strict=True):
        assert torch.equal(mine.keys, hf.keys) and torch.equal(mine.values, hf.values)
        assert mine.get_seq_length() == hf.get_seq_length()
        for query in (1, 3):
            assert mine.get_mask_sizes(query) == hf.get_mask_sizes(query)
    # Iterating gives `(keys, values, window)` per layer, as iterating a DynamicCache does.
    for (keys, values, window), (k, v, w) in zip(ours, theirs, strict=True):
        assert torch.equal(keys, k) and torch.equal(values, v)
        assert (window is None and w is None) or (window.dtype == w.dtype and window == w)


def filled(name: str, tokens: torch.Tensor) -> tuple[HFKeyValueCache, DynamicCache]:
    lm = model(name)
    ours, theirs = HFKeyValueCache(config=lm.config), DynamicCache(config=lm.config)
    run(lm, tokens, ours), run(lm, tokens, theirs)
    return ours, theirs


@pytest.mark.parametrize("name", FAMILIES)
def test_chunks_past_the_window_hold_and_give_what_dynamic_cache_does(name):
    lm, tokens = model(name), ids(2, 13)
    full = run(lm, tokens)
    ours, theirs = HFKeyValueCache(config=lm.config), DynamicCache(config=lm.config)
    assert any(ours.is_sliding) and ours.is_sliding == theirs.is_sliding
    for start, stop in CHUNKS:
        logits = run(lm, tokens[:, start:stop], ours)
        assert torch.equal(logits, run(lm, tokens[:, start:stop], theirs))
        torch.testing.assert_close(logits, full[:, start:stop], atol=1e-5, rtol=1e-5)
        assert_same_layers(ours, theirs)
        assert held_bytes(ours) == held_bytes(theirs)
        # A full layer appends into spare room (amortised O(1)): at most twice the bytes.
        assert held_bytes(ours, False) <= 2 * held_bytes(theirs, False)
    everything = HFKeyValueCache()
    run(lm, tokens, everything)
    assert not any(everything.is_sliding)
    assert held_bytes(everything, False) > held_bytes(ours) + held_bytes(ours, False)


@pytest.mark.parametrize("mode", list(GENERATE))
@pytest.mark.parametrize("name", FAMILIES)
def test_generate_on_a_sliding_cache_gives_hf_tokens(name, mode):
    lm, prompt = model(name), ids(2, 6)
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0
    kwargs = dict(max_new_tokens=6, attention_mask=mask, **GENERATE[mode])
    torch.manual_seed(3)
    reference = lm.generate(prompt, **kwargs)
    torch.manual_seed(3)
    cache = HFKeyValueCache(config=lm.config)
    assert torch.equal(lm.generate(prompt, **kwargs, **{hf_cache_argument(lm): cache}), reference)
    assert cache.get_seq_length() == reference.shape[1] - 1


def test_assisted_decoding_rolls_a_sliding_cache_back_as_dynamic_cache():
    lm, prompt = model("mistral"), ids(1, 9)
    reference = lm.generate(prompt, max_new_tokens=6, do_sample=False)
    ours, theirs = HFKeyValueCache(config=lm.config), DynamicCache(config=lm.config)
    for cache in (ours, theirs):
        assisted = lm.generate(
            prompt,
            max_new_tokens=6,
            do_sample=False,
            assistant_model=model("llama"),
            **{hf_cache_argument(lm): cache},
        )
        assert torch.equal(assisted, reference)
    assert_same_layers(ours, theirs)
    assert [a.record_past for a in ours.layers] == [b.record_past for b in theirs.layers]


@pytest.mark.parametrize("name", FAMILIES)
def test_branches_of_a_sliding_cache_continue_as_dynamic_cache(name):
    lm, tokens = model(name), ids(1, 13)
    ours, theirs = filled(name, tokens[:, :9])
    ours.freeze()
    before = state(ours)
    for continuation in (tokens[:, 9:], tokens[:, 9:11]):
        positions = torch.arange(9, 9 + continuation.shape[1])[None]
        frozen = run(lm, continuation, ours, position_ids=positions)
        fork, reference = ours.fork(), copy.deepcopy(theirs)
        assert torch.equal(frozen, run(lm, continuation, reference, position_ids=positions))
        assert torch.equal(frozen, run(lm, continuation, fork, position_ids=positions))
        assert_same_layers(fork, reference)
    assert_state(ours, before)
    leaves, spec = pytree.tree_flatten(ours)
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert rebuilt.frozen and [layer.evicted for layer in rebuilt.layers] == [
        layer.evicted for layer in ours.layers
    ]
    rebuilt.unfreeze()
    reference = copy.deepcopy(theirs)
    assert torch.equal(run(lm, tokens[:, 9:], rebuilt), run(lm, tokens[:, 9:], reference))
    assert_same_layers(rebuilt, reference)


def test_what_needs_evicted_positions_refuses_a_cache_that_dropped_them():
    lm, tokens = model("mistral"), ids(1, 9)
    ours, theirs = filled("mistral", tokens)
    before = state(ours)
    with pytest.raises(CacheShapeError, match=r"cropped\(5\): sliding-window layers \[0, 1\]"):
        ours.cropped(5)
    assert ours.cropped(9).get_seq_length() == 9
    with pytest.raises(RuntimeError, match="does not track past states"):
        theirs.crop(-1)
    with pytest.raises(CacheShapeError, match=r"crop\(-1\): layer 0 is a sliding-window layer"):
        ours.crop(-1)
    with pytest.raises(CacheShapeError, match=r"sliding-window layers \[0, 1\] hold only"):
        ours.save("unused.safetensors")
    ours.freeze()
    prefix = prefill(lm, tokens)  # safelens' own prefixes keep every position
    assert not any(prefix.cache.is_sliding) and prefix.cache.layers[0].keys.shape[2] == 9
    with pytest.raises(CacheShapeError, match=r"Prefix.cache: sliding-window layers \[0, 1\]"):
        Prefix(ours, prefix.tokens, prefix.attention_mask, prefix.last_logits)
    assert_state(ours, before)


def test_a_window_not_yet_full_crops_as_dynamic_cache():
    tokens = ids(1, 3)
    ours, theirs = filled("mistral", tokens)
    ours.crop(-1), theirs.crop(-1)
    assert_same_layers(ours, theirs)
    assert ours.cropped(1).get_seq_length() == 1
