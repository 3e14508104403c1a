"""`HFKeyValueCache` on HuggingFace causal LMs: HF's own numbers, freezing, branching, hooks.

References are HuggingFace itself: the uncached forward, `DynamicCache`, and `generate`
with its default cache, on tiny random-weight models built from config classes.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import transformers
from hf_models import CONFIGS, ids, model, run
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.version import Version
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin

from safelens import CacheConfigError, CacheDimensions, CacheShapeError, FrozenCacheError, HookError
from safelens.backends.hf._cache import HFKeyValueCache
from safelens.backends.hf._model import hf_cache_argument


def state(cache: HFKeyValueCache) -> list[torch.Tensor]:
    return [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]


def assert_state(cache: HFKeyValueCache, before: list[torch.Tensor]) -> None:
    after = state(cache)
    assert len(after) == len(before)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(after, before, strict=True))


def prefilled(name: str, tokens: torch.Tensor) -> HFKeyValueCache:
    cache = HFKeyValueCache()
    run(model(name), tokens, cache)
    return cache


# -- HuggingFace's own numbers --------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunked_forward_matches_uncached_and_dynamic_cache(name):
    """Chunks of 7, 1 and 4 tokens (past Mistral's and Gemma-2's window of 4)."""
    lm, tokens = model(name), ids(1, 12)
    full = run(lm, tokens)
    ours, theirs = HFKeyValueCache(), DynamicCache(config=lm.config)
    for start, stop in ((0, 7), (7, 8), (8, 12)):
        chunk = tokens[:, start:stop]
        logits = run(lm, chunk, ours)
        torch.testing.assert_close(logits, full[:, start:stop], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits, run(lm, chunk, theirs), atol=1e-5, rtol=1e-5)
    assert ours.get_seq_length() == 12 and ours.is_sliding == [False, False]


def test_bfloat16_matches_dynamic_cache_bitwise():
    lm, tokens = model("llama", torch.bfloat16), ids(1, 9)
    ours, theirs = HFKeyValueCache(), DynamicCache(config=lm.config)
    for chunk in (tokens[:, :5], tokens[:, 5:6], tokens[:, 6:]):
        assert torch.equal(run(lm, chunk, ours), run(lm, chunk, theirs))
    assert ours.layers[0].keys.dtype == torch.bfloat16
    assert torch.equal(ours.layers[1].values, theirs.layers[1].values)


def test_left_padded_batch_with_attention_mask():
    lm = model("qwen2")
    tokens = ids(2, 9)
    mask = torch.ones_like(tokens)
    mask[0, :3] = 0
    full = run(lm, tokens, attention_mask=mask)
    cache = HFKeyValueCache()
    first = run(lm, tokens[:, :6], cache, attention_mask=mask[:, :6])
    second = run(lm, tokens[:, 6:], cache, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(
        torch.cat([first, second], 1)[real], full[real], atol=1e-5, rtol=1e-5
    )


@given(cuts=st.lists(st.integers(1, 10), min_size=1, max_size=3, unique=True))
@settings(max_examples=5, deadline=None)
def test_any_chunking_equals_the_uncached_forward(cuts):
    lm, tokens = model("llama"), ids(1, 11, seed=3)
    bounds = [0, *sorted(cuts), 11]
    cache = HFKeyValueCache()
    logits = [run(lm, tokens[:, a:b], cache) for a, b in zip(bounds, bounds[1:], strict=False)]
    torch.testing.assert_close(torch.cat(logits, 1), run(lm, tokens), atol=1e-5, rtol=1e-5)


def test_gradients_flow_through_the_cache_as_without_it():
    lm, tokens = model("llama"), ids(1, 8)
    with torch.enable_grad():
        embeds = lm.get_input_embeddings()(tokens).detach().requires_grad_()
        cache = HFKeyValueCache()
        first = run(lm, None, cache, inputs_embeds=embeds[:, :5])
        second = run(lm, None, cache, inputs_embeds=embeds[:, 5:])
        (ours,) = torch.autograd.grad(torch.cat([first, second], 1).square().sum(), embeds)
        (reference,) = torch.autograd.grad(lm(inputs_embeds=embeds).logits.square().sum(), embeds)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


GENERATE = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, top_k=0, temperature=1.0),
    "beam": dict(do_sample=False, num_beams=3),
}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# bfloat16 repeats every float32 case; the fast pre-commit run keeps float32 only.
DTYPE_CASES = ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)]


@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_generate_gives_hf_tokens_on_a_left_padded_batch(name, dtype):
    """Greedy, seeded sampling and beam search, as `generate` with HF's default cache."""
    lm, prompt = model(name, DTYPES[dtype]), ids(2, 5)
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0
    for mode, options in GENERATE.items():
        kwargs = dict(max_new_tokens=4, attention_mask=mask, **options)
        torch.manual_seed(7)
        reference = lm.generate(prompt, **kwargs)
        torch.manual_seed(7)
        cache = HFKeyValueCache()
        ours = lm.generate(prompt, **kwargs, **{hf_cache_argument(lm): cache})
        assert torch.equal(ours, reference), mode
        assert cache.get_seq_length() == ours.shape[1] - 1
        assert cache.batch_size == 2 * options.get("num_beams", 1)


