"""TransformerBridge with an `HFKeyValueCache`: the bridge's own numbers under every transformers.

References are the bridge itself (its uncached forward, its `run_with_hooks` and
`run_with_cache`) and the HuggingFace model it wraps (an identical copy: uncached
forward, `DynamicCache`, `generate`), on tiny random-weight Llama (GQA, rotary) and
GPT-2 models booted offline (`bridge_models`). Runs in both CI environments, on either
side of transformers 5.24's `past_key_values=` -> `cache=` rename.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import transformers
from bridge_models import FAMILIES, bridge, reference
from hf_models import ids, run
from packaging.version import Version
from test_patching_bridge_plain import fresh_llama_bridge
from transformers import DynamicCache

from safelens import (
    Ablation,
    CacheConfigError,
    HFKeyValueCache,
    HookError,
    ablate_read,
    ablate_write,
    generate,
    hf_cache_argument,
    prefill,
    run_with_cache_capture,
    run_with_hooks,
    score_continuations,
)
from safelens.backends._families import backend_of
from safelens.backends.bridge import _cache_pass
from safelens.backends.bridge._backend import BridgeBackend
from safelens.backends.bridge._cache_pass import attention_modules, cache_pass
from safelens.backends.hf._backend import HFBackend
from safelens.core._thread_hooks import hooked_anywhere

RENAMED = Version(transformers.__version__) >= Version("5.24")
TOL = dict(atol=1e-5, rtol=1e-5)


def chunked(
    name: str, tokens: torch.Tensor, cache: HFKeyValueCache, cuts: list[int]
) -> torch.Tensor:
    model, logits = bridge(name), []
    for start, stop in zip([0, *cuts], [*cuts, tokens.shape[1]], strict=True):
        with cache_pass(model, cache) as argument:
            logits.append(model(tokens[:, start:stop], **argument))
    return torch.cat(logits, 1)


def pre_hooks(name: str) -> int:
    return sum(len(module._forward_pre_hooks) for module in attention_modules(bridge(name)))


# -- the cache through the bridge -------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_chunked_passes_give_the_bridges_and_hfs_uncached_numbers(name):
    tokens = ids(2, 9)
    cache = HFKeyValueCache(naming="bridge")
    ours = chunked(name, tokens, cache, [5, 6])
    torch.testing.assert_close(ours, bridge(name)(tokens), **TOL)
    torch.testing.assert_close(ours, run(reference(name), tokens), **TOL)
    theirs = DynamicCache(config=reference(name).config)
    run(reference(name), tokens[:, :5], theirs)
    assert cache.get_seq_length() == 9 and theirs.get_seq_length() == 5
    torch.testing.assert_close(cache.layers[1].keys[:, :, :5], theirs.layers[1].keys, **TOL)
    assert pre_hooks(name) == 0


def test_the_trap_as_measured_a_cache_passed_plainly_is_ignored_after_the_rename():
    """transformers >= 5.24: the bridge leaves a cache passed as cache= empty; before, it fills it."""
    model, tokens = bridge("llama"), ids(1, 6)
    cache = DynamicCache(config=reference("llama").config)
    name = "cache" if RENAMED else "past_key_values"
    model(tokens, **{name: cache}, use_cache=True)
    assert cache.get_seq_length() == (0 if RENAMED else 6)


NO_ARGUMENT = (
    r"takes a cache through no forward argument under transformers .*leaves the cache empty "
    r".*safelens\.run_with_hooks\(bridge, tokens, cache=cache\)"
)


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_cache_argument_of_a_bridge_names_an_argument_it_reads_or_refuses(name):
    """Before the rename the answer works when passed to the bridge; after it, no name
    does (the trap above), so the answer is an error naming run_with_hooks, which works."""
    model, tokens = bridge(name), ids(2, 9)
    full = model(tokens)
    if RENAMED:
        for target, what in [(model, "a TransformerBridge"), (model.original_model, "its atte")]:
            with pytest.raises(CacheConfigError, match=f"{what}.*{NO_ARGUMENT}"):
                hf_cache_argument(target)
        cache = HFKeyValueCache(naming="bridge")
        first = run_with_hooks(model, tokens[:, :5], cache=cache)
        rest = run_with_hooks(model, tokens[:, 5:], cache=cache)
    else:
        argument = hf_cache_argument(model)
        assert argument == hf_cache_argument(model.original_model) == "past_key_values"
        cache = HFKeyValueCache(naming="bridge")
        first = model(tokens[:, :5], **{argument: cache})
        rest = model(tokens[:, 5:], **{argument: cache})
    assert cache.get_seq_length() == 9
    torch.testing.assert_close(torch.cat([first, rest], 1), full, **TOL)


def test_the_model_inside_a_bridge_is_refused_where_its_attention_would_miss_the_cache():
    """safelens' HF passes on `bridge.original_model` would leave the cache empty: refused."""
    lm, tokens = bridge("llama").original_model, ids(1, 6)
    if not RENAMED:  # its attention reads past_key_values: HF's numbers
        prefix = prefill(lm, tokens[:, :4])
        torch.testing.assert_close(prefix.last_logits, run(reference("llama"), tokens)[:, 3])
        return
    with pytest.raises(CacheConfigError, match=f"its attention modules are a .*{NO_ARGUMENT}"):
        prefill(lm, tokens)


