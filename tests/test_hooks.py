"""The hooks API, checked against TransformerLens on real models."""

from __future__ import annotations

import copy

import pytest
import torch
from transformer_lens import TransformerLensKeyValueCache

import safelens
from safelens import HookError, KeyValueCache
from tests.models import make_model, ones_mask, tokens

PREFIX, CONTINUATION = 6, 3
MODELS = {
    "standard": dict(positional="standard"),
    "rotary_gqa": dict(positional="rotary", n_kv_heads=2),
}


@pytest.fixture(params=list(MODELS))
def model(request: pytest.FixtureRequest):
    return make_model(**MODELS[request.param])


def _stored(cache: KeyValueCache) -> list[torch.Tensor]:
    return [t.clone() for e in cache.entries for t in (e.keys, e.values)] + [
        cache.previous_attention_mask.clone()
    ]


def _bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )


def _prefilled(model, batch: int = 1) -> tuple[KeyValueCache, torch.Tensor]:
    toks = tokens(batch, PREFIX + CONTINUATION)
    cache = KeyValueCache.init_cache(model.cfg, batch_size=batch)
    model(toks[:, :PREFIX], past_kv_cache=cache, attention_mask=ones_mask(batch, PREFIX))
    return cache, toks


# -- one list for model and cache hook names ------------------------------------------


def test_one_list_mixes_model_and_cache_names_and_cleans_up(model) -> None:
    cache = KeyValueCache.init_cache(model.cfg)
    seen: list[str] = []

    def record(tensor, hook):
        seen.append(hook.name)

    names = ["hook_embed", "blocks.1.attn.hook_k", "blocks.1.kv_cache.hook_v_new"]
    safelens.run_with_hooks(model, tokens(1, PREFIX), cache=cache, fwd_hooks=[(names, record)])
    assert seen == names
    assert not any(hp.fwd_hooks for hp in model.hook_dict.values())
    assert not any(hp.fwd_hooks for hp in cache.hook_points().values())


def test_hooks_context_removes_hooks_on_error(model) -> None:
    cache = KeyValueCache.init_cache(model.cfg)
    with pytest.raises(RuntimeError, match="boom"):
        with safelens.hooks(
            model,
            cache,
            [("blocks.0.attn.hook_q", lambda t, hook: None)]
            + [("blocks.0.kv_cache.hook_k_full", lambda t, hook: None)],
        ):
            assert model.blocks[0].attn.hook_q.fwd_hooks
            assert cache[0].hook_k_full.fwd_hooks
            raise RuntimeError("boom")
    assert not model.blocks[0].attn.hook_q.fwd_hooks
    assert not cache[0].hook_k_full.fwd_hooks
    assert model.context_level == 0


def test_predicate_filter_covers_model_and_cache_names(model) -> None:
    cache = KeyValueCache.init_cache(model.cfg)
    seen: list[str] = []
    safelens.run_with_hooks(
        model,
        tokens(1, PREFIX),
        cache=cache,
        fwd_hooks=[
            (
                lambda name: name.startswith("blocks.0.") and "hook_k" in name,
                lambda t, hook: seen.append(hook.name),
            )
        ],
    )
    expected = [
        "blocks.0.attn.hook_k",
        "blocks.0.kv_cache.hook_k_new",
        "blocks.0.kv_cache.hook_k_full",
    ]
    assert seen == expected


def test_permanent_and_prepended_hooks(model) -> None:
    cache = KeyValueCache.init_cache(model.cfg)
    order: list[str] = []
    name = "blocks.0.kv_cache.hook_k_new"
    safelens.add_hook(
        model, cache, name, lambda t, hook: order.append("permanent"), is_permanent=True
    )
    safelens.add_hook(model, cache, name, lambda t, hook: order.append("first"), prepend=True)
    safelens.run_with_hooks(
        model, tokens(1, 2), cache=cache.fork(), fwd_hooks=[]
    )  # a fork's hook points start empty
    assert order == []
    safelens.run_with_hooks(
        model, tokens(1, 2), cache=cache, fwd_hooks=[(name, lambda t, hook: order.append("temp"))]
    )
    assert order == ["first", "permanent", "temp"]
    safelens.reset_hooks(model, cache)
    assert [h.is_permanent for h in cache[0].hook_k_new.fwd_hooks] == [True]
    safelens.reset_hooks(model, cache, including_permanent=True)
    assert not cache[0].hook_k_new.fwd_hooks


