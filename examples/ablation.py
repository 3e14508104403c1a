"""Zero-ablate a prefix's keys/values at one layer and position: read-time vs write-time."""

import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig

from safelens import Ablation, ablate_read, ablate_write, prefill, score_continuations

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
prompt = torch.randint(0, 100, (32,), generator=generator)
continuations = torch.randint(0, 100, (4, 5), generator=generator)

with torch.no_grad():
    prefix = prefill(model, prompt)
    clean = score_continuations(model, prefix, continuations).sums
    edit = Ablation("zero", layers=0, positions=list(range(8, 16)))
    read = score_continuations(model, ablate_read(prefix, edit), continuations).sums
    written = score_continuations(model, ablate_write(model, prefix, edit), continuations).sums
    print("clean      ", [round(x, 3) for x in clean.tolist()])
    print("read-time  ", [round(x, 3) for x in (read - clean).tolist()])
    print("write-time ", [round(x, 3) for x in (written - clean).tolist()])
