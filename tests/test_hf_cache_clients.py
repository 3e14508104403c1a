"""`HFKeyValueCache` under a client that compresses the cache by assigning its layers.

KV-cache compression libraries (kvpress' presses) hook each attention module after the
prefill, read `cache.layers[i].keys` / `.values`, keep some positions, and assign the
result back: `cache.layers[i].keys = kept_keys`, then `.values`. The reference is
`DynamicCache` under the same client: the same kept positions, logits and generated
tokens. A frozen cache refuses the assignment and stays as it was. Also the recipes
that reuse a prefix by copying it (`copy.deepcopy`, `pickle`, `torch.save`).
"""

from __future__ import annotations

import copy
import io
import pickle
from contextlib import contextmanager

import pytest
import torch
from hf_models import CONFIGS, ids, model, run
from transformers import DynamicCache

from safelens import CacheShapeError, FrozenCacheError
from safelens.backends.hf._cache import HFKeyValueCache
from safelens.backends.hf._model import hf_cache_argument

KEPT = 2  # below a sliding layer's window (3 held positions) too


def _attentions(lm: torch.nn.Module) -> list[torch.nn.Module]:
    return [
        module
        for module in lm.modules()
        if hasattr(module, "layer_idx") and "Attention" in type(module).__name__
    ]


@contextmanager
def knorm_press(lm: torch.nn.Module, kept: int = KEPT, prefill_only: bool = True):
    """A press as kvpress writes one: after the prefill, keep the `kept` positions whose
    keys have the smallest norm in each head (KnormPress' score), gathered per head
    (`prefill_only=False`: after every pass)."""

    def hook(module, args, kwargs, output):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        layer = cache.layers[module.layer_idx]
        if prefill_only and cache.get_seq_length(module.layer_idx) != hidden.shape[1]:
            return output  # not the prefill
        keys, values = layer.keys, layer.values
        index = (-keys.norm(dim=-1)).topk(kept, dim=-1).indices.sort(dim=-1).values
        index = index[..., None].expand(-1, -1, -1, keys.shape[-1])
        layer.keys = keys.gather(2, index)
        layer.values = values.gather(2, index)
        return output

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in _attentions(lm)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _config(name: str):
    return model(name).config


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_compressing_client_gives_dynamic_cache_results(name):
    """Kept keys and values, the next step's logits and greedy tokens, as `DynamicCache`."""
    lm, prompt = model(name), ids(2, 7)
    caches = {
        "ours": HFKeyValueCache(_config(name)),
        "reference": DynamicCache(config=_config(name)),
    }
    nexts = {}
    with torch.no_grad(), knorm_press(lm):
        for label, cache in caches.items():
            run(lm, prompt, cache)
            held = cache.layers[0].keys.shape[2]
            step = ids(2, 1, seed=5)
            mask = torch.ones(2, held + 1, dtype=torch.long, device=prompt.device)
            position = torch.full((2, 1), prompt.shape[1], device=prompt.device)
            try:
                nexts[label] = run(lm, step, cache, attention_mask=mask, position_ids=position)
            except RuntimeError as error:  # a sliding layer's mask spans its window
                nexts[label] = type(error)
    ours, reference = caches["ours"], caches["reference"]
    assert ours.get_seq_length() == reference.get_seq_length()
    for mine, theirs in zip(ours.layers, reference.layers, strict=True):
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=0, atol=0)
        torch.testing.assert_close(mine.values, theirs.values, rtol=0, atol=0)
        assert mine.get_mask_sizes(torch.tensor([0])) == theirs.get_mask_sizes(torch.tensor([0]))
    if isinstance(nexts["reference"], torch.Tensor):
        torch.testing.assert_close(nexts["ours"], nexts["reference"], rtol=1e-6, atol=1e-6)
    else:
        assert nexts["ours"] is nexts["reference"]


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2"])
def test_generate_under_a_compressing_client_gives_dynamic_cache_tokens(name):
    lm, prompt = model(name), ids(1, 8)
    tokens = {}
    with knorm_press(lm, kept=5):
        for label, cache in (("ours", HFKeyValueCache()), ("reference", DynamicCache())):
            tokens[label] = lm.generate(
                prompt, max_new_tokens=4, do_sample=False, **{hf_cache_argument(lm): cache}
            )
    assert torch.equal(tokens["ours"], tokens["reference"])


def test_assigned_keys_are_copied_and_keep_the_layer_s_dtype_and_device():
    lm, prompt = model("llama"), ids(1, 6)
    cache, reference = HFKeyValueCache(), DynamicCache()
    with torch.no_grad():
        run(lm, prompt, cache)
        run(lm, prompt, reference)
    layer = cache.layers[0]
    assert (layer.dtype, layer.device) == (layer.keys.dtype, layer.keys.device)
    if hasattr(reference.layers[0], "dtype"):  # transformers < 5.24 only
        assert (layer.dtype, layer.device) == (
            reference.layers[0].dtype,
            reference.layers[0].device,
        )
    kept = layer.keys[:, :, :2].clone()
    layer.keys = kept
    kept.zero_()  # the client's own tensor, edited after: the cache keeps what it was given
    assert layer.keys.abs().sum() > 0
    assert layer.keys.shape[2] == 2 and cache.get_seq_length() == 2


