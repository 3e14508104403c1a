"""safelens' experiments on a plain HuggingFace Llama, each checked against HuggingFace.

Builds a small random-weight `LlamaForCausalLM` from its config (no download), then:

1. prefills a prompt once into a frozen safelens cache (`prefill`),
2. scores three continuations of it in one batch (`score_continuations`) and compares
   them with HuggingFace's uncached forward of prompt + continuation,
3. generates greedily (`generate`) and compares with HuggingFace's `generate`,
4. ablates the prompt's keys/values at read time (`ablate_read`) and at write time
   (`ablate_write`), and
5. runs one pass with hooks on a model module and on the cache (`run_with_hooks`).

The prefix is checked to be bitwise unchanged at the end.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from safelens import (
    Ablation,
    HFKeyValueCache,
    ablate_read,
    ablate_write,
    generate,
    prefill,
    run_with_hooks,
    score_continuations,
)

torch.set_grad_enabled(False)
torch.manual_seed(0)
config = LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=100, bos_token_id=0, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
model = LlamaForCausalLM(config).eval()
generator = torch.Generator().manual_seed(0)
prompt = torch.randint(1, config.vocab_size, (1, 24), generator=generator)
continuations = [torch.randint(1, config.vocab_size, (n,), generator=generator) for n in (6, 3, 9)]

# 1. The prompt, run once into a frozen HFKeyValueCache.
prefix = prefill(model, prompt)
before = [t.clone() for layer in prefix.cache.layers for t in (layer.keys, layer.values)]
print(f"prefix: {prefix.cache}")

# 2. Three ragged continuations in one batch, the prefix broadcast (never copied).
scores = score_continuations(model, prefix, continuations)
for row, continuation in zip(scores.per_continuation(), continuations, strict=True):
    logits = model(torch.cat([prompt[0], continuation])[None]).logits[0, 23:-1]
    reference = torch.log_softmax(logits, -1).gather(-1, continuation[:, None])[:, 0]
    assert torch.allclose(row, reference, atol=1e-5)
print(f"scored {len(continuations)} continuations; sums {scores.sums.tolist()}")

# 3. Greedy generation gives HuggingFace's tokens; seeded sampling is reproducible.
greedy = generate(model, prefix, 8)
hf_tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)[:, 24:]
assert torch.equal(greedy.tokens, hf_tokens)
samples = generate(model, prefix, 8, n_samples=3, do_sample=True, top_k=20, seed=1)
print(f"greedy: {greedy.tokens[0].tolist()} (= HuggingFace generate)")
print(f"3 seeded samples of shape {tuple(samples.tokens.shape)}")

# 4. Ablations of the prompt's keys/values: KV head 1 of layer 0 at positions 3..9.
# Positions and heads index the cache's head-major [batch, n_kv_heads, pos, d_head] axes.
ablation = Ablation("zero", layers=0, heads=[1], positions=list(range(3, 10)))
read = ablate_read(prefix, ablation)  # later tokens read the zeros; the prompt is as computed
write = ablate_write(model, prefix, ablation)  # the prompt recomputed with the zeros stored
for name, edited in (("read-time", read), ("write-time", write)):
    changed = score_continuations(model, edited, continuations).sums - scores.sums
    print(f"{name} ablation changes the continuations' log-probabilities by {changed.tolist()}")
assert torch.equal(read.last_logits, prefix.last_logits)  # read-time: the prompt is untouched
assert not torch.equal(write.last_logits, prefix.last_logits)  # write-time: later layers feel it

# 5. One fwd_hooks list for the model's modules and the cache's hook points.
seen = {}


def scale_mlp(output, hook):  # a module hook: fn(tensor, hook) as in TransformerLens
    return 0.5 * output


def save_keys(keys, hook):  # a cache hook: the full, post-rotary keys attention reads
    seen[hook.name] = tuple(keys.shape)


branch = prefix.cache.fork()  # a branch of the frozen prefix that stores its own tokens
logits = run_with_hooks(
    model,
    continuations[0],
    cache=branch,
    fwd_hooks=[
        ("model.layers.1.mlp", scale_mlp),
        ("model.layers.0.kv_cache.hook_k_full", save_keys),
    ],
    attention_mask=torch.ones(1, 24 + 6),  # HuggingFace's mask: cached + new positions
)
print(f"hooked pass: logits {tuple(logits.shape)}, layer 0 keys read {seen}")
assert branch.get_seq_length() == 30 and isinstance(branch, HFKeyValueCache)

after = [t for layer in prefix.cache.layers for t in (layer.keys, layer.values)]
unchanged = all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
print(f"prefix bitwise unchanged: {unchanged}")
assert unchanged
