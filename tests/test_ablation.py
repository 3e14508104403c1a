"""Read-time and write-time ablations against TransformerLens references."""

from __future__ import annotations

import copy
import functools
import threading
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import D_VOCAB, make_model, tokens
from test_prefix import assert_unchanged, reference_log_probs, snapshot
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache
from transformer_lens.cache.key_value_cache_entry import TransformerLensKeyValueCacheEntry

from safelens import (
    Ablation,
    CacheConfigError,
    CacheShapeError,
    KeyValueCache,
    KeyValueCacheEntry,
    Prefix,
    TokenError,
    ablate_read,
    ablate_write,
    prefill,
    run_with_cache_capture,
    run_with_hooks,
    score_continuations,
)

PREFIX = 10


def prompt_and_continuations() -> tuple[torch.Tensor, torch.Tensor]:
    return tokens(1, PREFIX, seed=1)[0], tokens(3, 4, seed=2)


def replace(tensor: torch.Tensor, ablation: Ablation, layer: int, target: str) -> torch.Tensor:
    """The edit done by hand on a full [batch, pos, heads, d_head] tensor."""
    positions = (
        torch.arange(PREFIX) if ablation.positions is None else torch.tensor(ablation.positions)
    )
    heads = (
        torch.arange(tensor.shape[2])
        if ablation.heads is None
        else torch.tensor(ablation.heads).reshape(-1)
    )
    out = tensor.clone()
    index = (positions[:, None], heads[None, :])
    if ablation.kind == "zero":
        out[:, index[0], index[1]] = 0
    elif ablation.kind == "function":
        assert ablation.fn is not None
        out[:, index[0], index[1]] = ablation.fn(tensor[:, index[0], index[1]], layer, target)
    else:
        refs = ablation.reference if isinstance(ablation.reference, list) else [ablation.reference]
        stacked = torch.cat([getattr(r.cache[layer], target) for r in refs])
        source = stacked.mean(0, keepdim=True) if ablation.kind == "mean" else stacked
        out[:, index[0], index[1]] = source[:, index[0], index[1]].to(out.dtype)
    return out


def make_ablations(model) -> list[Ablation]:
    others = [prefill(model, tokens(2, PREFIX, seed=s)) for s in (5, 6)]
    return [
        Ablation("zero", layers=1, heads=[0, 1], positions=[3, 4, 7]),
        Ablation("mean", layers=[0, 1], positions=[5], reference=others, target="values"),
        Ablation("resample", layers=0, heads=1, positions=[2, 9], reference=others[0].select(1)),
        Ablation("function", layers=1, fn=lambda t, layer, target: 2 * t + 1, target="keys"),
    ]


def read_reference(model, prompt, continuations, ablation) -> torch.Tensor:
    """Continuation log-probs through TL with an edited deep copy of TL's own cache."""
    # Sized by hand: TransformerLens' init_cache gives n_key_value_heads heads even where
    # ungroup_grouped_query_attention makes the model emit (and cache) n_heads.
    cfg = model.cfg
    ungrouped = cfg.ungroup_grouped_query_attention
    heads = cfg.n_heads if ungrouped else (cfg.n_key_value_heads or cfg.n_heads)
    empty = torch.empty(1, 0, heads, model.cfg.d_head, dtype=model.cfg.dtype)
    tl_cache = TransformerLensKeyValueCache(
        [TransformerLensKeyValueCacheEntry(empty, empty) for _ in range(model.cfg.n_layers)],
        torch.empty(1, 0, dtype=torch.long),
    )
    first = model(
        prompt[None], past_kv_cache=tl_cache, attention_mask=torch.ones(1, PREFIX, dtype=torch.long)
    )
    edited = copy.deepcopy(tl_cache)
    for layer in ablation.layer_list(model.cfg.n_layers):
        entry = edited[layer]
        for target in ablation.targets():
            name = "past_keys" if target == "keys" else "past_values"
            setattr(entry, name, replace(getattr(entry, name), ablation, layer, target))
    rows = []
    for continuation in continuations:
        branch = copy.deepcopy(edited)
        logits = model(
            continuation[None],
            past_kv_cache=branch,
            attention_mask=torch.ones(1, len(continuation), dtype=torch.long),
        )
        all_logits = torch.cat([first[:, -1:], logits[:, :-1]], dim=1)[0]
        rows.append(all_logits.log_softmax(-1).gather(-1, continuation[:, None])[:, 0])
    return torch.stack(rows)


