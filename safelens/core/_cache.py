"""All layers' cached keys and values: `KeyValueCache`, a drop-in for TransformerLens.

Pass a `KeyValueCache` as `past_kv_cache=` to `HookedTransformer.forward` and it behaves
as TransformerLens' own cache, with the same logits, while appending in amortised O(1)
and offering what counterfactual work needs: [`fork`][safelens.KeyValueCache.fork],
[`expand`][safelens.KeyValueCache.expand], [`crop`][safelens.KeyValueCache.crop],
[`select`][safelens.KeyValueCache.select], [`clone`][safelens.KeyValueCache.clone] and
`with cache.frozen(): …`.

Those five operations never change the cache they are called on: they return a new
cache. `fork`, `expand` and `crop` share the prefix's storage (copy-on-write: later
appends on either side stay on that side), so N branches of a P-token prefix hold the
prefix once. The results start unfrozen, ready to take a continuation; `clone` keeps
the frozen flag.

Caveat on freezing: a frozen cache stores nothing, so a multi-step continuation run on
the frozen cache itself forgets each step's tokens (as TransformerLens' frozen cache
does). Run multi-step continuations on `cache.fork()` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from os import PathLike
from typing import Any

import torch
from jaxtyping import Int

from ._arguments import integer, positive_int
from ._cache_entry import KeyValueCacheEntry
from ._cache_layout import check_layout, row_index
from ._config import CacheDimensions
from ._errors import CacheShapeError
from ._fit import check_fits
from ._frozen import FrozenFlag
from ._hook_point import CacheHookPoint
from ._persistence import Devices, load_cache, save_cache
from ._storage import Sequence
from ._values import concat_values, shape_of, to_like

__all__ = ["KeyValueCache"]

_HOOK_POINTS = ("hook_k_new", "hook_v_new", "hook_k_full", "hook_v_full")


def _held(value: Any) -> Any:
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


class KeyValueCache:
    """Per-layer keys and values plus the attention mask seen so far.

    **Arguments:**

    - `entries`: one [`KeyValueCacheEntry`][safelens.KeyValueCacheEntry] per layer, or
      `None` for a cache whose entries are created on first access (`cache[3]`). An
      entry that already belongs to a cache (or appears twice) is taken as a
      copy-on-write branch of it (`fork`): the other cache never sees this one's appends,
      and is never relabelled.
    - `previous_attention_mask`: `[batch, pos_so_far]` mask of what is cached, or `None`.
    - `frozen`: start frozen (propagates to every entry).

    **Raises:** [`CacheShapeError`][safelens.CacheShapeError] when the layers' batch or
    `pos_so_far` differ, or the mask does not have one row per batch row and one column
    per cached position.

    ```python
    >>> cache = KeyValueCache()
    >>> _ = cache.append(0, keys=[[[1]]], values=[[[2]]])
    >>> _ = cache.append(0, keys=[[[3]]], values=[[[4]]])
    >>> cache[0].keys, cache[0].sequence_length
    ([[[1], [3]]], 2)

    ```
    """

    def __init__(
        self,
        entries: list[KeyValueCacheEntry] | None = None,
        previous_attention_mask: Int[torch.Tensor, "batch pos_so_far"] | Any = None,
        frozen: bool = False,
    ) -> None:
        if entries is not None and not isinstance(entries, list | tuple):
            raise TypeError(
                f"entries must be a list of KeyValueCacheEntry (one per layer) or None, got "
                f"{type(entries).__name__}"
            )
        given = dict(enumerate(entries or []))
        for layer, entry in given.items():
            if not isinstance(entry, KeyValueCacheEntry):
                raise TypeError(
                    f"entries[{layer}] must be a KeyValueCacheEntry, got {type(entry).__name__}"
                )
        check_layout(given, previous_attention_mask)
        self._lazy = entries is None
        self._entries = {layer: entry.adopted(layer) for layer, entry in given.items()}
        self._mask = _held(previous_attention_mask)
        self._frozen = False
        if frozen:
            self.freeze()

    @classmethod
    def init_cache(
        cls,
        cfg: Any,
        device: torch.device | str | None = None,
        batch_size: int = 1,
    ) -> KeyValueCache:
        """An empty cache for a model config, as TransformerLens' `init_cache` makes.

        One entry per layer, each `[batch_size, 0, n_kv_heads, d_head]` in the model's
        dtype, on the device TransformerLens puts that layer on when `cfg.n_devices > 1`,
        and an empty `[batch_size, 0]` integer attention mask.

        **Arguments:**

        - `cfg`: a `HookedTransformerConfig` or a HuggingFace-style config.
        - `device`: the first layer's device; defaults to `cfg.device`, else the CPU.
        - `batch_size`: rows of the cache.

        **Raises:** [`CacheConfigError`][safelens.CacheConfigError] naming a missing
        config attribute.

        ```python
        >>> from types import SimpleNamespace
        >>> cfg = SimpleNamespace(n_layers=2, n_heads=4, d_head=8, dtype="bfloat16")
        >>> cache = KeyValueCache.init_cache(cfg, "cpu", batch_size=3)
        >>> cache[1].keys.shape, cache[1].keys.dtype, cache.previous_attention_mask.shape
        (torch.Size([3, 0, 4, 8]), torch.bfloat16, torch.Size([3, 0]))

        ```
        """
        positive_int(batch_size, "batch_size", error=ValueError, shown=repr)
        dims = CacheDimensions.of(cfg)
        if device is None:
            device = getattr(cfg, "device", None)
        entries = []
        for layer in range(dims.n_layers):
            empty = dims.empty_keys(batch_size, dims.device_of_layer(layer, device))
            entries.append(KeyValueCacheEntry(empty, torch.empty_like(empty)))
        mask = torch.empty((batch_size, 0), dtype=torch.int, device=device)
        return cls(entries, mask)

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
        self._mask = _held(mask)

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
            full = concat_values(self.previous_attention_mask, attention_mask, dim=-1)
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

    # -- branching --------------------------------------------------------------------

    @classmethod
    def assembled(
        cls, entries: dict[int, KeyValueCacheEntry], mask: Any, lazy: bool = False
    ) -> KeyValueCache:
        """A cache of these entries and mask, unchecked: for internal passes only.

        `ablate_write` recomputes layers from different positions, so its working cache
        holds layers of different lengths, which the constructor refuses.
        """
        result = cls()
        result._lazy = lazy
        result._entries = {layer: entry.adopted(layer) for layer, entry in entries.items()}
        result._mask = _held(mask)
        return result

    def _derived(self, op: Callable[[Sequence], Sequence], name: str) -> KeyValueCache:
        entries = {layer: e.derived(op, name) for layer, e in self._entries.items()}
        mask = op(self._mask) if isinstance(self._mask, Sequence) else self._mask
        return KeyValueCache.assembled(entries, mask, self._lazy)

    def fork(self) -> KeyValueCache:
        """A branch that shares everything cached so far and takes its own appends.

        Copy-on-write both ways: the branch's appends never reach this cache (or other
        branches), and this cache's later appends never reach the branch. The branch is
        unfrozen, so forking a frozen prefix is how to run a multi-step continuation.

        ```python
        >>> prefix = KeyValueCache([KeyValueCacheEntry(torch.zeros(1, 5, 2, 4), torch.zeros(1, 5, 2, 4))])
        >>> branch = prefix.fork()
        >>> _ = branch.append(0, torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4))
        >>> branch.sequence_length, prefix.sequence_length
        (6, 5)

        ```
        """
        return self._derived(Sequence.fork, "fork")

    def expand(self, n: int) -> KeyValueCache:
        """This batch-1 cache broadcast to `n` rows, without copying it.

        The rows share this cache's storage; appends to the result go to storage of its
        own, one row each. The attention mask is expanded too.

        **Raises:** [`CacheShapeError`][safelens.CacheShapeError] when the batch is not 1.

        ```python
        >>> prefix = KeyValueCache([KeyValueCacheEntry(torch.zeros(1, 5, 2, 4), torch.zeros(1, 5, 2, 4))])
        >>> prefix.expand(32)[0].keys.shape
        torch.Size([32, 5, 2, 4])

        ```
        """
        positive_int(n, "n", error=ValueError, shown=repr)
        if self.batch_size != 1:
            raise CacheShapeError(
                f"expand(n) needs a batch-1 cache; this cache has batch {self.batch_size}. "
                "Use select([row]) first to pick one row"
            )
        return self._derived(lambda seq: seq.expand(n), "expand")

    def crop(self, length: int) -> KeyValueCache:
        """The first `length` positions (negative: all but the last `-length`).

        Shares storage with this cache, which is unchanged.

        ```python
        >>> cache = KeyValueCache([KeyValueCacheEntry(torch.zeros(1, 5, 2, 4), torch.zeros(1, 5, 2, 4))])
        >>> cache.crop(3).sequence_length, cache.crop(-1).sequence_length
        (3, 4)

        ```
        """
        total = self.sequence_length
        integer(length, "length", shown=lambda value: type(value).__name__)
        kept = total + length if length < 0 else length
        if not 0 <= kept <= total:
            raise ValueError(
                f"length must be in [-{total}, {total}] for a cache of {total} positions, "
                f"got {length}"
            )
        return self._derived(lambda seq: seq.crop(kept), "crop")

    def select(self, rows: int | slice | list[int] | torch.Tensor) -> KeyValueCache:
        """The batch rows `rows` (any index torch accepts), in storage of their own.

        ```python
        >>> cache = KeyValueCache([KeyValueCacheEntry(torch.zeros(4, 5, 2, 4), torch.zeros(4, 5, 2, 4))])
        >>> cache.select([0, 2])[0].keys.shape, cache.select(-1).batch_size
        (torch.Size([2, 5, 2, 4]), 1)

        ```
        """
        index = row_index(rows, self.batch_size)
        return self._derived(lambda seq: seq.select(index), "select")

    def clone(self) -> KeyValueCache:
        """An independent deep copy (same frozen flag), sharing no storage."""
        result = self._derived(Sequence.clone, "clone")
        if self._frozen:
            result.freeze()
        return result

    def storages(self) -> set[int]:
        """Data pointers of all storage this cache reads, to check sharing."""
        return {ptr for entry in self.entries for ptr in entry.storages()}

    # -- persistence ------------------------------------------------------------------

    def save(self, path: str | PathLike[str]) -> None:
        """Write this cache to a safetensors file at `path`; the cache is unchanged.

        The file holds every layer's keys and values, the attention mask if any, and
        metadata: format marker and version, `n_layers`, `n_kv_heads`, `d_head`, dtype,
        sequence length, batch size, the frozen flag, each layer's device and
        checksums. Frozen caches save as any other. Branches save their materialised
        keys and values: an `expand(n)` result is written with all `n` rows.

        **Arguments:**

        - `path`: where to write (an existing file is replaced).

        **Raises:** [`CacheShapeError`][safelens.CacheShapeError] when the cache holds
        no layer, a missing layer, non-tensor values, layers of differing shape or
        dtype, an attention mask that is not a `[batch, pos_so_far]` tensor, a dtype a
        cache file cannot hold (it holds float64, float32, float16, bfloat16,
        float8_e4m3fn, float8_e5m2, int64, int32, int16, int8, uint8 and bool; not,
        e.g., complex64 or uint16), or more layers than one file's 256 KiB header can
        describe (about 1000). `FileNotFoundError` when the directory of `path` does
        not exist, and `OSError` when writing fails (no permission, disk full), each
        naming `path` as its `filename`. A failed save writes nothing: any file
        already at `path` is unchanged.

        ```python
        >>> import tempfile, pathlib
        >>> cache = KeyValueCache([KeyValueCacheEntry(torch.ones(1, 5, 2, 4), torch.ones(1, 5, 2, 4))])
        >>> folder = tempfile.TemporaryDirectory()
        >>> path = pathlib.Path(folder.name) / "prefix.safetensors"
        >>> cache.save(path)
        >>> KeyValueCache.load(path)[0].keys.shape
        torch.Size([1, 5, 2, 4])
        >>> folder.cleanup()

        ```
        """
        save_cache(self.entries, self.previous_attention_mask, self._frozen, path)

    @classmethod
    def load(cls, path: str | PathLike[str], device: Devices | None = None) -> KeyValueCache:
        """Read a cache written by [`save`][safelens.KeyValueCache.save]; runs no code.

        The loaded cache has fixed entries, one per saved layer, and the frozen flag it
        was saved with. Keys, values, mask and dtype are bitwise as saved.

        **Arguments:**

        - `path`: a file written by `save`.
        - `device`: `None` for each layer's saved device; one device for every layer;
          or a per-layer list (or `{layer: device}` mapping naming every layer). The
          attention mask goes to layer 0's device, as TransformerLens puts it.

        **Raises:** [`CacheFileError`][safelens.CacheFileError] for a truncated,
        corrupt or foreign file (no safelens marker, a pickle, random bytes), an
        unknown format version, or a layer that cannot be put on its device (e.g. a
        cache saved on `cuda` loaded where there is none: pass `device="cpu"`);
        `FileNotFoundError` when there is no file. `ValueError` when `device` (or an
        item of it) names an unknown device, or a list or mapping does not give
        exactly one device per saved layer; `TypeError` when `device` is none of a
        device, a list or a mapping.

        ```python
        >>> import tempfile, pathlib
        >>> entries = [KeyValueCacheEntry(torch.ones(1, 5, 2, 4), torch.ones(1, 5, 2, 4)) for _ in range(2)]
        >>> cache = KeyValueCache(entries)
        >>> folder = tempfile.TemporaryDirectory()
        >>> path = pathlib.Path(folder.name) / "prefix.safetensors"
        >>> cache.save(path)
        >>> loaded = KeyValueCache.load(path, device=["cpu", "cpu"])
        >>> len(loaded), loaded.sequence_length, loaded[1].keys.device
        (2, 5, device(type='cpu'))
        >>> folder.cleanup()

        ```
        """
        return load_cache(
            lambda pairs, mask, frozen: cls(
                [KeyValueCacheEntry(*pair) for pair in pairs], mask, frozen
            ),
            path,
            device,
        )

    def check_fits(self, cfg: Any) -> None:
        """Check this cache fits model config `cfg`: layers, KV heads, `d_head`, dtype.

        **Arguments:**

        - `cfg`: a `HookedTransformerConfig` or a HuggingFace-style config.

        **Raises:** [`CacheConfigError`][safelens.CacheConfigError] listing every
        mismatch, expected (the config's) against found (the cache's).

        ```python
        >>> from types import SimpleNamespace
        >>> cache = KeyValueCache.init_cache(SimpleNamespace(n_layers=2, n_heads=4, d_head=8))
        >>> cache.check_fits(SimpleNamespace(n_layers=2, n_heads=4, d_head=8))
        >>> cache.check_fits(SimpleNamespace(n_layers=2, n_heads=4, d_head=16))
        Traceback (most recent call last):
        ...
        safelens.core._errors.CacheConfigError: the cache does not fit the model config: d_head: cfg expects 16, cache has 8 (layers [0, 1]). ...

        ```
        """
        check_fits(self.entries, cfg)

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

    def __repr__(self) -> str:
        return (
            f"KeyValueCache(layers={len(self)}, batch={self.batch_size}, "
            f"sequence_length={self.sequence_length}, frozen={self._frozen})"
        )
