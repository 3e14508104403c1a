"""Hook names of an [`HFKeyValueCache`][safelens.HFKeyValueCache], and hooks for a block.

Every layer of the cache has four hook points, named
`model.layers.{layer}.kv_cache.{hook_k_new, hook_v_new, hook_k_full, hook_v_full}` for
every architecture (GPT-2's modules are `transformer.h.{layer}`, its cache hook names are
still `model.layers.{layer}.…`), or `blocks.{layer}.kv_cache.…` for a cache made with
`naming="bridge"`, to sit beside a TransformerBridge's own `blocks.{layer}.…` names.
What each sees is stated in `safelens.backends.hf._layer`.

A hook list is `[(names, fn), ...]` as in TransformerLens' `run_with_hooks`: `names` is a
hook name, a list of names, or a predicate `fn(name) -> bool`. Every name is checked
before any hook is attached.

Caveat: a predicate selects among the layers the cache already has, so a fresh lazy
cache (no layers yet) refuses one; build it with `HFKeyValueCache(config=model.config)`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from typing import Any

from ...core._errors import HookError
from ...core._hook_point import CacheHookPoint, HookFunction
from ._layer import HOOK_POINTS, HOOK_PREFIXES, HFCacheLayer, HookNaming, hf_hook_name

__all__ = ["FwdHooks", "NamesFilter", "attached", "resolve", "resolve_hooks"]

NamesFilter = str | Seq[str] | Callable[[str], bool]
FwdHooks = Seq[tuple[NamesFilter, HookFunction]]
_NAME = {
    naming: re.compile(rf"{re.escape(prefix)}\.(\d+)\.kv_cache\.(hook_[kv]_(?:new|full))")
    for naming, prefix in HOOK_PREFIXES.items()
}


def resolve(
    names: NamesFilter, layers: list[HFCacheLayer], naming: HookNaming = "hf"
) -> list[tuple[int, str]]:
    """`(layer, point)` of each hook point `names` selects, or a `HookError` saying why not.

    A listed name may name a layer beyond `layers` (the cache creates it); a predicate
    sees the names of `layers` only. Names follow the scheme `naming`.

    ```python
    >>> resolve("model.layers.3.kv_cache.hook_v_full", [])
    [(3, 'hook_v_full')]
    >>> resolve(["blocks.0.kv_cache.hook_k_new"], [], naming="bridge")
    [(0, 'hook_k_new')]

    ```
    """
    if callable(names):
        if not layers:
            raise HookError(
                "a name filter function selects among existing layers, and this cache "
                "has none yet; build it with HFKeyValueCache(config=model.config)"
            )
        return [
            (layer.layer, point)
            for layer in layers
            for point in HOOK_POINTS
            if names(hf_hook_name(layer.layer, point, naming))
        ]
    listed = [names] if isinstance(names, str) else names
    if not isinstance(listed, Seq) or not all(isinstance(n, str) for n in listed):
        raise HookError(
            "a hook name filter must be a name, a list of names or a function "
            f"fn(name) -> bool, got {names!r}"
        )
    chosen: list[tuple[int, str]] = []
    for name in listed:
        match = _NAME[naming].fullmatch(name)
        if match is None:
            known = [
                hf_hook_name(layer.layer, point, naming)
                for layer in layers
                for point in HOOK_POINTS
            ]
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise HookError(
                f"unknown cache hook name {name!r}; expected {HOOK_PREFIXES[naming]}."
                f"{{layer}}.kv_cache.{{{', '.join(HOOK_POINTS)}}}{hint}"
            )
        chosen.append((int(match[1]), match[2]))
    return chosen


def resolve_hooks(
    fwd_hooks: Any, layers: list[HFCacheLayer], naming: HookNaming = "hf"
) -> list[tuple[int, str, Any]]:
    """`(layer, point, fn)` for every hook point each `(names, fn)` pair selects."""
    chosen: list[tuple[int, str, Any]] = []
    for pair in fwd_hooks:
        if not (isinstance(pair, tuple) and len(pair) == 2 and callable(pair[1])):
            raise HookError(
                f"fwd_hooks must be a list of (names, fn) pairs with fn callable as "
                f"fn(tensor, hook), got item {pair!r}"
            )
        names, fn = pair
        chosen.extend((layer, point, fn) for layer, point in resolve(names, layers, naming))
    return chosen


@contextmanager
def attached(hooks: list[tuple[CacheHookPoint, Any]], level: int) -> Iterator[None]:
    """Attach each `(point, fn)` at context level `level`; remove them on exit."""
    touched = []
    try:
        for point, fn in hooks:
            point.add_hook(fn, level=level)
            touched.append(point)
        yield
    finally:
        for point in touched:
            point.remove_hooks(level=level)