def write_reference(model, prompt, continuations, ablation) -> torch.Tensor:
    """Log-probs from one run_with_hooks over prefix + continuation with the edit."""
    hooks = []
    for layer in ablation.layer_list(model.cfg.n_layers):
        for target in ablation.targets():

            def edit(tensor, hook, layer=layer, target=target):
                head = replace(tensor[:, :PREFIX], ablation, layer, target)
                return torch.cat([head, tensor[:, PREFIX:]], dim=1)

            hooks.append((f"blocks.{layer}.attn.hook_{target[0]}", edit))
    full = torch.cat([prompt.expand(len(continuations), -1), continuations], dim=1)
    logits = model.run_with_hooks(full, fwd_hooks=hooks)
    log_probs = logits[:, PREFIX - 1 : -1].log_softmax(-1)
    return log_probs.gather(-1, continuations[..., None])[..., 0]


@pytest.mark.parametrize(
    "model_args", [{"positional": "rotary"}, {"positional": "rotary", "n_kv_heads": 2}]
)
@pytest.mark.parametrize("index", range(4))
def test_read_time_equals_edited_copy_of_tl_cache(model_args: dict, index: int) -> None:
    model = make_model(**model_args)
    prompt, continuations = prompt_and_continuations()
    ablation = make_ablations(model)[index]
    prefix = prefill(model, prompt)
    before = snapshot(prefix.cache)
    edited = ablate_read(prefix, ablation)
    assert torch.equal(edited.last_logits, prefix.last_logits)
    got = score_continuations(model, edited, continuations).log_probs
    expected = read_reference(model, prompt, continuations, ablation)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert_unchanged(prefix.cache, before)


@pytest.mark.parametrize("keep_residuals", [True, False])
@pytest.mark.parametrize(
    "model_args", [{"positional": "rotary"}, {"positional": "standard", "n_kv_heads": 2}]
)
@pytest.mark.parametrize("index", range(4))
def test_write_time_equals_run_with_hooks(
    model_args: dict, index: int, keep_residuals: bool
) -> None:
    model = make_model(**model_args)
    prompt, continuations = prompt_and_continuations()
    ablation = make_ablations(model)[index]
    prefix = prefill(model, prompt, keep_residuals=keep_residuals)
    before = snapshot(prefix.cache)
    edited = ablate_write(model, prefix, ablation)
    got = score_continuations(model, edited, continuations).log_probs
    expected = write_reference(model, prompt, continuations, ablation)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert_unchanged(prefix.cache, before)
    assert bool(edited.cache.frozen)


def test_write_time_reuses_what_the_edit_cannot_change() -> None:
    model = make_model("rotary", n_layers=3)
    prompt, _ = prompt_and_continuations()
    prefix = prefill(model, prompt)
    edited = ablate_write(model, prefix, Ablation("zero", layers=1, positions=[6]))
    assert edited.cache[0].storages() == prefix.cache[0].storages()
    assert torch.equal(edited.cache[2].keys[:, :6], prefix.cache[2].keys[:, :6])
    assert not torch.equal(edited.cache[2].keys[:, 6:], prefix.cache[2].keys[:, 6:])
    assert edited.residuals is not None and prefix.residuals is not None
    assert not torch.equal(edited.residuals[2], prefix.residuals[2])
    again = ablate_write(model, edited, Ablation("zero", layers=2, positions=[8]))
    two_at_once = ablate_write(
        model,
        prefix,
        [Ablation("zero", layers=1, positions=[6]), Ablation("zero", layers=2, positions=[8])],
    )
    torch.testing.assert_close(again.last_logits, two_at_once.last_logits)


def test_left_padded_batch_write_and_read() -> None:
    model = make_model("rotary")
    batch = tokens(2, PREFIX, seed=3)
    mask = torch.ones(2, PREFIX, dtype=torch.long)
    mask[0, :3] = 0
    prefix = prefill(model, batch, attention_mask=mask)
    ablation = Ablation("zero", layers=0, positions=[5, 6])
    written = ablate_write(model, prefix, ablation)
    unpadded = batch[0, 3:]
    shifted = Ablation("zero", layers=0, positions=[2, 3])
    alone = ablate_write(model, prefill(model, unpadded), shifted)
    torch.testing.assert_close(written.last_logits[:1], alone.last_logits, atol=1e-5, rtol=1e-5)
    read = ablate_read(prefix, ablation).select(0)
    continuation = [tokens(1, 3, seed=8)[0]]
    torch.testing.assert_close(
        score_continuations(model, read, continuation).log_probs,
        score_continuations(
            model, ablate_read(prefill(model, unpadded), shifted), continuation
        ).log_probs,
        atol=1e-5,
        rtol=1e-5,
    )


