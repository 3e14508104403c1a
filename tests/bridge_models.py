"""Small random-weight TransformerBridges for the tests, booted offline.

A bridge wraps a HuggingFace causal LM of a `hf_models` family (Llama with grouped-query
attention, GPT-2 with raw keys), booted with `TransformerBridge.boot_transformers` from a
temporary folder that holds only a tokenizer (a word-level one: token `i` is `"t{i}"`). No
download. Booting replaces the HF model's attention modules in place, so each bridge wraps
an HF model of its own, never `hf_models.model(...)`; `reference` is an identical,
independent HF model for comparisons. `bridge` caches each, so tests must leave its hooks
as found. Both are on `devices.DEVICE` (`SAFELENS_TEST_DEVICE`).
"""

from __future__ import annotations

import functools
import tempfile

import torch
import transformers
from devices import DEVICE
from hf_models import CONFIGS, tokenizer
from transformer_lens.model_bridge import TransformerBridge

FAMILIES = ("llama", "gpt2")


def _hf_model(name: str, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[name](layers)).to(DEVICE).eval()


@functools.cache
def reference(name: str = "llama") -> torch.nn.Module:
    """An HF model with the weights of `bridge(name)`'s, untouched by any bridge."""
    return _hf_model(name)


@functools.cache
def bridge(name: str = "llama", layers: int = 2) -> TransformerBridge:
    """A TransformerBridge over a tiny random-weight HF model of family `name`; cached."""
    with tempfile.TemporaryDirectory() as folder:
        tokenizer().save_pretrained(folder)
        booted = TransformerBridge.boot_transformers(
            folder, hf_model=_hf_model(name, layers), device=DEVICE
        )
    booted.eval()
    return booted
