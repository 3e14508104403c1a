"""What transformers calls on a user's cache: `TransformersCache`, `HFKeyValueCache`'s base.

HuggingFace's forward, masks and `generate` read a `Cache` through queries
(`get_seq_length`, `get_mask_sizes`, `get_query_offset`, `is_sliding`, `is_linear`,
`is_dummy`, `is_compileable`, `is_croppable`, `layers`, `offloading`) and change it with
in-place methods: `crop` (assisted decoding rolls back rejected drafts), `reorder_cache`
(beam search), `batch_repeat_interleave`, `batch_select_indices` and `reset`.
`TransformersCache` answers them over the cache's `HFCacheLayer`s,
alike under transformers 5.23 and 5.24+; the queries it does not define are
`transformers.Cache`'s own, which read the layers.

Caveat: these methods mutate, unlike safelens' branching methods (`fork`, `cropped`, …).
A frozen cache refuses every one that would change it with a
[`FrozenCacheError`][safelens.FrozenCacheError], and `crop(n)` with `n > 0`
(`KeyValueCache.crop`'s "keep the first `n`") is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from transformers.cache_utils import Cache

from ...core._cache_layout import row_index
from ...core._errors import FrozenCacheError
from ._frozen_pass import refuse_generate
from ._layer import HFCacheLayer

__all__ = ["TransformersCache"]


class TransformersCache(Cache):
    """The `transformers.Cache` methods `HFKeyValueCache` implements over its layers."""

    layers: list[HFCacheLayer]  # type: ignore[assignment]  # only ever HFCacheLayers
    _frozen: bool
    _user_defined: bool

    def _rows(self, rows: Any) -> torch.Tensor:
        return row_index(rows, max(self.batch_size, 0))

    # -- HuggingFace's in-place methods -----------------------------------------------

    def _mutable(self, call: str) -> None:
        if self._frozen:
            raise FrozenCacheError(
                f"{call} changes the cache in place, and this cache is frozen; call it on "
                "cache.fork() (or unfreeze() first)"
            )

    def crop(self, tokens_to_remove: int) -> None:
        """In place, as HuggingFace's: `crop(-k)` drops the last `k` positions of every layer.

        `crop(0)` drops nothing (`generate` calls it so), but a sliding-window layer that
        recorded past its window keeps only the window again, as `DynamicCache`'s. This is not
        [`KeyValueCache.crop`][safelens.KeyValueCache.crop], which returns a new cache:
        that is [`cropped`][safelens.HFKeyValueCache.cropped] here. A positive argument
        is refused, as transformers 5 refuses it, so `cache.crop(4)` written with
        `KeyValueCache.crop`'s meaning fails instead of cutting this cache in place.

        **Raises:** `ValueError` for a positive `tokens_to_remove` (naming `cropped`);
        [`CacheShapeError`][safelens.CacheShapeError] for a sliding-window layer asked to
        drop positions it no longer holds (as `DynamicCache` refuses it); [`FrozenCacheError`][safelens.FrozenCacheError] when
        frozen and the call would drop something. The cache is then unchanged.

        ```python
        >>> cache = HFKeyValueCache()
        >>> _ = cache.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), 0)
        >>> cache.crop(-2)
        >>> cache.get_seq_length(), cache.cropped(1).get_seq_length(), cache.get_seq_length()
        (3, 1, 3)

        ```
        """
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise TypeError(
                f"tokens_to_remove must be an int, got {type(tokens_to_remove).__name__}"
            )
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): HFKeyValueCache.crop is HuggingFace's in-place "
                "crop, which takes minus the number of positions to drop, e.g. crop(-2); "
                f"for a new cache of the first {tokens_to_remove} positions (what "
                f"KeyValueCache.crop({tokens_to_remove}) returns) use "
                f"cropped({tokens_to_remove})"
            )
        if not any(layer.get_seq_length() for layer in self.layers):
            return
        if tokens_to_remove == 0:
            # As `DynamicCache`: a sliding layer that recorded past its window drops it.
            if not self._frozen:
                for layer in self.layers:
                    layer.crop_(0)
            return
        self._mutable(f"crop({tokens_to_remove})")
        restores = [layer.snapshot() for layer in self.layers]
        try:
            for layer in self.layers:
                layer.crop_(-tokens_to_remove)
        except BaseException:
            for restore in restores:
                restore()
            raise

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """In place: batch row `i` becomes row `beam_idx[i]` (beam search)."""
        self._mutable("reorder_cache(beam_idx)")
        if self.batch_size > 0:
            index = self._rows(beam_idx)
            for layer in self.layers:
                layer.replace(lambda seq: seq.select(index))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """In place: each batch row repeated `repeats` times, as `repeat_interleave`."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be a positive int, got {repeats!r}")
        self._mutable(f"batch_repeat_interleave({repeats})")
        if self.batch_size > 0:
            self.reorder_cache(torch.arange(self.batch_size).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """In place: keep only batch rows `indices`."""
        self._mutable("batch_select_indices(indices)")
        if self.batch_size > 0:
            self.reorder_cache(indices)

    def reset(self) -> None:
        """In place: empty every layer (their hook points stay)."""
        self._mutable("reset()")
        for layer in self.layers:
            layer.reset()

    # -- what HuggingFace reads and sets ----------------------------------------------

    @property
    def _is_user_defined(self) -> bool:
        """Whether `generate` was handed this cache (it sets this before its first step)."""
        return self._user_defined

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        # `generate` stores every step it decodes: a frozen cache is refused before any.
        if value and self._frozen:
            raise refuse_generate()
        self._user_defined = bool(value)

    @property
    def batch_size(self) -> int:
        """Rows of the cache; -1 before anything is stored (HuggingFace's convention)."""
        return next((layer.batch for layer in self.layers if layer.batch is not None), -1)

    @property
    def is_croppable(self) -> bool:
        """Whether `crop(-k)` can drop positions: not while frozen (it would be refused)."""
        return not self._frozen

    @property
    def is_compileable(self) -> bool:
        """False: the storage grows, so `generate` never compiles around it."""
        return False

    @property
    def is_sliding(self) -> list[bool]:
        """Per layer, whether it keeps only a window (made so by `HFKeyValueCache(config=)`)."""
        return [layer.is_sliding for layer in self.layers]

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """-1: no maximum length."""
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """-1: no maximum length (transformers < 5 asks under this name)."""
        return -1

    def __iter__(self) -> Iterator[tuple[Any, Any, torch.Tensor | None]]:
        """Per layer `(keys, values, window)`, as iterating a `DynamicCache` gives them.

        Keys and values head-major (`None` in a layer that holds nothing yet); `window` the
        layer's `sliding_window` as a long tensor, `None` for a layer that keeps every
        position. Reading only: the tensors are the layer's own, so edit a `fork()`.
        """
        for layer in self.layers:
            window = layer.sliding_window
            yield (
                layer.keys,
                layer.values,
                None if window is None else torch.tensor(window, dtype=torch.long),
            )