def test_a_pass_that_misses_the_cache_is_refused_and_changes_nothing(monkeypatch):
    """Without the alias, transformers >= 5.24 would ignore the cache: refused, never silent."""
    monkeypatch.setattr(_cache_pass, "_aliased", lambda model: contextlib.nullcontext())
    tokens = ids(1, 7)
    cache = HFKeyValueCache(naming="bridge")
    if not RENAMED:  # nothing to bridge before the rename
        torch.testing.assert_close(chunked("llama", tokens, cache, [4]), bridge("llama")(tokens))
        return
    with pytest.raises(
        CacheConfigError, match=r"did not pass the cache to the attention of layers \[0, 1\]"
    ):
        chunked("llama", tokens, cache, [])
    assert cache.get_seq_length() == 0


def test_a_frozen_prefix_is_bitwise_unchanged_and_gives_the_full_run():
    model, tokens = bridge("llama"), ids(1, 9)
    cache = HFKeyValueCache(naming="bridge")
    chunked("llama", tokens[:, :6], cache, [])
    cache.freeze()
    before = [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]
    with cache_pass(model, cache) as argument:
        logits = model(tokens[:, 6:], **argument)
    torch.testing.assert_close(logits, model(tokens)[:, 6:], **TOL)
    after = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_a_failing_pass_leaves_cache_and_bridge_as_they_were():
    model, tokens = bridge("gpt2"), ids(1, 5)
    cache = HFKeyValueCache(naming="bridge")
    chunked("gpt2", tokens[:, :3], cache, [])
    with pytest.raises(RuntimeError, match="boom"), cache_pass(model, cache) as argument:
        model(tokens[:, 3:], **argument)
        raise RuntimeError("boom")
    assert cache.get_seq_length() == 3 and pre_hooks("gpt2") == 0


def test_caches_of_another_model_are_refused():
    too_deep = HFKeyValueCache(naming="bridge")
    for layer in range(3):
        too_deep.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), layer)
    with pytest.raises(CacheConfigError, match="holds 3 layers but the bridge's model has 2"):
        with cache_pass(bridge("llama"), too_deep):
            pass
    with pytest.raises(CacheConfigError, match="frozen and holds 0 of the model's 2 layers"):
        with cache_pass(bridge("llama"), HFKeyValueCache(naming="bridge", frozen=True)):
            pass


# -- hook names ----------------------------------------------------------------------------


