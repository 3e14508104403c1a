"""The pattern, resid_mid and `*_every` sweeps against transformer_lens.patching."""

from __future__ import annotations

import pytest
import torch
import transformer_lens.patching as tl_patching
from models import D_VOCAB, make_model, tokens
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformers import PreTrainedTokenizerFast

import safelens
from safelens import PatchingError, TokenError
from safelens.patching import _every as _patching_every
from safelens.patching import _patterns as _patching_patterns

SWEEPS = (
    {"get_act_patch_resid_mid": safelens.get_act_patch_resid_mid}
    | {
        name: getattr(_patching_patterns, name)
        for name in (
            "get_act_patch_attn_head_pattern_by_pos",
            "get_act_patch_attn_head_pattern_dest_src_pos",
            "get_act_patch_attn_head_pattern_all_pos",
        )
    }
    | {
        name: getattr(_patching_every, name)
        for name in (
            "get_act_patch_attn_head_all_pos_every",
            "get_act_patch_attn_head_by_pos_every",
            "get_act_patch_block_every",
        )
    }
)
BUNDLES = [name for name in SWEEPS if name.endswith("_every")]
MODELS = {"standard": ("standard", None), "rotary": ("rotary", None), "rotary-gqa": ("rotary", 2)}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from threads; on a shared CPU, spinning threads stall."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 0] - logits[:, -1, 1]


def length_of(name: str) -> int:
    """Five positions for the pos**2 grid, six elsewhere: TransformerLens runs each patch."""
    return 5 if "dest_src" in name else 6


def setup(kind: str, length: int = 6, batch: int = 1):
    model = make_model(*MODELS[kind], d_model=32)
    clean, corrupted = tokens(batch, length, seed=1), tokens(batch, length, seed=2)
    _, clean_cache = model.run_with_cache(clean)
    return model, corrupted, clean_cache


def hook_state(model) -> dict[str, tuple[list[int], int]]:
    """Every hook point's PyTorch hook ids and TransformerLens hook count."""
    return {
        name: (list(point._forward_hooks), len(point.fwd_hooks))
        for name, point in model.hook_dict.items()
    }


# -- the same numbers as TransformerLens ------------------------------------------------


@pytest.mark.parametrize("name", SWEEPS)
@pytest.mark.parametrize("kind", ["standard", "rotary"])
def test_equals_transformer_lens(kind: str, name: str) -> None:
    model, corrupted, clean_cache = setup(kind, length_of(name))
    expected = getattr(tl_patching, name)(model, corrupted, clean_cache, metric)
    result = SWEEPS[name](model, corrupted, clean_cache, metric, progress=False)
    assert result.shape == expected.shape
    assert result.dtype == expected.dtype and result.device == expected.device
    assert expected.std() > 0
    torch.testing.assert_close(result, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(SWEEPS)[:4])
def test_grouped_query_patterns_and_resid_mid_equal_transformer_lens(name: str) -> None:
    model, corrupted, clean_cache = setup("rotary-gqa", length_of(name))
    expected = getattr(tl_patching, name)(model, corrupted, clean_cache, metric)
    result = SWEEPS[name](model, corrupted, clean_cache, metric, progress=False)
    if "pattern" in name:
        assert result.shape[1] == model.cfg.n_heads  # patterns index query heads
    torch.testing.assert_close(result, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(SWEEPS)[1:3])
@pytest.mark.parametrize("hooked", [False, True])
def test_pattern_rows_run_from_their_destination_position(
    name: str, hooked: bool, monkeypatch
) -> None:
    """A row (or entry) of a pattern at destination `p` changes the head's output at `p`
    alone: its run reuses the corrupted run's positions before `p`. Not while a hook of
    the user's is attached (it may index positions); the numbers are TransformerLens'
    either way, on a 12-token batch of two, a grouped-query rotary model."""
    from safelens.patching import _grid

    model, corrupted, clean_cache = setup("rotary-gqa", length=12, batch=2)

    def mean_diff(logits: torch.Tensor) -> torch.Tensor:
        return (logits[:, -1, 0] - logits[:, -1, 1]).mean()

    expected = getattr(tl_patching, name)(model, corrupted, clean_cache, mean_diff)
    starts: list[int] = []
    forward = _grid._forward_chunk

    def spy(model_, corrupted_, pos, chunk, **shortcuts):
        starts.append(pos)
        return forward(model_, corrupted_, pos, chunk, **shortcuts)

    monkeypatch.setattr(_grid, "_forward_chunk", spy)
    seen: list[torch.Size] = []
    if hooked:
        model.blocks[1].hook_resid_pre.add_hook(lambda tensor, hook: seen.append(tensor.shape))
    try:
        result = SWEEPS[name](model, corrupted, clean_cache, mean_diff, progress=False)
    finally:
        model.reset_hooks()
    torch.testing.assert_close(result, expected, atol=1e-4, rtol=0)
    assert expected.std() > 0
    assert set(starts) == ({0} if hooked else {0, 4, 8})
    assert not hooked or seen


