"""The experiments on plain HuggingFace causal LMs, each against HuggingFace itself.

References: HF's uncached forward of prefix + continuation (with `generate`'s position
ids, so left padding is handled as HF handles it), HF's `DynamicCache`, HF's `generate`
on the full prompt (greedy and seeded sampling), a deep copy of a `DynamicCache` whose
keys/values were edited (read-time), and an uncached run with the same edit made by a
plain torch forward hook on the key/value projection (write-time). Every family of
`tests/hf_models.py`, in float32 and bfloat16, on tiny random-weight models.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import pytest
import torch
from devices import DEVICE
from hf_models import CONFIGS, ids, model, run
from models import make_model, tokens
from transformers import DynamicCache

from safelens import (
    Ablation,
    CacheConfigError,
    CacheShapeError,
    HookError,
    KeyValueCache,
    TokenError,
    ablate_read,
    ablate_write,
    generate,
    prefill,
    run_with_cache_capture,
    run_with_hooks,
    score_continuations,
)
from safelens.backends.hf._cache import HFKeyValueCache

FAMILIES = list(CONFIGS)
# Every family in float32, and bfloat16 on a GQA rotary model, which keeps the file fast.
CASES = [(name, torch.float32) for name in FAMILIES] + [("llama", torch.bfloat16)]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 6e-2}
HEADS, POSITIONS = [1], [2, 5]


def positions_of(mask: torch.Tensor) -> torch.Tensor:
    """`generate`'s position ids: real tokens counted from 0, padding at 0."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def uncached(lm: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor | None = None):
    mask = torch.ones_like(tokens) if mask is None else mask
    return lm(tokens, attention_mask=mask, position_ids=positions_of(mask)).logits


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of `tokens[i]` under `logits[i]`, `[n, new_tokens]`."""
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None])[..., 0]


def stored(cache: HFKeyValueCache) -> list[torch.Tensor]:
    return [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]


def assert_unchanged(cache: HFKeyValueCache, before: list[torch.Tensor]) -> None:
    after = stored(cache)
    assert len(after) == len(before)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert bool(cache.frozen)


def no_hooks(lm: torch.nn.Module) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks for m in lm.modules())


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# -- prefill and continuations ---------------------------------------------------------


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_continuations_equal_the_uncached_forward_and_dynamic_cache(name, dtype):
    lm, prompt = model(name, dtype), ids(1, 8)
    continuations = [ids(1, 5, seed=2)[0], ids(1, 1, seed=3)[0], ids(1, 3, seed=4)[0]]
    prefix = prefill(lm, prompt)
    before = stored(prefix.cache)
    scores = score_continuations(lm, prefix, continuations, batch_size=2)
    for row, continuation in zip(scores.per_continuation(), continuations, strict=True):
        logits = uncached(lm, torch.cat([prompt[0], continuation])[None])[0]
        assert_close(row, token_log_probs(logits[7:-1], continuation), dtype)
    # HF's own way: DynamicCache, batch_repeat_interleave, one right-padded batched pass.
    theirs = DynamicCache()
    run(lm, prompt, theirs)
    theirs.batch_repeat_interleave(len(continuations))
    tokens = torch.nn.utils.rnn.pad_sequence(continuations, batch_first=True)
    real = scores.mask.long()
    mask = torch.cat([torch.ones(len(continuations), 8, dtype=torch.long, device=DEVICE), real], 1)
    logits = run(lm, tokens, theirs, attention_mask=mask, position_ids=positions_of(mask)[:, 8:])
    later = token_log_probs(logits[:, :-1], tokens[:, 1:]) * real[:, 1:]
    assert_close(scores.log_probs[:, 1:], later, dtype)
    first = token_log_probs(uncached(lm, prompt)[:, -1].expand(3, -1), tokens[:, 0])
    assert_close(scores.log_probs[:, 0], first, dtype)
    assert_unchanged(prefix.cache, before)
    assert prefix.residuals is None and isinstance(prefix.cache, HFKeyValueCache)


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_a_left_padded_row_gives_the_numbers_of_the_row_unpadded(name, dtype):
    lm, prompts = model(name, dtype), ids(2, 7)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7], device=DEVICE)
    prefix = prefill(lm, prompts, attention_mask=mask)
    assert_close(prefix.last_logits, uncached(lm, prompts, mask)[:, -1], dtype)
    continuation = ids(1, 4, seed=5)[0]
    padded = score_continuations(lm, prefix.select(0), [continuation]).log_probs[0]
    alone = uncached(lm, torch.cat([prompts[0, 3:], continuation])[None])[0]
    assert_close(padded, token_log_probs(alone[3:-1], continuation), dtype)


# -- generation ------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_greedy_generation_gives_hf_generate_tokens_on_a_left_padded_batch(name, dtype):
    lm, prompts = model(name, dtype), ids(2, 6)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6], device=DEVICE)
    prefix = prefill(lm, prompts, attention_mask=mask)
    before = stored(prefix.cache)
    ours = generate(lm, prefix, 8)
    theirs = lm.generate(
        prompts, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0
    )
    assert torch.equal(ours.tokens, theirs[:, 6:])
    assert_unchanged(prefix.cache, before)


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma2"])
def test_seeded_sampling_draws_what_hf_generate_draws_with_that_seed(name):
    lm, prompt = model(name), ids(1, 5)
    settings = dict(temperature=0.8, top_k=20, top_p=0.9)
    ours = generate(lm, prefill(lm, prompt), 7, n_samples=4, do_sample=True, seed=11, **settings)
    torch.manual_seed(11)
    theirs = lm.generate(
        prompt, do_sample=True, max_new_tokens=7, num_return_sequences=4, **settings
    )
    assert torch.equal(ours.tokens, theirs[:, 5:])
    again = generate(lm, prefill(lm, prompt), 7, n_samples=4, do_sample=True, seed=11, **settings)
    assert torch.equal(again.tokens, ours.tokens)


# -- ablations -------------------------------------------------------------------------


def _head_dim(lm: torch.nn.Module) -> int:
    config = lm.config
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def projection(lm: torch.nn.Module, layer: int, target: str) -> tuple[torch.nn.Module, int, int]:
    """`(module, offset, n_kv_heads)`: where `target` of each KV head sits in its output."""
    config, d_head = lm.config, _head_dim(lm)
    heads = config.num_attention_heads
    if config.model_type == "gpt2":
        return (
            lm.transformer.h[layer].attn.c_attn,
            (1 if target == "keys" else 2) * heads * d_head,
            heads,
        )
    attn, kv = lm.model.layers[layer].self_attn, config.num_key_value_heads
    if hasattr(attn, "qkv_proj"):  # Phi-3: [q, k, v] in one projection
        return attn.qkv_proj, heads * d_head + (0 if target == "keys" else kv * d_head), kv
    return getattr(attn, "k_proj" if target == "keys" else "v_proj"), 0, kv


def projected(lm, layer, target, output):
    """The `[batch, pos, n_kv_heads, d_head]` view of `target` in a projection's output."""
    _, offset, kv = projection(lm, layer, target)
    d_head = _head_dim(lm)
    return output[..., offset : offset + kv * d_head].unflatten(-1, (kv, d_head))


