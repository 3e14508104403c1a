"""The `frozen` flag of caches and entries: a bool that is also a context manager.

`cache.frozen` reads as a bool (TransformerLens code tests it and sets it), and
`with cache.frozen(): ...` freezes for a block and restores the previous state on exit,
also when the block raises.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

__all__ = ["FrozenFlag", "Freezable"]


class Freezable(Protocol):
    def freeze(self) -> None: ...
    def unfreeze(self) -> None: ...


class FrozenFlag:
    """Whether its owner is frozen; call it for a context manager that freezes it."""

    __slots__ = ("_owner", "_value")

    def __init__(self, owner: Freezable, value: bool) -> None:
        self._owner = owner
        self._value = value

    def __bool__(self) -> bool:
        return self._value

    def __eq__(self, other: object) -> bool:
        return bool(self) == other

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return repr(self._value)

    @contextmanager
    def __call__(self) -> Iterator[None]:
        owner = self._owner
        was_frozen = self._value
        owner.freeze()
        try:
            yield
        finally:
            if not was_frozen:
                owner.unfreeze()