def test_lazy_cache_gets_entries_and_matches_uncached_forward(model) -> None:
    cache = KeyValueCache()
    seen: list[tuple[int, ...]] = []
    last = f"blocks.{model.cfg.n_layers - 1}.kv_cache.hook_k_full"
    logits = safelens.run_with_hooks(
        model,
        tokens(2, PREFIX),
        cache=cache,
        fwd_hooks=[(last, lambda t, hook: seen.append(tuple(t.shape)))],
    )
    torch.testing.assert_close(logits, model(tokens(2, PREFIX)), rtol=1e-5, atol=1e-5)
    assert seen == [(2, PREFIX, model.cfg.n_key_value_heads or model.cfg.n_heads, model.cfg.d_head)]
    assert len(cache) == model.cfg.n_layers and cache.sequence_length == PREFIX


# -- read-time and write-time semantics -----------------------------------------------


def _edit_position(layer_tensor: torch.Tensor, position: int, head: int) -> torch.Tensor:
    edited = layer_tensor.clone()
    edited[:, position, head] = 3.0
    return edited


@pytest.mark.parametrize("kind", ["k", "v"])
def test_full_patch_changes_this_pass_only(model, kind: str) -> None:
    cache, toks = _prefilled(model)
    before = _stored(cache)
    new = toks[:, PREFIX:]
    patched = safelens.run_with_hooks(
        model,
        new,
        cache=cache.fork(),
        fwd_hooks=[(f"blocks.0.kv_cache.hook_{kind}_full", lambda t, hook: t * 0)],
    )
    assert _bitwise_equal(_stored(cache), before)
    branch = cache.fork()
    plain = safelens.run_with_hooks(model, new, cache=branch)
    assert not torch.allclose(patched, plain)
    # the branch stored its own tokens unpatched
    reference = model.run_with_cache(toks)[1][f"blocks.0.attn.hook_{kind}"]
    stored = branch[0].keys if kind == "k" else branch[0].values
    torch.testing.assert_close(stored, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["k", "v"])
def test_new_patch_is_stored_and_equals_tl_run_with_hooks(model, kind: str) -> None:
    layer, position, head = 1, 2, 1
    cache = KeyValueCache.init_cache(model.cfg)
    toks = tokens(1, PREFIX + CONTINUATION)
    edit = lambda t, hook: _edit_position(t, position, head)  # noqa: E731
    safelens.run_with_hooks(
        model,
        toks[:, :PREFIX],
        cache=cache,
        fwd_hooks=[(f"blocks.{layer}.kv_cache.hook_{kind}_new", edit)],
    )
    stored = cache[layer].keys if kind == "k" else cache[layer].values
    assert torch.all(stored[:, position, head] == 3.0)
    continued = model(
        toks[:, PREFIX:], past_kv_cache=cache, attention_mask=ones_mask(1, CONTINUATION)
    )
    reference = model.run_with_hooks(toks, fwd_hooks=[(f"blocks.{layer}.attn.hook_{kind}", edit)])
    torch.testing.assert_close(continued, reference[:, PREFIX:], rtol=1e-4, atol=1e-4)


def test_new_patch_on_frozen_cache_stores_nothing(model) -> None:
    cache, toks = _prefilled(model)
    cache.freeze()
    before = _stored(cache)
    safelens.run_with_hooks(
        model,
        toks[:, PREFIX:],
        cache=cache,
        fwd_hooks=[("blocks.0.kv_cache.hook_k_new", lambda t, hook: t + 1)],
    )
    assert _bitwise_equal(_stored(cache), before)


