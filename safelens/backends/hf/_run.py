"""One `fwd_hooks` list for a HuggingFace model's modules and its cache; `run_with_hooks`' pass.

TransformerLens users write `run_with_hooks(tokens, fwd_hooks=[(name, fn), ...])` with
`fn(tensor, hook)`. On a HuggingFace model the same list may name:

- the cache's hook points, `model.layers.{l}.kv_cache.{hook_k_new, hook_v_new,
  hook_k_full, hook_v_full}` (what each sees: `safelens.backends.hf._layer`), and
- the model's own modules, by their `named_modules()` names: `model.layers.0.mlp`,
  `model.layers.0.self_attn`, `lm_head` (GPT-2: `transformer.h.0.mlp`, …). The hook
  gets the module's output, or the first element when the module returns a tuple
  (attention returns `(output, weights)`), and `hook.name` is the module name; a tensor
  it returns replaces that output (or that first element), `None` leaves it.

A name filter is a name, a list of names, or a predicate over every cache hook name and
module name. Every name is checked before any hook is attached; the hooks are removed on
exit, also on error, and a pass that fails inside leaves the cache as it was.

Caveat: module hooks act on the calling thread's passes only (`thread_hooks`) and exist
only for the block: `reset_hooks_end=False` (keeping hooks after the pass) is refused;
attach lasting hooks with `module.register_forward_hook` or `cache.hooks(...)`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch

from ...core._errors import CacheShapeError, HookError, TokenError
from ...core._thread_hooks import thread_hooks
from ...core._tokens import check_tokens
from .._backend import Backend, FwdHooks, NamesFilter
from ._cache import HFKeyValueCache

__all__ = [
    "ModuleHookPoint",
    "attach_hooks",
    "module_hooks",
    "run",
    "select_cache_hooks",
    "split_names",
]

_CACHE_NAME = re.compile(r"model\.layers\.(\d+)\.kv_cache\.hook_[kv]_(?:new|full)")
# `run_with_hooks` arguments a HuggingFace forward has no counterpart for, with their defaults.
_UNSUPPORTED = {
    "loss_per_token": False,
    "prepend_bos": None,
    "padding_side": None,
    "start_at_layer": None,
    "stop_at_layer": None,
    "tokens": None,
    "shortformer_pos_embed": None,
}


class ModuleHookPoint:
    """What a module hook gets as `hook`: the module's name and the module.

    ```python
    >>> ModuleHookPoint("model.layers.3.mlp", torch.nn.Identity()).layer()
    3

    ```
    """

    def __init__(self, name: str, module: torch.nn.Module) -> None:
        self.name = name
        self.module = module

    def layer(self) -> int:
        """The layer index in the name (`model.layers.3.mlp` → 3)."""
        found = re.search(r"\.(\d+)(?:\.|$)", self.name)
        if found is None:
            raise ValueError(f"{self.name!r} names no layer")
        return int(found[1])

    def __repr__(self) -> str:
        return f"ModuleHookPoint(name={self.name!r})"


class _ModuleHook:
    """A torch forward hook calling `fn(tensor, hook)` on a module's (first) output."""

    def __init__(self, point: ModuleHookPoint, fn: Callable[[torch.Tensor, Any], Any]) -> None:
        self.point = point
        self.fn = fn

    def __call__(self, output: Any, module: Any) -> Any:
        name = self.point.name
        if isinstance(output, torch.Tensor):
            tensor = output
        elif isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            tensor = output[0]
        else:
            raise HookError(
                f"module {name!r} returns {type(output).__name__}, not a tensor or a tuple "
                "starting with one; hook one of its submodules instead"
            )
        result = self.fn(tensor, self.point)
        if result is None:
            return None
        if not isinstance(result, torch.Tensor) or result.shape != tensor.shape:
            got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result)
            raise HookError(
                f"the hook on {name!r} returned {got}; expected a tensor of shape "
                f"{tuple(tensor.shape)} like the one it was given, or None"
            )
        return result if output is tensor else (result, *output[1:])


def _pairs(fwd_hooks: Any) -> list[tuple[NamesFilter, Any]]:
    if isinstance(fwd_hooks, tuple) and len(fwd_hooks) == 2 and callable(fwd_hooks[1]):
        raise HookError(
            f"fwd_hooks must be a list of (names, fn) pairs, got one pair {fwd_hooks!r}; wrap "
            "it in a list: [(names, fn)]"
        )
    pairs = list(fwd_hooks)
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise HookError(f"fwd_hooks[{i}] must be a (names, fn) pair, got {pair!r}")
        if not callable(pair[1]):
            raise HookError(
                f"the hook for {pair[0]!r} must be callable as fn(tensor, hook), got "
                f"{type(pair[1]).__name__}; nothing was attached"
            )
    return [(names, fn) for names, fn in pairs]


