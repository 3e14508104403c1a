"""How `torch.export` sees an `HFKeyValueCache`: a pytree of its layers' keys and values.

`torch.export` passes a model's inputs and outputs as pytrees of tensors. `DynamicCache`
is registered as one by transformers (`register_dynamic_cache_export_support`);
`register_cache_pytree` registers [`HFKeyValueCache`][safelens.HFKeyValueCache] the same
way when it is imported: its leaves are each layer's head-major keys and values, in layer
order (layers that hold nothing yet have none); its context is which layers hold
something, the hook naming, the frozen flag and each layer's sliding window and evicted
positions. Rebuilt, a cache holds those
tensors in storage of its own and behaves as the cache flattened: a frozen one stores
nothing in the exported program either.

Caveat: hooks attached to the cache's hook points are not part of the pytree, so an
exported program runs none of them; attach hooks in eager runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from ...core._storage import Sequence
from ._layer import HFCacheLayer, HookNaming

__all__ = ["register_cache_pytree"]

# (layers that hold something, naming, frozen, each layer's window and evicted positions)
Context = tuple[tuple[int, ...], HookNaming, bool, tuple[int | None, ...], tuple[int, ...]]


def _flatten(cache: Any) -> tuple[list[torch.Tensor], Context]:
    held = tuple(i for i, layer in enumerate(cache.layers) if layer.keys is not None)
    leaves = [t for i in held for t in (cache.layers[i].keys, cache.layers[i].values)]
    windows = tuple(layer.sliding_window for layer in cache.layers)
    evicted = tuple(layer.evicted for layer in cache.layers)
    return leaves, (held, cache.naming, bool(cache._frozen), windows, evicted)


def _flatten_with_keys(cache: Any) -> tuple[list[tuple[Any, torch.Tensor]], Context]:
    leaves, context = _flatten(cache)
    return [(pytree.SequenceKey(i), leaf) for i, leaf in enumerate(leaves)], context


def register_cache_pytree(cls: type) -> None:
    """Register `cls` (`HFKeyValueCache`) as a pytree node, once.

    ```python
    >>> from torch.utils import _pytree as pytree
    >>> cache = HFKeyValueCache()
    >>> _ = cache.update(torch.ones(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    >>> leaves, spec = pytree.tree_flatten(cache)
    >>> [leaf.shape for leaf in leaves], pytree.tree_unflatten(leaves, spec)
    ([torch.Size([1, 2, 3, 4]), torch.Size([1, 2, 3, 4])], HFKeyValueCache(layers=1, batch=1, sequence_length=3, frozen=False))

    ```
    """

    def unflatten(values: Any, context: Context) -> Any:
        held, naming, frozen, windows, evicted = context
        cache = cls(naming=naming)
        cache._windows = list(windows)
        leaves = iter(list(values))
        for i, (window, dropped) in enumerate(zip(windows, evicted, strict=True)):
            if i in held:
                keys, values_ = (Sequence.of(next(leaves).transpose(1, 2)) for _ in range(2))
                layer = HFCacheLayer(i, keys, values_, naming, window, dropped)
            else:
                layer = HFCacheLayer(i, naming=naming, sliding_window=window)
            cache.layers.append(layer)
        cache._frozen = frozen
        return cache

    if cls in pytree.SUPPORTED_NODES:
        return
    pytree.register_pytree_node(
        cls,
        _flatten,
        unflatten,
        serialized_type_name=f"{cls.__module__}.{cls.__name__}",
        flatten_with_keys_fn=_flatten_with_keys,
    )
