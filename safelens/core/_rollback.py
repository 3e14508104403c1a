"""Putting a cache back as it was when a forward pass through it fails.

A forward pass appends to the cache layer by layer, so a pass that fails part way (a
hook raises, a hook returns a tensor that does not fit, an interrupt) would leave the
first layers and the attention mask one pass ahead of the rest, and the next pass would
fail deep inside the model or, worse, read misaligned positions. [`snapshot`][] records
what a later `restore` needs (which entries exist, each stored tensor's filled length,
the mask) in O(layers), without copying any tensor; [`PassGuard`][] takes one snapshot
per forward pass of a model and restores it when that pass raises.

Caveat: only safelens' own storage is put back. A hook that edited a tensor it was
handed in place edited its own copy (read-time hook points hand out copies) or the
model's activation, never the cache.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ._cache import KeyValueCache
from ._storage import Sequence

__all__ = ["PassGuard", "snapshot"]


def snapshot(cache: KeyValueCache) -> Callable[[], None]:
    """A function that puts `cache` back as it is now (entries, keys, values, mask)."""

    def state(held: Any) -> Any:
        return held.snapshot() if isinstance(held, Sequence) else None

    entries = dict(cache._entries)
    held = [(e, e._keys, state(e._keys), e._values, state(e._values)) for e in entries.values()]
    mask, mask_state = cache._mask, state(cache._mask)

    def restore() -> None:
        cache._entries = entries
        for entry, keys, keys_state, values, values_state in held:
            entry._keys, entry._values = keys, values
            for seq, seq_state in ((keys, keys_state), (values, values_state)):
                if seq_state is not None:
                    seq.restore(seq_state)
        cache._mask = mask
        if mask_state is not None:
            mask.restore(mask_state)

    return restore


class PassGuard:
    """Snapshots `cache` before each forward pass of `model`; restores it if the pass fails.

    Attached with torch module hooks for the life of a `with PassGuard(model, cache):`
    block, and only for passes run by the thread that opened the block, so another
    thread's passes through the same model are left alone. A pass that raises an
    `Exception` is undone as it unwinds (even if the caller catches the error inside
    the block); one interrupted by a `BaseException` such as `KeyboardInterrupt` is
    undone when the block exits.
    """

    def __init__(self, model: torch.nn.Module, cache: KeyValueCache) -> None:
        self.model = model
        self.cache = cache
        self.thread = threading.get_ident()
        self.pending: list[Callable[[], None]] = []
        self.succeeded = False
        self.handles: list[Any] = []

    def _ours(self) -> bool:
        return threading.get_ident() == self.thread

    def _before(self, module: Any, args: Any) -> None:
        if self._ours():
            self.pending.append(snapshot(self.cache))

    def _after(self, module: Any, args: Any, output: Any) -> None:
        if self._ours() and self.pending:
            self.pending.pop()
            self.succeeded = True

    def _always(self, module: Any, args: Any, output: Any) -> None:
        # Runs after `_after` on success, and alone when the forward raised.
        if not self._ours():
            return
        if self.succeeded:
            self.succeeded = False
        elif self.pending:
            self.pending.pop()()

    def __enter__(self) -> PassGuard:
        model = self.model
        self.handles = [
            model.register_forward_pre_hook(self._before),
            model.register_forward_hook(self._after),
            model.register_forward_hook(self._always, always_call=True),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        if self.pending:
            self.pending[0]()
            self.pending.clear()
