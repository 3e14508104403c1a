"""TransformerLens' own key/value cache tests, run on safelens' `KeyValueCache`.

TransformerLens' `tests/integration/test_kv_cache.py` (gpt2-small and pythia-14m, which
download) checks its cache against its own uncached forward: one and several new
tokens, batches padded left, right or not at all before and after the cache, freezing
and unfreezing, a custom attention mask, `start_at_layer`. These are its tests, step for
step and with its assertions, with safelens' `KeyValueCache` where they make
`TransformerLensKeyValueCache`, on random-weight stand-ins of both models (GPT-2's
learned positions; Pythia's rotary, parallel attention and MLP) with a word-level
tokenizer (GPT-2's one special token for BOS, EOS and padding). The tolerances are
TransformerLens' own for gpt2-small (1e-4).
"""

from __future__ import annotations

import functools

import pytest
import torch as t
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformers import PreTrainedTokenizerFast

from safelens import KeyValueCache

PROMPTS = [
    "I went to Staten Island,",
    " Sharon",
    " to buy myself a mandolin",
    "It's always locked",
    "I'd rather be burned in Canada",
    "It's always blocked",
    " by the magistrate",
    " than to freeze here in the South",
    " by the candidate",
    " I'm headed to the church to play bingo.",
    " shine your light on me, Miss Liberty",
    "An apple",
    " a day keeps junk the",
    "An apple a day keeps the",
]
SPLIT = pre_tokenizers.Whitespace()
WORDS = ["<|endoftext|>", "<unk>"] + sorted(
    {word for prompt in PROMPTS for word, _ in SPLIT.pre_tokenize_str(prompt)}
)
ATOL = 1e-4


def _tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = SPLIT
    special = "<|endoftext|>"
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=special,
        eos_token=special,
        pad_token=special,
        unk_token="<unk>",
        name_or_path="word-level",
        add_bos_token=True,
    )


STAND_INS = {
    "gpt2-small": dict(positional_embedding_type="standard"),
    "pythia-14m": dict(positional_embedding_type="rotary", rotary_dim=8, parallel_attn_mlp=True),
}


@functools.cache
def _stand_in(name: str) -> HookedTransformer:
    cfg = HookedTransformerConfig(
        n_layers=4,
        d_model=64,
        n_ctx=64,
        d_head=16,
        n_heads=4,
        d_vocab=len(WORDS),
        act_fn="gelu_new",
        normalization_type="LN",
        seed=0,
        device="cpu",
        **STAND_INS[name],
    )
    model = HookedTransformer(cfg, tokenizer=_tokenizer(), default_padding_side="left")
    model.eval()
    return model


@pytest.fixture(params=list(STAND_INS))
def pretrained(request):
    return _stand_in(request.param), ATOL


def _one_new_token(model):
    """The prompt, one more token, and the uncached logits of both (both tests' opening)."""
    pre_prompt_tokens = model.to_tokens("I went to Staten Island,")
    pre_prompt_tokens_len = pre_prompt_tokens.shape[-1]
    single_new_token = model.to_tokens(" Sharon", prepend_bos=False)
    full_prompt_tokens = t.cat([pre_prompt_tokens, single_new_token], dim=-1)
    no_cache_logits = model(full_prompt_tokens)
    assert full_prompt_tokens.shape[-1] == pre_prompt_tokens_len + 1
    return pre_prompt_tokens, single_new_token, no_cache_logits


def test_single_new_token(pretrained):
    model, atol = pretrained
    pre_prompt_tokens, single_new_token, no_cache_logits = _one_new_token(model)

    past_kv_cache = KeyValueCache.init_cache(model.cfg, model.cfg.device, 1)
    model(pre_prompt_tokens, past_kv_cache=past_kv_cache)
    with_cache_logits = model(single_new_token, past_kv_cache=past_kv_cache)
    assert t.allclose(no_cache_logits[:, -1], with_cache_logits[:, -1], atol=atol)
    assert t.allclose(no_cache_logits[:, -1:], with_cache_logits, atol=atol)


