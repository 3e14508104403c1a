"""`Sequence` storage: handed-out tensors never change, appends stay cheap, gradients flow.

Storage laws are pinned against a reference model (a plain tensor per sequence, joined
with `torch.cat`); gradients are pinned against TransformerLens' own cache, whose appends
are out-of-place `torch.cat`s. The suite runs under an autouse `torch.no_grad()`, so the
gradient tests switch it back on with `torch.enable_grad()`.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache
from transformer_lens.cache.key_value_cache_entry import TransformerLensKeyValueCacheEntry

from safelens import KeyValueCache, KeyValueCacheEntry
from safelens.core._storage import Sequence

D_VOCAB = 13
PREFIX, STEPS = 5, 4


def _numbers(counter: itertools.count, batch: int, pos: int) -> torch.Tensor:
    """`[batch, pos, 2]` of values never seen before, so an overwrite always shows."""
    start = next(counter) * 1000
    return torch.arange(start, start + batch * pos * 2, dtype=torch.float32).reshape(batch, pos, 2)


def _grown(pos: int = 2) -> Sequence:
    """A sequence past its first append, so its buffer has spare room."""
    seq = Sequence.of(torch.zeros(1, 0, 2))
    for step in range(pos):
        seq.append_(torch.full((1, 1, 2), float(step)))
    return seq


# -- restore ----------------------------------------------------------------------------


def test_restore_never_lets_a_later_append_overwrite_a_handed_out_view() -> None:
    seq = _grown()
    state = seq.snapshot()
    handed = seq.append_(torch.full((1, 1, 2), 7.0))
    copy = handed.clone()
    seq.restore(state)
    assert seq.length == 2
    after = seq.append_(torch.full((1, 1, 2), 9.0))
    assert torch.equal(handed, copy)
    assert torch.equal(after[:, -1], torch.full((1, 2), 9.0))


def test_a_tensor_seen_by_a_hook_in_a_failed_append_is_never_overwritten() -> None:
    entry = KeyValueCacheEntry(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
    entry.append(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4))
    seen: list[torch.Tensor] = []

    def fail(tensor: torch.Tensor, hook: object) -> None:
        seen.append(tensor)
        raise RuntimeError("boom")

    entry.hook_k_full.add_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        entry.append(torch.full((1, 1, 2, 4), 2.0), torch.full((1, 1, 2, 4), 2.0))
    entry.hook_k_full.remove_hooks()
    copy = seen[0].clone()
    assert entry.sequence_length == 3
    entry.append(torch.full((1, 1, 2, 4), 3.0), torch.full((1, 1, 2, 4), 3.0))
    assert torch.equal(seen[0], copy)
    assert torch.equal(entry.keys[:, -1], torch.full((1, 2, 4), 3.0))


# -- the amortised path -----------------------------------------------------------------


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad_nothing_requires_it"])
def test_a_one_token_append_with_spare_room_writes_in_place(grad: bool) -> None:
    seq = _grown()
    with torch.set_grad_enabled(grad):
        assert torch.is_grad_enabled() == grad
        before = seq.storages()
        seq.append_(torch.ones(1, 1, 2))
        assert seq.storages() == before
    assert seq.length == 3


def test_an_in_place_append_leaves_autograd_version_counters_alone() -> None:
    """The write lands past every handed-out view, so a view that attention saved for
    backward (say, to differentiate trainable queries) must stay valid."""
    seq = _grown()
    full = seq.append_(torch.ones(1, 1, 2))
    version = full._version
    seq.append_(torch.ones(1, 1, 2))
    assert full._version == version


def test_a_recorded_append_is_out_of_place_and_leaves_handed_out_views_alone() -> None:
    seq = _grown()
    with torch.enable_grad():
        assert torch.is_grad_enabled()
        leaf = torch.ones(1, 1, 2, requires_grad=True)
        before = seq.storages()
        full = seq.append_(leaf * 2)
        assert seq.storages() != before and full.requires_grad
        version = full._version
        later = seq.append_(leaf * 3)
        assert full._version == version
        (full.sum() + later.sum()).backward()
    assert torch.equal(leaf.grad, torch.full((1, 1, 2), 7.0))


def test_a_frozen_join_carries_gradients() -> None:
    with torch.enable_grad():
        stored = torch.ones(1, 2, 2, requires_grad=True)
        new = torch.ones(1, 1, 2, requires_grad=True)
        seq = Sequence.of(stored * 1)
        (seq.joined(new * 2) * 3).sum().backward()
    assert torch.equal(stored.grad, torch.full((1, 2, 2), 3.0))
    assert torch.equal(new.grad, torch.full((1, 1, 2), 6.0))


# -- the law: views never change, every sequence equals its reference ------------------

_OPS = ["append", "append", "append", "view", "joined", "fork", "expand", "crop", "select"]
_OPS += ["clone", "snapshot", "restore"]


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_sequences_match_a_reference_and_handed_out_views_never_change(data) -> None:
    counter = itertools.count(1)
    batch = data.draw(st.integers(1, 2), label="batch")
    start = _numbers(counter, batch, data.draw(st.integers(0, 3), label="pos"))
    pool: list[tuple[Sequence, torch.Tensor]] = [(Sequence.of(start), start.clone())]
    snapshots: list[tuple[int, tuple[object, ...], torch.Tensor]] = []
    handed: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hand(tensor: torch.Tensor, expected: torch.Tensor) -> None:
        assert torch.equal(tensor, expected)
        handed.append((tensor, expected.clone()))

    for _ in range(data.draw(st.integers(1, 30), label="steps")):
        index = data.draw(st.integers(0, len(pool) - 1), label="sequence")
        seq, ref = pool[index]
        rows = ref.shape[0]
        op = data.draw(st.sampled_from(_OPS), label="op")
        if op in ("append", "joined"):
            new = _numbers(counter, rows, data.draw(st.integers(0, 3), label="count"))
            mode = data.draw(st.sampled_from(["off", "on", "recorded"]), label="grad")
            with torch.set_grad_enabled(mode != "off"):
                given_new = new.clone().requires_grad_(mode == "recorded")
                if op == "append":
                    full = seq.append_(given_new)
                    pool[index] = (seq, torch.cat([ref, new], dim=1))
                else:
                    full = seq.joined(given_new)
            hand(full.detach(), torch.cat([ref, new], dim=1))
        elif op == "view":
            hand(seq.view(), ref)
            pieces = seq.pieces()
            assert torch.equal(torch.cat(pieces, dim=1), ref)
            handed.extend((piece, piece.clone()) for piece in pieces)
        elif op == "fork":
            pool.append((seq.fork(), ref))
        elif op == "expand" and rows == 1:
            n = data.draw(st.integers(1, 3), label="rows")
            pool.append((seq.expand(n), ref.expand(n, *ref.shape[1:])))
        elif op == "crop":
            length = data.draw(st.integers(0, ref.shape[1]), label="length")
            pool.append((seq.crop(length), ref[:, :length]))
        elif op == "select":
            picked = data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=3))
            pool.append((seq.select(torch.tensor(picked)), ref[picked]))
        elif op == "clone":
            pool.append((seq.clone(), ref.clone()))
        elif op == "snapshot":
            snapshots.append((index, seq.snapshot(), ref))
        elif op == "restore" and snapshots:
            owner, state, then = data.draw(st.sampled_from(snapshots), label="snapshot")
            pool[owner][0].restore(state)
            pool[owner] = (pool[owner][0], then)
        for each, expected in pool:
            assert each.length == expected.shape[1]
            assert torch.equal(each.view().detach(), expected)
        for tensor, copy in handed:
            assert torch.equal(tensor, copy)


# -- gradients through a model, equal to TransformerLens' ------------------------------


def _model(positional: str = "standard", n_kv_heads: int | None = None) -> HookedTransformer:
    """A fresh tiny model, so no test sees another's gradients."""
    cfg = HookedTransformerConfig(
        n_layers=2,
        d_model=16,
        n_ctx=32,
        d_head=4,
        n_heads=4,
        d_vocab=D_VOCAB,
        d_mlp=32,
        act_fn="gelu",
        positional_embedding_type=positional,
        n_key_value_heads=n_kv_heads,
        normalization_type="LN",
        seed=0,
        device="cpu",
    )
    return HookedTransformer(cfg).eval()