def split_names(
    names: NamesFilter,
    model_names: list[str],
    cache_names: list[str],
    model_points: str,
    cache_only_hint: str,
    cache_only: bool = False,
) -> tuple[list[str], list[str]]:
    """`(model_names, cache_names)` that the filter `names` selects.

    `model_points` names what the model's names are (in errors); `cache_only_hint` says
    how to capture a model name when only cache names are allowed (`cache_only`).

    **Raises:** [`HookError`][safelens.HookError] for a filter that is neither a name, a
    list of names nor a predicate; for an unknown name (with the closest known ones); for
    a model name when `cache_only`.
    """
    if callable(names):
        chosen = [] if cache_only else [n for n in model_names if names(n)]
        return chosen, [n for n in cache_names if names(n)]
    listed = [names] if isinstance(names, str) else names
    if not isinstance(listed, Seq) or not all(isinstance(n, str) for n in listed):
        raise HookError(
            "a hook name filter must be a name, a list of names or a function "
            f"fn(name) -> bool, got {names!r}"
        )
    known_cache, known_model = set(cache_names), set(model_names)
    chosen_model, chosen_cache = [], []
    for name in listed:
        if name in known_cache:
            chosen_cache.append(name)
        elif name in known_model and cache_only:
            raise HookError(
                f"{name!r} is {model_points}, not a cache hook point; {cache_only_hint}"
            )
        elif name in known_model:
            chosen_model.append(name)
        else:
            close = difflib.get_close_matches(name, cache_names + model_names, n=5, cutoff=0.6)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            prefix = cache_names[0].split(".kv_cache.")[0].rsplit(".", 1)[0] if cache_names else ""
            raise HookError(
                f"unknown hook name {name!r}: neither {model_points} nor a cache hook point "
                f"{prefix}.{{0..{len(cache_names) // 4 - 1}}}.kv_cache.{{hook_k_new, "
                f"hook_v_new, hook_k_full, hook_v_full}}{hint}"
            )
    return chosen_model, chosen_cache


def _resolve(
    backend: Backend,
    names: NamesFilter,
    cache_only: bool = False,
    modules: dict[str, torch.nn.Module] | None = None,
) -> tuple[list[str], list[str]]:
    """`(module_names, cache_names)` that `names` selects, or a `HookError` saying why not.

    `modules`: the model's `named_modules()`, when the caller has them.
    """
    if modules is None:
        modules = dict(backend.model.named_modules())
    listed = [names] if isinstance(names, str) else names if isinstance(names, Seq) else []
    for name in listed:  # a filter of another type is refused by `split_names`
        if isinstance(name, str):
            _check_not_shared(backend.model, name, modules)
    return split_names(
        names,
        [name for name in modules if name],
        backend.cache_hook_names(),
        "a module of the model",
        "capture it with run_with_hooks and a hook that keeps what it sees",
        cache_only,
    )


def _check_not_shared(
    model: torch.nn.Module, name: str, modules: dict[str, torch.nn.Module]
) -> None:
    """A `HookError` if `name` is a second name of a module the model uses in several places.

    `named_modules()` lists a module object once, under its first name; a forward hook
    on it would fire wherever the model calls it, so one place cannot be hooked alone.
    """
    if name in modules:
        return
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return  # not a module at all: `split_names` says so
    first = next((known for known, each in modules.items() if each is module), None)
    if first is None or first == name:
        return
    raise HookError(
        f"{name!r} is the same module object as {first!r}: the model calls one module in "
        "several places (its layers share it), and a hook on it would fire at each of "
        "them, so safelens cannot hook one of them alone; give each place its own module "
        f"(e.g. model.get_submodule({name.rsplit('.', 1)[0]!r}).{name.rsplit('.', 1)[-1]} = "
        f"copy.deepcopy(model.get_submodule({first!r}))) to hook or patch them apart"
    )


def select_cache_hooks(backend: Backend, names: NamesFilter) -> list[str]:
    """The cache hook names `names` selects; a module name is a `HookError`."""
    return _resolve(backend, names, cache_only=True)[1]