def test_multiple_new_tokens(pretrained):
    model, atol = pretrained
    pre_prompt_tokens = model.to_tokens("I went to Staten Island,")
    pre_prompt_tokens_len = pre_prompt_tokens.shape[-1]
    new_tokens = model.to_tokens(" to buy myself a mandolin", prepend_bos=False)
    new_tokens_len = new_tokens.shape[-1]
    full_prompt_tokens = t.cat([pre_prompt_tokens, new_tokens], dim=-1)
    assert full_prompt_tokens.shape[-1] == pre_prompt_tokens_len + new_tokens_len
    no_cache_logits = model(full_prompt_tokens)

    past_kv_cache = KeyValueCache.init_cache(model.cfg, model.cfg.device, 1)
    model(pre_prompt_tokens, past_kv_cache=past_kv_cache)
    with_cache_logits = model(new_tokens, past_kv_cache=past_kv_cache)
    assert t.allclose(no_cache_logits[:, -1], with_cache_logits[:, -1], atol=atol)
    assert t.allclose(no_cache_logits[:, -new_tokens_len:], with_cache_logits, atol=atol)


@pytest.mark.parametrize("pre_padding", ["left", "right", None])
@pytest.mark.parametrize("post_padding", ["left", "right", None])
def test_multi_token_batch(pretrained, pre_padding, post_padding):
    model, atol = pretrained
    padded_batch_pre_prompts = ["It's always locked", "I'd rather be burned in Canada"]
    unpadded_batch_pre_prompts = ["It's always locked", "It's always blocked"]
    padded_batch_post_prompts = [" by the magistrate", " than to freeze here in the South"]
    unpadded_batch_post_prompts = [" by the magistrate", " by the candidate"]

    first_post_prompt_tokens = model.to_tokens(padded_batch_post_prompts[0], prepend_bos=False)
    first_full_prompt_tokens = t.cat(
        [model.to_tokens(padded_batch_pre_prompts[0]), first_post_prompt_tokens], dim=-1
    )
    first_post_prompt_len = first_post_prompt_tokens.shape[-1]
    first_prompt_no_cache_logits = model(first_full_prompt_tokens)
    first_post_prompt_no_cache_logits = first_prompt_no_cache_logits[0, -first_post_prompt_len:]

    if pre_padding is None:
        batch_pre_prompt_tokens = model.to_tokens(unpadded_batch_pre_prompts)
    else:
        batch_pre_prompt_tokens = model.to_tokens(
            padded_batch_pre_prompts, padding_side=pre_padding
        )
    if post_padding is None:
        batch_post_prompt_tokens = model.to_tokens(unpadded_batch_post_prompts, prepend_bos=False)
    else:
        batch_post_prompt_tokens = model.to_tokens(
            padded_batch_post_prompts, prepend_bos=False, padding_side=post_padding
        )

    past_kv_cache = KeyValueCache.init_cache(
        model.cfg, model.cfg.device, batch_pre_prompt_tokens.shape[0]
    )
    model(batch_pre_prompt_tokens, past_kv_cache=past_kv_cache, padding_side=pre_padding)
    past_kv_cache.freeze()
    with_cache_logits = model(
        batch_post_prompt_tokens,
        past_kv_cache=past_kv_cache,
        padding_side=post_padding,
        prepend_bos=False,
    )
    if post_padding == "left" or post_padding is None:
        first_post_prompt_with_cache_logits = with_cache_logits[0, -first_post_prompt_len:]
    else:
        first_post_prompt_with_cache_logits = with_cache_logits[0, :first_post_prompt_len]

    no_cache_probs = t.softmax(first_post_prompt_no_cache_logits, dim=-1)
    with_cache_probs = t.softmax(first_post_prompt_with_cache_logits, dim=-1)
    assert t.allclose(no_cache_probs, with_cache_probs, atol=atol)