def test_a_batch_of_prompts_with_a_scalar_metric_equals_transformer_lens() -> None:
    model, corrupted, clean_cache = setup("rotary", length=5, batch=2)

    def mean_diff(logits: torch.Tensor) -> torch.Tensor:
        return (logits[:, -1, 0] - logits[:, -1, 1]).mean()

    name = "get_act_patch_attn_head_pattern_by_pos"
    expected = getattr(tl_patching, name)(model, corrupted, clean_cache, mean_diff)
    result = SWEEPS[name](model, corrupted, clean_cache, mean_diff, progress=False)
    torch.testing.assert_close(result, expected, atol=1e-4, rtol=0)


# -- grouped-query bundles -----------------------------------------------------------------

HEAD_BUNDLES = {
    "get_act_patch_attn_head_all_pos_every": "all_pos",
    "get_act_patch_attn_head_by_pos_every": "by_pos",
}


@pytest.mark.parametrize("name", HEAD_BUNDLES)
def test_grouped_query_bundles_zero_pad_keys_and_values_to_n_heads(name: str) -> None:
    model, corrupted, clean_cache = setup("rotary-gqa")
    result = SWEEPS[name](model, corrupted, clean_cache, metric, progress=False)
    n_kv = model.cfg.n_key_value_heads
    by_pos = HEAD_BUNDLES[name] == "by_pos"
    # [patch_type=5, layer, (pos,) n_heads]: z, q, k, v, pattern.
    assert result.shape == (5, 2, *([6] if by_pos else []), 4)
    for row, activation in [(2, "k"), (3, "v")]:
        sweep = f"get_act_patch_attn_head_{activation}_{HEAD_BUNDLES[name]}"
        per_function = getattr(tl_patching, sweep)(model, corrupted, clean_cache, metric)
        assert per_function.shape[-1] == n_kv
        torch.testing.assert_close(result[row, ..., :n_kv], per_function, atol=1e-4, rtol=0)
        assert torch.equal(result[row, ..., n_kv:], torch.zeros_like(result[row, ..., n_kv:]))
    # TransformerLens 3.9 pads the same way, and stacks the same rows.
    expected = getattr(tl_patching, name)(model, corrupted, clean_cache, metric)
    torch.testing.assert_close(result, expected, atol=1e-4, rtol=0)


def test_ungrouped_grouped_query_bundles_cover_every_head_without_padding() -> None:
    model = HookedTransformer(
        HookedTransformerConfig(
            n_layers=2,
            d_model=32,
            n_ctx=16,
            d_head=8,
            n_heads=4,
            d_vocab=D_VOCAB,
            act_fn="gelu",
            positional_embedding_type="rotary",
            n_key_value_heads=2,
            ungroup_grouped_query_attention=True,
            seed=0,
            device="cpu",
        )
    )
    clean, corrupted = tokens(1, 6, seed=1), tokens(1, 6, seed=2)
    _, clean_cache = model.run_with_cache(clean)
    name = "get_act_patch_attn_head_all_pos_every"
    result = SWEEPS[name](model, corrupted, clean_cache, metric, progress=False)
    keys = tl_patching.generic_activation_patch(
        model,
        corrupted,
        clean_cache,
        metric,
        tl_patching.layer_head_vector_patch_setter,
        "k",
        index_df=tl_patching.make_df_from_ranges([2, 4], ["layer", "head"]),
    )
    torch.testing.assert_close(result[2].reshape(-1), keys, atol=1e-4, rtol=0)
    assert (result[2:4, :, 2:] != 0).all()