@contextmanager
def attach_hooks(backend: Backend, cache: HFKeyValueCache, fwd_hooks: FwdHooks) -> Iterator[None]:
    """Attach `fwd_hooks` (module and cache names) for the block, inside `cache.guard()`."""
    # Listing the model's modules costs as much as a small pass's arithmetic: only for hooks.
    pairs = _pairs(fwd_hooks)
    modules = dict(backend.model.named_modules()) if pairs else {}
    resolved = [(_resolve(backend, names, modules=modules), fn) for names, fn in pairs]
    module_points = [
        (modules[name], _ModuleHook(ModuleHookPoint(name, modules[name]), fn))
        for (module_names, _), fn in resolved
        for name in module_names
    ]
    cache_hooks = [(cache_names, fn) for (_, cache_names), fn in resolved if cache_names]
    with cache.hooks(cache_hooks), thread_hooks(module_points):
        yield


@contextmanager
def module_hooks(
    backend: Backend,
    cache: HFKeyValueCache,
    fwd_hooks: FwdHooks,
    reset_hooks_end: bool,
    clear_contexts: bool,
) -> Iterator[Any]:
    """`run_with_hooks`' hooks on a HuggingFace model; yields the model (see the module notes)."""
    if reset_hooks_end is not True:
        raise ValueError(
            "reset_hooks_end=False would keep hooks on a HuggingFace model after the pass; "
            "they exist only for the pass here. Attach lasting hooks with "
            "module.register_forward_hook or cache.hooks(...)"
        )
    try:
        with attach_hooks(backend, cache, fwd_hooks):
            yield backend.model
    finally:
        if clear_contexts:
            for point in cache.hook_points().values():
                point.clear_context()


def _checked_input(backend: Backend, cache: HFKeyValueCache, input: Any) -> torch.Tensor:
    if isinstance(input, str) or (
        isinstance(input, list) and bool(input) and all(isinstance(i, str) for i in input)
    ):
        if backend.tokenizer is None:
            raise TokenError(
                "input is text but the model has no tokenizer; pass token ids [batch, pos] "
                "(a tensor of ints) instead"
            )
        input = backend.to_tokens(input)
    past = backend.caches.length(cache)
    limits = SimpleNamespace(d_vocab=backend.d_vocab, n_ctx=backend.n_ctx)
    tokens = check_tokens(input, limits, "input", past=past, rank=None)
    if tokens.dim() == 1:
        tokens = tokens[None]
    if tokens.dim() != 2:
        raise CacheShapeError(
            f"input must be token ids [batch, pos] (or [pos]), got shape {tuple(tokens.shape)}"
        )
    batch = backend.caches.batch_size(cache)
    if batch and tokens.shape[0] != batch:
        raise CacheShapeError(
            f"input has batch {tokens.shape[0]} but the cache holds batch {batch}; use "
            "cache.expand(n) (from a batch-1 cache) or cache.select(rows) to match"
        )
    return tokens.to(backend.device)


def _checked_mask(mask: Any, tokens: torch.Tensor, past: int) -> torch.Tensor:
    expected = (tokens.shape[0], past + tokens.shape[1])
    if mask is None:
        return torch.ones(expected, dtype=torch.long, device=tokens.device)
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != expected:
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise CacheShapeError(
            f"attention_mask must be [batch, pos_so_far + new_tokens] = {expected} on a "
            f"HuggingFace model (the cache keeps no mask: pass the cached positions' mask "
            f"followed by the new tokens'), got {got}"
        )
    return mask.to(tokens.device)


def run(
    backend: Backend,
    input: Any,
    cache: Any,
    fwd_hooks: FwdHooks,
    forward_args: dict[str, Any],
    reset_hooks_end: bool,
    clear_contexts: bool,
) -> Any:
    """`run_with_hooks`' pass on a HuggingFace model: logits (or `None`), checked first."""
    if not isinstance(cache, HFKeyValueCache):
        raise HookError(
            f"cache must be a safelens HFKeyValueCache on a HuggingFace model, got "
            f"{type(cache).__name__}"
        )
    for name, default in _UNSUPPORTED.items():
        if forward_args.get(name, default) != default:
            raise ValueError(
                f"{name}={forward_args[name]!r} has no counterpart on a HuggingFace model; "
                f"leave it at {default!r}"
            )
    return_type = forward_args.get("return_type", "logits")
    if return_type not in ("logits", None):
        raise ValueError(
            f"return_type must be 'logits' or None on a HuggingFace model, got {return_type!r}"
        )
    tokens = _checked_input(backend, cache, input)
    mask = _checked_mask(forward_args.get("attention_mask"), tokens, backend.caches.length(cache))
    with backend.hooks(cache, fwd_hooks, reset_hooks_end, clear_contexts):
        logits = backend.forward(tokens, mask, cache)
    return logits if return_type == "logits" else None