def _tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, D_VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _steps(model, toks: torch.Tensor, cache, chunks: list[int]) -> torch.Tensor:
    """Logits of `toks` run through `cache` in `chunks`, with an all-ones mask."""
    logits, start = [], 0
    for size in chunks:
        part = toks[:, start : start + size]
        logits.append(model(part, attention_mask=torch.ones_like(part), past_kv_cache=cache))
        start += size
    return torch.cat(logits, dim=1)


def _loss(logits: torch.Tensor, toks: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy plus the sum of logits, so every parameter gets a gradient."""
    predicted = logits[:, :-1].flatten(0, 1)
    return torch.nn.functional.cross_entropy(predicted, toks[:, 1:].flatten()) + logits.sum()


def _gradients(model, run) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`run()`'s loss and the parameter gradients of its backward, leaving `.grad` clear."""
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        assert torch.is_grad_enabled()
        loss = run()
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _assert_close(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == theirs.keys() and theirs
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, atol=1e-5, rtol=1e-5, msg=name)
    assert any(grad.abs().sum() > 0 for grad in theirs.values())


MODELS = [("standard", None), ("rotary", None), ("rotary", 2)]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize(("positional", "n_kv_heads"), MODELS, ids=["standard", "rotary", "gqa"])
def test_parameter_gradients_equal_transformer_lens(positional, n_kv_heads, batch) -> None:
    model = _model(positional, n_kv_heads)
    toks = _tokens(batch, PREFIX + STEPS)
    chunks = [PREFIX] + [1] * STEPS

    def run(cache_class) -> torch.Tensor:
        cache = cache_class.init_cache(model.cfg, "cpu", batch)
        return _loss(_steps(model, toks, cache, chunks), toks)

    their_loss, theirs = _gradients(model, lambda: run(TransformerLensKeyValueCache))
    our_loss, ours = _gradients(model, lambda: run(KeyValueCache))
    assert torch.equal(our_loss, their_loss)
    _assert_close(ours, theirs)


@pytest.mark.parametrize(("positional", "n_kv_heads"), MODELS, ids=["standard", "rotary", "gqa"])
def test_cached_keys_and_values_replaced_by_leaves_get_transformer_lens_gradients(
    positional, n_kv_heads
) -> None:
    model = _model(positional, n_kv_heads)
    toks = _tokens(1, PREFIX + STEPS, seed=1)
    caches = {}
    for cache_class in (TransformerLensKeyValueCache, KeyValueCache):
        caches[cache_class] = cache = cache_class.init_cache(model.cfg, "cpu", 1)
        _steps(model, toks[:, :PREFIX], cache, [PREFIX])
    prefix = [(e.past_keys.clone(), e.past_values.clone()) for e in caches[KeyValueCache].entries]
    leaves = {}
    for cache_class, cache in caches.items():
        leaves[cache_class] = [
            (k.clone().requires_grad_(), v.clone().requires_grad_()) for k, v in prefix
        ]
        for entry, (keys, values) in zip(cache.entries, leaves[cache_class], strict=True):
            entry.past_keys, entry.past_values = keys, values

    def run(cache) -> torch.Tensor:
        return _loss(_steps(model, toks[:, PREFIX:], cache, [1] * STEPS), toks[:, PREFIX:])

    _, theirs = _gradients(model, lambda: run(caches[TransformerLensKeyValueCache]))
    _, ours = _gradients(model, lambda: run(caches[KeyValueCache]))
    _assert_close(ours, theirs)
    pairs = zip(leaves[KeyValueCache], leaves[TransformerLensKeyValueCache], strict=True)
    for our_pair, their_pair in pairs:
        for our_leaf, their_leaf in zip(our_pair, their_pair, strict=True):
            assert their_leaf.grad is not None and their_leaf.grad.abs().sum() > 0
            torch.testing.assert_close(our_leaf.grad, their_leaf.grad, atol=1e-5, rtol=1e-5)


_ROWS = {"fork": 1, "expand": 3, "frozen": 1}


def _our_branch(prefix: KeyValueCache, branch: str) -> KeyValueCache:
    if branch == "expand":
        return prefix.expand(_ROWS[branch])
    return prefix.fork() if branch == "fork" else prefix


def _their_branch(
    prefix: TransformerLensKeyValueCache, branch: str
) -> TransformerLensKeyValueCache:
    """A TransformerLens cache continuing `prefix`'s tensors (its appends are out of place)."""
    rows, frozen = _ROWS[branch], branch == "frozen"
    entries = [
        TransformerLensKeyValueCacheEntry(
            e.past_keys.expand(rows, -1, -1, -1), e.past_values.expand(rows, -1, -1, -1), frozen
        )
        for e in prefix.entries
    ]
    return TransformerLensKeyValueCache(
        entries, prefix.previous_attention_mask.expand(rows, -1), frozen
    )


@pytest.mark.parametrize("branch", ["fork", "expand", "frozen"])
@pytest.mark.parametrize("positional", ["standard", "rotary"])
def test_gradients_flow_through_branches_of_a_prefix_computed_with_grad(branch, positional) -> None:
    model = _model(positional)
    prompt = _tokens(1, PREFIX, seed=2)
    continuations = [_tokens(_ROWS[branch], 3, seed=3 + i) for i in range(2)]
    chunks = [3] if branch == "frozen" else [1, 1, 1]

    def run(cache_class, derive) -> torch.Tensor:
        prefix = cache_class.init_cache(model.cfg, "cpu", 1)
        loss = _loss(_steps(model, prompt, prefix, [PREFIX]), prompt)
        if branch == "frozen":
            prefix.freeze()
        for toks in continuations:
            continued = derive(prefix, branch)
            loss = loss + _loss(_steps(model, toks, continued, chunks), toks)
            if isinstance(continued, KeyValueCache):
                # Still copy-on-write: the branch reads the prefix's own storage.
                assert prefix.storages() <= continued.storages()
                assert prefix.sequence_length == PREFIX
        return loss

    their_loss, theirs = _gradients(model, lambda: run(TransformerLensKeyValueCache, _their_branch))
    our_loss, ours = _gradients(model, lambda: run(KeyValueCache, _our_branch))
    torch.testing.assert_close(our_loss, their_loss)
    _assert_close(ours, theirs)


def test_trainable_queries_alone_keep_the_in_place_path_and_get_correct_gradients() -> None:
    """Keys that need no gradient are written in place, yet attention saved them for
    backward (to differentiate the queries): the write must not invalidate them."""
    model = _model()
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name == "blocks.0.attn.W_Q")
    toks = _tokens(1, PREFIX + STEPS, seed=4)
    chunks = [PREFIX] + [1] * STEPS

    def run(cache_class) -> torch.Tensor:
        cache = cache_class.init_cache(model.cfg, "cpu", 1)
        return _loss(_steps(model, toks, cache, chunks), toks)

    _, theirs = _gradients(model, lambda: run(TransformerLensKeyValueCache))
    _, ours = _gradients(model, lambda: run(KeyValueCache))
    assert list(theirs) == ["blocks.0.attn.W_Q"]
    _assert_close(ours, theirs)
