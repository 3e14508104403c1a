"""shared_prefix_attention against TransformerLens' own attention on real models."""

from __future__ import annotations

import threading

import pytest
import torch
from models import make_model, ones_mask, tokens
from transformer_lens import HookedTransformer, HookedTransformerConfig

from safelens import (
    FrozenCacheError,
    KeyValueCache,
    prefill,
    score_continuations,
    shared_prefix_attention,
)

MODELS = {
    "standard": ("standard", None),
    "rotary": ("rotary", None),
    "rotary-gqa": ("rotary", 2),
}
PREFIX_MASK = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])
STEP_MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])


def prefix_cache(model: HookedTransformer) -> KeyValueCache:
    cache = KeyValueCache.init_cache(model.cfg, "cpu")
    model(tokens(1, 7, seed=3), attention_mask=PREFIX_MASK, past_kv_cache=cache)
    cache.freeze()
    return cache


def expanded(cache: KeyValueCache, n: int) -> KeyValueCache:
    rows = cache.expand(n)
    rows.freeze()
    return rows


def snapshot(cache: KeyValueCache) -> list[torch.Tensor]:
    return [t.clone() for entry in cache for t in (entry.keys, entry.values)]


@pytest.mark.parametrize("kind", MODELS)
def test_broadcast_prefix_equals_transformer_lens_and_the_uncached_run(kind: str) -> None:
    model = make_model(*MODELS[kind])
    prefix = prefix_cache(model)
    before = snapshot(prefix)
    step = tokens(3, 3, seed=4)
    reference = model(step, attention_mask=STEP_MASK, past_kv_cache=expanded(prefix, 3))
    with shared_prefix_attention(model):
        logits = model(step, attention_mask=STEP_MASK, past_kv_cache=expanded(prefix, 3))
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)
    full = torch.cat([tokens(1, 7, seed=3).expand(3, -1), step], dim=1)
    mask = torch.cat([PREFIX_MASK.expand(3, -1), STEP_MASK], dim=1)
    uncached = model(full, attention_mask=mask)[:, 7:]
    real = STEP_MASK.bool()
    torch.testing.assert_close(logits[real], uncached[real], atol=1e-4, rtol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(prefix), strict=True))


def test_bfloat16_model_matches_transformer_lens_to_its_precision() -> None:
    model = make_model("rotary", None, torch.bfloat16)
    prefix = prefix_cache(model)
    step = tokens(3, 3, seed=4)
    reference = model(step, attention_mask=STEP_MASK, past_kv_cache=expanded(prefix, 3))
    with shared_prefix_attention(model):
        logits = model(step, attention_mask=STEP_MASK, past_kv_cache=expanded(prefix, 3))
    assert logits.dtype == reference.dtype
    torch.testing.assert_close(logits.float(), reference.float(), atol=5e-2, rtol=5e-2)


def test_shared_and_per_row_pieces_are_read_together() -> None:
    model = make_model("rotary", 2)
    prefix = prefix_cache(model)
    rows = prefix.expand(3)
    model(tokens(3, 2, seed=5), attention_mask=ones_mask(3, 2), past_kv_cache=rows)
    rows.freeze()
    step = tokens(3, 2, seed=6)
    reference = model(step, attention_mask=ones_mask(3, 2), past_kv_cache=rows)
    with shared_prefix_attention(model):
        logits = model(step, attention_mask=ones_mask(3, 2), past_kv_cache=rows)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)


def test_rows_whose_prefix_masks_differ_are_read_per_row() -> None:
    model = make_model("rotary")
    cache = KeyValueCache.init_cache(model.cfg, "cpu", batch_size=2)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    model(tokens(2, 4, seed=7), attention_mask=mask, past_kv_cache=cache)
    cache.freeze()
    step = tokens(2, 2, seed=8)
    reference = model(step, attention_mask=ones_mask(2, 2), past_kv_cache=cache)
    with shared_prefix_attention(model):
        logits = model(step, attention_mask=ones_mask(2, 2), past_kv_cache=cache)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)


def test_an_unfrozen_cache_runs_transformer_lens_own_forward_bitwise() -> None:
    model = make_model("rotary")
    ours, theirs = prefix_cache(model).fork(), prefix_cache(model).fork()
    step = tokens(1, 2, seed=9)
    reference = model(step, attention_mask=ones_mask(1, 2), past_kv_cache=theirs)
    with shared_prefix_attention(model):
        logits = model(step, attention_mask=ones_mask(1, 2), past_kv_cache=ours)
    assert torch.equal(logits, reference)
    assert ours.sequence_length == theirs.sequence_length == 9


