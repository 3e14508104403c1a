"""One layer's cached keys and values: `KeyValueCacheEntry`.

An entry holds keys and values of shape `[batch, pos_so_far, n_kv_heads, d_head]`
(TransformerLens' layout: position-major, keys before any rotary embedding) or, for
adapters, numpy arrays or nested lists. Tensors appended along `pos` go into a growing
buffer (see `safelens.core._storage`), so a one-token append does not copy the cache.

Frozen semantics: while frozen, [`append`][safelens.KeyValueCacheEntry.append] still
returns the full keys and values, but nothing stored changes, bitwise.

Each entry carries four hook points (see the hook-name table in the docs):
`hook_k_new`/`hook_v_new` see the new keys/values before they are stored;
`hook_k_full`/`hook_v_full` see the keys/values handed back to attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float

from ._arguments import is_int
from ._entry_fit import POS, check_pair, fitted
from ._errors import CacheShapeError, FrozenCacheError
from ._frozen import FrozenFlag
from ._hook_point import CacheHookPoint
from ._storage import Sequence
from ._values import check_numbers, concat_values, shape_of

__all__ = ["KeyValueCacheEntry"]


def _hold(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() >= 2:
        return Sequence.of(value)
    return value


def _shown(value: Any) -> Any:
    return value.view() if isinstance(value, Sequence) else value


def _one_of(name: str, value: Any, alias: str, alias_value: Any) -> Any:
    if value is not None and alias_value is not None:
        raise TypeError(f"pass {name}= or {alias}=, not both")
    return value if value is not None else alias_value


def hook_name(layer: int | None, point: str) -> str:
    """The full name of hook point `point` of layer `layer`."""
    return f"kv_cache.{point}" if layer is None else f"blocks.{layer}.kv_cache.{point}"


class KeyValueCacheEntry:
    """Cached keys and values of one layer; a drop-in for TransformerLens' entry.

    **Arguments:**

    - `keys` (or `past_keys`): `[batch, pos_so_far, n_kv_heads, d_head]` tensor, numpy
      array, nested list, or `None` for an entry that starts empty.
    - `values` (or `past_values`): likewise.
    - `frozen`: start frozen.
    - `layer`: the layer index, used in hook names and error messages.

    ```python
    >>> entry = KeyValueCacheEntry(torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4))
    >>> keys, values = entry.append(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4))
    >>> keys.shape, entry.sequence_length
    (torch.Size([1, 4, 2, 4]), 4)

    ```
    """

    hook_k_new: CacheHookPoint
    hook_v_new: CacheHookPoint
    hook_k_full: CacheHookPoint
    hook_v_full: CacheHookPoint

    def __init__(
        self,
        keys: Any = None,
        values: Any = None,
        frozen: bool = False,
        *,
        past_keys: Any = None,
        past_values: Any = None,
        layer: int | None = None,
    ) -> None:
        keys = _one_of("keys", keys, "past_keys", past_keys)
        values = _one_of("values", values, "past_values", past_values)
        check_pair(keys, values, "entry" if layer is None else f"layer {layer}")
        self._keys = _hold(keys)
        self._values = _hold(values)
        self._frozen = bool(frozen)
        self._owned = False
        self.set_layer(layer)

    def adopted(self, layer: int) -> KeyValueCacheEntry:
        """This entry as layer `layer` of a cache: itself if free, else a branch of it.

        An entry no cache holds yet is labelled `layer` and returned. One that a cache
        already holds is never relabelled or shared: the result is a copy-on-write
        branch with its own (empty) hook points and the same frozen flag.
        """
        if not self._owned:
            self._owned = True
            self.set_layer(layer)
            return self
        if isinstance(self._keys, Sequence) and isinstance(self._values, Sequence):
            branch = self.derived(Sequence.fork, "a cache")
        else:
            branch = KeyValueCacheEntry()
            branch._keys, branch._values = self._keys, self._values
        branch._frozen = self._frozen
        branch._owned = True
        branch.set_layer(layer)
        return branch

    def set_layer(self, layer: int | None) -> None:
        """Name this entry layer `layer` (renames its hook points, keeps their hooks)."""
        self.layer = layer
        for point in ("hook_k_new", "hook_v_new", "hook_k_full", "hook_v_full"):
            existing = self.__dict__.get(point)
            if existing is None:
                setattr(self, point, CacheHookPoint(hook_name(layer, point)))
            else:
                existing.name = hook_name(layer, point)

    @classmethod
    def init_cache_entry(
        cls,
        cfg: Any,
        device: torch.device | str | None,
        batch_size: int = 1,
        layer: int | None = None,
    ) -> KeyValueCacheEntry:
        """An empty `[batch_size, 0, n_kv_heads, d_head]` entry for a model config."""
        from ._config import CacheDimensions

        dims = CacheDimensions.of(cfg)
        empty = dims.empty_keys(batch_size, device)
        return cls(empty, torch.empty_like(empty), layer=layer)

    # -- stored state -----------------------------------------------------------------

    @property
    def keys(self) -> Any:
        """The cached keys, exactly the filled part (`[batch, pos_so_far, …]`)."""
        return _shown(self._keys)

    @keys.setter
    def keys(self, value: Any) -> None:
        self._keys = _hold(self._numbers(value, "keys"))

    @property
    def values(self) -> Any:
        """The cached values, exactly the filled part."""
        return _shown(self._values)

    @values.setter
    def values(self, value: Any) -> None:
        self._values = _hold(self._numbers(value, "values"))

    past_keys = keys
    past_values = values

    @property
    def sequence_length(self) -> int:
        """Size of axis 1 of the cached keys; 0 when no shape can be inferred."""
        if isinstance(self._keys, Sequence):
            return self._keys.length
        shape = shape_of(self._keys)
        return shape[POS] if shape is not None and len(shape) > POS else 0

    @property
    def frozen(self) -> FrozenFlag:
        """Whether appends store; `with entry.frozen(): …` freezes for a block."""
        return FrozenFlag(self, self._frozen)

    @frozen.setter
    def frozen(self, value: bool) -> None:
        self._frozen = bool(value)

    def freeze(self) -> None:
        """Stop storing: later appends return the concatenation but change nothing."""
        self._frozen = True

    def unfreeze(self) -> None:
        """Store appends again."""
        self._frozen = False

    # -- appending --------------------------------------------------------------------

    def _where(self) -> str:
        return "entry" if self.layer is None else f"layer {self.layer}"

    def _numbers(self, value: Any, name: str) -> Any:
        """`value`, refused (naming this layer) if a nested list of it is not numbers."""
        try:
            check_numbers(value, name)
        except CacheShapeError as error:
            raise CacheShapeError(f"{self._where()}: {error}") from None
        return value

    def append(
        self,
        keys: Float[torch.Tensor, "batch new_tokens n_heads d_head"] | Any,
        values: Float[torch.Tensor, "batch new_tokens n_heads d_head"] | Any,
        dim: int = 1,
    ) -> tuple[Any, Any]:
        """Append `keys` and `values` along `dim`; return the full keys and values.

        Stores the new keys/values unless the entry is frozen; either way it returns
        old + new. Inputs of another kind, dtype or device are converted to those of
        what is cached. Hook points fire in this order: `hook_k_new`, `hook_v_new` on
        the new tensors (their results are what is stored), then `hook_k_full`,
        `hook_v_full` on the full tensors returned (never stored).

        **Arguments:**

        - `keys`, `values`: `[batch, new_tokens, n_kv_heads, d_head]` (or any value
          [`concat_values`][safelens.concat_values] joins with what is cached).
        - `dim`: the axis to append along; negative counts from the end.

        **Returns:** `(full_keys, full_values)`.

        **Raises:** [`CacheShapeError`][safelens.CacheShapeError] naming the layer, the
        expected sizes and what arrived; the entry is then unchanged.
        """
        if not (isinstance(self._keys, Sequence) and isinstance(self._values, Sequence)):
            return self._append_plain(keys, values, dim)
        rank = self._keys.template.dim()
        if not is_int(dim) or dim not in (POS, POS - rank):
            raise CacheShapeError(
                f"{self._where()}: dim={dim!r}, but a tensor cache grows along pos only "
                f"(dim=1 or dim={POS - rank} of [batch, pos, n_kv_heads, d_head]); "
                "appending along batch or heads would silently change what the cache is"
            )
        if self._keys.length != self._values.length:
            raise CacheShapeError(
                f"{self._where()}: the cache holds {self._keys.length} key positions but "
                f"{self._values.length} value positions; set entry.keys and entry.values to "
                "tensors of one length before appending"
            )
        new_keys, new_values = self._new(keys, values)
        if self._frozen:
            full_keys = self._keys.joined(new_keys)
            full_values = self._values.joined(new_values)
            return self._read_hooks(full_keys, full_values)
        before = (self._keys.snapshot(), self._values.snapshot())
        full_keys = self._keys.append_(new_keys)
        full_values = self._values.append_(new_values)
        try:
            return self._read_hooks(full_keys, full_values)
        except BaseException:
            self._keys.restore(before[0])
            self._values.restore(before[1])
            raise

    def _new(self, keys: Any, values: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """New keys and values fitted to the cache, through `hook_k_new`/`hook_v_new`."""
        assert isinstance(self._keys, Sequence) and isinstance(self._values, Sequence)
        new_keys = fitted(self._where(), "keys", keys, self._keys)
        new_values = fitted(self._where(), "values", values, self._values)
        if self.hook_k_new.fwd_hooks:
            new_keys = self.hook_k_new(new_keys)
        if self.hook_v_new.fwd_hooks:
            new_values = self.hook_v_new(new_values)
        return new_keys, new_values

    @property
    def reads_in_pieces(self) -> bool:
        """Whether [`frozen_pieces`][safelens.KeyValueCacheEntry.frozen_pieces] may be used.

        True for a frozen entry of tensors whose `hook_k_full`/`hook_v_full` have no hooks.
        """
        return (
            bool(self._frozen)
            and isinstance(self._keys, Sequence)
            and isinstance(self._values, Sequence)
            and not self.hook_k_full.fwd_hooks
            and not self.hook_v_full.fwd_hooks
        )

    def frozen_pieces(
        self,
        keys: Float[torch.Tensor, "batch new_tokens n_heads d_head"],
        values: Float[torch.Tensor, "batch new_tokens n_heads d_head"],
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """What a frozen `append` would join, left unjoined: the stored pieces, then the new.

        A piece may be a batch-1 tensor broadcast to the batch (`cache.expand(n)`), which
        attention can read once instead of once per row. `hook_k_new`/`hook_v_new` fire
        as in [`append`][safelens.KeyValueCacheEntry.append]; nothing is stored.

        **Returns:** `(key_pieces, value_pieces)`, each ending with the new tensor.

        **Raises:** `FrozenCacheError` unless
        [`reads_in_pieces`][safelens.KeyValueCacheEntry.reads_in_pieces].
        """
        if not self.reads_in_pieces:
            raise FrozenCacheError(
                f"{self._where()}: frozen_pieces needs a frozen entry of tensors with no "
                "hooks on hook_k_full/hook_v_full (they see the joined tensors); use append"
            )
        new_keys, new_values = self._new(keys, values)
        stored_keys = tuple(p for p in self._keys.pieces() if p.shape[POS])
        stored_values = tuple(p for p in self._values.pieces() if p.shape[POS])
        return stored_keys + (new_keys,), stored_values + (new_values,)

    def _read_hooks(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[Any, Any]:
        # A read-time hook gets a tensor of its own: whatever it does to its argument,
        # in place or not, never reaches storage.
        if self.hook_k_full.fwd_hooks:
            keys = self.hook_k_full(keys.clone())
        if self.hook_v_full.fwd_hooks:
            values = self.hook_v_full(values.clone())
        return keys, values

    def _append_plain(self, keys: Any, values: Any, dim: int) -> tuple[Any, Any]:
        self._numbers(keys, "keys")
        self._numbers(values, "values")
        try:
            full_keys = concat_values(self.keys, keys, dim=dim)
            full_values = concat_values(self.values, values, dim=dim)
        except CacheShapeError as error:
            raise CacheShapeError(f"{self._where()}: {error}") from None
        if not self._frozen:
            self.keys, self.values = full_keys, full_values
        return full_keys, full_values

    def derived(self, op: Callable[[Sequence], Sequence], name: str) -> KeyValueCacheEntry:
        """A new unfrozen entry whose keys and values are `op` of this entry's storage."""
        if not (isinstance(self._keys, Sequence) and isinstance(self._values, Sequence)):
            raise CacheShapeError(
                f"{name} needs tensor keys and values of rank >= 2; {self._where()} "
                f"holds {type(self.keys).__name__}"
            )
        entry = KeyValueCacheEntry(layer=self.layer)
        entry._keys, entry._values = op(self._keys), op(self._values)
        return entry

    def storages(self) -> list[int]:
        """Data pointers of the storage this entry's keys and values read."""
        if not (isinstance(self._keys, Sequence) and isinstance(self._values, Sequence)):
            return []
        return self._keys.storages() + self._values.storages()

    # -- views ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """`{"keys", "values", "sequence_length"}` of this entry."""
        return {
            "keys": self.keys,
            "values": self.values,
            "sequence_length": self.sequence_length,
        }

    def __repr__(self) -> str:
        return (
            f"KeyValueCacheEntry(layer={self.layer}, shape={shape_of(self.keys)}, "
            f"frozen={self._frozen})"
        )