@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_assisted_generation_crops_in_place_and_matches(name, dtype):
    lm, prompt = model(name, DTYPES[dtype]), ids(1, 5)
    assistant = model("qwen2" if name == "llama" else "llama", DTYPES[dtype])
    reference = lm.generate(prompt, max_new_tokens=6, do_sample=False)
    cache = HFKeyValueCache()
    assisted = lm.generate(
        prompt,
        max_new_tokens=6,
        do_sample=False,
        assistant_model=assistant,
        **{hf_cache_argument(lm): cache},
    )
    assert torch.equal(assisted, reference)
    assert cache.get_seq_length() == reference.shape[1] - 1


def test_generate_on_a_frozen_cache_is_refused_before_any_step():
    """`generate` stores each step; a frozen cache stores none (`test_frozen_seam`)."""
    lm, prompt = model("llama"), ids(1, 8)
    prefix = prefilled("llama", prompt[:, :6])
    prefix.freeze()
    before = state(prefix)
    arg = hf_cache_argument(lm)
    for options in ({}, {"assistant_model": model("qwen2")}):
        with pytest.raises(FrozenCacheError, match="generate was handed a frozen cache"):
            lm.generate(prompt, max_new_tokens=4, do_sample=False, **options, **{arg: prefix})
    assert_state(prefix, before)


@pytest.mark.parametrize(
    ("name", "mode", "branch"),
    [("llama", "greedy", HFKeyValueCache.fork), ("gemma2", "beam", lambda p: p.expand(3))],
)
def test_generate_from_a_branch_of_a_frozen_prefix(name, mode, branch):
    """A fork for greedy decoding; `expand(num_beams)` for beam search."""
    lm, prompt = model(name), ids(1, 8)
    prefix = prefilled(name, prompt[:, :6])
    prefix.freeze()
    before = state(prefix)
    kwargs = dict(max_new_tokens=4, **GENERATE[mode])
    ours = lm.generate(prompt, **kwargs, **{hf_cache_argument(lm): branch(prefix)})
    assert torch.equal(ours, lm.generate(prompt, **kwargs))
    assert_state(prefix, before)


# -- freezing and branching -----------------------------------------------------------


def test_frozen_cache_returns_joined_keys_and_stores_nothing():
    lm, tokens = model("mistral"), ids(1, 10)
    prefix = prefilled("mistral", tokens[:, :6])
    with prefix.frozen():
        before = state(prefix)
        logits = run(lm, tokens[:, 6:], prefix)
        assert_state(prefix, before)
    assert not prefix.frozen
    torch.testing.assert_close(logits, run(lm, tokens)[:, 6:], atol=1e-5, rtol=1e-5)


def test_frozen_cache_is_not_even_given_new_layers():
    cache = HFKeyValueCache(frozen=True)
    keys, _ = cache.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 1)
    assert keys.shape == (1, 2, 3, 4) and cache.layers == [] and cache.get_seq_length() == 0


