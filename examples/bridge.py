"""Counterfactual continuations and an ablation on a TransformerBridge, offline.

Boots TransformerLens' `TransformerBridge` over a small random-weight HuggingFace Llama
(grouped-query attention; no download: the boot folder holds only a word-level
tokenizer), prefills a prompt once into a frozen safelens cache, then:

- scores three continuations of it in one batch and compares them with the bridge's
  uncached forward of prompt + continuation;
- generates greedily from it and compares with HuggingFace's `generate` on the same
  weights;
- zeroes one head's cached values at one prompt position, read-time and write-time,
  and compares the write-time result with the bridge's own `run_with_hooks` edit.

Works on TransformerLens 3.9 and 4.x, on either side of transformers 5.24's
`past_key_values=` -> `cache=` rename (which the bridge's attention does not read;
safelens hands it the cache).
"""

import copy
import tempfile

import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformer_lens.model_bridge import TransformerBridge
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from safelens import (
    Ablation,
    ablate_read,
    ablate_write,
    generate,
    hf_cache_argument,
    prefill,
    score_continuations,
)

torch.set_grad_enabled(False)
torch.manual_seed(0)
VOCAB = 100
config = LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=VOCAB, bos_token_id=0, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
hf_model = LlamaForCausalLM(config).eval()
reference = copy.deepcopy(hf_model)  # booting replaces hf_model's attention modules
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1")),
    bos_token="t0",
    unk_token="t1",
)
with tempfile.TemporaryDirectory() as folder:
    tokenizer.save_pretrained(folder)
    bridge = TransformerBridge.boot_transformers(folder, hf_model=hf_model, device="cpu")
print(f"transformers {transformers.__version__} takes the cache as {hf_cache_argument(reference)}=")

generator = torch.Generator().manual_seed(0)
prompt = torch.randint(1, VOCAB, (1, 16), generator=generator)
continuations = torch.randint(1, VOCAB, (3, 5), generator=generator)
prefix = prefill(bridge, prompt)
before = [t.clone() for layer in prefix.cache.layers for t in (layer.keys, layer.values)]


def uncached(continuation: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of `continuation` after the prompt, from one uncached pass."""
    tokens = torch.cat([prompt[0], continuation])[None]
    log_probs = bridge(tokens).log_softmax(-1)[0, prompt.shape[1] - 1 : -1]
    return log_probs.gather(-1, continuation[:, None])[:, 0]


# 1. Three continuations of the frozen prefix, in one batch.
scores = score_continuations(bridge, prefix, continuations)
expected = torch.stack([uncached(row) for row in continuations])
diff = (scores.log_probs - expected).abs().max().item()
print(f"3 continuations vs the bridge's uncached forward: max abs diff {diff:.2e}")
assert diff < 1e-4

# 2. Greedy generation from the prefix.
generated = generate(bridge, prefix, max_new_tokens=8).tokens
hf = reference.generate(prompt, max_new_tokens=8, do_sample=False)[:, prompt.shape[1] :]
print(f"8 greedy tokens equal HuggingFace generate: {torch.equal(generated, hf)}")
assert torch.equal(generated, hf)

# 3. Zero KV head 1's values at prompt position 5, in layer 0.
ablation = Ablation("zero", layers=0, heads=[1], positions=[5], target="values")
read = score_continuations(bridge, ablate_read(prefix, ablation), continuations)
write = score_continuations(bridge, ablate_write(bridge, prefix, ablation), continuations)


def zero_value(values: torch.Tensor, hook: object) -> None:  # [batch, pos, n_kv_heads, d_head]
    values[:, 5, 1] = 0


full = torch.cat([prompt.expand(3, -1), continuations], 1)
edited = bridge.run_with_hooks(full, fwd_hooks=[("blocks.0.attn.hook_v", zero_value)])
edited = edited.log_softmax(-1)[:, prompt.shape[1] - 1 : -1].gather(-1, continuations[..., None])
diff = (write.log_probs - edited[..., 0]).abs().max().item()
print(f"write-time ablation vs the bridge's own hook_v edit: max abs diff {diff:.2e}")
assert diff < 1e-4
effect = (read.sums - scores.sums).abs().max().item(), (write.sums - scores.sums).abs().max().item()
print(f"change in total log-prob: read-time {effect[0]:.3f}, write-time {effect[1]:.3f}")

after = [t for layer in prefix.cache.layers for t in (layer.keys, layer.values)]
unchanged = all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
print(f"prefix bitwise unchanged: {unchanged}")
assert unchanged
