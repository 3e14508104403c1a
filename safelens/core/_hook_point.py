"""A TransformerLens-style hook point that lives on a cache entry, not on a module.

`CacheHookPoint` follows the protocol of TransformerLens' `HookPoint`: hook functions
are called as `fn(tensor, hook=hook_point)` and may return a replacement tensor or
`None`; `add_hook(fn, dir=, is_permanent=, level=, prepend=)` and
`remove_hooks(dir=, including_permanent=, level=)` behave as there. It does not derive
from `torch.nn.Module`, so the same cache works under any model that calls
`entry.append`. Only forward hooks exist: a cache hook point sits on stored tensors,
which have no backward pass of their own.

A hook that returns a tensor of another shape, dtype or device is refused with a
[`HookError`][safelens.HookError] naming the hook, before anything is stored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ._errors import HookError

__all__ = ["CacheHookPoint", "HookFunction"]

HookFunction = Callable[..., "torch.Tensor | None"]


@dataclass(frozen=True)
class _Handle:
    fn: HookFunction
    is_permanent: bool
    level: int | None


def _check_direction(dir: str, allowed: tuple[str, ...]) -> None:
    if dir not in allowed:
        raise HookError(
            f"dir must be one of {allowed}, got {dir!r}; cache hook points have forward hooks only"
        )


class CacheHookPoint:
    """A named point where hook functions see (and may replace) a cached tensor.

    **Arguments:**

    - `name`: the full hook name, e.g. `"blocks.0.kv_cache.hook_k_new"`.
    - `layout`: the named shape of the tensors it sees, for error messages.

    ```python
    >>> CacheHookPoint("model.layers.3.kv_cache.hook_k_new", "[batch, n_kv_heads, pos, d_head]").layer()
    3

    ```
    """

    def __init__(self, name: str, layout: str = "[batch, pos, n_kv_heads, d_head]") -> None:
        self.name = name
        self.layout = layout
        self.fwd_hooks: list[_Handle] = []
        self.ctx: dict[Any, Any] = {}

    def __repr__(self) -> str:
        return f"CacheHookPoint(name={self.name!r}, {len(self.fwd_hooks)} fwd)"

    def layer(self) -> int:
        """The layer index: the number before `.kv_cache.` (`blocks.{layer}.kv_cache.…`)."""
        return int(self.name.split(".kv_cache.")[0].rsplit(".", 1)[-1])

    def add_hook(
        self,
        hook: HookFunction,
        dir: Literal["fwd"] = "fwd",
        is_permanent: bool = False,
        level: int | None = None,
        prepend: bool = False,
    ) -> None:
        """Attach `hook`, called as `hook(tensor, hook=self)` each time this point fires.

        **Arguments:**

        - `hook`: a function of `(tensor, hook)` returning a tensor or `None`.
        - `dir`: `"fwd"`, the only direction a cache hook point has.
        - `is_permanent`: survive `remove_hooks()` unless `including_permanent=True`.
        - `level`: the context level, for context managers that remove their own hooks.
        - `prepend`: run before the hooks already attached.
        """
        _check_direction(dir, ("fwd",))
        if not callable(hook):
            raise HookError(
                f"hook for {self.name!r} must be callable as fn(tensor, hook), got "
                f"{type(hook).__name__}"
            )
        handle = _Handle(hook, is_permanent, level)
        if prepend:
            self.fwd_hooks.insert(0, handle)
        else:
            self.fwd_hooks.append(handle)

    def add_perma_hook(self, hook: HookFunction, dir: Literal["fwd"] = "fwd") -> None:
        """Attach a permanent hook (see [`add_hook`][safelens.CacheHookPoint.add_hook])."""
        self.add_hook(hook, dir=dir, is_permanent=True)

    def has_hooks(
        self,
        dir: Literal["fwd", "bwd", "both"] = "both",
        including_permanent: bool = True,
        level: int | None = None,
    ) -> bool:
        """Whether any hook matching the arguments is attached."""
        _check_direction(dir, ("fwd", "bwd", "both"))
        if dir == "bwd":
            return False
        return any(
            (including_permanent or not h.is_permanent) and (level is None or h.level == level)
            for h in self.fwd_hooks
        )

    def remove_hooks(
        self,
        dir: Literal["fwd", "bwd", "both"] = "fwd",
        including_permanent: bool = False,
        level: int | None = None,
    ) -> None:
        """Detach temporary hooks (all hooks with `including_permanent=True`).

        With `level`, only temporary hooks added at that level are detached.
        """
        _check_direction(dir, ("fwd", "bwd", "both"))
        if including_permanent:
            self.fwd_hooks = []
            return
        self.fwd_hooks = [
            h for h in self.fwd_hooks if h.is_permanent or (level is not None and h.level != level)
        ]

    def clear_context(self) -> None:
        """Empty `ctx`, the scratch dict hook functions may use."""
        self.ctx = {}

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """Run the attached hooks in order on `tensor`; return the (maybe replaced) result."""
        for handle in self.fwd_hooks:
            result = handle.fn(tensor, hook=self)
            if result is None:
                continue
            if not isinstance(result, torch.Tensor):
                raise HookError(
                    f"hook {handle.fn!r} on {self.name!r} returned "
                    f"{type(result).__name__}; expected a tensor of shape "
                    f"{tuple(tensor.shape)} or None"
                )
            if (
                result.shape != tensor.shape
                or result.dtype != tensor.dtype
                or result.device != tensor.device
            ):
                raise HookError(
                    f"hook {handle.fn!r} on {self.name!r} returned shape "
                    f"{tuple(result.shape)}, {result.dtype} on {result.device}; expected "
                    f"shape {tuple(tensor.shape)} {self.layout}, "
                    f"{tensor.dtype} on {tensor.device}. A hook must return a tensor "
                    "like the one it was given, or None"
                )
            tensor = result
        return tensor