def test_forks_share_the_prefix_and_continue_independently():
    lm, tokens = model("llama"), ids(1, 10)
    prefix = prefilled("llama", tokens[:, :6])
    prefix.freeze()
    before = state(prefix)
    left, right = prefix.fork(), prefix.fork()
    assert prefix.storages() <= left.storages() and not left.frozen
    a = run(lm, tokens[:, 6:8], left)
    b = run(lm, tokens[:, 6:10], right)
    torch.testing.assert_close(a, run(lm, tokens[:, :8])[:, 6:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b, run(lm, tokens)[:, 6:], atol=1e-5, rtol=1e-5)
    assert (left.get_seq_length(), right.get_seq_length()) == (8, 10)
    assert_state(prefix, before)


def test_expand_broadcasts_a_prefix_to_a_batch_of_continuations():
    lm = model("phi3")
    prefix_tokens, continuations = ids(1, 6), ids(3, 4, seed=2)
    prefix = prefilled("phi3", prefix_tokens)
    prefix.freeze()
    batch = prefix.expand(3)
    assert batch.batch_size == 3 and prefix.storages() <= batch.storages()
    logits = run(lm, continuations, batch)
    full = run(lm, torch.cat([prefix_tokens.expand(3, -1), continuations], 1))
    torch.testing.assert_close(logits, full[:, 6:], atol=1e-5, rtol=1e-5)
    with pytest.raises(
        CacheShapeError, match="expand.n. needs a batch-1 cache; this cache has batch 3"
    ):
        batch.expand(2)


def test_select_cropped_clone_return_new_caches():
    lm, tokens = model("llama"), ids(2, 8)
    cache = prefilled("llama", tokens[:, :6])
    before = state(cache)
    row = cache.select([1])
    short = cache.cropped(-2)
    copy = cache.clone()
    assert_state(cache, before)
    assert row.batch_size == 1 and short.get_seq_length() == 4 and copy.get_seq_length() == 6
    assert not copy.storages() & cache.storages()
    torch.testing.assert_close(
        run(lm, tokens[1:, 6:], row), run(lm, tokens[1:])[:, 6:], atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        run(lm, tokens[:, 4:], short), run(lm, tokens)[:, 4:], atol=1e-5, rtol=1e-5
    )
    cache.freeze()
    assert cache.clone().frozen and not cache.fork().frozen
    with pytest.raises(ValueError, match=r"length must be in \[-6, 6\]"):
        cache.cropped(7)
    with pytest.raises(TypeError, match="rows must be"):
        cache.select(0.5)
    every = cache.select(None)  # every row, as `tensor[None]` keeps every row
    assert every.batch_size == 2 and not every.storages() & cache.storages()
    assert all(
        torch.equal(mine, theirs)
        for mine, theirs in zip(state(every), state(cache.select(slice(None))), strict=True)
    )


def test_crop_is_in_place_with_hf_meaning_and_refuses_keyvaluecache_meaning():
    lm = model("llama")
    cache, theirs = prefilled("llama", ids(1, 6)), DynamicCache(config=lm.config)
    run(lm, ids(1, 6), theirs)
    branch = cache.fork()
    for call in (0, -2, -1):
        cache.crop(call), theirs.crop(call)
        for mine, hf in zip(cache.layers, theirs.layers, strict=True):
            assert torch.equal(mine.keys, hf.keys) and torch.equal(mine.values, hf.values)
    assert cache.get_seq_length() == 3 and branch.get_seq_length() == 6
    with pytest.raises(ValueError, match=r"crop\(3\): .*in-place.*use cropped\(3\)"):
        cache.crop(3)
    with pytest.raises(ValueError, match="positive value"):
        theirs.crop(3)  # transformers 5 refuses it too
    assert cache.cropped(2).get_seq_length() == 2 and cache.get_seq_length() == 3
    cache.freeze()
    cache.crop(0)
    with pytest.raises(FrozenCacheError, match=r"crop\(-1\) changes the cache in place"):
        cache.crop(-1)
    assert cache.get_seq_length() == 3
    empty = HFKeyValueCache(frozen=True)
    empty.crop(-3)  # nothing to drop


def test_in_place_batch_methods_match_dynamic_cache():
    lm, tokens = model("llama"), ids(3, 5)
    ours, theirs = HFKeyValueCache(), DynamicCache(config=lm.config)
    run(lm, tokens, ours), run(lm, tokens, theirs)
    for method, arg in (
        ("reorder_cache", torch.tensor([2, 0, 0])),
        ("batch_repeat_interleave", 2),
        ("batch_select_indices", torch.tensor([5, 1, 2])),
    ):
        getattr(ours, method)(arg), getattr(theirs, method)(arg)
        for mine, hf in zip(ours.layers, theirs.layers, strict=True):
            assert torch.equal(mine.keys, hf.keys) and torch.equal(mine.values, hf.values)
    ours.freeze()
    with pytest.raises(FrozenCacheError, match="reorder_cache.beam_idx. changes the cache"):
        ours.reorder_cache(torch.tensor([0, 1, 2]))


@pytest.mark.parametrize(
    "indices",
    [(0, 2), [2, 0], (-1,), torch.tensor([1, 1]), torch.tensor([True, False, True])],
    ids=["tuple", "list", "negative", "tensor", "bool-mask"],
)
def test_batch_select_indices_reads_rows_as_dynamic_cache_does(indices):
    lm, tokens = model("llama"), ids(3, 5)
    ours, theirs = HFKeyValueCache(), DynamicCache(config=lm.config)
    run(lm, tokens, ours), run(lm, tokens, theirs)
    ours.batch_select_indices(indices), theirs.batch_select_indices(indices)
    for mine, hf in zip(ours.layers, theirs.layers, strict=True):
        assert torch.equal(mine.keys, hf.keys) and torch.equal(mine.values, hf.values)
    assert ours.batch_size == theirs.layers[0].keys.shape[0]


def test_batch_select_indices_out_of_range_is_an_index_error_that_changes_nothing():
    lm, tokens = model("llama"), ids(3, 5)
    ours, theirs = HFKeyValueCache(), DynamicCache(config=lm.config)
    run(lm, tokens, ours), run(lm, tokens, theirs)
    before = state(ours)
    for indices in ((0, 3), [-4], torch.tensor([5])):
        with pytest.raises(IndexError):
            theirs.batch_select_indices(indices)
        with pytest.raises(IndexError, match="do not index a batch of 3 rows"):
            ours.batch_select_indices(indices)
    with pytest.raises(TypeError, match="rows must be"):
        ours.batch_select_indices((0.0, 1.0))
    assert_state(ours, before)


def test_hf_interface():
    """Everything HF's forward, masks and `generate` read of a user cache, on 5.23 and 5.24+."""
    lm = model("llama")
    cache, theirs = HFKeyValueCache(config=lm.config), DynamicCache(config=lm.config)
    assert len(cache.layers) == 2 and cache.batch_size == -1 and cache.get_seq_length() == 0
    assert not cache.is_initialized and cache.get_mask_sizes(3, 1) == theirs.get_mask_sizes(3, 1)
    run(lm, ids(2, 5), cache), run(lm, ids(2, 5), theirs)
    assert all(isinstance(layer, CacheLayerMixin) for layer in cache.layers)
    for query in (1, 3):
        for layer in (0, 1, 2):
            assert cache.get_mask_sizes(query, layer) == theirs.get_mask_sizes(query, layer)
            assert cache.get_seq_length(layer) == theirs.get_seq_length(layer)
            assert (
                cache.get_query_offset(layer) == theirs.get_query_offset(layer) == 5 * (layer < 2)
            )
    assert cache.is_linear == theirs.is_linear == [False, False]
    assert cache.is_dummy == theirs.is_dummy == [False, False]
    assert cache.is_sliding == theirs.is_sliding == [False, False]
    assert cache.is_initialized and cache.is_croppable and theirs.is_croppable
    assert cache.offloading is False and len(cache) == 2
    assert cache.get_max_length() == -1 and cache.get_max_cache_shape() == -1
    assert not cache.is_compileable and cache.batch_size == 2  # DynamicCache says -1
    cache.activate_past_recording()  # assisted decoding calls it; nothing to record
    if hasattr(cache, "get_recurrent_states_to_keep"):  # transformers >= 5.24
        assert cache.get_recurrent_states_to_keep() == theirs.get_recurrent_states_to_keep() == 0
    assert cache.layers[0].keys.shape == theirs.layers[0].keys.shape == (2, 2, 5, 8)
    for (keys, values, window), (k, v, w) in zip(cache, theirs, strict=True):
        assert torch.equal(keys, k) and torch.equal(values, v) and window is w is None
    with cache.frozen():
        assert not cache.is_croppable  # crop(-k) would be refused: generate must not rely on it
    cache.reset()
    assert cache.get_seq_length() == 0 and len(cache.layers) == 2
    assert cache.is_sliding == [False, False]  # gemma-2 and mistral: the mask applies the window
    with pytest.raises(CacheConfigError, match="has no layer count"):
        HFKeyValueCache(config=SimpleNamespace(hidden_size=32))


# -- hook points ----------------------------------------------------------------------


def test_hooks_see_head_major_post_rotary_keys():
    lm, tokens = model("llama"), ids(1, 8)
    reference = DynamicCache(config=lm.config)
    run(lm, tokens[:, :5], reference)
    cache = HFKeyValueCache(config=lm.config)
    seen = {}

    def save(tensor, hook):
        seen[hook.name] = tensor.clone()

    with cache.hooks([(lambda name: name.startswith("model.layers.1"), save)]):
        run(lm, tokens[:, :5], cache)
    assert torch.equal(seen["model.layers.1.kv_cache.hook_k_new"], reference.layers[1].keys)
    assert torch.equal(seen["model.layers.1.kv_cache.hook_v_full"], reference.layers[1].values)
    assert not any(point.fwd_hooks for point in cache.hook_points().values())
    run(lm, tokens[:, 5:], reference)
    with cache.hooks([("model.layers.0.kv_cache.hook_k_full", save)]):
        run(lm, tokens[:, 5:], cache)
    assert seen["model.layers.0.kv_cache.hook_k_full"].shape == (1, 2, 8, 8)
    assert torch.equal(seen["model.layers.0.kv_cache.hook_k_full"], reference.layers[0].keys)


def test_write_time_hook_is_stored_and_equals_editing_the_model():
    lm, tokens = model("llama"), ids(1, 6)
    cache = HFKeyValueCache()
    with cache.hooks([("model.layers.0.kv_cache.hook_v_new", lambda v, hook: v * 0)]):
        ours = run(lm, tokens, cache)
    handle = lm.model.layers[0].self_attn.v_proj.register_forward_hook(lambda m, i, o: o * 0)
    try:
        reference = run(lm, tokens)
    finally:
        handle.remove()
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    assert not cache.layers[0].values.any() and cache.layers[1].values.any()


def test_read_time_hook_changes_this_pass_only():
    lm, tokens = model("llama"), ids(1, 8)
    cache = prefilled("llama", tokens[:, :6])
    fork = cache.fork()
    before = state(cache)

    def zero_in_place(values, hook):
        values.zero_()

    with cache.hooks([("model.layers.0.kv_cache.hook_v_full", zero_in_place)]):
        edited = run(lm, tokens[:, 6:], cache)
    plain = run(lm, tokens[:, 6:], fork)
    assert not torch.allclose(edited, plain)
    assert_state(cache.cropped(6), before)
    assert torch.equal(cache.layers[0].values[:, :, 6:], fork.layers[0].values[:, :, 6:])


def test_hook_that_raises_leaves_the_cache_as_before_the_pass():
    lm, tokens = model("llama"), ids(1, 9)
    cache = prefilled("llama", tokens[:, :6])
    before = state(cache)

    def fail(tensor, hook):
        raise RuntimeError("hook failed")

    with pytest.raises(RuntimeError, match="hook failed"):
        with cache.hooks([("model.layers.1.kv_cache.hook_k_full", fail)]):
            run(lm, tokens[:, 6:], cache)
    assert_state(cache, before)
    with pytest.raises(HookError, match="returned shape"):
        with cache.hooks([("model.layers.1.kv_cache.hook_k_new", lambda k, hook: k[:, :1])]):
            run(lm, tokens[:, 6:], cache)
    assert_state(cache, before)
    torch.testing.assert_close(
        run(lm, tokens[:, 6:], cache), run(lm, tokens)[:, 6:], atol=1e-5, rtol=1e-5
    )


def test_guard_restores_after_a_failure_outside_the_cache():
    lm, tokens = model("llama"), ids(1, 9)
    cache = prefilled("llama", tokens[:, :6])
    before = state(cache)

    def fail(module, args, output):
        raise KeyboardInterrupt

    handle = lm.model.norm.register_forward_hook(fail)
    try:
        with pytest.raises(KeyboardInterrupt), cache.guard():
            run(lm, tokens[:, 6:], cache)
    finally:
        handle.remove()
    assert_state(cache, before)


def test_hook_names_are_checked_before_anything_is_attached():
    cache = HFKeyValueCache()
    point = cache.hook_point("model.layers.0.kv_cache.hook_k_new")
    assert point.name == "model.layers.0.kv_cache.hook_k_new" and len(cache.layers) == 1
    good = ("model.layers.0.kv_cache.hook_v_new", print)
    with pytest.raises(HookError, match="did you mean 'model.layers.0.kv_cache.hook_k_new'"):
        with cache.hooks([good, ("model.layers.0.kv_cache.hook_k_nwe", print)]):
            pass
    with pytest.raises(HookError, match="list of .names, fn. pairs"):
        with cache.hooks([good, ("model.layers.3.kv_cache.hook_k_new", 3)]):
            pass
    with pytest.raises(HookError, match="has none yet; build it with HFKeyValueCache"):
        with HFKeyValueCache().hooks([(lambda name: True, print)]):
            pass
    assert not any(point.fwd_hooks for point in cache.hook_points().values())
    assert len(cache.layers) == 1


# -- bad input ------------------------------------------------------------------------


def test_keys_that_do_not_fit_are_refused_and_change_nothing():
    cache = HFKeyValueCache()
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 1)
    before = state(cache)
    with pytest.raises(CacheShapeError, match=r"looks like position-major .*transpose\(1, 2\)"):
        cache.update(torch.zeros(1, 5, 2, 4), torch.zeros(1, 5, 2, 4), 0)
    with pytest.raises(CacheShapeError, match=r"batch=1, n_kv_heads=2.*use expand\(n\)"):
        cache.update(torch.zeros(3, 2, 1, 4), torch.zeros(3, 2, 1, 4), 0)
    with pytest.raises(CacheShapeError, match="same batch and new_tokens"):
        cache.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 2, 4), 0)
    with pytest.raises(CacheShapeError, match="must be a floating tensor"):
        cache.update([[1]], torch.zeros(1, 2, 1, 4), 0)
    cache.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 0)
    with pytest.raises(CacheShapeError, match="layer 1: key_states of shape"):
        cache.update(torch.zeros(1, 2, 1, 5), torch.zeros(1, 2, 1, 4), 1)
    assert_state(cache, before)