@contextmanager
def seam_edit(
    lm, layer: int, target: str, new: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[None]:
    """A plain torch hook setting `target`'s `[batch, POSITIONS, HEADS, d_head]` to `new(slice)`."""
    module = projection(lm, layer, target)[0]
    rows, cols = torch.tensor(POSITIONS)[:, None], torch.tensor(HEADS)[None, :]

    def hook(module, args, output):
        output = output.clone()
        part = projected(lm, layer, target, output)
        part[:, rows, cols] = new(part[:, rows, cols]).to(part.dtype)
        return output

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def captured_projections(lm, tokens) -> dict[str, torch.Tensor]:
    """Layer 0's keys and values as the projection emits them, `[batch, pos, kv, d_head]`."""
    seen = {}
    handles = []
    for target in ("keys", "values"):
        module = projection(lm, 0, target)[0]

        def keep(module, args, output, target=target):
            seen[target] = projected(lm, 0, target, output).clone()

        handles.append(module.register_forward_hook(keep))
    try:
        uncached(lm, tokens)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def edits(lm, dtype):
    """`(ablation, plain-hook edit per target)` pairs: zero, function, resample, mean."""
    other, pair = ids(1, 8, seed=7), ids(2, 8, seed=8)
    resampled, meaned = captured_projections(lm, other), captured_projections(lm, pair)
    rows, cols = torch.tensor(POSITIONS)[:, None], torch.tensor(HEADS)[None, :]
    where = dict(layers=0, heads=HEADS, positions=POSITIONS)
    return [
        (Ablation("zero", target="keys", **where), {"keys": torch.zeros_like}),
        (
            # Linear, so it commutes with the rotary embedding applied after the projection.
            Ablation("function", fn=lambda t, layer, target: -3 * t, **where),
            {"keys": lambda t: -3 * t, "values": lambda t: -3 * t},
        ),
        (
            Ablation("resample", reference=prefill(lm, other), **where),
            {t: (lambda s, t=t: resampled[t][:, rows, cols]) for t in ("keys", "values")},
        ),
        (
            Ablation("mean", target="values", reference=prefill(lm, pair), **where),
            {"values": lambda s: meaned["values"][:, rows, cols].float().mean(0, keepdim=True)},
        ),
    ]


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_write_time_ablation_equals_the_uncached_run_edited_at_the_projection(name, dtype):
    lm, prompt, continuation = model(name, dtype), ids(1, 8), ids(1, 4, seed=9)
    prefix = prefill(lm, prompt)
    before = stored(prefix.cache)
    for ablation, plain in edits(lm, dtype):
        edited = ablate_write(lm, prefix, ablation)
        scores = score_continuations(lm, edited, [continuation[0]]).log_probs[0]
        with ExitStack() as stack:
            for target, fn in plain.items():
                stack.enter_context(seam_edit(lm, 0, target, fn))
            logits = uncached(lm, torch.cat([prompt, continuation], 1))[0]
        assert_close(edited.last_logits[0], logits[7], dtype)
        assert_close(scores, token_log_probs(logits[7:-1], continuation[0]), dtype)
        assert no_hooks(lm)
    assert_unchanged(prefix.cache, before)


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_read_time_ablation_equals_an_edited_copy_of_a_dynamic_cache(name, dtype):
    lm, prompt, continuation = model(name, dtype), ids(1, 8), ids(1, 4, seed=9)
    prefix, other = prefill(lm, prompt), prefill(lm, ids(1, 8, seed=7))
    before = stored(prefix.cache)
    theirs, source = DynamicCache(), DynamicCache()
    run(lm, prompt, theirs)
    run(lm, ids(1, 8, seed=7), source)
    heads, positions = torch.tensor(HEADS)[:, None], torch.tensor(POSITIONS)[None, :]
    cases = [
        (Ablation("zero", layers=[0, 1], heads=HEADS, positions=POSITIONS), lambda layer, t: 0.0),
        (
            Ablation("resample", layers=1, heads=HEADS, positions=POSITIONS, reference=other),
            lambda layer, t: getattr(source.layers[layer], t)[:, heads, positions],
        ),
    ]
    for ablation, value in cases:
        edited = copy.deepcopy(theirs)
        for layer in ablation.layer_list(2):
            for target in ("keys", "values"):
                getattr(edited.layers[layer], target)[:, heads, positions] = value(layer, target)
        logits = run(lm, continuation, edited)[0]
        read = ablate_read(prefix, ablation)
        scores = score_continuations(lm, read, [continuation[0]]).log_probs[0]
        assert_close(scores[1:], token_log_probs(logits[:-1], continuation[0, 1:]), dtype)
        assert torch.equal(read.last_logits, prefix.last_logits)
    assert_unchanged(prefix.cache, before)


def test_function_ablations_get_head_major_slices_and_misfits_change_nothing():
    lm = model("llama")
    prefix = prefill(lm, ids(1, 8))
    before = stored(prefix.cache)
    shapes = []

    def keep(tensor, layer, target):
        shapes.append(tuple(tensor.shape))
        return tensor

    ablate_read(prefix, Ablation("function", layers=0, heads=HEADS, positions=POSITIONS, fn=keep))
    assert shapes == [(1, 1, 2, 8)] * 2  # [batch, heads, positions, d_head]
    bad = Ablation("function", layers=0, fn=lambda tensor, layer, target: tensor[:, :1])
    match = r"shape \(1, 2, 8, 8\) \[batch, heads, positions, d_head\]"
    with pytest.raises(CacheShapeError, match=match):
        ablate_write(lm, prefix, bad)
    with pytest.raises(CacheShapeError, match=match):
        ablate_read(prefix, bad)
    assert_unchanged(prefix.cache, before)
    assert no_hooks(lm)


# -- hooked runs and capture -----------------------------------------------------------

MLP = {"llama": "model.layers.0.mlp", "gpt2": "transformer.h.0.mlp"}


@pytest.mark.parametrize("name", list(MLP))
def test_run_with_hooks_mixes_module_names_and_cache_hook_names(name):
    lm, prompt = model(name), ids(1, 6)
    seen = {}

    def zero(tensor, hook):
        seen[hook.name] = tuple(tensor.shape)
        return torch.zeros_like(tensor)

    def save(tensor, hook):
        seen[hook.name] = tensor.clone()

    cache = HFKeyValueCache()
    logits = run_with_hooks(
        lm,
        prompt,
        cache=cache,
        fwd_hooks=[(MLP[name], zero), ("model.layers.1.kv_cache.hook_v_new", save)],
    )
    module = lm.get_submodule(MLP[name])
    handle = module.register_forward_hook(lambda m, a, out: torch.zeros_like(out))
    try:
        reference = uncached(lm, prompt)
    finally:
        handle.remove()
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)
    assert seen[MLP[name]] == (1, 6, 32)
    assert torch.equal(seen["model.layers.1.kv_cache.hook_v_new"], cache.layers[1].values)
    assert no_hooks(lm) and not any(p.fwd_hooks for p in cache.hook_points().values())
    # The next pass continues the cache, given the full mask as HuggingFace takes it.
    more = run_with_hooks(
        lm, ids(1, 2, seed=3), cache=cache, attention_mask=torch.ones(1, 8, device=DEVICE)
    )
    assert more.shape == (1, 2, lm.config.vocab_size) and cache.get_seq_length() == 8