def test_bfloat16_write_time() -> None:
    model = make_model("rotary", dtype=torch.bfloat16)
    prompt, continuations = prompt_and_continuations()
    ablation = Ablation("zero", layers=1, heads=[2], positions=[4])
    edited = ablate_write(model, prefill(model, prompt), ablation)
    got = score_continuations(model, edited, continuations).log_probs
    expected = write_reference(model, prompt, continuations, ablation).float()
    torch.testing.assert_close(got, expected, atol=0.1, rtol=0.05)


# -- models whose cached keys are not `attn.hook_k` ------------------------------------

SPECIAL = {
    "qk_norm": {"use_qk_norm": True, "n_key_value_heads": 2},
    "clip_qkv": {"clip_qkv": 1.0},
    "olmo2": {"original_architecture": "Olmo2ForCausalLM", "gated_mlp": True, "act_fn": "silu"},
    "ungrouped": {"n_key_value_heads": 2, "ungroup_grouped_query_attention": True},
}


# The models whose cache TransformerLens' forward accepts; "ungrouped" is refused (below).
NAMES = [name for name in SPECIAL if name != "ungrouped"]


@functools.cache
def special_model(name: str) -> HookedTransformer:
    """A tiny rotary RMS model with `SPECIAL[name]`; q/k norm weights random, not ones."""
    settings: dict[str, Any] = {"act_fn": "gelu", **SPECIAL[name]}
    cfg = HookedTransformerConfig(
        n_layers=2, d_model=32, n_ctx=64, d_head=8, n_heads=4, d_vocab=D_VOCAB,
        normalization_type="RMS", positional_embedding_type="rotary", seed=0, device="cpu",
        **settings,
    )  # fmt: skip
    model = HookedTransformer(cfg)
    generator = torch.Generator().manual_seed(0)
    for param_name, param in model.named_parameters():
        if param_name.endswith(("q_norm.w", "k_norm.w")):
            param.data = 1 + 0.5 * torch.randn(param.shape, generator=generator)
    return model.eval()


def special_ablations(model) -> list[Ablation]:
    others = [prefill(model, tokens(2, PREFIX, seed=s)) for s in (5, 6)]
    return [
        Ablation("zero", layers=0, heads=[1], positions=[3, 4, 7]),
        Ablation("function", layers=[0, 1], fn=lambda t, layer, target: 2 * t + 1),
        Ablation("mean", layers=0, positions=[5], reference=others, target="values"),
        Ablation("resample", layers=1, heads=1, positions=[2, 9], reference=others[0].select(1)),
    ]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("index", range(4))
def test_write_time_equals_run_with_hooks_where_the_cache_is_not_hook_k(
    name: str, index: int
) -> None:
    model = special_model(name)
    prompt, continuations = prompt_and_continuations()
    ablation = special_ablations(model)[index]
    if ablation.kind == "resample" and name in ("qk_norm", "olmo2"):
        ablation = Ablation(**{**vars(ablation), "target": "values"})
    prefix = prefill(model, prompt)
    before = snapshot(prefix.cache)
    edited = ablate_write(model, prefix, ablation)
    got = score_continuations(model, edited, continuations).log_probs
    expected = write_reference(model, prompt, continuations, ablation)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert_unchanged(prefix.cache, before)
    assert no_hooks(model)


@pytest.mark.parametrize("name", NAMES)
def test_prefill_and_read_time_on_these_models(name: str) -> None:
    model = special_model(name)
    prompt, continuations = prompt_and_continuations()
    prefix = prefill(model, prompt)
    expected = torch.stack([reference_log_probs(model, prompt, c) for c in continuations])
    got = score_continuations(model, prefix, continuations).log_probs
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    ablation = Ablation("zero", layers=0, heads=[1], positions=[3, 4, 7])
    read = score_continuations(model, ablate_read(prefix, ablation), continuations).log_probs
    reference = read_reference(model, prompt, continuations, ablation)
    torch.testing.assert_close(read, reference, atol=1e-5, rtol=1e-5)


