"""One forward pass through a cache with hooks attached: `run_with_hooks`.

The cache's counterpart of TransformerLens' `model.run_with_hooks`, on every backend: the
`fwd_hooks` list may name the model's hook points and the cache's, and every hook
function has TransformerLens' signature `fn(tensor, hook) -> tensor | None`.

- `HookedTransformer`: the model's hook names (`blocks.{l}.attn.hook_k`, …) and the
  cache's `blocks.{l}.kv_cache.{hook_k_new, hook_v_new, hook_k_full, hook_v_full}`
  (see `safelens.backends.hooked._hooks`); `attention_mask` covers the new tokens (the
  cache holds the cached positions' mask).
- HuggingFace causal LMs: the model's module names (`model.layers.0.mlp`,
  `model.layers.0.self_attn`, …; a hook sees the module's output, or the first element
  of a tuple output, and what it returns replaces that) and the cache's
  `model.layers.{l}.kv_cache.…` (see `safelens.backends.hf._run`); `attention_mask`
  covers cached plus new positions, as HuggingFace takes it.
- TransformerBridge: the bridge's hook names and the cache's `blocks.{l}.kv_cache.…`
  (`HFKeyValueCache(naming="bridge")`); masks as on HuggingFace models.

It is also the one way to run a model of any family over a safelens cache without
hooks (`fwd_hooks=()`): on a TransformerBridge under transformers >= 5.24 no forward
argument reaches the bridge's attention (see
[`hf_cache_argument`][safelens.hf_cache_argument]), and this pass hands it the cache.

The pass is checked before it runs, and put back exactly as it was if it fails: the
cache, and the hooks attached to the model and the cache.

Caveat: on `HookedTransformer`, a lazy or empty cache first gets `[batch, 0, n_kv_heads,
d_head]` tensors in the model's dtype for every layer, as `KeyValueCache.init_cache`
would make them, because TransformerLens reads the cached length of every layer.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from ..backends._backend import FwdHooks
from ..backends._families import backend_of
from ..backends._supported import SupportedModel

__all__ = ["run_with_hooks"]


def run_with_hooks(
    model: SupportedModel,
    input: Any,
    *,
    cache: Any,
    fwd_hooks: FwdHooks = (),
    attention_mask: torch.Tensor | None = None,
    return_type: str | None = "logits",
    loss_per_token: bool = False,
    prepend_bos: bool | None = None,
    padding_side: Literal["left", "right"] | None = None,
    start_at_layer: int | None = None,
    stop_at_layer: int | None = None,
    tokens: torch.Tensor | None = None,
    shortformer_pos_embed: torch.Tensor | None = None,
    reset_hooks_end: bool = True,
    clear_contexts: bool = False,
) -> Any:
    """One forward pass through `cache` with `fwd_hooks` attached (model and cache names).

    As `model.run_with_hooks(input, past_kv_cache=cache, fwd_hooks=...)`, but `fwd_hooks`
    may also name cache hook points, and `model` may be a HuggingFace causal LM (see the
    module notes for the names and masks of each family). A token `input` without
    `attention_mask` on a model without tokenizer gets an all-ones mask. If the pass
    fails (a hook raises or returns a tensor that does not fit), the cache is put back
    exactly as it was.

    **Arguments:**

    - `model`: a `HookedTransformer`, a TransformerBridge or a HuggingFace causal LM;
      `input`: tokens `[batch, new_tokens]` (or, on a `HookedTransformer`, what
      `model.forward` accepts).
    - `cache`: the cache to read and append to: a
      [`KeyValueCache`][safelens.KeyValueCache] on a `HookedTransformer`, an
      [`HFKeyValueCache`][safelens.HFKeyValueCache] on a HuggingFace model
      (`naming="bridge"` on a TransformerBridge).
    - `fwd_hooks`: `[(names, fn), ...]`, `names` a hook name, list of names or predicate.
    - `attention_mask` … `shortformer_pos_embed`: passed to `model.forward` (a
      HuggingFace model takes `attention_mask` and `return_type` `"logits"` or `None`
      only, and refuses the others with a `ValueError`).
    - `reset_hooks_end`, `clear_contexts`: as in [`hooks`][safelens.hooks] (a
      HuggingFace model needs `reset_hooks_end=True`).

    **Returns:** what `model.forward` returns (the logits on a HuggingFace model).

    **Raises:** [`HookError`][safelens.HookError] for an unknown hook name or a hook
    result of the wrong shape, dtype or device; `TypeError` for a model of no known
    family.

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> model = HookedTransformer(HookedTransformerConfig(n_layers=1, d_model=16, n_ctx=8,
    ...     d_head=4, n_heads=4, d_vocab=10, act_fn="relu"))
    >>> cache = KeyValueCache()
    >>> zero = lambda tensor, hook: torch.zeros_like(tensor)
    >>> logits = run_with_hooks(model, torch.tensor([[1, 2, 3]]), cache=cache,
    ...     fwd_hooks=[("blocks.0.kv_cache.hook_v_new", zero)])
    >>> logits.shape, cache[0].values.abs().sum().item()
    (torch.Size([1, 3, 10]), 0.0)

    ```
    """
    forward_args = dict(
        attention_mask=attention_mask,
        return_type=return_type,
        loss_per_token=loss_per_token,
        prepend_bos=prepend_bos,
        padding_side=padding_side,
        start_at_layer=start_at_layer,
        stop_at_layer=stop_at_layer,
        tokens=tokens,
        shortformer_pos_embed=shortformer_pos_embed,
    )
    backend = backend_of(model, "run_with_hooks")
    return backend.run(input, cache, fwd_hooks, forward_args, reset_hooks_end, clear_contexts)