def test_cache_argument_name():
    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    class Neither(torch.nn.Module):
        def forward(self, input_ids):
            return input_ids

    renamed = Version(transformers.__version__) >= Version("5.24")
    assert hf_cache_argument(model("gpt2")) == ("cache" if renamed else "past_key_values")
    assert hf_cache_argument(Old()) == "past_key_values"
    with pytest.raises(CacheConfigError, match="takes neither cache= nor past_key_values="):
        hf_cache_argument(Neither())


# -- guarantees -----------------------------------------------------------------------

POINTS = ("hook_k_new", "hook_v_new", "hook_k_full", "hook_v_full")


def hook_names(cache: HFKeyValueCache, point: str) -> list[str]:
    return [f"model.layers.{layer}.kv_cache.{point}" for layer in range(len(cache.layers))]


def edit_in_place(tensor, hook):
    tensor.mul_(-2).add_(1)


def fail(tensor, hook):
    raise RuntimeError("hook failed")


def apply(op: str, branch: HFKeyValueCache, branches: list[HFKeyValueCache], point: str) -> None:
    """Do `op` to `branch`; an in-place method on a frozen branch must refuse (or change nothing)."""
    lm, rows, length = model("llama"), max(branch.batch_size, 1), branch.get_seq_length()
    if op == "forward":
        run(lm, ids(rows, 2, seed=length), branch)
    elif op in ("edit", "raise"):
        with pytest.raises(RuntimeError, match="hook failed") if op == "raise" else nullcontext():
            with branch.hooks(
                [(hook_names(branch, point), fail if op == "raise" else edit_in_place)]
            ):
                run(lm, ids(rows, 2, seed=length), branch)
    elif op in ("fork", "clone") or (op == "expand" and branch.batch_size == 1):
        branches.append(branch.expand(2) if op == "expand" else getattr(branch, op)())
    elif op in ("select", "cropped") and length:
        branches.append(branch.select([-1]) if op == "select" else branch.cropped(-1))
    elif op in (
        "crop",
        "reorder_cache",
        "batch_repeat_interleave",
        "batch_select_indices",
        "reset",
    ):
        argument = {
            "crop": -1,
            "reorder_cache": torch.arange(rows).flip(0),
            "batch_repeat_interleave": 2,
            "batch_select_indices": torch.tensor([0]),
        }
        try:
            getattr(branch, op)(*([argument[op]] if op in argument else []))
        except FrozenCacheError:
            assert branch.frozen


