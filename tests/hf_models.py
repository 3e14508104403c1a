"""Small random-weight HuggingFace causal LMs for the tests, built from config classes.

The model families of the HF backend: GPT-2 (raw keys), Llama (GQA), Qwen2 (qkv bias),
Mistral (sliding window), Gemma-2 (hybrid sliding window, soft-capping, eager attention),
Phi-3 and GPT-OSS (attention sinks, hybrid sliding window, mixture of experts). No
download; `model` caches each, so tests must leave its hooks as found. Models and token
ids are on `devices.DEVICE` (`SAFELENS_TEST_DEVICE`).
"""

from __future__ import annotations

import functools

import torch
import transformers
from devices import DEVICE

from safelens.backends.hf._model import hf_cache_argument

VOCAB = 50
SIZES = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4)
SPECIAL = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=None, pad_token_id=None)
# family -> config(number of layers), two layers unless asked
CONFIGS = {
    "llama": lambda layers=2: transformers.LlamaConfig(
        **SIZES, num_hidden_layers=layers, **SPECIAL, num_key_value_heads=2
    ),
    "gpt2": lambda layers=2: transformers.GPT2Config(
        n_embd=32, n_layer=layers, n_head=4, n_positions=64, **SPECIAL
    ),
    "qwen2": lambda layers=2: transformers.Qwen2Config(
        **SIZES, num_hidden_layers=layers, **SPECIAL, num_key_value_heads=2
    ),
    "mistral": lambda layers=2: transformers.MistralConfig(
        **SIZES, num_hidden_layers=layers, **SPECIAL, num_key_value_heads=2, sliding_window=4
    ),
    "gemma2": lambda layers=2: transformers.Gemma2Config(
        **SIZES,
        num_hidden_layers=layers,
        **SPECIAL,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=4,
        attn_implementation="eager",
        attn_logit_softcapping=20.0,
        final_logit_softcapping=10.0,
    ),
    "phi3": lambda layers=2: transformers.Phi3Config(
        **SIZES, num_hidden_layers=layers, **SPECIAL, num_key_value_heads=2
    ),
    "gpt_oss": lambda layers=2: transformers.GptOssConfig(
        **SIZES,
        num_hidden_layers=layers,
        **SPECIAL,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=4,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
}


@functools.cache
def model(
    name: str = "llama", dtype: torch.dtype = torch.float32, layers: int = 2
) -> torch.nn.Module:
    """A tiny random-weight causal LM; cached, so tests must leave its hooks as found."""
    torch.manual_seed(0)
    built = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](layers))
    return built.to(DEVICE, dtype).eval()


def ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=generator).to(DEVICE)


def run(lm: torch.nn.Module, tokens: torch.Tensor, cache: object = None, **kw) -> torch.Tensor:
    """Logits of `lm` on `tokens`, through `cache` (passed under the forward's own name)."""
    if cache is not None:
        kw[hf_cache_argument(lm)] = cache
    return lm(tokens, **kw).logits


def logits(lm: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """`lm`'s logits for `tokens`, without gradients: a HuggingFace model's or a bridge's."""
    with torch.no_grad():
        out = lm(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the `VOCAB` ids, built offline: token `i` is `"t{i}"`."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")),
        bos_token="t0",
        unk_token="t1",
    )