# -- invariants --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["get_act_patch_attn_head_pattern_dest_src_pos", *BUNDLES, "get_act_patch_resid_mid"]
)
def test_patching_the_corrupted_run_into_itself_changes_nothing(name: str) -> None:
    model, corrupted, _ = setup("rotary-gqa", length=5)
    logits, corrupted_cache = model.run_with_cache(corrupted)
    result = SWEEPS[name](model, corrupted, corrupted_cache, metric, progress=False)
    measured = torch.ones_like(result, dtype=torch.bool)
    if name in HEAD_BUNDLES:  # k and v rows: n_kv_heads results, then zero padding
        measured[2:4, ..., 2:] = False
        assert (result[~measured] == 0).all()
    expected = metric(logits).expand(result.shape)
    torch.testing.assert_close(result[measured], expected[measured], atol=1e-4, rtol=0)


def test_bundle_limits_pass_through_without_changing_numbers() -> None:
    model, corrupted, clean_cache = setup("standard")
    name = "get_act_patch_block_every"
    default = SWEEPS[name](model, corrupted, clean_cache, metric, progress=False)
    small = SWEEPS[name](
        model, corrupted, clean_cache, metric, max_batch=1, max_bytes=2**20, progress=False
    )
    torch.testing.assert_close(small, default, atol=1e-5, rtol=0)
    with pytest.raises(PatchingError, match="max_batch must be a positive int"):
        SWEEPS[name](model, corrupted, clean_cache, metric, max_batch=0)


# -- hostile input -------------------------------------------------------------------------


def snapshot(cache) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in cache.items()}


def assert_unchanged(model, before_hooks, cache, before_cache) -> None:
    assert hook_state(model) == before_hooks
    assert cache.keys() == before_cache.keys()
    assert all(torch.equal(cache[name], before_cache[name]) for name in before_cache)


@pytest.mark.parametrize("name", SWEEPS)
def test_tokens_outside_the_vocabulary_are_a_token_error(name: str) -> None:
    model, corrupted, clean_cache = setup("rotary")
    hooks, cache = hook_state(model), snapshot(clean_cache)
    with pytest.raises(TokenError, match=f"ids must be in \\[0, d_vocab={D_VOCAB}\\)"):
        SWEEPS[name](model, corrupted + D_VOCAB, clean_cache, metric, progress=False)
    assert_unchanged(model, hooks, clean_cache, cache)


@pytest.mark.parametrize("name", SWEEPS)
def test_a_clean_cache_of_another_length_is_a_patching_error(name: str) -> None:
    model, corrupted, _ = setup("rotary")
    _, clean_cache = model.run_with_cache(tokens(1, 5, seed=1))
    hooks, cache = hook_state(model), snapshot(clean_cache)
    with pytest.raises(PatchingError, match=r"has shape .*must have the same length"):
        SWEEPS[name](model, corrupted, clean_cache, metric, progress=False)
    assert_unchanged(model, hooks, clean_cache, cache)


class CountingMetric:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return metric(logits)


@pytest.mark.parametrize("name", BUNDLES)
def test_a_bundle_refuses_a_cache_missing_an_activation_before_any_patch(name: str) -> None:
    model, corrupted, _ = setup("standard")
    _, partial = model.run_with_cache(tokens(1, 6, seed=1), names_filter=lambda n: "resid" in n)
    counting = CountingMetric()
    expected = f"{name} stacks sweeps of .* cannot sweep .*has no activation 'blocks.0"
    with pytest.raises(PatchingError, match=expected):
        SWEEPS[name](model, corrupted, partial, counting, progress=False)
    assert counting.calls == 0


def test_block_every_on_an_attention_only_model_says_why_before_any_patch() -> None:
    model = make_model("standard", attn_only=True, d_model=32)
    _, clean_cache = model.run_with_cache(tokens(1, 6, seed=1))
    counting = CountingMetric()
    with pytest.raises(PatchingError, match=r"attention-only \(cfg.attn_only=True\)"):
        _patching_every.get_act_patch_block_every(
            model, tokens(1, 6, seed=2), clean_cache, counting, progress=False
        )
    assert counting.calls == 0


@pytest.mark.parametrize(
    ("config", "match"),
    [({"attn_only": True}, "attention-only"), ({"parallel_attn_mlp": True}, "in parallel")],
)
def test_resid_mid_on_a_model_without_it_says_why(config: dict, match: str) -> None:
    cfg = HookedTransformerConfig(
        n_layers=2, d_model=32, n_ctx=16, d_head=8, d_vocab=D_VOCAB, act_fn="gelu", **config
    )
    model = HookedTransformer(cfg)
    _, clean_cache = model.run_with_cache(tokens(1, 6, seed=1))
    with pytest.raises(PatchingError, match=match):
        safelens.get_act_patch_resid_mid(
            model, tokens(1, 6, seed=2), clean_cache, metric, progress=False
        )


