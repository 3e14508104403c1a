"""A frozen prefix and two forked continuations on a plain HuggingFace Llama.

Builds a small random-weight `LlamaForCausalLM` from its config (no download), prefills
a prompt into a safelens `HFKeyValueCache`, freezes it, then continues it two ways, each
on a fork of the prefix (a branch sharing the prefix's storage):

- token by token, one forward pass per token, and
- one multi-token forward pass.

Each is compared with HuggingFace's uncached forward of prompt + continuation, and the
prefix is checked to be bitwise unchanged.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from safelens import HFKeyValueCache, hf_cache_argument

torch.set_grad_enabled(False)
torch.manual_seed(0)
config = LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=100, bos_token_id=0, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
model = LlamaForCausalLM(config).eval()
arg = hf_cache_argument(model)
print(f"transformers takes the cache as {arg}=")
generator = torch.Generator().manual_seed(0)
prompt = torch.randint(0, config.vocab_size, (1, 24), generator=generator)
first = torch.randint(0, config.vocab_size, (1, 6), generator=generator)
second = torch.randint(0, config.vocab_size, (1, 9), generator=generator)

prefix = HFKeyValueCache(config=config)
model(prompt, **{arg: prefix})
prefix.freeze()
before = [t.clone() for layer in prefix.layers for t in (layer.keys, layer.values)]


def uncached_tail(continuation: torch.Tensor) -> torch.Tensor:
    return model(torch.cat([prompt, continuation], dim=1)).logits[:, prompt.shape[1] :]


# 1. One token per forward pass, on a fork of the frozen prefix.
branch = prefix.fork()
stepped = torch.cat(
    [model(first[:, i : i + 1], **{arg: branch}).logits for i in range(first.shape[1])], dim=1
)
diff = (stepped - uncached_tail(first)).abs().max().item()
print(f"fork + {first.shape[1]} one-token steps vs uncached forward: max abs diff {diff:.2e}")
assert diff < 1e-5 and branch.get_seq_length() == prompt.shape[1] + first.shape[1]

# 2. One multi-token forward pass on another fork.
once = model(second, **{arg: prefix.fork()}).logits
diff = (once - uncached_tail(second)).abs().max().item()
print(f"fork + one {second.shape[1]}-token pass vs uncached forward: max abs diff {diff:.2e}")
assert diff < 1e-5

after = [t for layer in prefix.layers for t in (layer.keys, layer.values)]
unchanged = all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
print(f"prefix bitwise unchanged: {unchanged} ({prefix.get_seq_length()} positions)")
assert unchanged
