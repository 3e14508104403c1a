"""A safelens cache as `past_kv_cache=` gives TransformerLens' own logits, bitwise.

Every comparison runs the same model three ways: uncached over the whole sequence,
cached with TransformerLens' `TransformerLensKeyValueCache`, and cached with a safelens
`KeyValueCache`. The two caches hand attention the same tensors, so their logits are
compared with `torch.equal`; the uncached run differs by float rounding only.
"""

from __future__ import annotations

import sys

import pytest
import torch
from models import make_model, ones_mask, tokens
from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

from safelens import KeyValueCache

POSITIONAL = ["standard", "rotary", "shortformer", "alibi"]
DTYPES = [torch.float32, torch.bfloat16]


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.05}


def left_padded_mask(batch: int, length: int) -> torch.Tensor:
    mask = ones_mask(batch, length)
    for row in range(batch):
        mask[row, : 2 * row] = 0
    return mask


def run_in_chunks(model, toks, mask, cache, chunks: list[int]) -> torch.Tensor:
    logits, start = [], 0
    for size in chunks:
        stop = start + size
        logits.append(
            model(toks[:, start:stop], attention_mask=mask[:, start:stop], past_kv_cache=cache)
        )
        start = stop
    return torch.cat(logits, dim=1)


def state(cache) -> list[torch.Tensor]:
    tensors = [t.clone() for e in cache.entries for t in (e.past_keys, e.past_values)]
    return tensors + [cache.previous_attention_mask.clone()]


def assert_bitwise(after: list[torch.Tensor], before: list[torch.Tensor]) -> None:
    assert len(after) == len(before)
    for a, b in zip(after, before, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def assert_same_as_transformer_lens(ours: KeyValueCache, theirs) -> None:
    """Keys, values and the mask bitwise, dtype included.

    `init_cache`'s mask is int32 in both; TransformerLens' `torch.cat` promotes it to the
    int64 of the masks passed in, and safelens' mask follows it.
    """
    assert_bitwise(state(ours), state(theirs))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("positional", "n_kv_heads"),
    [(p, None) for p in POSITIONAL] + [("rotary", 2), ("standard", 1)],
)
@pytest.mark.parametrize(
    "chunks", [[6, 1, 1, 1, 1], [3, 4, 1, 2]], ids=["one-token", "multi-token"]
)
def test_cached_logits_equal_transformer_lens(positional, n_kv_heads, dtype, chunks):
    model = make_model(positional, n_kv_heads=n_kv_heads, dtype=dtype)
    batch, length = 3, sum(chunks)
    toks, mask = tokens(batch, length), left_padded_mask(batch, length)
    # First, as it sizes the model's ALiBi table (model state) for all runs after it.
    uncached = model(toks, attention_mask=mask)
    ours = KeyValueCache.init_cache(model.cfg, model.cfg.device, batch)
    theirs = TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, batch)
    our_logits = run_in_chunks(model, toks, mask, ours, chunks)
    their_logits = run_in_chunks(model, toks, mask, theirs, chunks)
    assert torch.equal(our_logits, their_logits)
    assert_same_as_transformer_lens(ours, theirs)
    assert ours.sequence_length == length
    real = mask.bool()
    torch.testing.assert_close(our_logits[real], uncached[real], **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("positional", POSITIONAL)
def test_frozen_prefix_is_bitwise_unchanged(positional, dtype):
    model = make_model(positional, dtype=dtype)
    batch, prefix_len = 2, 7
    toks, mask = tokens(batch, prefix_len + 5, seed=3), left_padded_mask(batch, prefix_len + 5)
    uncached = model(toks, attention_mask=mask)
    ours = KeyValueCache.init_cache(model.cfg, model.cfg.device, batch)
    theirs = TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, batch)
    for cache in (ours, theirs):
        model(toks[:, :prefix_len], attention_mask=mask[:, :prefix_len], past_kv_cache=cache)
        cache.freeze()
    before = state(ours)
    rest, rest_mask = toks[:, prefix_len:], mask[:, prefix_len:]
    for _ in range(3):
        our_logits = model(rest, attention_mask=rest_mask, past_kv_cache=ours)
        assert torch.equal(our_logits, model(rest, attention_mask=rest_mask, past_kv_cache=theirs))
        torch.testing.assert_close(our_logits, uncached[:, prefix_len:], **tolerance(dtype))
        for step in range(3):
            one = slice(prefix_len + step, prefix_len + step + 1)
            ours_one = model(toks[:, one], attention_mask=mask[:, one], past_kv_cache=ours)
            assert torch.equal(
                ours_one, model(toks[:, one], attention_mask=mask[:, one], past_kv_cache=theirs)
            )
        assert_bitwise(state(ours), before)
    assert_same_as_transformer_lens(ours, theirs)


@pytest.mark.parametrize("positional", ["rotary", "shortformer"])
def test_fork_of_a_frozen_prefix_runs_a_multi_step_continuation(positional):
    model = make_model(positional)
    toks, mask = tokens(1, 12, seed=4), ones_mask(1, 12)
    prefix = KeyValueCache.init_cache(model.cfg, model.cfg.device)
    model(toks[:, :8], attention_mask=mask[:, :8], past_kv_cache=prefix)
    prefix.freeze()
    before = state(prefix)
    reference = TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device)
    model(toks[:, :8], attention_mask=mask[:, :8], past_kv_cache=reference)
    branch = prefix.fork()
    ours = run_in_chunks(model, toks[:, 8:], mask[:, 8:], branch, [1, 2, 1])
    theirs = run_in_chunks(model, toks[:, 8:], mask[:, 8:], reference, [1, 2, 1])
    assert torch.equal(ours, theirs)
    assert_bitwise(state(prefix), before)
    assert branch.sequence_length == 12


def greedy(model, prompt: torch.Tensor, new_tokens: int, cache) -> torch.Tensor:
    mask = torch.ones_like(prompt)
    logits = model(prompt, attention_mask=mask, past_kv_cache=cache)
    out = [logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(new_tokens - 1):
        logits = model(out[-1], attention_mask=torch.ones_like(out[-1]), past_kv_cache=cache)
        out.append(logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat([prompt, *out], dim=1)


@pytest.mark.parametrize("positional", ["standard", "rotary"])
def test_greedy_generation_equals_transformer_lens_generate(positional, monkeypatch):
    model = make_model(positional)
    prompt = tokens(2, 10, seed=6)

    def tl_generate(use_past_kv_cache: bool = True) -> torch.Tensor:
        return model.generate(
            prompt, max_new_tokens=12, do_sample=False, stop_at_eos=False, verbose=False,
            use_past_kv_cache=use_past_kv_cache,
        )  # fmt: skip

    uncached = tl_generate(use_past_kv_cache=False)
    cached = tl_generate()
    cfg = model.cfg
    ours = greedy(model, prompt, 12, KeyValueCache.init_cache(cfg, cfg.device, 2))
    theirs = greedy(model, prompt, 12, TransformerLensKeyValueCache.init_cache(cfg, cfg.device, 2))
    assert ours.shape == (2, 22)
    assert torch.equal(ours, theirs) and torch.equal(ours, uncached)
    if positional == "rotary":
        assert torch.equal(cached, uncached)
    # Without a tokenizer TransformerLens' cached `generate` passes no attention mask and
    # offsets absolute position embeddings twice, so for "standard" it differs from the
    # uncached run; with a safelens cache swapped in it reproduces exactly that.
    module = sys.modules["transformer_lens.HookedTransformer"]
    monkeypatch.setattr(module, "TransformerLensKeyValueCache", KeyValueCache)
    assert torch.equal(tl_generate(), cached)
