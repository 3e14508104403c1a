"""Hooks that act only on the calling thread's forward passes: `thread_hooks`.

TransformerLens attaches hooks through each `HookPoint`'s own bookkeeping
(`model.hooks(...)`, `add_hook`), which every thread shares: a hook attached in one
thread fires in every other thread's forward passes through the model while it is
there, and leaving the block resets hooks by a `context_level` the threads share. The
passes safelens runs for itself (`prefill`'s residual capture, `ablate_write`'s edits,
the patching sweeps' patches and captures) attach their hooks with `thread_hooks`
instead: plain PyTorch forward hooks, each tagged with the thread that attached it and
acting only in that thread's passes, removed by their own handles when the block exits
(also on error). The user's hooks on the same points, and TransformerLens'
bookkeeping, stay as they were. `hooked_here` reads those tags: whether a point has a
hook that acts on the calling thread's passes.

Half-registered hooks: PyTorch registers a hook `with_kwargs=True` in two steps (the
hook, then its flag), so another thread's forward pass through the module in between
calls it the plain way, `hook(module, args)` (a forward hook: `hook(module, args,
output)`). Every such hook safelens attaches takes that call and does nothing: it is
never its own thread's pass, which starts only after the registration.

Caveat: a hook acts in the thread that attached it, not in the work that thread
starts: a forward pass handed to another thread (a worker pool, `DataParallel`
replicas) runs without it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["LIBRARIES", "Hook", "hooked_anywhere", "hooked_here", "suspended", "thread_hooks"]

# `fn(tensor, hook)`, TransformerLens' hook protocol: returns the new tensor, or `None`.
Hook = Callable[[torch.Tensor, Any], Any]


@contextmanager
def thread_hooks(points: Sequence[tuple[torch.nn.Module, Hook]]) -> Iterator[None]:
    """Within the block, `fn(tensor, hook)` runs at each point, in this thread's passes only.

    The hooks are registered with PyTorch directly and removed by their own handles,
    even on error: the user's hooks on the same points (and TransformerLens' hook
    bookkeeping) stay as they were, and other threads' forward passes never see them.
    """
    thread = threading.get_ident()
    handles = []
    try:
        for point, fn in points:
            handles.append(point.register_forward_hook(_ThreadHook(thread, point, fn)))
        yield
    finally:
        for handle in handles:
            handle.remove()


# Per thread: whether its own hooks are suspended (`suspended`).
_SUSPENDED = threading.local()


@contextmanager
def suspended() -> Iterator[None]:
    """Within the block, the hooks this thread attached with `thread_hooks` do not act.

    For a pass that computes a piece of the work on fewer rows and hands the hook
    points the full rows afterwards (`shared_prefix_attention`'s shared inputs): the
    hooks see each tensor once, at its full shape.
    """
    before = getattr(_SUSPENDED, "on", False)
    _SUSPENDED.on = True
    try:
        yield
    finally:
        _SUSPENDED.on = before


class _ThreadHook:
    """A forward hook that applies `fn` to its point's output in one thread's passes."""

    def __init__(self, thread: int, point: torch.nn.Module, fn: Hook) -> None:
        self.thread = thread  # read by `hooked_here`
        self.point = point
        self.fn = fn

    def __call__(self, module: Any, inputs: Any, output: torch.Tensor) -> Any:
        if threading.get_ident() != self.thread or getattr(_SUSPENDED, "on", False):
            return None
        return self.fn(output, self.point)


def hooked_here(point: torch.nn.Module) -> bool:
    """Whether `point` has a forward hook that acts on the calling thread's passes.

    A hook with a `thread` attribute (a thread id, as `thread_hooks` tags its hooks)
    acts only on that thread's passes; any other hook acts on every thread's.
    """
    me = threading.get_ident()
    hooks = tuple(point._forward_hooks.values())  # one step: other threads may add hooks
    return any(getattr(hook, "thread", me) == me for hook in hooks)


def hooked_anywhere(model: torch.nn.Module) -> bool:
    """Whether a hook of the user's is attached anywhere in `model`.

    Read once, before a sweep attaches its own. A TransformerLens hook point counts with
    any hook in its own list (`add_hook`, `hooks()`); so does a forward hook or pre-hook
    on any other module, or a global one, unless it is the libraries' own bookkeeping
    (its code in torch, transformers, TransformerLens, accelerate or safelens: the
    capture hooks transformers and TransformerBridge install on their first pass,
    `add_hook`'s wrappers, safelens' thread hooks).
    """
    module_hooks = torch.nn.modules.module
    hooks = [*module_hooks._global_forward_hooks.values()]
    hooks += module_hooks._global_forward_pre_hooks.values()
    for module in model.modules():
        if getattr(module, "fwd_hooks", None):  # a TransformerLens hook point's own list
            return True
        hooks += (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
    return not all(_libraries(hook) for hook in hooks)


# The packages whose code is the libraries' own, not the user's.
LIBRARIES = frozenset({"torch", "transformers", "transformer_lens", "accelerate", "safelens"})


def _libraries(hook: Any) -> bool:
    """Whether `hook`'s code belongs to one of `LIBRARIES` (a partial: its function's)."""
    function = getattr(hook, "func", hook)
    module = getattr(function, "__module__", None) or type(function).__module__
    return str(module).partition(".")[0] in LIBRARIES
