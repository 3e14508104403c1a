"""Score many continuations of one frozen prefix, and generate from it."""

import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig

from safelens import generate, prefill, score_continuations

cfg = HookedTransformerConfig(
    n_layers=2,
    d_model=64,
    n_ctx=256,
    d_head=16,
    n_heads=4,
    d_vocab=100,
    act_fn="gelu",
    positional_embedding_type="rotary",
    seed=0,
)
model = HookedTransformer(cfg)
generator = torch.Generator().manual_seed(0)
prompt = torch.randint(0, 100, (64,), generator=generator)

with torch.no_grad():
    prefix = prefill(model, prompt)
    continuations = [torch.randint(0, 100, (n,), generator=generator) for n in (3, 5, 8, 2)]
    scores = score_continuations(model, prefix, continuations)
    for continuation, total in zip(continuations, scores.sums, strict=True):
        print(f"{len(continuation)} tokens: total log-prob {total:.3f}")

    full = torch.cat([prompt, continuations[0]])[None]
    reference = model(full).log_softmax(-1)[0, 63:-1].gather(-1, continuations[0][:, None])
    print(
        "equals uncached run:",
        torch.allclose(scores.per_continuation()[0], reference[:, 0], atol=1e-5),
    )

    samples = generate(model, prefix, 6, n_samples=3, do_sample=True, top_k=20, seed=0)
    print("samples:", samples.tokens.tolist())
    print("prefix still frozen:", bool(prefix.cache.frozen))
