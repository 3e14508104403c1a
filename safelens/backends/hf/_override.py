"""Replace modules' `forward` on the calling thread only: `overriding`.

Within `with overriding({module: replacement, ...}):`, a call of `module` on the calling
thread runs `replacement(own, *args, **kwargs)`, where `own` is the module's own
`forward`; on every other thread the module runs `own(*args, **kwargs)`, unchanged.
PyTorch runs the module's hooks around either, as usual.

How: while any thread overrides a module, its `forward` is an instance attribute that
looks up the calling thread's replacement. The attribute is put back (or removed) when
the last block overriding that module exits, also on error. One thread overrides a
module once at a time (a `RuntimeError` otherwise); blocks for other modules nest.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["Replacement", "overriding"]

# `replacement(own, *args, **kwargs)`: what the module returns on the overriding thread.
Replacement = Callable[..., Any]

_LOCK = threading.Lock()
# id(module) -> (threads overriding it, the instance `forward` it had before, if any)
_INSTALLED: dict[int, tuple[int, Any]] = {}
_MISSING = object()


class _Replacements(threading.local):
    """The calling thread's replacements, by `id(module)`."""

    def __init__(self) -> None:
        self.by_module: dict[int, Replacement] = {}


_REPLACEMENTS = _Replacements()


def _dispatching(key: int, own: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        replacement = _REPLACEMENTS.by_module.get(key)
        if replacement is None:  # not overridden on this thread
            return own(*args, **kwargs)
        return replacement(own, *args, **kwargs)

    return forward


@contextmanager
def overriding(replacements: Mapping[torch.nn.Module, Replacement]) -> Iterator[None]:
    """Within the block, on this thread, each module runs its replacement (module notes)."""
    mine = _REPLACEMENTS.by_module
    keys = [id(module) for module in replacements]
    if any(key in mine for key in keys):
        raise RuntimeError("a module is overridden once at a time on one thread")
    with _LOCK:
        for module in replacements:
            count, before = _INSTALLED.get(id(module), (0, _MISSING))
            if count == 0:
                before = module.__dict__.get("forward", _MISSING)
                own = module.forward
                object.__setattr__(module, "forward", _dispatching(id(module), own))
            _INSTALLED[id(module)] = (count + 1, before)
    try:
        mine.update({id(module): replacement for module, replacement in replacements.items()})
        yield
    finally:
        for key in keys:
            mine.pop(key, None)
        with _LOCK:
            for module in replacements:
                count, before = _INSTALLED.pop(id(module))
                if count > 1:
                    _INSTALLED[id(module)] = (count - 1, before)
                elif before is _MISSING:
                    del module.__dict__["forward"]
                else:
                    object.__setattr__(module, "forward", before)