@pytest.mark.parametrize("name", ["blocks.0.attn.hook_rot_k", "blocks.0.kv_cache.hook_k_full"])
def test_hooks_that_need_the_joined_keys_see_them(name: str) -> None:
    model = make_model("rotary")
    prefix = prefix_cache(model)
    step = tokens(3, 3, seed=4)
    reference = model(step, attention_mask=STEP_MASK, past_kv_cache=expanded(prefix, 3))
    seen: list[tuple[int, ...]] = []
    rows = expanded(prefix, 3)
    point = model.hook_dict.get(name) or rows.hook_points()[name]
    point.add_hook(lambda tensor, hook: seen.append(tuple(tensor.shape)))
    try:
        with shared_prefix_attention(model):
            logits = model(step, attention_mask=STEP_MASK, past_kv_cache=rows)
    finally:
        point.remove_hooks()
    assert seen == [(3, 10, 4, 16)]  # layer 0 ran TransformerLens' forward
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)


def test_attention_hooks_fire_with_transformer_lens_shapes_and_values() -> None:
    model = make_model("rotary", 2)
    prefix = prefix_cache(model)
    step = tokens(3, 3, seed=4)
    names = ["hook_q", "hook_k", "hook_v", "hook_rot_q", "hook_attn_scores", "hook_pattern"]
    names = [f"blocks.1.attn.{name}" for name in names + ["hook_z"]]

    def capture() -> dict[str, torch.Tensor]:
        seen: dict[str, torch.Tensor] = {}

        def keep(tensor: torch.Tensor, hook: object) -> None:
            seen[hook.name] = tensor.clone()  # type: ignore[attr-defined]

        with model.hooks(fwd_hooks=[(name, keep) for name in names]):
            model(step, attention_mask=STEP_MASK, past_kv_cache=expanded(prefix, 3))
        return seen

    reference = capture()
    with shared_prefix_attention(model):
        ours = capture()
    assert list(ours) == list(reference)
    for name in names:
        assert ours[name].shape == reference[name].shape, name
        finite = reference[name].isfinite()
        torch.testing.assert_close(ours[name][finite], reference[name][finite], atol=1e-5, rtol=0)


def test_a_hook_on_hook_q_may_keep_only_the_last_query() -> None:
    model = make_model("rotary")
    prefix = prefix_cache(model)
    attn = model.blocks[0].attn
    x = torch.randn(3, 3, model.cfg.d_model, generator=torch.Generator().manual_seed(0))
    with shared_prefix_attention(model):
        full = attn(x, x, x, past_kv_cache_entry=expanded(prefix, 3)[0])
        attn.hook_q.add_hook(lambda q, hook: q[:, -1:])
        try:
            last = attn(x, x, x, past_kv_cache_entry=expanded(prefix, 3)[0])
        finally:
            attn.hook_q.remove_hooks()
    assert last.shape == (3, 1, model.cfg.d_model)
    torch.testing.assert_close(last, full[:, -1:], atol=1e-5, rtol=1e-5)


def test_forward_is_restored_on_exit_and_when_the_block_raises() -> None:
    model = make_model("rotary")
    with shared_prefix_attention(model):
        assert all("forward" in block.attn.__dict__ for block in model.blocks)
    assert not any("forward" in block.attn.__dict__ for block in model.blocks)
    with pytest.raises(RuntimeError, match="inside"), shared_prefix_attention(model):
        raise RuntimeError("inside")
    assert not any("forward" in block.attn.__dict__ for block in model.blocks)


def test_layers_it_cannot_reproduce_keep_their_forward() -> None:
    cfg = HookedTransformerConfig(
        n_layers=1,
        d_model=16,
        n_ctx=16,
        d_head=4,
        d_vocab=11,
        act_fn="gelu",
        positional_embedding_type="alibi",
    )
    model = HookedTransformer(cfg)
    with shared_prefix_attention(model):
        assert "forward" not in model.blocks[0].attn.__dict__


def test_rejects_what_is_not_a_model() -> None:
    with (
        pytest.raises(TypeError, match="model must be a HookedTransformer"),
        shared_prefix_attention(object()),
    ):
        pass


