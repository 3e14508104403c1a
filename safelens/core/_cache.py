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

from collections.abc import Callable
from os import PathLike
from typing import Any

import torch
from jaxtyping import Int

from ._arguments import integer, positive_int
from ._cache_entry import KeyValueCacheEntry
from ._cache_layout import check_layout, row_index
from ._cache_state import CacheState, held_mask
from ._config import CacheDimensions
from ._errors import CacheShapeError
from ._fit import check_fits
from ._persistence import Devices, load_cache, save_cache
from ._storage import Sequence
from ._values import check_numbers

__all__ = ["KeyValueCache"]


class KeyValueCache(CacheState):
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
        check_numbers(previous_attention_mask, "previous_attention_mask")
        check_layout(given, previous_attention_mask)
        self._lazy = entries is None
        self._entries = {layer: entry.adopted(layer) for layer, entry in given.items()}
        self._mask = held_mask(previous_attention_mask)
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
        result._mask = held_mask(mask)
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

        `rows` is an int, a slice, a list of ints, an integer or bool tensor, or `None`
        for every row (as `tensor[None]` keeps every row); floats and bools, which torch
        would read as other rows than meant, are refused.

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
        safelens.CacheConfigError: the cache does not fit the model config: d_head: cfg expects 16, cache has 8 (layers [0, 1]). ...

        ```
        """
        check_fits(self.entries, cfg)

    def __repr__(self) -> str:
        return (
            f"KeyValueCache(layers={len(self)}, batch={self.batch_size}, "
            f"sequence_length={self.sequence_length}, frozen={self._frozen})"
        )
