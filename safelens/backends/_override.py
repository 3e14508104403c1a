"""Replace modules' `forward` (or another function they call) on the calling thread only.

Within `with overriding({module: replacement, ...}):`, a call of `module` on the calling
thread runs `replacement(own, *args, **kwargs)`, where `own` is the module's own
`forward`; on every other thread the module runs `own(*args, **kwargs)`, unchanged.
PyTorch runs the module's hooks around either, as usual. With `attribute="act_fn"`, the
function the module holds under that name is replaced instead (a TransformerLens MLP's
activation).

How: while any thread overrides a module's attribute, the attribute is an instance
attribute that looks up the calling thread's replacement. It is put back (or removed)
when the last block overriding it exits, also on error. One thread overrides a module's
attribute once at a time (a `RuntimeError` otherwise); blocks for others nest. Any
family's passes use it (`safelens.patching`'s lean passes on HuggingFace models, the
`HookedTransformer` sweeps' activation).
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
# (id(module), attribute) -> (threads overriding it, the instance attribute it had before)
_INSTALLED: dict[tuple[int, str], tuple[int, Any]] = {}
_MISSING = object()


class _Replacements(threading.local):
    """The calling thread's replacements, by `(id(module), attribute)`."""

    def __init__(self) -> None:
        self.by_module: dict[tuple[int, str], Replacement] = {}


_REPLACEMENTS = _Replacements()


def _dispatching(key: tuple[int, str], own: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        replacement = _REPLACEMENTS.by_module.get(key)
        if replacement is None:  # not overridden on this thread
            return own(*args, **kwargs)
        return replacement(own, *args, **kwargs)

    return forward


@contextmanager
def overriding(
    replacements: Mapping[torch.nn.Module, Replacement], attribute: str = "forward"
) -> Iterator[None]:
    """Within the block, on this thread, each module runs its replacement (module notes).

    `attribute`: the function of each module that is replaced, its `forward` by default.
    """
    mine = _REPLACEMENTS.by_module
    keys = [(id(module), attribute) for module in replacements]
    if any(key in mine for key in keys):
        raise RuntimeError("a module is overridden once at a time on one thread")
    with _LOCK:
        for module, key in zip(replacements, keys, strict=True):
            count, before = _INSTALLED.get(key, (0, _MISSING))
            if count == 0:
                before = module.__dict__.get(attribute, _MISSING)
                own = getattr(module, attribute)
                object.__setattr__(module, attribute, _dispatching(key, own))
            _INSTALLED[key] = (count + 1, before)
    try:
        mine.update(dict(zip(keys, replacements.values(), strict=True)))
        yield
    finally:
        for key in keys:
            mine.pop(key, None)
        with _LOCK:
            for module, key in zip(replacements, keys, strict=True):
                count, before = _INSTALLED.pop(key)
                if count > 1:
                    _INSTALLED[key] = (count - 1, before)
                elif before is _MISSING:
                    del module.__dict__[attribute]
                else:
                    object.__setattr__(module, attribute, before)