def test_frozen_pieces_needs_a_frozen_entry_without_full_hooks() -> None:
    model = make_model("rotary")
    entry = prefix_cache(model).fork()[0]
    new = torch.zeros(1, 1, 4, 16)
    assert not entry.reads_in_pieces
    with pytest.raises(FrozenCacheError, match="frozen_pieces needs a frozen entry"):
        entry.frozen_pieces(new, new)
    entry.freeze()
    keys, values = entry.frozen_pieces(new, new)
    assert [tuple(k.shape) for k in keys] == [(1, 7, 4, 16), (1, 1, 4, 16)]
    assert entry.sequence_length == 7
    entry.hook_k_full.add_hook(lambda tensor, hook: tensor)
    assert not entry.reads_in_pieces


def test_a_forward_attribute_of_its_own_is_restored_exactly() -> None:
    model = make_model("rotary")
    attn = model.blocks[0].attn
    own = attn.forward  # a bound method stored on the instance
    attn.forward = own
    try:
        with shared_prefix_attention(model), shared_prefix_attention(model):
            assert attn.__dict__["forward"] is not own
        assert attn.__dict__["forward"] is own
    finally:
        del attn.forward
    assert "forward" not in model.blocks[1].attn.__dict__


def run_threads(jobs: list, iterations: int) -> list[str]:
    """Run each job `iterations` times in a thread of its own; the errors they raised."""
    errors: list[str] = []

    def work(job) -> None:
        try:
            with torch.no_grad():
                for _ in range(iterations):
                    job()
        except BaseException as error:  # noqa: BLE001 - reported to the test
            errors.append(repr(error))

    threads = [threading.Thread(target=work, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_threads_scoring_one_frozen_prefix_get_the_serial_results() -> None:
    model = make_model("rotary", 2)
    prefix = prefill(model, tokens(1, 7, seed=3))
    before = snapshot(prefix.cache)
    plain = tokens(2, 6, seed=11)
    expected_plain = model(plain)
    continuations = [[tokens(1, n, seed=20 + 4 * i + n)[0] for n in (1, 3, 2)] for i in range(3)]
    serial = [score_continuations(model, prefix, c).log_probs for c in continuations]
    mismatches: list[int] = []

    def scorer(i: int):
        def job() -> None:
            if not torch.allclose(
                score_continuations(model, prefix, continuations[i]).log_probs,
                serial[i],
                atol=1e-5,
            ):
                mismatches.append(i)

        return job

    def plain_forward() -> None:
        if not torch.equal(model(plain), expected_plain):
            mismatches.append(-1)

    errors = run_threads([scorer(0), scorer(1), scorer(2), plain_forward], iterations=12)
    assert errors == [] and mismatches == []
    assert not any("forward" in block.attn.__dict__ for block in model.blocks)
    assert torch.equal(model(plain), expected_plain)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(prefix.cache), strict=True))


def test_a_thread_outside_the_block_runs_transformer_lens_own_attention() -> None:
    model = make_model("rotary", 2)
    prefix = prefix_cache(model)
    step = tokens(3, 3, seed=4)
    reference = model(step, attention_mask=STEP_MASK, past_kv_cache=expanded(prefix, 3))
    inside, done = threading.Event(), threading.Event()
    seen: list[torch.Tensor] = []

    def hold_the_block() -> None:
        with shared_prefix_attention(model):
            inside.set()
            done.wait(timeout=30)

    holder = threading.Thread(target=hold_the_block)
    holder.start()
    try:
        assert inside.wait(timeout=30)
        assert all("forward" in block.attn.__dict__ for block in model.blocks)
        seen.append(model(step, attention_mask=STEP_MASK, past_kv_cache=expanded(prefix, 3)))
    finally:
        done.set()
        holder.join()
    assert torch.equal(seen[0], reference)  # bitwise: TransformerLens' own forward ran
    assert not any("forward" in block.attn.__dict__ for block in model.blocks)