@pytest.mark.parametrize("kind", ["k", "v"])
def test_read_time_patch_equals_edited_copy_of_tl_cache(model, kind: str) -> None:
    layer, position, head = 1, 3, 1
    toks = tokens(1, PREFIX + CONTINUATION)
    tl_cache = TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, 1)
    model(toks[:, :PREFIX], past_kv_cache=tl_cache, attention_mask=ones_mask(1, PREFIX))
    edited = copy.deepcopy(tl_cache)
    attribute = "past_keys" if kind == "k" else "past_values"
    setattr(
        edited[layer], attribute, _edit_position(getattr(edited[layer], attribute), position, head)
    )
    edited.freeze()
    reference = model(
        toks[:, PREFIX:], past_kv_cache=edited, attention_mask=ones_mask(1, CONTINUATION)
    )

    cache, _ = _prefilled(model)
    cache.freeze()
    before = _stored(cache)
    ours = safelens.run_with_hooks(
        model,
        toks[:, PREFIX:],
        cache=cache,
        fwd_hooks=[
            (
                f"blocks.{layer}.kv_cache.hook_{kind}_full",
                lambda t, hook: _edit_position(t, position, head),
            )
        ],
    )
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    assert _bitwise_equal(_stored(cache), before)


def test_rotary_hooks_see_pre_rotary_keys() -> None:
    model = make_model(positional="rotary", n_kv_heads=2)
    toks = tokens(1, PREFIX)
    _, captured = safelens.run_with_cache_capture(
        model, toks, cache=KeyValueCache(), names="blocks.1.kv_cache.hook_k_new"
    )
    _, activations = model.run_with_cache(toks)
    keys = captured["blocks.1.kv_cache.hook_k_new"]
    torch.testing.assert_close(keys, activations["blocks.1.attn.hook_k"], rtol=0, atol=0)
    assert keys.shape == (1, PREFIX, 2, model.cfg.d_head)
    assert not torch.allclose(keys, activations["blocks.1.attn.hook_rot_k"])


def test_frozen_cache_bitwise_unchanged_after_many_hooked_passes(model) -> None:
    cache, toks = _prefilled(model)
    cache.freeze()
    before = _stored(cache)
    patches = [
        (lambda name: "kv_cache" in name, lambda t, hook: t * 2),
        ("blocks.1.kv_cache.hook_v_full", lambda t, hook: t.zero_()),
        ("blocks.0.attn.hook_k", lambda t, hook: t + 1),
    ]
    for step in range(4):
        safelens.run_with_hooks(
            model,
            toks[:, PREFIX : PREFIX + 1 + step % 2],
            cache=cache,
            fwd_hooks=patches[: step + 1],
        )
        safelens.run_with_cache_capture(model, toks[:, PREFIX:], cache=cache, fwd_hooks=patches)
    assert _bitwise_equal(_stored(cache), before)


# -- capture --------------------------------------------------------------------------