OPS = [
    "forward", "edit", "raise", "fork", "clone", "expand", "select", "cropped",
    "crop", "reorder_cache", "batch_repeat_interleave", "batch_select_indices", "reset",
]  # fmt: skip


@given(
    steps=st.lists(
        st.tuples(st.sampled_from(OPS), st.integers(0, 20), st.sampled_from(POINTS)), max_size=8
    )
)
@settings(max_examples=25, deadline=None)
def test_a_frozen_prefix_is_bitwise_unchanged_by_anything_done_to_it_or_its_branches(steps):
    prefix = prefilled("llama", ids(1, 5))
    prefix.freeze()
    before, storages = state(prefix), prefix.storages()
    branches = [prefix]
    for op, index, point in steps:
        apply(op, branches[index % len(branches)], branches, point)
        assert_state(prefix, before)
    assert prefix.frozen and prefix.storages() == storages
    assert not any(p.fwd_hooks for b in branches for p in b.hook_points().values())


def test_frozen_cache_refuses_every_in_place_method_that_would_change_it():
    cache = prefilled("llama", ids(2, 5))
    cache.freeze()
    before = state(cache)
    for call, match in (
        (lambda: cache.crop(-1), r"crop\(-1\)"),
        (lambda: cache.crop(-7), r"crop\(-7\)"),
        (lambda: cache.reorder_cache(torch.tensor([1, 0])), r"reorder_cache\(beam_idx\)"),
        (lambda: cache.batch_repeat_interleave(2), r"batch_repeat_interleave\(2\)"),
        (lambda: cache.batch_select_indices(torch.tensor([0])), r"batch_select_indices"),
        (lambda: cache.reset(), r"reset\(\)"),
    ):
        with pytest.raises(FrozenCacheError, match=match + ".* changes the cache in place"):
            call()
    cache.crop(0)  # changes nothing, so allowed
    assert_state(cache, before)