def test_bridge_naming_of_the_cache_hook_points():
    cache = HFKeyValueCache(naming="bridge")
    assert cache.hook_point("blocks.1.kv_cache.hook_v_full").name == "blocks.1.kv_cache.hook_v_full"
    assert cache.fork().layers[1].hook_k_new.name == "blocks.1.kv_cache.hook_k_new"
    with pytest.raises(HookError, match=r"expected blocks\.\{layer\}\.kv_cache"):
        cache.hook_point("model.layers.0.kv_cache.hook_k_new")
    with pytest.raises(ValueError, match=r"naming must be one of \('hf', 'bridge'\)"):
        HFKeyValueCache(naming="blocks")


@pytest.mark.parametrize("name", FAMILIES)
def test_cache_hooks_see_the_bridges_keys_head_major(name):
    """`hook_k_new` holds the keys the bridge's attention uses: `hook_rot_k` (rotary) or `hook_k`."""
    model, tokens = bridge(name), ids(1, 6)
    key_hook = "blocks.1.attn.hook_rot_k" if name == "llama" else "blocks.1.attn.hook_k"
    _, theirs = model.run_with_cache(tokens, names_filter=[key_hook])
    _, captured = run_with_cache_capture(
        model,
        tokens,
        cache=HFKeyValueCache(naming="bridge"),
        names=["blocks.1.kv_cache.hook_k_new"],
    )
    torch.testing.assert_close(
        captured["blocks.1.kv_cache.hook_k_new"].transpose(1, 2), theirs[key_hook], **TOL
    )


def test_one_hook_list_mixes_bridge_and_cache_names_and_write_time_edits_equal_the_bridges():
    """Zeroing position 2's new values at layer 0 equals the bridge's own hook_v edit."""
    model, tokens = bridge("llama"), ids(1, 7)

    def zero_cache(values, hook):
        values[:, :, 2] = 0

    def zero_bridge(values, hook):
        values[:, 2] = 0

    seen = {}

    def keep(tensor, hook):
        seen[hook.name] = tensor.shape

    cache = HFKeyValueCache(naming="bridge")
    ours = run_with_hooks(
        model,
        tokens,
        cache=cache,
        fwd_hooks=[("blocks.0.kv_cache.hook_v_new", zero_cache), ("blocks.1.hook_resid_pre", keep)],
    )
    theirs = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_v", zero_bridge)])
    torch.testing.assert_close(ours, theirs, **TOL)
    assert (ours - model(tokens)).abs().max() > 1e-4
    assert cache.layers[0].values[:, :, 2].abs().sum() == 0
    assert list(seen.values()) == [torch.Size([1, 7, 32])]  # hook.name: TL's canonical name
    assert not model.hook_dict["blocks.1.hook_resid_pre"].has_hooks()


def test_hook_names_are_checked_before_anything_is_attached():
    model, cache = bridge("llama"), HFKeyValueCache(naming="bridge")
    with pytest.raises(
        HookError, match=r"unknown hook name 'blocks\.0\.kv_cache\.hook_k_nwe'.*did you mean"
    ):
        run_with_hooks(
            model,
            ids(1, 3),
            cache=cache,
            fwd_hooks=[
                ("blocks.0.hook_resid_pre", lambda t, hook: None),
                ("blocks.0.kv_cache.hook_k_nwe", print),
            ],
        )
    assert not model.hook_dict["blocks.0.hook_resid_pre"].has_hooks()
    with pytest.raises(HookError, match=r"need an HFKeyValueCache\(naming='bridge'\)"):
        run_with_hooks(model, ids(1, 3), cache=HFKeyValueCache())
    assert cache.get_seq_length() == 0


# -- the experiments -------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_prefill_scores_and_generation_equal_the_uncached_bridge_and_hf_generate(name):
    model, tokens = bridge(name), ids(1, 9)
    prefix = prefill(model, tokens[:, :6])
    assert backend_of(model).family == "bridge" and prefix.cache.naming == "bridge"
    full = model(tokens).log_softmax(-1)
    torch.testing.assert_close(prefix.last_logits.log_softmax(-1), full[:, 5], **TOL)
    scores = score_continuations(model, prefix, [tokens[0, 6:], tokens[0, 6:8]])
    expected = full[0, 5:8].gather(-1, tokens[0, 6:9, None])[:, 0]
    torch.testing.assert_close(scores.log_probs[0], expected, **TOL)
    torch.testing.assert_close(scores.per_continuation()[1], expected[:2], **TOL)
    generated = generate(model, prefix, 5)
    hf = reference(name).generate(tokens[:, :6], max_new_tokens=5, do_sample=False)
    assert torch.equal(generated.tokens, hf[:, 6:])