def test_ungrouped_models_are_refused_with_the_reason_and_the_fix() -> None:
    # TransformerLens 3.9's forward asserts a cache holds n_key_value_heads heads, while
    # ungrouped attention appends n_heads: no cache, its own included, runs there.
    model = special_model("ungrouped")
    prompt = prompt_and_continuations()[0][None]
    match = r"ungroup_grouped_query_attention=True.*Build the model with ungroup_grouped_query_attention=False"
    with pytest.raises(CacheConfigError, match="prefill: this model has " + match):
        prefill(model, prompt)
    with pytest.raises(CacheConfigError, match="run_with_hooks: this model has " + match):
        run_with_hooks(model, prompt, cache=KeyValueCache())
    other = prefill(special_model("clip_qkv"), prompt)
    with pytest.raises(CacheConfigError, match="ablate_write: this model has " + match):
        ablate_write(model, other, Ablation("zero", layers=0))
    assert not any(point.fwd_hooks for point in model.hook_dict.values())


@pytest.mark.parametrize("name", ["qk_norm", "olmo2", "clip_qkv"])
def test_hook_k_new_sees_the_keys_after_norm_and_clip(name: str) -> None:
    model = special_model(name)
    prompt = prompt_and_continuations()[0][None]
    cache = KeyValueCache.init_cache(model.cfg)
    names = ["blocks.0.kv_cache.hook_k_new", "blocks.0.kv_cache.hook_v_new"]
    _, captured = run_with_cache_capture(model, prompt, cache=cache, names=names)
    _, activations = model.run_with_cache(prompt)
    keys, values = (captured[name] for name in names)
    hook_k, hook_v = activations["blocks.0.attn.hook_k"], activations["blocks.0.attn.hook_v"]
    assert torch.equal(keys, cache[0].keys) and torch.equal(values, cache[0].values)
    if name == "clip_qkv":
        assert torch.equal(keys, hook_k.clamp(-1.0, 1.0)) and not torch.equal(keys, hook_k)
        assert torch.equal(values, hook_v.clamp(-1.0, 1.0)) and not torch.equal(values, hook_v)
    else:
        assert not torch.allclose(keys, hook_k, atol=1e-3) and torch.equal(values, hook_v)


@pytest.mark.parametrize("name", ["qk_norm", "olmo2"])
@pytest.mark.parametrize("kind", ["mean", "resample"])
def test_reference_keys_on_normed_models_are_refused_write_time(name: str, kind: str) -> None:
    model = special_model(name)
    prefix = prefill(model, tokens(1, 6))
    other = prefill(model, tokens(1, 6, seed=9))
    ablation = Ablation(kind, layers=0, positions=[2], reference=other, target="both")  # type: ignore[arg-type]
    with pytest.raises(CacheConfigError, match=rf'kind="{kind}" ablation of keys on a model that'):
        ablate_write(model, prefix, ablation)
    ablate_read(prefix, ablation)


# -- bad input -------------------------------------------------------------------------


def no_hooks(model: Any) -> bool:
    """No hook on any of the model's hook points, TransformerLens' or plain torch ones."""
    points = getattr(model, "hook_dict", {}).values()
    return not any(point.fwd_hooks or point._forward_hooks for point in points)


def bitwise(cache: KeyValueCache) -> list[Any]:
    """Everything `cache` holds, to compare bitwise after a failed call."""
    held: list[Any] = [len(cache), cache.previous_attention_mask]
    return held + [t for entry in cache.entries for t in (entry.keys, entry.values)]


def same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a, b, strict=True)
    )


def test_bad_kinds_targets_and_arguments() -> None:
    with pytest.raises(
        ValueError, match=r"kind must be one of \('zero', 'mean', 'resample', 'function'\)"
    ):
        Ablation("shuffle", layers=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"target must be one of"):
        Ablation("zero", layers=0, target="queries")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match='kind="mean" needs reference='):
        Ablation("mean", layers=0)
    with pytest.raises(ValueError, match='kind="function" needs fn='):
        Ablation("function", layers=0)
    with pytest.raises(ValueError, match='fn= is used by kind="function", not "zero"'):
        Ablation("zero", layers=0, fn=lambda t, layer, target: t)
    with pytest.raises(ValueError, match='reference= is used by kind="mean" or "resample"'):
        Ablation("zero", layers=0, reference=KeyValueCache())
    with pytest.raises(ValueError, match="needs at least one reference; got an empty list"):
        Ablation("mean", layers=0, reference=[])
    with pytest.raises(ValueError, match='kind="resample" takes one reference .* got 2'):
        Ablation("resample", layers=0, reference=[KeyValueCache(), KeyValueCache()])
    with pytest.raises(TypeError, match=r"reference\[0\] must be a KeyValueCache or a Prefix"):
        Ablation("resample", layers=0, reference=torch.zeros(1, 4, 4, 16))