def test_hostile_keys_are_refused_with_the_reason_and_change_nothing():
    cache = prefilled("llama", ids(1, 4))
    before = state(cache)
    with pytest.raises(
        CacheShapeError,
        match=r"layer 0: key_states of shape \(1, 3, 2, 8\) do not fit.*this looks like "
        r"position-major \[batch, pos, heads, d_head\] layout.*key_states.transpose\(1, 2\)",
    ):
        cache.update(torch.zeros(1, 3, 2, 8), torch.zeros(1, 2, 3, 8), 0)
    for keys, match in (
        (torch.zeros(1, 2, 8), r"must be a floating tensor .*got \(1, 2, 8\) torch.float32"),
        (torch.zeros(1, 2, 1, 8, dtype=torch.long), r"floating tensor .*torch.int64"),
        (torch.zeros(1, 2, 1, 8, dtype=torch.complex64), r"floating tensor .*complex64"),
        (torch.zeros(1, 2, 1, 8, device="meta"), r"on meta cannot be moved to the cache's device"),
    ):
        with pytest.raises(CacheShapeError, match=match):
            cache.update(keys, torch.zeros(1, 2, 1, 8), 0)
        with pytest.raises(CacheShapeError, match=match.replace("key", "value")):
            cache.update(torch.zeros(1, 2, 1, 8), keys, 1)
    for layer_idx in (-1, True, 1.0, None):
        with pytest.raises(TypeError, match=f"layer_idx must be an int >= 0, got {layer_idx}"):
            cache.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), layer_idx)
    assert_state(cache, before)
    keys, _ = cache.update(torch.ones(1, 2, 1, 8, dtype=torch.float64), torch.ones(1, 2, 1, 8), 0)
    assert keys.dtype == cache.layers[0].keys.dtype == torch.float32  # converted, as SPEC §1
    assert cache.layers[1].hook_k_full.layer() == 1


