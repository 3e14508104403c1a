"""Save a frozen prefix cache, load it back, check it fits the model, continue from it."""

import tempfile
from pathlib import Path

import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig

from safelens import CacheConfigError, KeyValueCache

cfg = HookedTransformerConfig(
    n_layers=2,
    d_model=64,
    n_ctx=128,
    d_head=16,
    n_heads=4,
    d_vocab=100,
    act_fn="gelu",
    positional_embedding_type="rotary",
    normalization_type="LN",
    seed=0,
    device="cpu",
)
model = HookedTransformer(cfg).eval()
tokens = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(0))
ones = torch.ones(1, 16, dtype=torch.long)

with torch.no_grad():
    prefix = KeyValueCache.init_cache(model.cfg, "cpu")
    model(tokens[:, :12], past_kv_cache=prefix, attention_mask=ones[:, :12])
    prefix.freeze()

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "prefix.safetensors"
        prefix.save(path)
        print(f"saved {prefix} in {path.stat().st_size} bytes")
        loaded = KeyValueCache.load(path, device="cpu")

    loaded.check_fits(model.cfg)
    same = all(
        torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        for a, b in zip(loaded, prefix, strict=True)
    )
    print(f"loaded {loaded}; keys and values bitwise equal: {same}")

    logits = model(tokens[:, 12:], past_kv_cache=loaded.fork(), attention_mask=ones[:, 12:])
    reference = model(tokens)[:, 12:]
    print(f"continuation vs uncached run, max abs diff: {(logits - reference).abs().max():.1e}")

    try:
        loaded.check_fits(
            HookedTransformerConfig(
                n_layers=2, d_model=64, n_ctx=128, d_head=32, n_heads=2, d_vocab=100, act_fn="gelu"
            )
        )
    except CacheConfigError as error:
        print(f"another model: {error}")