def test_a_frozen_cache_refuses_assigned_keys_and_stays_as_it_was():
    lm, prompt = model("llama"), ids(1, 6)
    cache = HFKeyValueCache()
    with torch.no_grad():
        run(lm, prompt, cache)
    cache.freeze()
    before = [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]
    with pytest.raises(FrozenCacheError, match=r"cache.layers\[0\].keys = .*frozen.*fork"):
        cache.layers[0].keys = cache.layers[0].keys[:, :, :2]
    # A prefix handed to the client frozen: its hook fails, nothing changes.
    with torch.no_grad(), knorm_press(lm, prefill_only=False), pytest.raises(FrozenCacheError):
        run(lm, ids(1, 1, seed=3), cache)
    after = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    # Each way a cache is frozen or thawed tells its layers.
    fork = cache.fork()
    fork.layers[0].keys = fork.layers[0].keys[:, :, :2]
    assert fork.get_seq_length() == 2 and cache.get_seq_length() == 6
    with fork.frozen():
        with pytest.raises(FrozenCacheError):
            fork.layers[1].values = fork.layers[1].values[:, :, :2]
    fork.layers[1].values = fork.layers[1].values[:, :, :2]
    assert all(layer.frozen for layer in cache.clone().layers)
    assert all(layer.frozen for layer in HFKeyValueCache(_config("llama"), frozen=True).layers)


def test_a_loaded_frozen_cache_refuses_assigned_keys(tmp_path):
    cache = HFKeyValueCache()
    with torch.no_grad():
        run(model("llama"), ids(1, 4), cache)
    cache.freeze()
    cache.save(tmp_path / "prefix.safetensors")
    loaded = HFKeyValueCache.load(tmp_path / "prefix.safetensors")
    with pytest.raises(FrozenCacheError):
        loaded.layers[0].keys = loaded.layers[0].keys[:, :, :1]


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda k: k[:, :1], r"n_kv_heads=2"),
        (lambda k: k[..., :4], r"d_head=8"),
        (lambda k: k.transpose(1, 2), r"n_kv_heads=2"),
        (lambda k: k.double(), r"torch.float64"),
        (lambda k: k[0], r"got \(2, 6, 8\)"),
        (lambda k: "keys", r"got str"),
    ],
)
def test_keys_that_do_not_fit_the_layer_are_refused_and_change_nothing(bad, match):
    cache = HFKeyValueCache()
    with torch.no_grad():
        run(model("llama"), ids(1, 6), cache)
    before = cache.layers[0].keys.clone()
    with pytest.raises(CacheShapeError, match=match):
        cache.layers[0].keys = bad(cache.layers[0].keys)
    assert torch.equal(cache.layers[0].keys, before)


def test_a_layer_that_has_seen_nothing_has_nothing_to_replace():
    cache = HFKeyValueCache(_config("llama"))
    with pytest.raises(CacheShapeError, match="holds nothing yet"):
        cache.layers[0].keys = torch.zeros(1, 2, 3, 8)
    with pytest.raises(AttributeError, match="before its first update"):
        _ = cache.layers[0].dtype


# -- pickle, torch.save and copy.deepcopy, as HuggingFace's cache-reuse recipes use them --


@pytest.mark.parametrize("name", ["llama", "gpt2", "mistral"])
@pytest.mark.parametrize(
    "copied",
    [
        pytest.param(lambda cache: pickle.loads(pickle.dumps(cache)), id="pickle"),
        pytest.param(copy.deepcopy, id="deepcopy"),
        pytest.param(lambda cache: _saved_and_loaded(cache), id="torch.save"),
    ],
)
def test_a_copied_prefix_continues_as_a_copied_dynamic_cache(name, copied):
    """The prefix is copied after its pass (whose undo does not travel) and continued."""
    lm, prompt = model(name), ids(1, 6)
    longer = torch.cat([prompt, ids(1, 3, seed=9)], 1)
    tokens, caches = {}, {}
    for label, cache in (("ours", HFKeyValueCache()), ("reference", DynamicCache())):
        with torch.no_grad():
            run(lm, prompt, cache)
        caches[label] = cache
        tokens[label] = lm.generate(
            longer, max_new_tokens=4, do_sample=False, **{hf_cache_argument(lm): copied(cache)}
        )
    assert torch.equal(tokens["ours"], tokens["reference"])
    assert caches["ours"].get_seq_length() == 6  # the original is untouched
    frozen = caches["ours"]
    frozen.freeze()
    again = copied(frozen)
    assert again.frozen and all(layer.frozen for layer in again.layers)
    with pytest.raises(FrozenCacheError):
        again.layers[0].keys = again.layers[0].keys[:, :, :1]


def _saved_and_loaded(cache: HFKeyValueCache) -> HFKeyValueCache:
    buffer = io.BytesIO()
    torch.save(cache, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)