def test_hostile_hook_results_are_refused_and_change_nothing():
    lm, tokens = model("llama"), ids(1, 7)
    cache = prefilled("llama", tokens[:, :5])
    before = state(cache)
    for result, match in (
        (lambda k: k.double(), "torch.float64 on cpu; expected shape"),
        (lambda k: k.to("meta"), "torch.float32 on meta; expected shape"),
        (
            lambda k: k[..., :4],
            r"shape \(1, 2, \d, 4\).*expected shape \(1, 2, \d, 8\) \[batch, n_kv_heads",
        ),
        (lambda k: k.tolist(), "returned list; expected a tensor"),
    ):
        for point in POINTS:
            with pytest.raises(HookError, match=match):
                hook = lambda t, hook, result=result: result(t)  # noqa: E731
                with cache.hooks([(f"model.layers.1.kv_cache.{point}", hook)]):
                    run(lm, tokens[:, 5:], cache)
            assert_state(cache, before)


def test_layer_index_gaps_are_filled_with_empty_layers_as_dynamic_cache_does():
    ours, theirs = HFKeyValueCache(), DynamicCache()
    for cache in (ours, theirs):
        cache.update(torch.ones(1, 2, 3, 8), torch.ones(1, 2, 3, 8), 2)
    assert len(ours.layers) == len(theirs.layers) == 3
    assert [ours.get_seq_length(i) for i in range(4)] == [
        theirs.get_seq_length(i) for i in range(4)
    ]
    assert ours.batch_size == 1 and ours.layers[0].keys is None
    assert ours.get_mask_sizes(2, 0) == theirs.get_mask_sizes(2, 0)
    assert ours.get_mask_sizes(2, 2) == theirs.get_mask_sizes(2, 2)
    with pytest.raises(CacheShapeError, match=r"layers \[0, 1\] hold nothing yet"):
        ours.save("unused.safetensors")


