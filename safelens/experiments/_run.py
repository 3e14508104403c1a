"""One forward pass through a cache with hooks attached: `run_with_hooks`.

The cache's counterpart of TransformerLens' `model.run_with_hooks`: the `fwd_hooks` list
may name the model's hook points and the cache's (see `safelens.backends.hooked._hooks`). The pass is
checked before it runs (token ids, batch, mask, and that it reaches every layer of an
unfrozen cache), and put back exactly as it was if it fails.

Caveat: a lazy or empty cache first gets `[batch, 0, n_kv_heads, d_head]` tensors in the
model's dtype for every layer, as `KeyValueCache.init_cache` would make them, because
TransformerLens reads the cached length of every layer.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from transformer_lens import HookedTransformer

from ..backends.hooked._hooks import FwdHooks, hooks
from ..core._arguments import integer
from ..core._cache import KeyValueCache
from ..core._config import CacheDimensions, refuse_ungrouped
from ..core._errors import CacheShapeError, HookError, TokenError
from ..core._rollback import snapshot
from ..core._tokens import check_tokens

__all__ = ["run_with_hooks", "forward"]


def _fill_empty_layers(model: HookedTransformer, cache: KeyValueCache, batch: int) -> None:
    """Give every layer without tensor keys an empty `[batch, 0, n_kv_heads, d_head]` pair."""
    dims = CacheDimensions.of(model.cfg)
    for layer in range(dims.n_layers):
        try:
            entry = cache[layer]
        except IndexError:
            raise HookError(
                f"the cache holds {len(cache)} layers but the model has {dims.n_layers}; "
                "build it with KeyValueCache.init_cache(model.cfg)"
            ) from None
        if entry.keys is None and entry.values is None:
            empty = dims.empty_keys(batch, dims.device_of_layer(layer, model.cfg.device))
            entry.keys, entry.values = empty, torch.empty_like(empty)


def _check_layers(model: HookedTransformer, cache: KeyValueCache, forward_args: dict) -> None:
    """Refuse a pass that would store some layers and not others into an unfrozen cache."""
    start, stop = forward_args.get("start_at_layer"), forward_args.get("stop_at_layer")
    n_layers = model.cfg.n_layers
    for name, value in (("start_at_layer", start), ("stop_at_layer", stop)):
        integer(value, name, optional=True, shown=repr)
    partial = start is not None or list(range(n_layers)[:stop]) != list(range(n_layers))
    if partial and not cache.frozen:
        which = "start_at_layer" if start is not None else "stop_at_layer"
        value = start if start is not None else stop
        raise CacheShapeError(
            f"{which}={value} with an unfrozen cache would store keys and values for some "
            f"of the model's {n_layers} layers only (and leave the attention mask out of step), "
            "so the next pass through it would read misaligned positions. Run this pass on a "
            "frozen cache (`with cache.frozen(): ...`): it then reads the cache and stores nothing"
        )


def _checked_input(
    model: HookedTransformer, cache: KeyValueCache, input: torch.Tensor, mask: Any
) -> torch.Tensor:
    """Token ids `[batch, pos]` that fit the model, the cache and the mask, or an error."""
    tokens = check_tokens(input, model.cfg, "input", past=cache.sequence_length, rank=None)
    if tokens.dim() == 1:
        tokens = tokens[None]
    if tokens.dim() != 2:
        raise CacheShapeError(
            f"input must be token ids [batch, pos] (or [pos]), got shape {tuple(tokens.shape)}"
        )
    batch = cache.batch_size
    if batch and tokens.shape[0] != batch:
        raise CacheShapeError(
            f"input has batch {tokens.shape[0]} but the cache holds batch {batch}; use "
            "cache.expand(n) (from a batch-1 cache) or cache.select(rows) to match"
        )
    if mask is not None and tuple(getattr(mask, "shape", ())) != tuple(tokens.shape):
        raise CacheShapeError(
            f"attention_mask must be [batch, new_tokens] = {tuple(tokens.shape)} like input, "
            f"got {tuple(getattr(mask, 'shape', ())) or type(mask).__name__}; the cache "
            "already holds the mask of the cached positions"
        )
    return tokens


def forward(
    model: HookedTransformer,
    input: Any,
    cache: KeyValueCache,
    fwd_hooks: FwdHooks,
    forward_args: dict[str, Any],
    reset_hooks_end: bool,
    clear_contexts: bool,
) -> Any:
    if not isinstance(cache, KeyValueCache):
        raise HookError(f"cache must be a safelens KeyValueCache, got {type(cache).__name__}")
    refuse_ungrouped(model.cfg, "run_with_hooks")
    _check_layers(model, cache, forward_args)
    text = isinstance(input, str) or (
        isinstance(input, list) and bool(input) and all(isinstance(i, str) for i in input)
    )
    if text and model.tokenizer is None:
        raise TokenError(
            "input is text but the model has no tokenizer; pass token ids [batch, pos] "
            "(a tensor of ints) instead"
        )
    if not text and forward_args.get("start_at_layer") is None:
        input = _checked_input(model, cache, input, forward_args.get("attention_mask"))
    if forward_args.get("tokens") is not None:
        check_tokens(forward_args["tokens"], model.cfg, "tokens", rank=None)
    restore = snapshot(cache)
    try:
        if isinstance(input, torch.Tensor):
            _fill_empty_layers(model, cache, input.shape[0])
            if forward_args["attention_mask"] is None and model.tokenizer is None:
                forward_args["attention_mask"] = torch.ones(
                    input.shape[:2], dtype=torch.long, device=input.device
                )
        with hooks(model, cache, fwd_hooks, reset_hooks_end, clear_contexts):
            return model(input, past_kv_cache=cache, **forward_args)
    except BaseException:
        restore()
        raise


def run_with_hooks(
    model: HookedTransformer,
    input: Any,
    *,
    cache: KeyValueCache,
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
    may also name cache hook points. A token `input` without `attention_mask` on a model
    without tokenizer gets an all-ones mask. A lazy or empty cache first gets empty
    tensors for every layer (see the module notes). If the pass fails (a hook raises or
    returns a tensor that does not fit), the cache is put back exactly as it was.

    **Arguments:**

    - `model`: the `HookedTransformer`; `input`: tokens `[batch, new_tokens]` (or what
      `model.forward` accepts).
    - `cache`: the [`KeyValueCache`][safelens.KeyValueCache] to read and append to.
    - `fwd_hooks`: `[(names, fn), ...]`, `names` a hook name, list of names or predicate.
    - `attention_mask` … `shortformer_pos_embed`: passed to `model.forward`.
    - `reset_hooks_end`, `clear_contexts`: as in [`hooks`][safelens.hooks].

    **Returns:** what `model.forward` returns.

    **Raises:** [`HookError`][safelens.HookError] for an unknown hook name or a hook
    result of the wrong shape, dtype or device.

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
    return forward(model, input, cache, fwd_hooks, forward_args, reset_hooks_end, clear_contexts)
