"""What a `KeyValueCache` holds and records: `CacheState`, its entries, mask and flag.

One [`KeyValueCacheEntry`][safelens.KeyValueCacheEntry] per layer (a lazy cache creates
them on first access), the `[batch, pos_so_far]` attention mask of what is cached, held
in growing storage as the keys are, and the frozen flag, which reaches every entry.
`KeyValueCache` (`safelens.core._cache`) builds on this: it makes the state (constructor,
`init_cache`) and derives new caches and files from it.

Caveat: a frozen cache stores nothing. Its appends, of keys and values or of the mask,
return the full tensors and leave the state bitwise unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from jaxtyping import Int

from ._arguments import integer
from ._cache_entry import KeyValueCacheEntry
from ._errors import CacheShapeError
from ._frozen import FrozenFlag
from ._hook_point import CacheHookPoint
from ._storage import Sequence
from ._values import check_numbers, concat_values, shape_of, to_like

__all__ = ["CacheState", "held_mask"]

_HOOK_POINTS = ("hook_k_new", "hook_v_new", "hook_k_full", "hook_v_full")


def held_mask(value: Any) -> Any:
    """An attention mask as a cache holds it: a 2-D tensor in growing storage, else as is."""
    if isinstance(value, torch.Tensor) and value.dim() == 2:
        return Sequence.of(value)
    return value


def _shown(value: Any) -> Any:
    return value.view() if isinstance(value, Sequence) else value


def _promoted(held: torch.dtype, new: Any) -> torch.dtype:
    """The dtype `torch.cat` gives an integer mask of `held` and integer tensor `new`."""
    if not isinstance(new, torch.Tensor) or new.is_floating_point() or new.is_complex():
        return held
    return torch.promote_types(held, new.dtype)


class CacheState:
    """The entries, attention mask and frozen flag of a `KeyValueCache`, and their appends."""

    _entries: dict[int, KeyValueCacheEntry]
    _mask: Any
    _lazy: bool
    _frozen: bool

    # -- entries ----------------------------------------------------------------------

    @property
    def entries(self) -> list[KeyValueCacheEntry]:
        """The entries, in layer order."""
        return [self._entries[layer] for layer in sorted(self._entries)]

    def __getitem__(self, layer: int) -> KeyValueCacheEntry:
        """Layer `layer`'s entry; a lazy cache creates it (inheriting the frozen flag)."""
        integer(layer, "layer")
        if not self._lazy:
            count = len(self._entries)
            if not -count <= layer < count:
                raise IndexError(f"layer {layer} is out of range for a cache of {count} layers")
            return self._entries[layer % count]
        if layer < 0:
            raise IndexError(f"layer must be >= 0 in a lazily filled cache, got {layer}")
        if layer not in self._entries:
            entry = KeyValueCacheEntry(frozen=self._frozen, layer=layer)
            self._entries[layer] = entry.adopted(layer)
        return self._entries[layer]

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[KeyValueCacheEntry]:
        return iter(self.entries)

    def append(self, layer: int, keys: Any, values: Any, dim: int = 1) -> tuple[Any, Any]:
        """Append to layer `layer` (see [`KeyValueCacheEntry.append`][safelens.KeyValueCacheEntry.append])."""
        return self[layer].append(keys, values, dim=dim)

    @property
    def sequence_length(self) -> int:
        """Positions cached (of the first layer; the mask's when there are no entries)."""
        if self._entries:
            return self.entries[0].sequence_length
        shape = shape_of(self.previous_attention_mask)
        return shape[-1] if shape else 0

    @property
    def batch_size(self) -> int:
        """Rows of the cache (0 when nothing tells)."""
        for value in [e.keys for e in self.entries] + [self.previous_attention_mask]:
            shape = shape_of(value)
            if shape:
                return shape[0]
        return 0

    # -- attention mask ---------------------------------------------------------------

    @property
    def previous_attention_mask(self) -> Any:
        """The `[batch, pos_so_far]` attention mask of what is cached."""
        return _shown(self._mask)

    @previous_attention_mask.setter
    def previous_attention_mask(self, mask: Any) -> None:
        self._mask = held_mask(mask)

    def append_attention_mask(
        self, attention_mask: Int[torch.Tensor, "batch new_tokens"] | Any
    ) -> Any:
        """Append `attention_mask` along its last axis; return the full mask.

        Stores it unless frozen. With no previous mask it starts from an empty one of the
        same kind. The new mask takes the kind and device of the stored one, and the dtype
        `torch.cat` gives them, as in TransformerLens' cache: `init_cache`'s int32 mask
        joined with an int64 mask is int64 (another kind, or a floating mask, takes the
        stored dtype).

        **Raises:** [`CacheShapeError`][safelens.CacheShapeError] when its batch size
        differs from the cached mask's; the cache is then unchanged.
        """
        if not isinstance(self._mask, Sequence):
            check_numbers(attention_mask, "attention_mask")
            held = self.previous_attention_mask
            try:
                full = concat_values(held, attention_mask, dim=-1)
            except CacheShapeError as error:
                raise CacheShapeError(
                    f"attention_mask of shape {shape_of(attention_mask)} does not fit the cached "
                    f"mask of shape {shape_of(held)}; expected [batch, new_tokens] with the "
                    f"cached mask's batch ({error})"
                ) from None
            if not self._frozen:
                self.previous_attention_mask = full
            return full
        stored = self._mask
        held = stored.template
        dtype = _promoted(held.dtype, attention_mask)
        try:
            new = to_like(attention_mask, held.new_empty(0, dtype=dtype))
        except (TypeError, ValueError, RuntimeError) as error:
            raise CacheShapeError(
                f"attention_mask of type {type(attention_mask).__name__} cannot be converted "
                f"to a {held.dtype} tensor like the cached mask: {error}"
            ) from None
        if new.dim() != 2 or new.shape[0] != held.shape[0]:
            raise CacheShapeError(
                f"attention_mask of shape {tuple(new.shape)} does not fit the cached mask "
                f"[batch={held.shape[0]}, pos_so_far={stored.length}]; expected "
                f"[batch={held.shape[0]}, new_tokens]"
            )
        if dtype != held.dtype:
            # As TransformerLens' `torch.cat`: its int32 mask joined with int64 is int64.
            stored = Sequence.of(stored.view().to(dtype))
        if self._frozen:
            return stored.joined(new)
        self._mask = stored
        return stored.append_(new)

    # -- freezing ---------------------------------------------------------------------

    @property
    def frozen(self) -> FrozenFlag:
        """Whether forward passes store; `with cache.frozen(): …` freezes for a block.

        ```python
        >>> cache = KeyValueCache()
        >>> with cache.frozen():
        ...     bool(cache.frozen)
        True
        >>> bool(cache.frozen)
        False

        ```
        """
        return FrozenFlag(self, self._frozen)

    @frozen.setter
    def frozen(self, value: bool) -> None:
        self.freeze() if value else self.unfreeze()

    def freeze(self) -> None:
        """Freeze the cache and every entry: appends return the full tensors, store nothing."""
        self._frozen = True
        for entry in self._entries.values():
            entry.freeze()

    def unfreeze(self) -> None:
        """Unfreeze the cache and every entry."""
        self._frozen = False
        for entry in self._entries.values():
            entry.unfreeze()

    # -- hook points ------------------------------------------------------------------

    def hook_points(self) -> dict[str, CacheHookPoint]:
        """Every hook point of every entry, by full name (`blocks.{l}.kv_cache.…`)."""
        return {
            point.name: point
            for entry in self.entries
            for point in (getattr(entry, name) for name in _HOOK_POINTS)
        }

    # -- views ------------------------------------------------------------------------

    def to_dict(self) -> dict[int, dict[str, Any]]:
        """`{layer: {"keys", "values", "sequence_length"}}`, a serialisable view."""
        return {layer: self._entries[layer].to_dict() for layer in sorted(self._entries)}
