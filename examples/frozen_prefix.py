"""Run a prefix once, freeze it, and continue it two different ways.

Builds a small random-weight HookedTransformer (no download), prefills a prefix into a
safelens `KeyValueCache`, freezes it, then runs two continuations from it:

- a token-by-token loop on `prefix.fork()` (a branch that shares the prefix storage and
  keeps its own tokens), and
- one multi-token forward pass directly on the frozen prefix.

Each is compared with the full uncached run of prefix + continuation, and the prefix is
checked to be bitwise unchanged.
"""

import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig

from safelens import KeyValueCache

torch.set_grad_enabled(False)
cfg = HookedTransformerConfig(
    n_layers=2, d_model=64, n_ctx=128, d_head=16, n_heads=4, d_vocab=100,
    act_fn="gelu", positional_embedding_type="rotary", seed=0, device="cpu",
)  # fmt: skip
model = HookedTransformer(cfg).eval()
generator = torch.Generator().manual_seed(0)
prefix_tokens = torch.randint(0, cfg.d_vocab, (1, 24), generator=generator)
first = torch.randint(0, cfg.d_vocab, (1, 6), generator=generator)
second = torch.randint(0, cfg.d_vocab, (1, 9), generator=generator)


def ones(tokens: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(tokens)


prefix = KeyValueCache.init_cache(cfg, cfg.device)
model(prefix_tokens, attention_mask=ones(prefix_tokens), past_kv_cache=prefix)
prefix.freeze()
before = [t.clone() for e in prefix for t in (e.keys, e.values)]
before.append(prefix.previous_attention_mask.clone())

# 1. A multi-step loop, one token per forward pass, on a fork of the frozen prefix.
branch = prefix.fork()
stepped = torch.cat(
    [
        model(first[:, i : i + 1], attention_mask=ones(first[:, i : i + 1]), past_kv_cache=branch)
        for i in range(first.shape[1])
    ],
    dim=1,
)
full = model(torch.cat([prefix_tokens, first], dim=1))
diff = (stepped - full[:, prefix_tokens.shape[1] :]).abs().max().item()
print(f"fork + {first.shape[1]} one-token steps vs uncached run: max abs diff {diff:.2e}")
assert diff < 1e-4

# 2. One multi-token forward pass on the frozen prefix itself.
once = model(second, attention_mask=ones(second), past_kv_cache=prefix)
full = model(torch.cat([prefix_tokens, second], dim=1))
diff = (once - full[:, prefix_tokens.shape[1] :]).abs().max().item()
print(f"one {second.shape[1]}-token pass on the frozen prefix vs uncached: max abs diff {diff:.2e}")
assert diff < 1e-4

after = [t for e in prefix for t in (e.keys, e.values)] + [prefix.previous_attention_mask]
unchanged = all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
print(f"prefix bitwise unchanged: {unchanged} ({prefix.sequence_length} positions)")
assert unchanged and branch.sequence_length == prefix.sequence_length + first.shape[1]