def test_left_padded_prefix_rows_give_their_unpadded_numbers():
    model, tokens = bridge("llama"), ids(2, 6)
    mask = torch.ones_like(tokens)
    mask[0, :2] = 0
    prefix = prefill(model, tokens, attention_mask=mask)
    alone = prefill(model, tokens[:1, 2:])
    torch.testing.assert_close(prefix.last_logits[:1], alone.last_logits, **TOL)


def test_ablations_equal_hf_with_an_edited_cache_and_the_bridges_own_edit():
    """Read-time: HF continuing an edited DynamicCache. Write-time: the bridge zeroing hook_v."""
    model, tokens = bridge("llama"), ids(1, 8)
    prefix = prefill(model, tokens[:, :6])
    zero = Ablation("zero", layers=0, heads=[1], positions=[2], target="values")
    plain = score_continuations(model, prefix, [tokens[0, 6:]])

    read = score_continuations(model, ablate_read(prefix, zero), [tokens[0, 6:]])
    edited = DynamicCache(config=reference("llama").config)
    run(reference("llama"), tokens[:, :6], edited)
    edited.layers[0].values[:, 1, 2] = 0
    continued = run(reference("llama"), tokens[:, 6:], edited).log_softmax(-1)
    torch.testing.assert_close(read.log_probs[0, 1], continued[0, 0, tokens[0, 7]], **TOL)

    def zero_bridge(values, hook):
        values[:, 2, 1] = 0

    write = score_continuations(model, ablate_write(model, prefix, zero), [tokens[0, 6:]])
    theirs = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_v", zero_bridge)])
    expected = theirs.log_softmax(-1)[0, 5:7].gather(-1, tokens[0, 6:8, None])[:, 0]
    torch.testing.assert_close(write.log_probs[0], expected, **TOL)
    differences = [
        (a.log_probs - b.log_probs).abs().max() for a, b in [(read, plain), (write, read)]
    ]
    assert min(differences) > 1e-4, differences


# -- unhooked passes on the bridge's plain model -----------------------------------------


@pytest.fixture
def passes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """`(family, new tokens)` of every pass run, in order: `bridge` or `hf` (the plain model)."""
    seen: list[tuple[str, int]] = []
    for backend in (BridgeBackend, HFBackend):
        original = backend._call

        def spy(self, tokens, *args, _original=original, **kwargs):
            seen.append((self.family, tokens.shape[1]))
            return _original(self, tokens, *args, **kwargs)

        monkeypatch.setattr(backend, "_call", spy)
    return seen