def test_a_block_that_raises_in_one_thread_leaves_another_threads_block_working() -> None:
    model = make_model("rotary", 2)
    prefix = prefix_cache(model)
    step = tokens(3, 3, seed=4)
    reference = model(step, attention_mask=STEP_MASK, past_kv_cache=expanded(prefix, 3))
    inside, raised = threading.Event(), threading.Event()
    seen: list[torch.Tensor] = []

    def hold_the_block() -> None:
        with torch.no_grad(), shared_prefix_attention(model):
            inside.set()
            raised.wait(timeout=30)
            seen.append(model(step, attention_mask=STEP_MASK, past_kv_cache=expanded(prefix, 3)))

    holder = threading.Thread(target=hold_the_block)
    holder.start()
    try:
        assert inside.wait(timeout=30)
        with pytest.raises(RuntimeError, match="inside"), shared_prefix_attention(model):
            raise RuntimeError("inside")
        assert all("forward" in block.attn.__dict__ for block in model.blocks)
    finally:
        raised.set()
        holder.join()
    torch.testing.assert_close(seen[0], reference, atol=1e-5, rtol=1e-5)
    assert not any("forward" in block.attn.__dict__ for block in model.blocks)


@pytest.mark.parametrize("kind", MODELS)
def test_shared_inputs_map_repeated_rows_once_with_the_same_outputs_and_hooks(kind: str) -> None:
    from safelens.backends.hooked._shared_attention import shared_inputs
    from safelens.core._thread_hooks import thread_hooks

    model = make_model(*MODELS[kind])
    prefix = prefix_cache(model)
    attn = model.blocks[1].attn
    generator = torch.Generator().manual_seed(0)
    head = torch.randn(2, 3, model.cfg.d_model, generator=generator)
    copy = torch.randn(1, 3, model.cfg.d_model, generator=generator)
    x = torch.cat([head, copy.expand(3, -1, -1)])  # rows 2: repeat row 2
    seen: list[tuple[str, tuple[int, ...]]] = []
    calls = {"projections": 0}
    project = attn.calculate_qkv_matrices

    def counting(*inputs: torch.Tensor):
        calls["projections"] += inputs[0].shape[0]
        return project(*inputs)

    def edit(tensor: torch.Tensor, hook: object) -> torch.Tensor:
        seen.append((hook.name, tuple(tensor.shape)))  # type: ignore[attr-defined]
        tensor[3, 1] += 1.0  # a patch of one repeated row, in place
        return tensor

    points = [(getattr(attn, name), edit) for name in ("hook_q", "hook_k", "hook_v")]
    with shared_prefix_attention(model), thread_hooks(points):
        reference = attn(x, x, x, past_kv_cache_entry=expanded(prefix, 5)[1])
        plain = calls["projections"]
        attn.calculate_qkv_matrices = counting
        try:
            with shared_inputs(2, 1):
                ours = attn(x, x, x, past_kv_cache_entry=expanded(prefix, 5)[1])
        finally:
            del attn.calculate_qkv_matrices
    assert plain == 0 and calls["projections"] == 3  # two rows of their own and one repeated
    assert seen[:3] == seen[3:] and [shape[0] for _, shape in seen] == [5] * 6
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(ours[3], ours[4])  # the patched copy differs from the others


@pytest.mark.parametrize("kind", ["transformer_lens", "forward", "pre"])
def test_shared_inputs_are_not_taken_under_a_hook_of_someone_elses(kind: str) -> None:
    from safelens.backends.hooked._shared_attention import shared_inputs

    model = make_model("rotary")
    prefix = prefix_cache(model)
    attn = model.blocks[0].attn
    x = torch.randn(1, 3, model.cfg.d_model, generator=torch.Generator().manual_seed(0))
    x = x.expand(4, -1, -1).clone()
    seen: list[int] = []
    if kind == "transformer_lens":
        attn.hook_k.add_hook(lambda k, hook: seen.append(k.shape[0]))
        handle = None
    elif kind == "forward":
        handle = attn.hook_k.register_forward_hook(lambda m, i, k: seen.append(k.shape[0]))
    else:
        handle = attn.hook_k.register_forward_pre_hook(lambda m, i: seen.append(i[0].shape[0]))
    try:
        with shared_prefix_attention(model), shared_inputs(0, 1):
            ours = attn(x, x, x, past_kv_cache_entry=expanded(prefix, 4)[0])
    finally:
        attn.hook_k.remove_hooks()
        if handle is not None:
            handle.remove()
    reference = attn(x, x, x, past_kv_cache_entry=expanded(prefix, 4)[0])
    assert seen == [4]  # once, on every row
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