def test_a_failed_run_leaves_the_cache_and_the_model_as_they_were():
    lm = model("llama")
    cache = HFKeyValueCache()
    run_with_hooks(lm, ids(1, 6), cache=cache)
    before = stored(cache)

    def boom(tensor, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_with_hooks(lm, ids(1, 2), cache=cache, fwd_hooks=[("model.layers.1.mlp", boom)])
    with pytest.raises(HookError, match=r"unknown hook name 'model.layers.0.mpl'.*did you mean"):
        run_with_hooks(lm, ids(1, 2), cache=cache, fwd_hooks=[("model.layers.0.mpl", boom)])
    with pytest.raises(
        CacheShapeError,
        match=r"attention_mask must be \[batch, pos_so_far \+ new_tokens\] = \(1, 8\)",
    ):
        run_with_hooks(lm, ids(1, 2), cache=cache, attention_mask=torch.ones(1, 2, device=DEVICE))
    with pytest.raises(
        ValueError, match="start_at_layer=1 has no counterpart on a HuggingFace model"
    ):
        run_with_hooks(lm, ids(1, 2), cache=cache, start_at_layer=1)
    cache.freeze()
    assert_unchanged(cache, before)
    assert no_hooks(lm) and not any(p.fwd_hooks for p in cache.hook_points().values())


def test_capture_keeps_head_major_positions_and_heads():
    lm = model("qwen2")
    prefix = prefill(lm, ids(1, 6))
    branch = prefix.cache.fork()
    _, captured = run_with_cache_capture(
        lm,
        ids(1, 2, seed=4),
        cache=branch,
        names=lambda name: name.endswith("hook_k_full"),
        positions=[0, -1],
        heads=1,
        attention_mask=torch.ones(1, 8, device=DEVICE),
    )
    assert {n: tuple(t.shape) for n, t in captured.items()} == {
        "model.layers.0.kv_cache.hook_k_full": (1, 1, 2, 8),
        "model.layers.1.kv_cache.hook_k_full": (1, 1, 2, 8),
    }
    keys = branch.layers[1].keys
    assert torch.equal(captured["model.layers.1.kv_cache.hook_k_full"], keys[:, 1:2, [0, -1]])
    with pytest.raises(HookError, match="is a module of the model, not a cache hook point"):
        run_with_cache_capture(lm, ids(1, 1), cache=prefix.cache.fork(), names="model.layers.0.mlp")


@pytest.mark.parametrize(
    "argument, value, match",
    [
        ("positions", "0", "positions must be an int, a sequence of ints or None, got str '0'"),
        ("positions", [[0]], r"positions must hold ints, got \[0\] \(list\) at index 0"),
        ("heads", ["a"], r"heads must hold ints, got 'a' \(str\) at index 0"),
    ],
)
def test_capture_names_positions_and_heads_that_are_not_ints(argument, value, match):
    lm = model("llama")
    prefix = prefill(lm, ids(1, 6))
    branch = prefix.cache.fork()
    with pytest.raises(HookError, match=match):
        run_with_cache_capture(
            lm, ids(1, 2), cache=branch, attention_mask=torch.ones(1, 8), **{argument: value}
        )
    assert branch.get_seq_length() == 6 and no_hooks(lm)


def test_a_prefix_of_another_family_or_size_is_refused_before_anything_runs():
    lm = model("llama")
    foreign = prefill(model("gpt2"), ids(1, 5))  # 4 key/value heads, llama has 2
    before = stored(foreign.cache)
    match = (
        r"generate: the prefix was made by another model; .*n_kv_heads: cfg expects 2, cache has 4"
    )
    with pytest.raises(CacheConfigError, match=match):
        generate(lm, foreign, 3)
    with pytest.raises(CacheConfigError, match="ablate_write: model does not fit prefix.cache"):
        ablate_write(lm, foreign, Ablation("zero", layers=0))
    hooked = prefill(make_model("rotary"), tokens(1, 5))
    with pytest.raises(
        TypeError, match="a HuggingFace model reads a safelens HFKeyValueCache, got KeyValueCache"
    ):
        score_continuations(lm, hooked, [[1, 2]])
    with pytest.raises(
        TypeError,
        match="prefill needs a TransformerLens HookedTransformer as model, got Linear; it also takes",
    ):
        prefill(torch.nn.Linear(2, 2), ids(1, 3))
    with pytest.raises(
        HookError,
        match="cache must be a safelens HFKeyValueCache on a HuggingFace model, got KeyValueCache",
    ):
        run_with_hooks(lm, ids(1, 2), cache=KeyValueCache())
    assert_unchanged(foreign.cache, before)
    assert no_hooks(lm)


def test_text_is_tokenized_left_padded_by_a_tokenizer_set_on_the_model():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, **{f"w{i}": i for i in range(1, 10)}}
    inner = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>")
    lm = model("llama")
    lm.tokenizer = tokenizer
    try:
        prefix = prefill(lm, ["w1 w2 w3", "w4"])
    finally:
        del lm.tokenizer
    assert prefix.tokens.tolist() == [[1, 2, 3], [0, 0, 4]]
    assert prefix.attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert tokenizer.padding_side == "right"  # the caller's tokenizer is left as it was
    given = prefill(lm, prefix.tokens, attention_mask=prefix.attention_mask)
    torch.testing.assert_close(prefix.last_logits, given.last_logits)


