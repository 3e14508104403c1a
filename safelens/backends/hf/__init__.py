"""The HuggingFace adapter (plain causal LMs and TransformerLens' `TransformerBridge`): a cache that is a `transformers.Cache`, head-major `[batch, n_kv_heads, pos, d_head]` post-rotary keys."""
