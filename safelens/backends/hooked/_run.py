"""`run_with_hooks`' pass on a `HookedTransformer`: checks, empty layers, rollback.

The pass is checked before it runs (token ids, batch, mask, and that it reaches every
layer of an unfrozen cache), and put back exactly as it was if it fails.

Caveat: a lazy or empty cache first gets `[batch, 0, n_kv_heads, d_head]` tensors in the
model's dtype for every layer, as `KeyValueCache.init_cache` would make them, because
TransformerLens reads the cached length of every layer.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core._arguments import integer
from ...core._cache import KeyValueCache
from ...core._config import CacheDimensions
from ...core._errors import CacheShapeError, HookError, TokenError
from ...core._rollback import snapshot
from ...core._tokens import check_tokens
from .._backend import Backend, FwdHooks
from ._hooks import hooks

__all__ = ["run"]


def _fill_empty_layers(backend: Backend, cache: KeyValueCache, batch: int) -> None:
    """Give every layer without tensor keys an empty `[batch, 0, n_kv_heads, d_head]` pair."""
    dims = CacheDimensions.of(backend.model.cfg)
    for layer in range(dims.n_layers):
        try:
            entry = cache[layer]
        except IndexError:
            raise HookError(
                f"the cache holds {len(cache)} layers but the model has {dims.n_layers}; "
                "build it with KeyValueCache.init_cache(model.cfg)"
            ) from None
        if entry.keys is None and entry.values is None:
            empty = dims.empty_keys(batch, dims.device_of_layer(layer, backend.model.cfg.device))
            entry.keys, entry.values = empty, torch.empty_like(empty)


def _check_layers(n_layers: int, cache: KeyValueCache, forward_args: dict) -> None:
    """Refuse a pass that would store some layers and not others into an unfrozen cache."""
    start, stop = forward_args.get("start_at_layer"), forward_args.get("stop_at_layer")
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


def _checked_input(cfg: Any, cache: KeyValueCache, input: torch.Tensor, mask: Any) -> torch.Tensor:
    """Token ids `[batch, pos]` that fit the model, the cache and the mask, or an error."""
    tokens = check_tokens(input, cfg, "input", past=cache.sequence_length, rank=None)
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


def run(
    backend: Backend,
    input: Any,
    cache: Any,
    fwd_hooks: FwdHooks,
    forward_args: dict[str, Any],
    reset_hooks_end: bool,
    clear_contexts: bool,
) -> Any:
    """`model(input, past_kv_cache=cache, **forward_args)` with `fwd_hooks`, checked first."""
    if not isinstance(cache, KeyValueCache):
        raise HookError(f"cache must be a safelens KeyValueCache, got {type(cache).__name__}")
    model = backend.model
    _check_layers(backend.n_layers, cache, forward_args)
    text = isinstance(input, str) or (
        isinstance(input, list) and bool(input) and all(isinstance(i, str) for i in input)
    )
    if text and backend.tokenizer is None:
        raise TokenError(
            "input is text but the model has no tokenizer; pass token ids [batch, pos] "
            "(a tensor of ints) instead"
        )
    if not text and forward_args.get("start_at_layer") is None:
        input = _checked_input(backend.model.cfg, cache, input, forward_args.get("attention_mask"))
    if forward_args.get("tokens") is not None:
        check_tokens(forward_args["tokens"], backend.model.cfg, "tokens", rank=None)
    restore = snapshot(cache)
    try:
        if isinstance(input, torch.Tensor):
            _fill_empty_layers(backend, cache, input.shape[0])
            if forward_args["attention_mask"] is None and backend.tokenizer is None:
                forward_args["attention_mask"] = torch.ones(
                    input.shape[:2], dtype=torch.long, device=input.device
                )
        with hooks(model, cache, fwd_hooks, reset_hooks_end, clear_contexts):
            return model(input, past_kv_cache=cache, **forward_args)
    except BaseException:
        restore()
        raise