def test_freeze_cache(pretrained):
    model, atol = pretrained
    pre_prompt_tokens = model.to_tokens("I went to Staten Island,")
    new_tokens_1 = model.to_tokens(" I'm headed to the church to play bingo.", prepend_bos=False)
    past_kv_cache_1 = KeyValueCache.init_cache(model.cfg, model.cfg.device, 1)
    new_tokens_2 = model.to_tokens(" shine your light on me, Miss Liberty", prepend_bos=False)
    past_kv_cache_2 = KeyValueCache.init_cache(model.cfg, model.cfg.device, 1)

    model(pre_prompt_tokens, past_kv_cache=past_kv_cache_1)
    past_kv_cache_1.freeze()
    with_cache_logits_1 = model(new_tokens_1, past_kv_cache=past_kv_cache_1)

    model(pre_prompt_tokens, past_kv_cache=past_kv_cache_2)
    past_kv_cache_2.freeze()
    model(new_tokens_2, past_kv_cache=past_kv_cache_2)

    # Caches frozen at the same point should be identical.
    assert len(past_kv_cache_1.entries) == len(past_kv_cache_2.entries)
    for entry_1, entry_2 in zip(past_kv_cache_1.entries, past_kv_cache_2.entries, strict=True):
        assert entry_1.past_keys.shape == entry_2.past_keys.shape
        assert entry_1.past_values.shape == entry_2.past_values.shape
        assert t.allclose(entry_1.past_keys, entry_2.past_keys, atol=1e-3)
        assert t.allclose(entry_1.past_values, entry_2.past_values, atol=1e-3)

    # The same prompt on another cache frozen at the same point gives the same results.
    with_cache_2_logits_1 = model(new_tokens_1, past_kv_cache=past_kv_cache_2)
    assert t.allclose(with_cache_logits_1, with_cache_2_logits_1, atol=atol)

    # Unfreezing stores the next pass.
    past_kv_cache_2.unfreeze()
    with_cache_2_logits_1 = model(new_tokens_1, past_kv_cache=past_kv_cache_2)
    for entry_1, entry_2 in zip(past_kv_cache_1.entries, past_kv_cache_2.entries, strict=True):
        assert entry_1.past_keys.shape[1] < entry_2.past_keys.shape[1]
        assert entry_1.past_values.shape[1] < entry_2.past_values.shape[1]

    # That pass still read the frozen prefix alone; the next one reads what it stored.
    assert t.allclose(with_cache_logits_1, with_cache_2_logits_1, atol=atol)
    with_cache_2_logits_1 = model(new_tokens_1, past_kv_cache=past_kv_cache_2)
    assert not t.allclose(with_cache_logits_1, with_cache_2_logits_1, atol=atol)


def test_kv_cache_with_custom_attention_mask(pretrained):
    model, atol = pretrained
    tokens_pre = model.to_tokens("An apple")
    tokens_post = model.to_tokens(" a day keeps junk the", prepend_bos=False)
    tokens_whole = model.to_tokens("An apple a day keeps the")
    correct_logits = model(tokens_whole)

    past_kv_cache = KeyValueCache.init_cache(model.cfg, model.cfg.device, 1)
    model(tokens_pre, past_kv_cache=past_kv_cache)
    exp_logits = model(
        tokens_post,
        attention_mask=t.tensor([[1, 1, 1, 0, 1]], device=model.cfg.device),
        past_kv_cache=past_kv_cache,
    )
    assert t.allclose(correct_logits[:, -1], exp_logits[:, -1], atol=atol)


def test_kv_cache_and_start_at_layer(pretrained):
    model, atol = pretrained
    pre_prompt_tokens, single_new_token, no_cache_logits = _one_new_token(model)

    past_kv_cache = KeyValueCache.init_cache(model.cfg, model.cfg.device, 1)
    model(pre_prompt_tokens, past_kv_cache=past_kv_cache)
    past_kv_cache.freeze()
    _, toks, shortformer_pos_embed, attn_mask = model.input_to_embed(
        single_new_token, past_kv_cache=past_kv_cache
    )
    _, cache = model.run_with_cache(single_new_token, stop_at_layer=4, past_kv_cache=past_kv_cache)
    resid_3 = cache["blocks.3.hook_resid_pre"]
    with_cache_logits = model(
        resid_3,
        start_at_layer=3,
        tokens=toks,
        shortformer_pos_embed=shortformer_pos_embed,
        attention_mask=attn_mask,
        past_kv_cache=past_kv_cache,
    )
    assert t.allclose(no_cache_logits[:, -1], with_cache_logits[:, -1], atol=atol)
    assert t.allclose(no_cache_logits[:, -1:], with_cache_logits, atol=atol)
