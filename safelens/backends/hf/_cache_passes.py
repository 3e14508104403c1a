"""What a forward pass does to an `HFKeyValueCache`: `CachePasses`, its base.

`update` is the seam HuggingFace attention calls once per layer and pass, with
head-major `[batch, n_kv_heads, new_tokens, d_head]` keys after the rotary embedding. It
stores them (growing the cache by a layer when a pass reaches one it lacks) unless the
cache is frozen, and keeps the bookkeeping that makes a failed pass undo itself: an update
with a layer index not above the previous one starts a pass, every layer is snapshotted
then, and an update of that pass that raises puts the whole cache back. `guard` does the
same for a block of the user's, and `hooks` attaches hooks to the cache's hook points for
a block, inside `guard`.

Caveat: the cache sees only its own updates. A failure between them (a model hook
raising between layers, an interrupt) leaves the pass's earlier layers stored unless the
pass runs in `with cache.guard():`. A frozen cache stores nothing, and refuses a pass
that does not continue what it holds (`safelens.backends.hf._frozen_pass`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from ...core._errors import HookError
from ...core._frozen import FrozenFlag
from ...core._hook_point import CacheHookPoint
from ._frozen_pass import FrozenPasses
from ._hooks import FwdHooks, attached, resolve, resolve_hooks
from ._layer import HOOK_POINTS, HFCacheLayer, HookNaming
from ._transformers_cache import TransformersCache

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["CachePasses"]


class CachePasses(TransformersCache):
    """The seam `update`, a pass's undo, freezing and hooks of an `HFKeyValueCache`."""

    naming: HookNaming
    _windows: list[int | None]
    _frozen_passes: FrozenPasses
    _pass: Callable[[], None] | None
    _last_layer: int
    _level: int

    def _grow(self, n_layers: int) -> None:
        while len(self.layers) < n_layers:
            layer = len(self.layers)
            window = self._windows[layer] if layer < len(self._windows) else None
            self.layers.append(HFCacheLayer(layer, naming=self.naming, sliding_window=window))
            self.layers[-1].frozen = self._frozen

    def __getstate__(self) -> dict[str, Any]:
        """What `pickle` and `copy.deepcopy` keep: all but the last pass's undo."""
        state = dict(self.__dict__)
        state["_pass"], state["_last_layer"] = None, -1
        return state

    @property
    def _frozen(self) -> bool:
        """Whether updates store; each layer is told, to refuse keys or values assigned to it."""
        return bool(self.__dict__.get("_frozen_flag", False))

    @_frozen.setter
    def _frozen(self, value: bool) -> None:
        self.__dict__["_frozen_flag"] = bool(value)
        for layer in self.layers:
            layer.frozen = bool(value)

    # -- the seam ---------------------------------------------------------------------

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append head-major keys/values to layer `layer_idx`; return cached + new.

        Stores nothing while frozen, and then refuses a pass whose positions (the
        `position_ids` or `cache_position` HuggingFace attention passes along in
        `args`/`kwargs`, under transformers >= 5.24) start past what the cache holds: a
        multi-step loop that believes its earlier steps were stored. An update with a
        layer index not above the previous one starts a forward pass: every layer is
        snapshotted then, and if this or a later update of the pass raises, the whole
        cache is put back.

        **Arguments:**

        - `key_states`, `value_states`: `[batch, n_kv_heads, new_tokens, d_head]`.
        - `layer_idx`: the layer.

        **Returns:** `(keys, values)`, `[batch, n_kv_heads, pos_so_far + new_tokens, d_head]`.

        **Raises:** [`CacheShapeError`][safelens.CacheShapeError] for keys or values that
        do not fit the layer; [`HookError`][safelens.HookError] from a hook's result;
        [`FrozenCacheError`][safelens.FrozenCacheError] for a pass over a frozen cache
        that does not continue what it holds (run it on `cache.fork()`).
        """
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise TypeError(f"layer_idx must be an int >= 0, got {layer_idx!r}")
        if self._frozen:
            # A frozen cache is never changed, not even by adding a layer.
            exists = layer_idx < len(self.layers)
            layer = (
                self.layers[layer_idx] if exists else HFCacheLayer(layer_idx, naming=self.naming)
            )
            self._frozen_passes.check(layer.get_seq_length(), args, kwargs)
            return layer.update(key_states, value_states, store=False)
        if self._pass is None or layer_idx <= self._last_layer:
            self._pass = self._snapshot()
        restore, self._last_layer = self._pass, layer_idx
        last = layer_idx == len(self.layers) - 1
        try:
            self._grow(layer_idx + 1)
            result = self.layers[layer_idx].update(key_states, value_states)
        except BaseException:
            restore()
            raise
        if last:
            # No update of this pass is left to undo, and the snapshot would keep any
            # buffer the pass outgrew alive until the next pass.
            self._pass = None
        return result

    def _snapshot(self) -> Callable[[], None]:
        layers = list(self.layers)
        restores = [layer.snapshot() for layer in layers]

        def restore() -> None:
            self.layers[:] = layers
            for layer_restore in restores:
                layer_restore()
            self._pass, self._last_layer = None, -1

        return restore

    @contextmanager
    def guard(self) -> Iterator[Self]:
        """Put the cache back as it was on entry if the block raises; yields the cache.

        ```python
        >>> cache = HFKeyValueCache()
        >>> try:
        ...     with cache.guard():
        ...         _ = cache.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 0)
        ...         raise KeyboardInterrupt
        ... except KeyboardInterrupt:
        ...     pass
        >>> cache.get_seq_length()
        0

        ```
        """
        restore = self._snapshot()
        try:
            yield self
        except BaseException:
            restore()
            raise

    # -- freezing ---------------------------------------------------------------------

    @property
    def frozen(self) -> FrozenFlag:
        """Whether updates store; `with cache.frozen(): …` freezes for a block."""
        return FrozenFlag(self, self._frozen)

    @frozen.setter
    def frozen(self, value: bool) -> None:
        self._frozen = bool(value)

    def freeze(self) -> None:
        """Stop storing: `update` returns cached + new keys/values, changes nothing."""
        self._frozen = True

    def unfreeze(self) -> None:
        """Store updates again."""
        self._frozen = False

    # -- hook points ------------------------------------------------------------------

    def hook_points(self) -> dict[str, CacheHookPoint]:
        """Every hook point of every layer, by name (`model.layers.{l}.kv_cache.…` or `blocks.…`)."""
        points = (getattr(layer, point) for layer in self.layers for point in HOOK_POINTS)
        return {point.name: point for point in points}

    def hook_point(self, name: str) -> CacheHookPoint:
        """The hook point `name`; a layer the cache lacks is created (empty).

        ```python
        >>> HFKeyValueCache().hook_point("model.layers.1.kv_cache.hook_v_full")
        CacheHookPoint(name='model.layers.1.kv_cache.hook_v_full', 0 fwd)

        ```
        """
        if not isinstance(name, str):
            raise HookError(f"name must be a hook name (a str), got {type(name).__name__}")
        ((layer, point),) = resolve(name, self.layers, self.naming)
        self._grow(layer + 1)
        hook_point: CacheHookPoint = getattr(self.layers[layer], point)
        return hook_point

    @contextmanager
    def hooks(self, fwd_hooks: FwdHooks) -> Iterator[Self]:
        """Attach `[(names, fn), ...]` for the block, inside [`guard`][safelens.HFKeyValueCache.guard].

        `names` is a hook name, a list of names, or a predicate over the existing layers'
        names. Every name is checked before any hook is attached; on exit the block's
        hooks are removed, also when it raises.

        **Raises:** [`HookError`][safelens.HookError] for an unknown name or a hook that
        is not callable; nothing is attached then.
        """
        chosen = resolve_hooks(fwd_hooks, self.layers, self.naming)
        self._grow(1 + max((layer for layer, _, _ in chosen), default=-1))
        self._level += 1
        points = [(getattr(self.layers[layer], point), fn) for layer, point, fn in chosen]
        with attached(points, self._level), self.guard():
            yield self
