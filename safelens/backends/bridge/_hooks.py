"""One `fwd_hooks` list for a TransformerBridge's hook points and its cache's.

TransformerLens users write `bridge.run_with_hooks(tokens, fwd_hooks=[(name, fn), ...])`.
Through safelens ([`run_with_hooks`][safelens.run_with_hooks], `backend.hooks`) the
same list may also name the cache's hook points,
`blocks.{layer}.kv_cache.{hook_k_new, hook_v_new, hook_k_full, hook_v_full}`, beside the
bridge's own `blocks.{layer}.attn.hook_q`, `blocks.{layer}.hook_resid_pre`, …: the list
is split, bridge names going to the bridge's hook points through its own `hooks()`
(so they see what `bridge.run_with_hooks` shows, after the bridge's conversions), cache
names to the cache's [`CacheHookPoint`][safelens.CacheHookPoint]s.

A name filter is a name, a list of names, or a predicate over every bridge and cache
hook name. Every name is checked before any hook is attached; the block's hooks are
removed on exit (with `reset_hooks_end`), also on error, and a pass that fails inside
leaves the cache as it was.

safelens' own passes (`pass_hooks`: the sweeps' patches, `prefill`'s and the
ablations' captures) attach their bridge hooks with `thread_bridge_hooks` instead: plain
PyTorch forward hooks on the same hook points, with the same conversions, acting on the
calling thread's passes only and removed by their own handles, so that passes on one
bridge from several threads never see each other's hooks nor undo them.

Caveats: the cache's hooks see head-major `[batch, n_kv_heads, pos, d_head]` keys after
the rotary embedding (`safelens.backends.hf._layer`); the bridge's `hook_k` sees
`[batch, pos, n_kv_heads, d_head]` before it. Hooks attached through `bridge_hooks`
(`run_with_hooks`) use TransformerLens' bookkeeping, so while attached they act on every
thread's passes through the bridge, as the bridge's own `run_with_hooks` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from ...core._errors import HookError
from ...core._thread_hooks import Hook, thread_hooks
from .._backend import Backend, FwdHooks, NamesFilter
from ..hf._cache import HFKeyValueCache
from ..hf._run import _pairs, split_names

__all__ = ["bridge_hooks", "select_cache_hooks", "thread_bridge_hooks"]


def _resolve(
    backend: Backend, names: NamesFilter, cache_only: bool = False
) -> tuple[list[str], list[str]]:
    """`(bridge_names, cache_names)` that `names` selects, or a `HookError` saying why not."""
    cache_names = backend.cache_hook_names()
    listed = [names] if isinstance(names, str) else names
    if not callable(listed) and all(isinstance(name, str) for name in listed):
        if set(listed) <= set(cache_names):  # no need for the bridge's (costly) hook_dict
            return [], list(listed)
    return split_names(
        names,
        list(backend.model.hook_dict),
        cache_names,
        "a hook point of the bridge",
        "capture it with bridge.run_with_cache(..., names_filter=...)",
        cache_only,
    )


def select_cache_hooks(backend: Backend, names: NamesFilter) -> list[str]:
    """The cache hook names `names` selects; a bridge hook name is a `HookError`."""
    return _resolve(backend, names, cache_only=True)[1]


@contextmanager
def bridge_hooks(
    backend: Backend,
    cache: HFKeyValueCache,
    fwd_hooks: FwdHooks,
    reset_hooks_end: bool = True,
    clear_contexts: bool = False,
) -> Iterator[Any]:
    """Attach `fwd_hooks` (bridge and cache names) for the block; yields the bridge.

    Cache hooks are attached through `cache.hooks` (inside `cache.guard()`), bridge
    hooks through `bridge.hooks(reset_hooks_end=, clear_contexts=)`.
    """
    if not isinstance(cache, HFKeyValueCache) or cache.naming != "bridge":
        raise HookError(
            "cache hooks on a TransformerBridge need an HFKeyValueCache(naming='bridge') "
            f"(hook names blocks.{{layer}}.kv_cache.…), got {cache!r}; make it with "
            "backend_of(bridge).empty_cache(batch) or prefill(bridge, tokens)"
        )
    resolved = [(_resolve(backend, names), fn) for names, fn in _pairs(fwd_hooks)]
    bridge_pairs = [(name, fn) for (names, _), fn in resolved for name in names]
    cache_pairs = [(names, fn) for (_, names), fn in resolved if names]
    bridge_block: AbstractContextManager[Any] = (
        backend.model.hooks(
            fwd_hooks=bridge_pairs, reset_hooks_end=reset_hooks_end, clear_contexts=clear_contexts
        )
        if bridge_pairs or clear_contexts
        else nullcontext()  # nothing for TransformerLens' bookkeeping to do
    )
    with cache.hooks(cache_pairs), bridge_block:
        try:
            yield backend.model
        finally:
            if clear_contexts:
                for point in cache.hook_points().values():
                    point.clear_context()


@contextmanager
def thread_bridge_hooks(
    backend: Backend, cache: HFKeyValueCache, fwd_hooks: FwdHooks
) -> Iterator[None]:
    """`bridge_hooks` for safelens' own passes: bridge hooks act on this thread's only.

    Each `fn(tensor, hook)` sees the hook point's tensor after its conversion (as
    `add_hook` shows it), and what it returns is converted back.
    """
    resolved = [(_resolve(backend, names), fn) for names, fn in _pairs(fwd_hooks)]
    cache_pairs = [(names, fn) for (_, names), fn in resolved if names]
    hook_dict = backend.model.hook_dict if any(names for (names, _), _ in resolved) else {}
    points = [
        (hook_dict[name], _converted(hook_dict[name], fn))
        for (names, _), fn in resolved
        for name in names
    ]
    with cache.hooks(cache_pairs), thread_hooks(points):
        yield


def _converted(point: Any, fn: Hook) -> Hook:
    """`fn` on `point`'s tensor as its conversion shows it, its result converted back."""
    conversion = point.hook_conversion
    if conversion is None:
        return fn

    def hook(tensor: Any, hook: Any) -> Any:
        result = fn(conversion.convert(tensor), hook)
        return None if result is None else conversion.revert(result)

    return hook