@pytest.mark.parametrize(
    ("field", "value", "error", "match"),
    [
        ("positions", [], ValueError, "positions is empty"),
        ("heads", [0.5], TypeError, r"heads must hold ints, got 0.5 \(float\) at index 0"),
        (
            "positions",
            [1, 2.0],
            TypeError,
            r"positions must hold ints, got 2.0 \(float\) at index 1",
        ),
        ("layers", "0", TypeError, "layers must be an int, a sequence of ints or None, got str"),
        ("layers", ["0"], TypeError, r"layers must hold ints, got '0' \(str\)"),
        ("heads", True, TypeError, "heads must be an int, a sequence of ints or None, got bool"),
        ("positions", [True, 2], TypeError, r"positions must hold ints, got True \(bool\)"),
        ("positions", torch.tensor([True]), TypeError, r"got tensor\(True\) \(Tensor\)"),
        ("positions", 2.5, TypeError, "got float 2.5"),
        ("positions", [3, 3], ValueError, r"positions \[3, 3\] lists an index more than once"),
    ],
)
def test_index_lists_are_ints_listed_once(field, value, error, match) -> None:
    with pytest.raises(error, match=match):
        Ablation("zero", **{"layers": 0, field: value})


def test_indices_accept_numpy_and_tensors_and_are_kept_as_tuples() -> None:
    numpy = pytest.importorskip("numpy")
    ablation = Ablation(
        "zero", layers=numpy.int64(1), heads=torch.tensor([0, 2]), positions=range(3)
    )
    assert (ablation.layers, ablation.heads, ablation.positions) == (1, (0, 2), (0, 1, 2))
    listed = [4, 5]
    ablation = Ablation("zero", layers=0, positions=listed)
    listed.append(99)  # the caller's list is not the ablation's
    assert ablation.positions == (4, 5)


@functools.cache
def six_positions() -> Prefix:
    return prefill(make_model("rotary"), tokens(1, 6))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-12, 12), min_size=1, max_size=5, unique=True))
def test_positions_resolve_as_python_indices_or_name_the_bound(positions: list[int]) -> None:
    prefix = six_positions()
    ablation = Ablation("zero", layers=0, heads=0, positions=positions)
    wrapped = [p % 6 for p in positions]
    if any(not -6 <= p < 6 for p in positions):
        with pytest.raises(
            IndexError, match=r"out of range for a prefix of 6 positions: each must be in \[-6, 6\)"
        ):
            ablate_read(prefix, ablation)
    elif len(set(wrapped)) < len(wrapped):
        with pytest.raises(ValueError, match="name one index twice"):
            ablate_read(prefix, ablation)
    else:
        keys = ablate_read(prefix, ablation).cache[0].keys
        assert keys[0, wrapped, 0].abs().sum() == 0
        untouched = [p for p in range(6) if p not in wrapped]
        assert torch.equal(keys[0, untouched], prefix.cache[0].keys[0, untouched])


def test_out_of_range_indices_name_the_bound() -> None:
    model = make_model("rotary")
    prefix = prefill(model, tokens(1, 4))
    with pytest.raises(
        IndexError, match=r"positions \[9\] out of range for a prefix of 4 positions"
    ):
        ablate_read(prefix, Ablation("zero", layers=0, positions=9))
    with pytest.raises(
        IndexError, match=r"layers \[5\] out of range for 2 layers: each must be in \[-2, 2\)"
    ):
        ablate_write(model, prefix, Ablation("zero", layers=5))
    with pytest.raises(IndexError, match=r"heads \[-5\] out of range for 4 KV heads"):
        ablate_write(model, prefix, Ablation("zero", layers=0, heads=[0, -5]))


def unmasked(cache: KeyValueCache) -> KeyValueCache:
    return KeyValueCache(
        [KeyValueCacheEntry(e.keys.clone(), e.values.clone()) for e in cache.entries]
    )


