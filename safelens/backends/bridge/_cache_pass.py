"""One forward pass of a TransformerBridge through a cache: `cache_pass`.

A TransformerBridge runs its HuggingFace model's forward, and the model hands the cache
to each layer's attention, where the bridge's attention component calls
`cache.update` with head-major, post-rotary keys. Through the bridge, an
[`HFKeyValueCache`][safelens.HFKeyValueCache] gives the bridge's uncached numbers.

The trap this module handles: transformers 5.24 renamed the models' forward argument
`past_key_values=` to `cache=` (the old name warns and is renamed), so a decoder layer
now hands its attention the cache as `cache=`. The bridge's attention components
(TransformerLens 3.9 and 4.x) read only `past_key_values` (or `layer_past`), so under
transformers >= 5.24 the cache is silently ignored: nothing is stored, and a
continuation attends to its own tokens only. Under 5.23 and earlier it is exact.

[`cache_pass`][safelens.backends.bridge._cache_pass.cache_pass] makes one pass exact
under every version:

1. the cache is passed under the name the HuggingFace model's forward takes (its
   signature: `safelens.backends.hf._model.forward_cache_argument`), so no deprecation
   warning;
2. when that name is `cache`, each attention component of the bridge gets a forward
   pre-hook, for the pass only, that hands it the cache under `past_key_values` too;
3. every layer must have called `cache.update` exactly once on the calling thread
   (none, for a layer the thread's pass skips: `safelens.backends.hf._skip`); a pass in which some layer did not (another version combination, another
   architecture) is refused with a [`CacheConfigError`][safelens.CacheConfigError] and
   the cache is put back, instead of returning numbers that ignored it.

Caveat: the pre-hooks are torch hooks on the bridge's modules while at least one pass
is in flight (shared by concurrent passes, counted under a lock); they pass on a cache
that HuggingFace hands as `cache=` and change nothing else.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from ...core._errors import CacheConfigError
from ..hf._cache import HFKeyValueCache
from ..hf._hooks import attached
from ..hf._layer import hf_hook_name
from ..hf._model import forward_cache_argument
from ..hf._skip import skipped_layers

__all__ = ["cache_pass", "attention_modules"]

_LOCK = threading.Lock()
# id(bridge) -> (passes in flight, the pre-hook handles they share)
_ALIASED: dict[int, tuple[int, list[Any]]] = {}
_ATTENTION: weakref.WeakKeyDictionary[Any, list[torch.nn.Module]] = weakref.WeakKeyDictionary()
# Levels for the counting hooks: negative, so never one a cache's own hooks() uses.
_LEVELS = itertools.count(-1, -1)


def attention_modules(bridge: Any) -> list[torch.nn.Module]:
    """The bridge's attention components: the modules that call `cache.update`.

    Found once per bridge (a walk over every module); a bridge whose components were
    replaced since is caught by `cache_pass`' count of `cache.update` calls.
    """
    from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge

    found = _ATTENTION.get(bridge)
    if found is None:
        found = [module for module in bridge.modules() if isinstance(module, AttentionBridge)]
        _ATTENTION[bridge] = found
    return found


def _alias(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Hand a cache that arrives as `cache=` to the bridge under `past_key_values=` too.

    Without `kwargs` (half-registered, `safelens.core._thread_hooks`: a pass of a thread
    outside `cache_pass`, which hands no cache), nothing.
    """
    if (
        kwargs is not None
        and kwargs.get("cache") is not None
        and kwargs.get("past_key_values") is None
    ):
        return args, {**kwargs, "past_key_values": kwargs["cache"]}
    return None


@contextmanager
def _aliased(bridge: Any) -> Iterator[None]:
    """The `_alias` pre-hook on every attention component, while any pass needs it."""
    key = id(bridge)
    with _LOCK:
        count, handles = _ALIASED.get(key, (0, []))
        if count == 0:
            handles = [
                module.register_forward_pre_hook(_alias, with_kwargs=True)
                for module in attention_modules(bridge)
            ]
        _ALIASED[key] = (count + 1, handles)
    try:
        yield
    finally:
        with _LOCK:
            count, handles = _ALIASED.pop(key)
            if count > 1:
                _ALIASED[key] = (count - 1, handles)
            else:
                for handle in handles:
                    handle.remove()


def _check_layers(cache: HFKeyValueCache, n_layers: int) -> None:
    held = len(cache.layers)
    if held > n_layers:
        raise CacheConfigError(
            f"cache holds {held} layers but the bridge's model has {n_layers}: it was filled "
            "by another model. Make caches with backend_of(bridge).empty_cache(batch)"
        )
    if cache.frozen and held != n_layers:
        raise CacheConfigError(
            f"cache is frozen and holds {held} of the model's {n_layers} layers, so the "
            "layers it lacks would read nothing; fill it with an unfrozen pass first"
        )


@contextmanager
def cache_pass(bridge: Any, cache: HFKeyValueCache) -> Iterator[dict[str, HFKeyValueCache]]:
    """Run the block's one forward pass of `bridge` through `cache`, exactly, or refuse it.

    Yields the keyword argument to call the bridge with, `{name: cache}`. On exit the
    pass is checked: every layer called `cache.update` once on this thread. A block
    that raises, or a pass that missed a layer, leaves `cache` as it was.

    **Arguments:**

    - `bridge`: a TransformerLens `TransformerBridge`.
    - `cache`: the [`HFKeyValueCache`][safelens.HFKeyValueCache] to read and (unless
      frozen) store into; an unfrozen cache gets its missing layers (empty) first.

    **Raises:** [`CacheConfigError`][safelens.CacheConfigError] for a cache with more
    layers than the model (or a frozen one with fewer), and after a pass in which some
    layer did not read the cache.

    Used as `with cache_pass(bridge, cache) as argument: bridge(tokens, **argument)`.
    """
    n_layers = len(bridge.blocks)
    _check_layers(cache, n_layers)
    name = forward_cache_argument(bridge.original_model)
    me, counts = threading.get_ident(), [0] * n_layers

    def counter(layer: int) -> Any:
        def count(tensor: torch.Tensor, hook: Any) -> None:
            if threading.get_ident() == me:
                counts[layer] += 1

        return count

    with ExitStack() as stack:
        stack.enter_context(cache.guard())
        if len(cache.layers) < n_layers:  # unfrozen: the layers update would add anyway
            cache.hook_point(hf_hook_name(n_layers - 1, "hook_k_new", cache.naming))
        points = [(layer.hook_k_new, counter(i)) for i, layer in enumerate(cache.layers)]
        if name == "cache":
            stack.enter_context(_aliased(bridge))
        stack.enter_context(attached(points, next(_LEVELS)))
        yield {name: cache}
        skipped = skipped_layers()
        missed = [
            layer for layer, count in enumerate(counts) if count != (0 if layer in skipped else 1)
        ]
        if missed:
            raise CacheConfigError(
                f"the bridge's forward did not pass the cache to the attention of layers "
                f"{missed} (cache.update calls per layer: {counts}), so its numbers ignore "
                "the cache; the cache was put back. This is the transformers >= 5.24 trap "
                "(the bridge's attention reads past_key_values=, the model hands it "
                "cache=) in a form safelens does not bridge: pass the cache through "
                "safelens' functions on a supported family, or run without a cache"
            )
