"""Capture and patch keys/values through the cache, next to the model's own hooks.

Runs a prefix once into a frozen safelens cache, captures its keys, then scores a
continuation with one prefix key zeroed at read time (the frozen prefix stays as it
is) and checks the result against TransformerLens with an edited copy of its own cache.
"""

import copy

import torch
from transformer_lens import (
    HookedTransformer,
    HookedTransformerConfig,
    TransformerLensKeyValueCache,
)

import safelens

cfg = HookedTransformerConfig(
    n_layers=2,
    d_model=64,
    n_ctx=64,
    d_head=16,
    n_heads=4,
    n_key_value_heads=2,
    d_vocab=100,
    act_fn="gelu",
    positional_embedding_type="rotary",
    seed=0,
)
torch.set_grad_enabled(False)
model = HookedTransformer(cfg).eval()
prefix = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
continuation = torch.tensor([[5, 6, 7]])
LAYER, POSITION, HEAD = 1, 4, 1

cache = safelens.KeyValueCache.init_cache(cfg)
_, captured = safelens.run_with_cache_capture(
    model, prefix, cache=cache, names=f"blocks.{LAYER}.kv_cache.hook_k_new", heads=[HEAD]
)
print("captured", {name: tuple(t.shape) for name, t in captured.items()})
cache.freeze()
stored = cache[LAYER].keys.clone()


def zero_key(keys, hook):
    keys = keys.clone()
    keys[:, POSITION, HEAD] = 0
    return keys


norms = []
patched = safelens.run_with_hooks(
    model,
    continuation,
    cache=cache,
    fwd_hooks=[
        (f"blocks.{LAYER}.kv_cache.hook_k_full", zero_key),
        (f"blocks.{LAYER}.attn.hook_z", lambda z, hook: norms.append(z.norm().item())),
    ],
)
print("frozen prefix unchanged:", torch.equal(cache[LAYER].keys, stored))

tl_cache = TransformerLensKeyValueCache.init_cache(cfg, cfg.device, 1)
model(prefix, past_kv_cache=tl_cache, attention_mask=torch.ones(1, 12, dtype=torch.long))
edited = copy.deepcopy(tl_cache)
edited[LAYER].past_keys = zero_key(edited[LAYER].past_keys, None)
edited.freeze()
reference = model(
    continuation, past_kv_cache=edited, attention_mask=torch.ones(1, 3, dtype=torch.long)
)
print("matches TransformerLens edited cache:", torch.allclose(patched, reference, atol=1e-5))
print(f"layer {LAYER} hook_z norm while patched: {norms[0]:.3f}")