@functools.cache
def bad_references() -> list[tuple[str, Any, str]]:
    model = make_model("rotary")
    other_d_head = make_model("rotary", d_model=128, n_heads=4)
    other_heads = make_model("rotary", n_heads=2)
    long = tokens(3, 8, seed=4)
    padded = torch.ones(3, 8, dtype=torch.long)
    padded[:, :4] = 0
    return [
        ("mean", prefill(other_d_head, long), r"d_head: prefix has 16, reference 32"),
        ("resample", prefill(other_heads, long[:1]), r"n_kv_heads: prefix has 4, reference 2"),
        (
            "resample",
            prefill(make_model("rotary", n_layers=3), long[:1]),
            "layers: prefix has 2, reference 3",
        ),
        (
            "resample",
            prefill(model, long),
            r"batch: prefix has 1, reference 3 \(expected 1 or that\)",
        ),
        (
            "resample",
            prefill(model, long[:1, :3]),
            "pos: the ablation edits position 3, reference has 3",
        ),
        ("resample", KeyValueCache(), r"reference holds no layers \(an empty KeyValueCache\(\)\)"),
        (
            "mean",
            unmasked(prefill(model, long).cache),
            r"reference needs an attention mask \[batch=3, pos=8\]",
        ),
        (
            "mean",
            prefill(model, long, attention_mask=padded),
            r"every reference row is padding .* positions \[1, 3\]",
        ),
    ]


@pytest.mark.parametrize("case", range(8))
@pytest.mark.parametrize("semantics", ["read", "write"])
def test_references_that_do_not_fit_say_which_part(case: int, semantics: str) -> None:
    model = make_model("rotary")
    prefix = prefill(model, tokens(1, 6))
    kind, reference, match = bad_references()[case]
    held = reference.cache if hasattr(reference, "cache") else reference
    before, prefix_before = bitwise(held), snapshot(prefix.cache)
    ablation = Ablation(kind, layers=[0, 1], positions=[1, 3], reference=reference)
    with pytest.raises(CacheShapeError, match=match):
        if semantics == "read":
            ablate_read(prefix, ablation)
        else:
            ablate_write(model, prefix, ablation)
    assert same(bitwise(held), before)
    assert_unchanged(prefix.cache, prefix_before)


def test_references_are_never_changed() -> None:
    model = make_model("rotary", n_kv_heads=2)
    prefix = prefill(model, tokens(1, PREFIX))
    others = [prefill(model, tokens(2, PREFIX, seed=s)) for s in (5, 6)]
    # unfrozen caches, which a careless edit could write to
    caches = [others[0].cache.fork(), others[1].cache.select([0])]
    held = [o.cache for o in others] + caches
    before = [bitwise(cache) for cache in held]
    for ablation in [
        Ablation("mean", layers=[0, 1], positions=[2, 5], reference=others + caches[:1]),
        Ablation("resample", layers=1, heads=[1], reference=caches[1]),
    ]:
        ablate_read(prefix, ablation)
        ablate_write(model, prefix, ablation)
    assert all(same(bitwise(c), b) for c, b in zip(held, before, strict=True))


@pytest.mark.parametrize(
    ("result", "match"),
    [
        (
            lambda t: t[:, :1],
            r"fn returned \(1, 1, 4, 16\) for layer 0 keys; expected shape \(1, 4, 4, 16\)",
        ),
        (lambda t: t.tolist(), r"fn returned list for layer 0 keys; expected shape"),
        (
            lambda t: t.long(),
            r"fn returned torch.int64 for layer 0 keys; expected a floating tensor",
        ),
        (lambda t: t * float("nan"), r"fn returned 256 NaN or infinite values for layer 0 keys"),
    ],
)
def test_fn_results_that_do_not_fit(result, match) -> None:
    model = make_model("rotary")
    prefix = prefill(model, tokens(1, 4))
    before = snapshot(prefix.cache)
    ablation = Ablation("function", layers=0, fn=lambda t, layer, target: result(t))
    with pytest.raises(CacheShapeError, match=match):
        ablate_read(prefix, ablation)
    with pytest.raises(CacheShapeError, match=match):
        ablate_write(model, prefix, ablation)
    assert_unchanged(prefix.cache, before)
    assert no_hooks(model)