def experiments(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Last logits of a 6-token prefix, scores of its continuation, 5 greedy tokens."""
    prefix = prefill(model, tokens[:, :6])
    scores = score_continuations(model, prefix, [tokens[0, 6:], tokens[0, 6:8]])
    return prefix.last_logits, scores.log_probs, generate(model, prefix, 5).tokens


def test_unhooked_experiments_run_on_the_plain_model_with_the_bridges_numbers(passes):
    model, tokens = bridge("llama"), ids(1, 9)
    last, scores, generated = experiments(model, tokens)
    full = model(tokens).log_softmax(-1)
    torch.testing.assert_close(last.log_softmax(-1), full[:, 5], **TOL)
    expected = full[0, 5:8].gather(-1, tokens[0, 6:9, None])[:, 0]
    torch.testing.assert_close(scores[0], expected, **TOL)
    hf = reference("llama").generate(tokens[:, :6], max_new_tokens=5, do_sample=False)
    assert torch.equal(generated, hf[:, 6:])
    # Each call checks the plain model against one bridge pass of the prefix's last token.
    checks = [("bridge", 1), ("hf", 1)]
    assert passes == [("hf", 6), *checks, *checks, ("hf", 3), *checks, *[("hf", 1)] * 4]


def test_a_hook_on_the_bridge_keeps_every_pass_on_the_bridge(passes):
    """A bridge hook point's hook, or a torch hook on any of its modules, fires in every pass."""
    model, tokens = bridge("llama"), ids(1, 9)
    unhooked = experiments(model, tokens)
    fired: list[str] = []
    handle = model.blocks[1].mlp.register_forward_hook(lambda *args: fired.append("torch"))
    try:
        with model.hooks(fwd_hooks=[("blocks.0.attn.hook_v", lambda v, hook: fired.append(v))]):
            hooked = experiments(model, tokens)
        torch_only = experiments(model, tokens)
    finally:
        handle.remove()
    assert not hooked_anywhere(model)
    on_bridge = [("bridge", 6), ("bridge", 3), *[("bridge", 1)] * 4]
    assert passes[-12:] == on_bridge * 2
    assert fired.count("torch") == 12 and len(fired) == 18
    for got in (hooked, torch_only):
        torch.testing.assert_close(got[0], unhooked[0], **TOL)
        torch.testing.assert_close(got[1], unhooked[1], **TOL)
        assert torch.equal(got[2], unhooked[2])


def test_a_plain_model_that_computes_otherwise_is_not_used(monkeypatch, passes):
    """The check on the prefix's last token catches a plain model with other numbers."""
    model, tokens = bridge("llama"), ids(1, 9)
    expected = experiments(model, tokens)
    other = copy.deepcopy(reference("llama"))
    with torch.no_grad():
        other.model.layers[1].mlp.down_proj.weight.mul_(1.5)
    monkeypatch.setattr(BridgeBackend, "plain", lambda self: HFBackend(other))
    passes.clear()
    got = experiments(model, tokens)
    torch.testing.assert_close(got[0], expected[0], **TOL)
    torch.testing.assert_close(got[1], expected[1], **TOL)
    assert torch.equal(got[2], expected[2])
    checks = [("bridge", 1), ("hf", 1)]
    rerun = [("hf", 6), *checks, ("bridge", 6)]  # prefill: checked after its pass
    assert passes == [*rerun, *checks, ("bridge", 3), *checks, *[("bridge", 1)] * 4]


def test_a_plain_model_that_fails_leaves_the_passes_on_the_bridge(monkeypatch, passes):
    model, tokens = bridge("llama"), ids(1, 9)
    expected = experiments(model, tokens)
    broken = copy.deepcopy(reference("llama"))

    def fail(module, args):
        raise RuntimeError("the plain model cannot run this")

    broken.model.layers[1].mlp.register_forward_pre_hook(fail)
    monkeypatch.setattr(BridgeBackend, "plain", lambda self: HFBackend(broken))
    passes.clear()
    got = experiments(model, tokens)
    torch.testing.assert_close(got[1], expected[1], **TOL)
    assert torch.equal(got[2], expected[2])
    checks = [("bridge", 1), ("hf", 1)]
    assert passes == [
        *[("hf", 6), ("bridge", 6)],
        *[*checks, ("bridge", 3)],
        *[*checks, *[("bridge", 1)] * 4],
    ]


def test_compatibility_mode_experiments_equal_the_bridges_uncached_forward():
    model = fresh_llama_bridge()
    model.enable_compatibility_mode()
    tokens = ids(1, 9)
    last, scores, _ = experiments(model, tokens)
    full = model(tokens).log_softmax(-1)
    torch.testing.assert_close(last.log_softmax(-1), full[:, 5], atol=1e-4, rtol=1e-4)
    expected = full[0, 5:8].gather(-1, tokens[0, 6:9, None])[:, 0]
    torch.testing.assert_close(scores[0], expected, atol=1e-4, rtol=1e-4)