# -- TransformerLens' own patching tests, on local stand-ins ---------------------------------
# tests/unit/test_patching.py (solu-1l, "The cat sat" / "The dog ran", metric
# logits[:, -1, :].sum()) and tests/acceptance/test_patching.py (gpt2-small on an IOI
# prompt pair, get_act_patch_attn_out) download their models; these run the same kind
# of assertions on random-weight models with a word-level tokenizer.

WORDS = ["<unk>", "<bos>", "The", "cat", "sat", "dog", "ran", "Bob", "Carl", "met", "with"]
WORDS += [".", "gave", "the", "milk", "to"]


def word_model(n_layers: int, act_fn: str) -> HookedTransformer:
    vocab = {word: index for index, word in enumerate(WORDS)}
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<bos>",
        pad_token="<bos>",
        unk_token="<unk>",
        name_or_path="word-level",
        add_bos_token=True,
    )
    cfg = HookedTransformerConfig(
        n_layers=n_layers,
        d_model=32,
        n_ctx=16,
        d_head=8,
        n_heads=4,
        d_vocab=len(WORDS),
        act_fn=act_fn,
        normalization_type="LN",
        seed=0,
        device="cpu",
    )
    model = HookedTransformer(cfg, tokenizer=tokenizer)
    model.eval()
    return model


def test_transformer_lens_unit_checks_of_all_pos_every_on_a_solu_stand_in() -> None:
    model = word_model(n_layers=1, act_fn="solu_ln")  # solu-1l's shape of model, smaller
    _, clean_cache = model.run_with_cache("The cat sat")
    corrupted_tokens = model.to_tokens("The dog ran")

    def summed(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1, :].sum()

    name = "get_act_patch_attn_head_all_pos_every"
    result = SWEEPS[name](model, corrupted_tokens, clean_cache, summed, progress=False)
    assert result.shape == (5, model.cfg.n_layers, model.cfg.n_heads)
    assert not torch.all(result == result[0, 0, 0]), "All patch results are identical"
    assert torch.isfinite(result).all()
    expected = getattr(tl_patching, name)(model, corrupted_tokens, clean_cache, summed)
    torch.testing.assert_close(result, expected, atol=1e-4, rtol=0)


def test_transformer_lens_acceptance_check_of_attn_out_on_an_ioi_stand_in() -> None:
    import safelens

    model = word_model(n_layers=2, act_fn="gelu")
    clean_input = "Bob met with Carl. Carl gave the milk to"
    corrupt_input = "Bob met with Carl. Bob gave the milk to"
    corrupt_tokens = torch.tensor(model.tokenizer.encode(corrupt_input, add_special_tokens=False))
    corrupt_tokens = corrupt_tokens.unsqueeze(0)
    bob, carl = WORDS.index("Bob"), WORDS.index("Carl")

    def patching_metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[0, -1, bob] - logits[0, -1, carl]

    # As written, the clean cache holds a BOS position the corrupted tokens lack:
    # TransformerLens patches clean position p into corrupted position p regardless,
    # one token off; safelens refuses.
    _, clean_cache = model.run_with_cache(clean_input)
    assert clean_cache["hook_embed"].shape[1] == corrupt_tokens.shape[1] + 1
    scan = tl_patching.get_act_patch_attn_out(model, corrupt_tokens, clean_cache, patching_metric)
    assert scan.shape == torch.Size([2, 10])
    with pytest.raises(PatchingError, match="must have the same length"):
        safelens.get_act_patch_attn_out(
            model, corrupt_tokens, clean_cache, patching_metric, progress=False
        )
    # Aligned, both give the [layer, pos] scan, equal.
    clean_tokens = model.tokenizer.encode(clean_input, add_special_tokens=False)
    _, clean_cache = model.run_with_cache(torch.tensor([clean_tokens]))
    scan = safelens.get_act_patch_attn_out(
        model, corrupt_tokens, clean_cache, patching_metric, progress=False
    )
    assert scan.shape == torch.Size([2, 10])
    expected = tl_patching.get_act_patch_attn_out(
        model, corrupt_tokens, clean_cache, patching_metric
    )
    torch.testing.assert_close(scan, expected, atol=1e-4, rtol=0)