def test_a_failing_write_leaves_no_hooks_and_the_prefix_unchanged() -> None:
    model = make_model("rotary")
    prefix = prefill(model, tokens(1, 6))
    before = snapshot(prefix.cache)
    residuals = [r.clone() for r in prefix.residuals or ()]

    def fail(t, layer, target):
        if layer == 1:
            raise RuntimeError("boom in layer 1")
        return t

    with pytest.raises(RuntimeError, match="boom in layer 1"):
        ablate_write(model, prefix, Ablation("function", layers=[0, 1], positions=[2], fn=fail))
    assert no_hooks(model)
    assert_unchanged(prefix.cache, before)
    assert all(torch.equal(a, b) for a, b in zip(prefix.residuals or (), residuals, strict=True))


def other_width_model() -> HookedTransformer:
    """Layers, heads, d_head, d_vocab and dtype of make_model("rotary"), but d_model 48."""
    cfg = HookedTransformerConfig(
        n_layers=2, d_model=48, n_ctx=256, d_head=16, n_heads=4, d_vocab=D_VOCAB, act_fn="gelu",
        positional_embedding_type="rotary", device="cpu", seed=0,
    )  # fmt: skip
    return HookedTransformer(cfg).eval()


@pytest.mark.parametrize(
    ("other", "error", "match"),
    [
        (
            lambda: make_model("rotary", n_layers=3),
            CacheConfigError,
            "layers: cfg expects 3, cache has 2",
        ),
        (lambda: make_model("rotary", n_kv_heads=2), CacheConfigError, "n_kv_heads: cfg expects 2"),
        (
            lambda: make_model("rotary", dtype=torch.bfloat16),
            CacheConfigError,
            "dtype: cfg expects torch.bfloat16",
        ),
        (
            other_width_model,
            CacheConfigError,
            r"residuals are 2 of shapes \[\(1, 6, 64\)\].*d_model=48",
        ),
        (
            lambda: torch.nn.Linear(2, 2),
            TypeError,
            "needs the HookedTransformer the prefix was run through",
        ),
    ],
)
def test_a_model_that_does_not_fit_the_prefix(other, error, match) -> None:
    prefix = prefill(make_model("rotary"), tokens(1, 6))
    before = snapshot(prefix.cache)
    model = other()
    with pytest.raises(error, match=match):
        ablate_write(model, prefix, Ablation("zero", layers=0, positions=[2]))
    assert_unchanged(prefix.cache, before)
    assert no_hooks(model)


def test_prefix_tokens_the_model_cannot_embed() -> None:
    small = HookedTransformerConfig(
        n_layers=2, d_model=64, n_ctx=256, d_head=16, n_heads=4, d_vocab=20, act_fn="gelu",
        positional_embedding_type="rotary", device="cpu", seed=0,
    )  # fmt: skip
    prefix = prefill(make_model("rotary"), torch.tensor([[1, 2, 40, 3]]), keep_residuals=False)
    with pytest.raises(TokenError, match=r"prefix.tokens holds token id 40"):
        ablate_write(HookedTransformer(small), prefix, Ablation("zero", layers=0, positions=[1]))


def test_not_a_prefix_or_not_ablations() -> None:
    prefix = prefill(make_model("rotary"), tokens(1, 4))
    with pytest.raises(TypeError, match="ablate_read needs a Prefix"):
        ablate_read(prefix.cache, Ablation("zero", layers=0))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ablations must be an Ablation or a non-empty list"):
        ablate_read(prefix, [])


def test_another_threads_passes_are_not_edited() -> None:
    model = make_model("rotary")
    prompt, continuations = prompt_and_continuations()
    prefix = prefill(model, prompt)
    clean = score_continuations(model, prefix, continuations).log_probs
    inside, proceed = threading.Event(), threading.Event()

    def zero_once_the_main_thread_has_run(t, layer, target):
        inside.set()
        assert proceed.wait(30)
        return t * 0

    ablation = Ablation("function", layers=0, target="keys", fn=zero_once_the_main_thread_has_run)
    results: dict[str, Prefix] = {}
    worker = threading.Thread(
        target=lambda: results.update(edited=ablate_write(model, prefix, ablation))
    )
    worker.start()
    assert inside.wait(30)  # the worker's edit hooks are attached and running now
    during = score_continuations(model, prefix, continuations).log_probs
    proceed.set()
    worker.join(30)
    torch.testing.assert_close(during, clean, atol=1e-6, rtol=1e-6)
    serial = ablate_write(model, prefix, Ablation("zero", layers=0, target="keys"))
    torch.testing.assert_close(results["edited"].last_logits, serial.last_logits)
    assert no_hooks(model)
