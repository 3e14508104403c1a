"""Capturing what the cache hook points see: `run_with_cache_capture`.

The cache's counterpart of TransformerLens' `run_with_cache`: one forward pass through
a cache ([`KeyValueCache`][safelens.KeyValueCache] on a `HookedTransformer`,
[`HFKeyValueCache`][safelens.HFKeyValueCache] on a HuggingFace model) whose
`hook_k_new` / `hook_v_new` / `hook_k_full` / `hook_v_full` points are recorded,
optionally only some positions and KV heads. Capture hooks run after the caller's
`fwd_hooks`, so they see patched tensors. Captures keep the cache's layout:
`[batch, pos, n_kv_heads, d_head]` on a `HookedTransformer`, `[batch, n_kv_heads, pos,
d_head]` on a HuggingFace model.

Caveat: every capture is a detached clone, so capturing `hook_*_full` on a long cache
holds a copy of all of its keys or values per layer; pass `positions` or `heads` to keep
less.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from ..backends._backend import FwdHooks, NamesFilter
from ..backends._families import backend_of
from ..backends._supported import SupportedModel
from ..core._arguments import indices
from ..core._errors import HookError
from ..core._hook_point import CacheHookPoint

__all__ = ["run_with_cache_capture"]

Indices = int | Seq[int] | torch.Tensor


def _index(chosen: int | tuple[int, ...], size: int, what: str, name: str) -> torch.Tensor:
    index = torch.tensor(chosen, dtype=torch.long).reshape(-1)
    if index.numel() and not (-size <= int(index.min()) and int(index.max()) < size):
        raise HookError(
            f"{what} {index.tolist()} out of range for {name!r}, which sees {size} "
            f"{'positions' if what == 'positions' else 'KV heads'}"
        )
    return index % size


def run_with_cache_capture(
    model: SupportedModel,
    input: Any,
    *,
    cache: Any,
    names: NamesFilter | None = None,
    positions: Indices | None = None,
    heads: Indices | None = None,
    fwd_hooks: FwdHooks = (),
    attention_mask: torch.Tensor | None = None,
    return_type: str | None = "logits",
    start_at_layer: int | None = None,
    stop_at_layer: int | None = None,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Run one forward pass through `cache` and collect what its hook points saw.

    Capture hooks run after `fwd_hooks`, so they see patched tensors: for `hook_*_new`,
    exactly what is stored; for `hook_*_full`, exactly what attention reads.

    **Arguments:**

    - `model`, `input`, `cache`, `fwd_hooks`, `attention_mask`, `return_type`,
      `start_at_layer`, `stop_at_layer`: as in [`run_with_hooks`][safelens.run_with_hooks].
    - `names`: cache hook names to capture (a name, a list, or a predicate); `None` for
      all of them.
    - `positions`: keep only these indices of the `pos` axis each hook sees (absolute
      positions for `hook_*_full`; indices among the new tokens for `hook_*_new`).
    - `heads`: keep only these KV heads.

    **Returns:** `(output, captured)`, `captured[name]` a detached clone in the cache's
    layout (selected positions/heads only, axes kept).

    **Raises:** [`HookError`][safelens.HookError] for an unknown or model hook name, or
    positions/heads that are not ints (or a flat sequence of them) or out of range; the
    cache is then unchanged.

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> model = HookedTransformer(HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=8,
    ...     d_head=4, n_heads=4, d_vocab=10, act_fn="relu"))
    >>> _, captured = run_with_cache_capture(model, torch.tensor([[1, 2, 3]]),
    ...     cache=KeyValueCache(), names=lambda name: name.endswith("hook_k_full"),
    ...     positions=[0, -1], heads=1)
    >>> {name: tuple(t.shape) for name, t in captured.items()}
    {'blocks.0.kv_cache.hook_k_full': (1, 2, 1, 4), 'blocks.1.kv_cache.hook_k_full': (1, 2, 1, 4)}

    ```
    """
    backend = backend_of(model, "run_with_cache_capture")
    chosen = backend.cache_hook_names() if names is None else backend.select_cache_hooks(names)
    layout = backend.caches.layout
    picked = None if positions is None else indices(positions, "positions", error=HookError)
    head_index = (
        None
        if heads is None
        else _index(
            indices(heads, "heads", error=HookError), backend.n_kv_heads, "heads", "the cache"
        )
    )
    captured: dict[str, torch.Tensor] = {}

    def save(tensor: torch.Tensor, hook: CacheHookPoint) -> None:
        kept = tensor.detach()
        if picked is not None:
            index = _index(picked, kept.shape[layout.pos_axis], "positions", hook.name)
            kept = kept.index_select(layout.pos_axis, index.to(kept.device))
        if head_index is not None:
            kept = kept.index_select(layout.heads_axis, head_index.to(kept.device))
        captured[hook.name] = kept.clone()

    forward_args = dict(
        attention_mask=attention_mask,
        return_type=return_type,
        start_at_layer=start_at_layer,
        stop_at_layer=stop_at_layer,
    )
    all_hooks = list(fwd_hooks) + ([(chosen, save)] if chosen else [])
    output = backend.run(input, cache, all_hooks, forward_args, True, False)
    return output, captured
