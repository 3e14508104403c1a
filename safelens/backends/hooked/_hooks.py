"""One `fwd_hooks` list for the model's hook points and the cache's.

TransformerLens users write `model.run_with_hooks(tokens, fwd_hooks=[(name, fn), ...])`.
Here the same list may also name the cache's hook points,
`blocks.{layer}.kv_cache.hook_k_new` / `hook_v_new` / `hook_k_full` / `hook_v_full`:
[`hooks`][safelens.hooks] splits it, sending model names to the model's hook points and
cache names to the cache entries' [`CacheHookPoint`][safelens.CacheHookPoint]s, and
removes the temporary ones on exit, also on error.
`hooks` also puts the cache back as it was when a forward pass inside the block fails
(see `safelens.core._rollback`). [`run_with_hooks`][safelens.run_with_hooks] runs one
forward pass that way (`safelens.experiments._run`), and `safelens.experiments._capture` collects what the cache
hook points saw.

Caveats:

- Keys are cached *before* rotary embeddings (TransformerLens rotates the full keys on
  every pass), so cache hooks see the same keys as `blocks.{l}.attn.hook_k`, not
  `hook_rot_k`. With grouped-query attention the heads axis has `n_key_value_heads`
  entries.
- Hooks live on the cache's entries: `cache.fork()` and friends return caches whose
  hook points start empty.
- A lazy cache (`KeyValueCache()`) gets an empty entry for each layer named, as
  `cache[layer]` would make it.
- `hook_k_full`/`hook_v_full` hooks get a copy of the joined tensors: editing it in
  place changes this pass only, never what is stored.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from typing import Any, Literal

from transformer_lens import HookedTransformer

from ...core._cache import KeyValueCache
from ...core._cache_entry import hook_name
from ...core._errors import HookError
from ...core._hook_point import CacheHookPoint, HookFunction
from ...core._rollback import PassGuard

__all__ = [
    "NamesFilter",
    "add_hook",
    "cache_hook_names",
    "hooks",
    "reset_hooks",
]

NamesFilter = str | Seq[str] | Callable[[str], bool]
FwdHooks = Seq[tuple[NamesFilter, HookFunction]]

_POINTS = ("hook_k_new", "hook_v_new", "hook_k_full", "hook_v_full")


def cache_hook_names(n_layers: int) -> list[str]:
    """Every cache hook name of a model with `n_layers` layers, in layer order.

    ```python
    >>> cache_hook_names(2)[:2]
    ['blocks.0.kv_cache.hook_k_new', 'blocks.0.kv_cache.hook_v_new']

    ```
    """
    return [hook_name(layer, point) for layer in range(n_layers) for point in _POINTS]


def _unknown(name: str, model: HookedTransformer) -> HookError:
    known = list(model.hook_dict) + cache_hook_names(model.cfg.n_layers)
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    return HookError(
        f"unknown hook name {name!r}: neither a hook point of the model nor a cache hook "
        f"point blocks.{{0..{model.cfg.n_layers - 1}}}.kv_cache.{{{', '.join(_POINTS)}}}"
        f"{hint}"
    )


def _resolve(
    model: HookedTransformer, names: NamesFilter, cache_only: bool = False
) -> tuple[list[str], list[str]]:
    """`(model_names, cache_names)` that `names` selects, or a `HookError` saying why not."""
    cache_names = cache_hook_names(model.cfg.n_layers)
    if callable(names):
        chosen = [] if cache_only else [n for n in model.hook_dict if names(n)]
        return chosen, [n for n in cache_names if names(n)]
    listed = [names] if isinstance(names, str) else names
    if not isinstance(listed, Seq) or not all(isinstance(n, str) for n in listed):
        raise HookError(
            "a hook name filter must be a name, a list of names or a function "
            f"fn(name) -> bool, got {names!r}"
        )
    model_names, chosen_cache = [], []
    known_cache = set(cache_names)
    for name in listed:
        if name in known_cache:
            chosen_cache.append(name)
        elif name in model.hook_dict and cache_only:
            raise HookError(
                f"{name!r} is a hook point of the model, not of the cache; capture it with "
                "model.run_with_cache(..., names_filter=...)"
            )
        elif name in model.hook_dict:
            model_names.append(name)
        else:
            raise _unknown(name, model)
    return model_names, chosen_cache


def _check_hook(hook: Any, names: Any) -> None:
    if not callable(hook):
        raise HookError(
            f"the hook for {names!r} must be callable as fn(tensor, hook), got "
            f"{type(hook).__name__}; nothing was attached"
        )


def _pairs(fwd_hooks: Any) -> list[tuple[NamesFilter, HookFunction]]:
    """`fwd_hooks` as a list of `(names, fn)` pairs, or a `HookError` saying why not."""
    if isinstance(fwd_hooks, str | tuple) and len(fwd_hooks) == 2 and callable(fwd_hooks[1]):
        raise HookError(
            f"fwd_hooks must be a list of (names, fn) pairs, got one pair {fwd_hooks!r}; wrap "
            "it in a list: [(names, fn)]"
        )
    try:
        pairs = [tuple(pair) for pair in fwd_hooks]
    except TypeError:
        raise HookError(
            f"fwd_hooks must be a list of (names, fn) pairs, got {type(fwd_hooks).__name__}"
        ) from None
    for i, pair in enumerate(pairs):
        if len(pair) != 2:
            raise HookError(f"fwd_hooks[{i}] must be a (names, fn) pair, got {pair!r}")
        _check_hook(pair[1], pair[0])
    return pairs  # type: ignore[return-value]


def _cache_point(cache: KeyValueCache, name: str) -> CacheHookPoint:
    """The hook point `name` (`blocks.{l}.kv_cache.{point}`); a lazy cache makes layer l."""
    layer, point = int(name.split(".")[1]), name.rsplit(".", 1)[1]
    try:
        entry = cache[layer]
    except IndexError:
        raise HookError(
            f"hook {name!r} names layer {layer}, but the cache holds {len(cache)} layers; "
            "build it with KeyValueCache.init_cache(model.cfg) or KeyValueCache()"
        ) from None
    hook_point: CacheHookPoint = getattr(entry, point)
    return hook_point


def add_hook(
    model: HookedTransformer,
    cache: KeyValueCache,
    name: NamesFilter,
    hook: HookFunction,
    dir: Literal["fwd"] = "fwd",
    is_permanent: bool = False,
    level: int | None = None,
    prepend: bool = False,
) -> None:
    """Attach `hook` to every model or cache hook point that `name` selects.

    As TransformerLens' `model.add_hook`, over the model's hook names and the cache's.
    The hook stays until removed ([`reset_hooks`][safelens.reset_hooks]); permanent
    hooks survive `reset_hooks` unless `including_permanent=True`.

    **Arguments:**

    - `model`: the `HookedTransformer`.
    - `cache`: the [`KeyValueCache`][safelens.KeyValueCache] whose hook points to use.
    - `name`: a hook name, a list of names, or a predicate `fn(name) -> bool`.
    - `hook`: `fn(tensor, hook) -> tensor | None`.
    - `dir`: `"fwd"` (cache hook points have no backward hooks).
    - `is_permanent`, `level`, `prepend`: as in TransformerLens' `HookPoint.add_hook`;
      `prepend=True` runs `hook` before those already attached.

    **Raises:** [`HookError`][safelens.HookError] for an unknown name (listing near
    matches) or a layer the cache lacks; nothing is attached then.

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> model = HookedTransformer(HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=32, d_head=8, d_vocab=20, act_fn="gelu"))
    >>> cache = KeyValueCache.init_cache(model.cfg, "cpu")
    >>> add_hook(model, cache, lambda name: name.endswith("hook_k_full"), lambda k, hook: k * 0)
    >>> [name for name, point in cache.hook_points().items() if point.fwd_hooks]
    ['blocks.0.kv_cache.hook_k_full', 'blocks.1.kv_cache.hook_k_full']
    >>> reset_hooks(model, cache)
    >>> any(point.fwd_hooks for point in cache.hook_points().values())
    False

    ```
    """
    model_names, cache_names = _resolve(model, name)
    _check_hook(hook, name)
    if dir not in ("fwd", "bwd") or (cache_names and dir != "fwd"):
        allowed = ("fwd",) if cache_names else ("fwd", "bwd")
        raise HookError(
            f"dir must be one of {allowed} for {name!r}, got {dir!r}; cache hook points have "
            "forward hooks only"
        )
    points = [_cache_point(cache, n) for n in cache_names]
    for model_name in model_names:
        model.add_hook(
            model_name, hook, dir=dir, is_permanent=is_permanent, level=level, prepend=prepend
        )
    for point in points:
        point.add_hook(hook, dir=dir, is_permanent=is_permanent, level=level, prepend=prepend)


def reset_hooks(
    model: HookedTransformer,
    cache: KeyValueCache,
    clear_contexts: bool = True,
    including_permanent: bool = False,
    level: int | None = None,
) -> None:
    """Remove temporary hooks from the model and the cache (all, with `including_permanent`).

    With `level`, only temporary hooks added at that context level are removed. See
    [`add_hook`][safelens.add_hook] for an example.
    """
    model.reset_hooks(clear_contexts, "both", including_permanent, level)
    for point in cache.hook_points().values():
        point.remove_hooks("fwd", including_permanent=including_permanent, level=level)
        if clear_contexts:
            point.clear_context()


@contextmanager
def hooks(
    model: HookedTransformer,
    cache: KeyValueCache,
    fwd_hooks: FwdHooks = (),
    reset_hooks_end: bool = True,
    clear_contexts: bool = False,
) -> Iterator[HookedTransformer]:
    """Attach `fwd_hooks` (model and cache names mixed) for the block; yields the model.

    As TransformerLens' `model.hooks()`: every name is checked before any hook is
    attached, and on exit the hooks this block attached are removed, also when the
    block raises. Hooks attached before (and permanent ones) stay.

    **Arguments:**

    - `model`, `cache`: the model and the cache that will be passed as `past_kv_cache=`.
    - `fwd_hooks`: `[(names, fn), ...]`; `names` as in [`add_hook`][safelens.add_hook].
    - `reset_hooks_end`: remove this block's hooks on exit.
    - `clear_contexts`: also empty every hook point's `ctx` on exit.

    **Raises:** [`HookError`][safelens.HookError] for an unknown name; nothing is
    attached then.

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> model = HookedTransformer(HookedTransformerConfig(n_layers=1, d_model=16, n_ctx=8,
    ...     d_head=4, n_heads=4, d_vocab=10, act_fn="relu"))
    >>> cache = KeyValueCache.init_cache(model.cfg)
    >>> seen = []
    >>> save = lambda tensor, hook: seen.append((hook.name, tuple(tensor.shape)))
    >>> names = ["blocks.0.attn.hook_k", "blocks.0.kv_cache.hook_k_full"]
    >>> with hooks(model, cache, [(names, save)]):
    ...     _ = model(torch.tensor([[1, 2, 3]]), past_kv_cache=cache,
    ...               attention_mask=torch.ones(1, 3))
    >>> seen
    [('blocks.0.attn.hook_k', (1, 3, 4, 4)), ('blocks.0.kv_cache.hook_k_full', (1, 3, 4, 4))]

    ```
    """
    if not isinstance(cache, KeyValueCache):
        raise HookError(f"cache must be a safelens KeyValueCache, got {type(cache).__name__}")
    resolved = [(_resolve(model, names), fn) for names, fn in _pairs(fwd_hooks)]
    attach = [
        (model_names, [_cache_point(cache, n) for n in cache_names], fn)
        for (model_names, cache_names), fn in resolved
    ]
    model.context_level += 1
    level = model.context_level
    touched: list[Any] = []
    try:
        for model_names, points, fn in attach:
            for model_name in model_names:
                touched.append(model.hook_dict[model_name])
                touched[-1].add_hook(fn, dir="fwd", level=level)
            for point in points:
                touched.append(point)
                point.add_hook(fn, level=level)
        with PassGuard(model, cache):
            yield model
    finally:
        if reset_hooks_end and clear_contexts:
            reset_hooks(model, cache, clear_contexts, including_permanent=False, level=level)
        elif reset_hooks_end:
            # Only this block attached hooks at `level`, and only to `touched`: removing
            # them there spares a sweep of every hook point of the model on each pass.
            for point in touched:
                point.remove_hooks(level=level)
        model.context_level -= 1
