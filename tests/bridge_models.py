"""Small random-weight TransformerBridges for the tests, booted offline.

A bridge wraps a HuggingFace causal LM of a `hf_models` family (Llama with grouped-query
attention, GPT-2 with raw keys), booted with `TransformerBridge.boot_transformers` from a
temporary folder that holds only a tokenizer (a word-level one: token `i` is `"t{i}"`). No
download. Booting replaces the HF model's attention modules in place, so each bridge wraps
an HF model of its own, never `hf_models.model(...)`; `reference` is an identical,
independent HF model for comparisons. `bridge` caches each, so tests must leave its hooks
as found.
"""

from __future__ import annotations

import functools
import tempfile

import torch
import transformers
from hf_models import CONFIGS, VOCAB
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformer_lens.model_bridge import TransformerBridge

FAMILIES = ("llama", "gpt2")


def _hf_model(name: str, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[name](layers)).eval()


@functools.cache
def reference(name: str = "llama") -> torch.nn.Module:
    """An HF model with the weights of `bridge(name)`'s, untouched by any bridge."""
    return _hf_model(name)


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")),
        bos_token="t0",
        unk_token="t1",
    )


def boot(hf_model: torch.nn.Module) -> TransformerBridge:
    """A TransformerBridge over `hf_model` (booting changes its attention modules in place)."""
    with tempfile.TemporaryDirectory() as folder:
        _tokenizer().save_pretrained(folder)
        booted = TransformerBridge.boot_transformers(folder, hf_model=hf_model, device="cpu")
    booted.eval()
    return booted


@functools.cache
def bridge(name: str = "llama", layers: int = 2) -> TransformerBridge:
    """A TransformerBridge over a tiny random-weight HF model of family `name`; cached."""
    return boot(_hf_model(name, layers))