def test_capture_positions_and_heads_match_tl(model) -> None:
    cache, toks = _prefilled(model, batch=2)
    before = _stored(cache)
    new = toks[:, PREFIX:]
    logits, captured = safelens.run_with_cache_capture(
        model,
        new,
        cache=cache.fork(),
        names=["blocks.0.kv_cache.hook_v_full", "blocks.1.kv_cache.hook_k_new"],
        positions=[1, -1],
        heads=[1],
    )
    _, activations = model.run_with_cache(toks)
    full_v = activations["blocks.0.attn.hook_v"]
    new_k = activations["blocks.1.attn.hook_k"][:, PREFIX:]
    torch.testing.assert_close(
        captured["blocks.0.kv_cache.hook_v_full"],
        full_v[:, [1, -1]][:, :, [1]],
        rtol=1e-5,
        atol=1e-5,
    )
    torch.testing.assert_close(
        captured["blocks.1.kv_cache.hook_k_new"], new_k[:, [1, -1]][:, :, [1]], rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(logits, model(toks)[:, PREFIX:], rtol=1e-4, atol=1e-4)
    assert _bitwise_equal(_stored(cache), before)


def test_capture_returns_detached_clones(model) -> None:
    cache = KeyValueCache.init_cache(model.cfg)
    _, captured = safelens.run_with_cache_capture(
        model, tokens(1, PREFIX), cache=cache, names="blocks.0.kv_cache.hook_k_new"
    )
    keys = captured["blocks.0.kv_cache.hook_k_new"]
    keys.zero_()
    assert cache[0].keys.abs().sum() > 0
    assert not keys.requires_grad
    assert set(safelens.run_with_cache_capture(model, tokens(1, 2), cache=cache.fork())[1]) == set(
        safelens.cache_hook_names(model.cfg.n_layers)
    )


def test_capture_sees_patched_tensors(model) -> None:
    _, captured = safelens.run_with_cache_capture(
        model,
        tokens(1, PREFIX),
        cache=KeyValueCache(),
        names="blocks.0.kv_cache.hook_v_new",
        fwd_hooks=[("blocks.0.kv_cache.hook_v_new", lambda t, hook: torch.ones_like(t))],
    )
    assert torch.all(captured["blocks.0.kv_cache.hook_v_new"] == 1)


# -- errors ---------------------------------------------------------------------------


def test_wrong_shape_names_hook_and_leaves_cache_unchanged(model) -> None:
    cache, toks = _prefilled(model)
    before = _stored(cache)
    with pytest.raises(
        HookError,
        match=r"'blocks\.1\.kv_cache\.hook_k_new' returned shape .*expected shape \(1, 3,",
    ):
        safelens.run_with_hooks(
            model,
            toks[:, PREFIX:],
            cache=cache,
            fwd_hooks=[("blocks.1.kv_cache.hook_k_new", lambda t, hook: t[:, :1])],
        )
    assert _bitwise_equal(_stored(cache), before)
    assert not cache[1].hook_k_new.fwd_hooks


@pytest.mark.parametrize(
    "patch",
    [lambda t, hook: t.double(), lambda t, hook: t.to("meta")],
    ids=["dtype", "device"],
)
def test_wrong_dtype_or_device_is_refused(model, patch) -> None:
    cache, toks = _prefilled(model)
    before = _stored(cache)
    with pytest.raises(HookError, match=r"hook_v_full' returned .*expected shape"):
        safelens.run_with_hooks(
            model,
            toks[:, PREFIX:],
            cache=cache,
            fwd_hooks=[("blocks.0.kv_cache.hook_v_full", patch)],
        )
    assert _bitwise_equal(_stored(cache), before)


def test_unknown_name_lists_near_matches(model) -> None:
    cache = KeyValueCache.init_cache(model.cfg)
    with pytest.raises(
        HookError,
        match=r"unknown hook name 'blocks\.0\.kv_cache\.hook_k_ful'.*did you mean 'blocks\.0\.kv_cache\.hook_k_full'",
    ):
        safelens.run_with_hooks(
            model,
            tokens(1, 2),
            cache=cache,
            fwd_hooks=[("blocks.0.kv_cache.hook_k_ful", lambda t, hook: None)],
        )
    with pytest.raises(HookError, match=r"did you mean 'blocks\.0\.attn\.hook_k'"):
        with safelens.hooks(model, cache, [("blocks.0.attn.hook_kk", lambda t, hook: None)]):
            pass
    layer = model.cfg.n_layers
    with pytest.raises(
        HookError, match=rf"unknown hook name 'blocks\.{layer}\.kv_cache\.hook_k_new'"
    ):
        safelens.add_hook(model, cache, f"blocks.{layer}.kv_cache.hook_k_new", lambda t, hook: None)
    assert cache.sequence_length == 0


def test_capture_rejects_model_names_and_bad_indices(model) -> None:
    cache = KeyValueCache.init_cache(model.cfg)
    with pytest.raises(HookError, match=r"'blocks\.0\.attn\.hook_k' is a hook point of the model"):
        safelens.run_with_cache_capture(
            model, tokens(1, 2), cache=cache, names="blocks.0.attn.hook_k"
        )
    with pytest.raises(HookError, match=r"heads \[9\] out of range .* sees \d+ KV heads"):
        safelens.run_with_cache_capture(model, tokens(1, 2), cache=cache, heads=9)
    with pytest.raises(
        HookError,
        match=r"positions \[5\] out of range for 'blocks\.0\.kv_cache\.hook_k_new', which sees 2 positions",
    ):
        safelens.run_with_cache_capture(model, tokens(1, 2), cache=cache, positions=5)
    assert cache.sequence_length == 0


@pytest.mark.parametrize(
    "argument, value, match",
    [
        ("positions", "0", "positions must be an int, a sequence of ints or None, got str '0'"),
        ("positions", ["a"], r"positions must hold ints, got 'a' \(str\) at index 0"),
        ("positions", [[0]], r"positions must hold ints, got \[0\] \(list\) at index 0"),
        ("positions", [1.5], r"positions must hold ints, got 1.5 \(float\) at index 0"),
        ("positions", [0, True], r"positions must hold ints, got True \(bool\) at index 1"),
        ("heads", "all", "heads must be an int, a sequence of ints or None, got str 'all'"),
        ("heads", torch.tensor([0.5]), r"heads must hold ints, got tensor\(0.5000\)"),
    ],
)
def test_capture_names_positions_and_heads_that_are_not_ints(model, argument, value, match) -> None:
    cache = KeyValueCache.init_cache(model.cfg)
    with pytest.raises(HookError, match=match):
        safelens.run_with_cache_capture(model, tokens(1, 2), cache=cache, **{argument: value})
    assert cache.sequence_length == 0


# -- hooks cannot reach storage, and a refused call attaches nothing -------------------


@pytest.mark.parametrize("kind", ["k", "v"])
def test_read_time_hook_editing_in_place_never_reaches_storage(model, kind: str) -> None:
    cache, toks = _prefilled(model)
    before = _stored(cache)

    def zero_in_place(tensor, hook):
        tensor.zero_()

    name = f"blocks.0.kv_cache.hook_{kind}_full"
    edited = safelens.run_with_hooks(
        model, toks[:, PREFIX:], cache=cache, fwd_hooks=[(name, zero_in_place)]
    )
    stored = _stored(cache)
    for layer, (k, v) in enumerate(zip(before[0:-1:2], before[1:-1:2], strict=True)):
        assert torch.equal(stored[2 * layer][:, :PREFIX], k)
        assert torch.equal(stored[2 * layer + 1][:, :PREFIX], v)
    # The edit did reach this pass: it equals returning zeros.
    fresh, _ = _prefilled(model)
    zeros = safelens.run_with_hooks(
        model,
        toks[:, PREFIX:],
        cache=fresh,
        fwd_hooks=[(name, lambda t, hook: torch.zeros_like(t))],
    )
    torch.testing.assert_close(edited, zeros)


def test_add_hook_refuses_before_attaching_anything(model) -> None:
    cache = KeyValueCache.init_cache(model.cfg)
    names = ["blocks.0.attn.hook_k", "blocks.1.attn.hook_k", "blocks.0.kv_cache.hook_k_new"]
    with pytest.raises(HookError, match="must be callable as fn\\(tensor, hook\\), got str"):
        safelens.add_hook(model, cache, names, "not a function")  # type: ignore[arg-type]
    with pytest.raises(HookError, match=r"dir must be one of \('fwd',\) .* got 'bwd'"):
        safelens.add_hook(model, cache, names, lambda t, hook: None, dir="bwd")  # type: ignore[arg-type]
    with pytest.raises(HookError, match=r"dir must be one of \('fwd', 'bwd'\)"):
        safelens.add_hook(model, cache, names[:1], lambda t, hook: None, dir="up")  # type: ignore[arg-type]
    assert not any(point.fwd_hooks or point.bwd_hooks for point in model.hook_dict.values())
    assert not any(point.fwd_hooks for point in cache.hook_points().values())
    toks = tokens(1, 3)
    torch.testing.assert_close(safelens.run_with_hooks(model, toks, cache=cache), model(toks))
