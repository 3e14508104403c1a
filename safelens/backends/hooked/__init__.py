"""The TransformerLens `HookedTransformer` adapter: position-major `[batch, pos, n_kv_heads, d_head]` pre-rotary keys, passed as `past_kv_cache=`."""