def test_threads_running_forks_of_one_frozen_prefix_give_the_serial_results():
    lm = model("llama")
    prefix = prefilled("llama", ids(1, 6))
    prefix.freeze()
    before = state(prefix)
    arg = hf_cache_argument(lm)
    start = threading.Barrier(2)

    def branch(seed: int, wait: bool = False) -> list[torch.Tensor]:
        tokens, fork = ids(1, 6, seed=seed), prefix.fork()
        if wait:
            start.wait()
        steps = [run(lm, tokens[:, i : i + 2], fork) for i in range(0, 6, 2)]
        prompt = torch.cat([torch.zeros_like(tokens), tokens], 1)
        return [*steps, lm.generate(prompt, max_new_tokens=3, do_sample=False, **{arg: fork})]

    serial = [branch(seed) for seed in (1, 2, 3, 4)]
    with ThreadPoolExecutor(2) as pool:
        threaded = list(pool.map(lambda seed: branch(seed, wait=seed < 3), (1, 2, 3, 4)))
    for ours, reference in zip(threaded, serial, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours, reference, strict=True))
    assert_state(prefix, before)


@pytest.mark.parametrize("frozen", [False, True])
def test_torch_export_runs_as_with_dynamic_cache(frozen):
    """`torch.export` flattens the cache to its keys and values, as `DynamicCache`."""
    from transformers.integrations.executorch import register_dynamic_cache_export_support

    register_dynamic_cache_export_support()
    lm, tokens = model("llama"), ids(1, 8)
    arg, new, mask = hf_cache_argument(lm), tokens[:, 5:], torch.ones_like(tokens)

    def filled(cls):
        cache = cls(config=lm.config)
        run(lm, tokens[:, :5], cache)
        return cache

    def export(cache):
        inputs = {"input_ids": new, "attention_mask": mask, arg: cache, "use_cache": True}
        return torch.export.export(lm, (), inputs, strict=False).module()

    ours, theirs = filled(HFKeyValueCache), filled(DynamicCache)
    ours.frozen = frozen
    before = state(ours)
    exported, reference = export(ours), export(theirs)
    assert_state(ours, before)
    given = filled(HFKeyValueCache)
    given.frozen = frozen
    output = exported(input_ids=new, attention_mask=mask, **{arg: given}, use_cache=True)
    expected = reference(
        input_ids=new, attention_mask=mask, **{arg: filled(DynamicCache)}, use_cache=True
    )
    assert torch.equal(output.logits, expected.logits)
    result = output.past_key_values
    assert isinstance(result, HFKeyValueCache) and bool(result.frozen) == frozen
    assert result.get_seq_length() == (5 if frozen else 8)
    if not frozen:
        for mine, hf in zip(result.layers, expected.past_key_values.layers, strict=True):
            assert torch.equal(mine.keys, hf.keys) and torch.equal(mine.values, hf.values)


@pytest.mark.parametrize(
    ("config", "kv_heads"),
    [
        (transformers.FalconConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2), 1),
        (
            transformers.FalconConfig(
                hidden_size=32, num_attention_heads=4, num_hidden_layers=2, multi_query=False
            ),
            4,
        ),
        (transformers.GPTBigCodeConfig(n_embd=32, n_head=4, n_layer=2), 1),
    ],
)
def test_multi_query_configs_have_the_key_value_heads_their_attention_caches(config, kv_heads):
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    cache = transformers.DynamicCache()
    argument = hf_cache_argument(model)
    model(torch.zeros(1, 3, dtype=torch.long), **{argument: cache}, use_cache=True)
    assert cache.layers[0].keys.shape[1] == kv_heads
    assert CacheDimensions.of(config).n_kv_heads == kv_heads