def test_no_experiment_module_imports_a_model_library():
    import subprocess
    import sys

    modules = ["_ablation", "_ablation_plan", "_capture", "_continuations", "_generation"]
    modules += ["_metrics", "_prefix", "_run"]
    code = "; ".join(
        [f"import safelens.experiments.{name}" for name in modules]
        + ["import sys", "print(sorted({'transformer_lens', 'transformers'} & set(sys.modules)))"]
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_rotary_model_runs_past_max_position_embeddings_as_huggingface_does():
    """Rotary positions are computed, not looked up: HuggingFace runs longer prompts, and
    so do the experiments; a learned position table (GPT-2's) still bounds them."""
    import transformers

    config = CONFIGS["llama"](2)
    config.max_position_embeddings = 16
    torch.manual_seed(0)
    lm = transformers.AutoModelForCausalLM.from_config(config).eval()
    tokens_ = ids(1, 24, seed=5)
    with torch.no_grad():
        expected = lm(tokens_).logits.log_softmax(-1)
    prefix = prefill(lm, tokens_[:, :20])
    scores = score_continuations(lm, prefix, [tokens_[0, 20:]])
    want = expected[0, 19:23].gather(-1, tokens_[0, 20:, None])[:, 0]
    torch.testing.assert_close(scores.log_probs[0], want, atol=1e-5, rtol=1e-5)
    gpt2 = model("gpt2")
    limit = gpt2.config.n_positions
    with pytest.raises(TokenError, match=rf"more than the model's context n_ctx={limit}"):
        prefill(gpt2, ids(1, limit + 1))


def test_token_ids_are_bounded_by_the_input_embedding_and_scored_ids_by_the_logits() -> None:
    # An input embedding with more rows than the untied output layer: a prompt may hold
    # every id the embedding has; a continuation, which is also scored, only ids the
    # logits have.
    import transformers

    config = CONFIGS["llama"]()
    config.vocab_size, config.tie_word_embeddings = 10, False
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.model.embed_tokens = torch.nn.Embedding(30, 32)
    prompt = torch.tensor([[1, 25, 3, 29]])
    with torch.no_grad():
        logits = hf(torch.cat([prompt, torch.tensor([[4, 7]])], 1)).logits
        expected = logits.log_softmax(-1)
        prefix = prefill(hf, prompt)
        torch.testing.assert_close(prefix.last_logits, logits[:, 3], atol=1e-5, rtol=1e-5)
        scores = score_continuations(hf, prefix, [[4, 7]])
    torch.testing.assert_close(
        scores.per_continuation()[0], torch.stack([expected[0, 3, 4], expected[0, 4, 7]])
    )
    with pytest.raises(TokenError, match=r"token id 30 .*d_vocab=30"):
        prefill(hf, torch.tensor([[1, 30]]))
    with pytest.raises(TokenError, match=r"token id 25 .*d_vocab=10"):
        score_continuations(hf, prefix, [[4, 25]])
