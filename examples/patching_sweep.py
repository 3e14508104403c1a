"""A key-by-position patching sweep on a tiny random model, checked against TransformerLens."""

import torch
import transformer_lens.patching as tl_patching
from transformer_lens import HookedTransformer, HookedTransformerConfig

import safelens

cfg = HookedTransformerConfig(
    n_layers=2,
    d_model=32,
    n_ctx=16,
    d_head=8,
    n_heads=4,
    d_vocab=50,
    act_fn="gelu",
    positional_embedding_type="rotary",
    n_key_value_heads=2,
    seed=0,
)
model = HookedTransformer(cfg)
clean, corrupted = torch.tensor([[1, 7, 3, 9, 4, 2]]), torch.tensor([[1, 8, 3, 9, 4, 2]])
clean_logits, clean_cache = model.run_with_cache(clean)
metric = safelens.logit_diff_metric(clean_logits, model(corrupted), answer_token=5, wrong_token=6)

result = safelens.get_act_patch_attn_head_k_by_pos(model, corrupted, clean_cache, metric)
reference = tl_patching.get_act_patch_attn_head_k_by_pos(model, corrupted, clean_cache, metric)
print("shape [layer, pos, n_kv_heads]:", tuple(result.shape))
print("max abs difference from TransformerLens:", float((result - reference).abs().max()))
