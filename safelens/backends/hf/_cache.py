"""A safelens cache for HuggingFace causal LMs: `HFKeyValueCache`, a `transformers.Cache`.

Pass it to a HuggingFace causal LM's forward or `generate` (under the name
[`hf_cache_argument`][safelens.hf_cache_argument] gives) and it gives the model's own
numbers, storing keys and values in safelens storage (`safelens.backends.hf._layer`): amortised
O(1) appends, freezing, copy-on-write branches and hook points on keys and values
(`safelens.backends.hf._hooks`). `update` is the seam: head-major `[batch, n_kv_heads,
new_tokens, d_head]` keys after the rotary embedding (`safelens.backends.hf._cache_passes`
holds it and the passes' bookkeeping; this module, the cache's construction, branches and
files).

A pass whose `update` raises (a hook raises or returns a misfit, keys that do not fit)
leaves the cache as it was before the pass: every layer is snapshotted at the pass's
first update and restored. For failures the cache cannot see (a model hook raising
between layers, an interrupt), run the pass in `with cache.guard():`.

Caveats: `crop`, `reorder_cache`, `batch_repeat_interleave`, `batch_select_indices` and
`reset` are HuggingFace's *in-place* methods (`generate` calls them; they live in
`safelens.backends.hf._transformers_cache` with the queries HuggingFace reads): unlike
`KeyValueCache.crop`, `crop(-k)` here mutates, `crop(n)` with `n > 0` is refused, and
`cropped` is the non-mutating crop. A frozen cache stores nothing and refuses the
in-place methods that would change it, so run `generate` and multi-step loops on
`cache.fork()` (`generate` handed a frozen cache is refused, see
`safelens.backends.hf._frozen_pass`). Sliding-window layers hold what `DynamicCache`
holds: with `config=` a HuggingFace config, the layers `DynamicCache(config=)` makes
sliding keep only their window (`HFKeyValueCache()` without a config, like
`DynamicCache()`, and the caches safelens' experiments make keep every position, which
ablations, patching by position, `cropped` and `save` need). Saving and loading
(`safelens.backends.hf._persistence`) use head-major files that `KeyValueCache` refuses,
and the other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from os import PathLike
from typing import Any

import torch

from ...core._config import CacheDimensions
from ...core._errors import CacheShapeError
from ...core._persistence import Devices
from ...core._storage import Sequence
from ._cache_passes import CachePasses
from ._frozen_pass import FrozenPasses
from ._layer import HookNaming, check_naming, sliding_windows
from ._model import check_cacheable
from ._persistence import check_layers_fit, load_layers, save_layers, text_config
from ._pytree import register_cache_pytree

__all__ = ["HFKeyValueCache"]


class HFKeyValueCache(CachePasses):
    """A `transformers.Cache` whose storage, freezing and hook points are safelens'.

    Keys and values are head-major `[batch, n_kv_heads, pos_so_far, d_head]`, keys after
    the rotary embedding, as HuggingFace attention hands them to `update`.

    Two kinds of methods, named so that neither a HuggingFace nor a safelens user is
    surprised: `fork`, `expand`, `select`, `cropped` and `clone` return a new cache and
    never change this one (as `KeyValueCache`'s `fork`, `expand`, `select`, `crop` and
    `clone`); `crop`, `reorder_cache`, `batch_repeat_interleave`, `batch_select_indices`
    and `reset` are HuggingFace's in-place methods, which `generate` calls. `crop(-k)`
    drops the last `k` positions in place; `crop(n)` with `n > 0`, `KeyValueCache.crop`'s
    "keep the first `n`", is refused (as transformers 5 refuses it) with a pointer to
    `cropped(n)`. A frozen cache refuses every in-place call that would change it with a
    [`FrozenCacheError`][safelens.FrozenCacheError], so `generate` runs on `cache.fork()`.

    **Arguments:**

    - `config`: a HuggingFace config (or `None`). With one, the cache starts with one
      empty layer per `num_hidden_layers`, so every hook point exists before the first
      forward, and the layers `DynamicCache(config=config)` makes sliding keep only their
      window, as there; without, layers are created on first use and keep every
      position.
    - `frozen`: start frozen.
    - `naming`: the hook names' scheme: `"hf"` for `model.layers.{layer}.kv_cache.…`,
      `"bridge"` for `blocks.{layer}.kv_cache.…`, beside a TransformerBridge's own
      `blocks.{layer}.…` hook names.

    **Raises:** [`CacheConfigError`][safelens.CacheConfigError] for a config without a
    layer count, or with layers that store no keys and values (convolution, state-space
    or linear-attention layers: LFM2, Mamba, Jamba, Qwen3-Next, MiniMax).

    ```python
    >>> cache = HFKeyValueCache()
    >>> keys, values = cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    >>> keys.shape, cache.get_seq_length(), cache.layers[0].hook_k_new.name
    (torch.Size([1, 2, 3, 4]), 3, 'model.layers.0.kv_cache.hook_k_new')

    ```
    """

    def __init__(self, config: Any = None, frozen: bool = False, naming: HookNaming = "hf") -> None:
        super().__init__(layers=[])
        self.naming = check_naming(naming)
        self._windows = sliding_windows(config)
        if config is not None:
            text = text_config(config)
            check_cacheable(text, f"config {type(config).__name__}")
            self._grow(CacheDimensions.of(text).n_layers)
        self._frozen = bool(frozen)
        self._user_defined = False
        self._frozen_passes = FrozenPasses()
        self._pass: Callable[[], None] | None = None
        self._last_layer = -1
        self._level = 0

    # -- branching (never mutates this cache) ------------------------------------------

    def _derived(self, op: Callable[[Sequence], Sequence]) -> HFKeyValueCache:
        return self._derived_each([op] * len(self.layers))

    def _derived_each(self, ops: list[Callable[[Sequence], Sequence]]) -> HFKeyValueCache:
        """A new cache whose layer `l` is `ops[l]` of this one's."""
        result = HFKeyValueCache(naming=self.naming)
        result._windows = self._windows
        result.layers.extend(layer.derived(op) for layer, op in zip(self.layers, ops, strict=True))
        return result

    def fork(self) -> HFKeyValueCache:
        """A branch sharing everything cached so far, taking its own updates (unfrozen).

        ```python
        >>> prefix = HFKeyValueCache()
        >>> _ = prefix.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), 0)
        >>> branch = prefix.fork()
        >>> _ = branch.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), 0)
        >>> branch.get_seq_length(), prefix.get_seq_length()
        (6, 5)

        ```
        """
        return self._derived(Sequence.fork)

    def expand(self, n: int) -> HFKeyValueCache:
        """This batch-1 cache broadcast to `n` rows without copying it (unfrozen).

        **Raises:** [`CacheShapeError`][safelens.CacheShapeError] when the batch is not 1.

        ```python
        >>> prefix = HFKeyValueCache()
        >>> _ = prefix.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), 0)
        >>> prefix.expand(8).layers[0].keys.shape
        torch.Size([8, 2, 5, 4])

        ```
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        if self.batch_size != 1:
            raise CacheShapeError(
                f"expand(n) needs a batch-1 cache; this cache has batch {self.batch_size}"
                f"{' (it holds nothing yet)' if self.batch_size < 0 else ''}. Use "
                "select([row]) first to pick one row"
            )
        return self._derived(lambda seq: seq.expand(n))

    def cropped(self, length: int) -> HFKeyValueCache:
        """The first `length` positions (negative: all but the last `-length`), unfrozen.

        Shares storage with this cache, which is unchanged (`crop` is HF's in-place one).

        ```python
        >>> cache = HFKeyValueCache()
        >>> _ = cache.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), 0)
        >>> cache.cropped(3).get_seq_length(), cache.cropped(-1).get_seq_length()
        (3, 4)

        ```
        """
        total = self.get_seq_length()
        if isinstance(length, bool) or not isinstance(length, int):
            raise TypeError(f"length must be an int, got {type(length).__name__}")
        kept = total + length if length < 0 else length
        if not 0 <= kept <= total:
            raise ValueError(
                f"length must be in [-{total}, {total}] for a cache of {total} positions, "
                f"got {length}"
            )
        slid = [layer.layer for layer in self.layers if layer.evicted]
        if slid and kept < total:
            raise CacheShapeError(
                f"cropped({length}): sliding-window layers {slid} hold only their last "
                "positions (as DynamicCache holds them), not the ones a shorter cache would "
                "read; make the cache with HFKeyValueCache() (no config), which keeps every "
                "position, to crop it"
            )
        return self._derived(lambda seq: seq.crop(min(kept, seq.length)))

    def select(self, rows: int | slice | list[int] | torch.Tensor) -> HFKeyValueCache:
        """The batch rows `rows` (any index torch accepts), in storage of their own.

        `rows` is an int, a slice, a list of ints, an integer or bool tensor, or `None`
        for every row (as `tensor[None]` keeps every row); floats and bools, which torch
        would read as other rows than meant, are refused.

        ```python
        >>> cache = HFKeyValueCache()
        >>> _ = cache.update(torch.zeros(4, 2, 5, 4), torch.zeros(4, 2, 5, 4), 0)
        >>> cache.select([0, 2]).batch_size, cache.select(-1).batch_size
        (2, 1)

        ```
        """
        index = self._rows(rows)
        return self._derived(lambda seq: seq.select(index))

    def _repeated(self, runs: list[int], batch: int) -> HFKeyValueCache:
        """Layer `l`'s `batch` rows repeated `runs[l]` times (run-major), unfrozen.

        For a pass whose batch grows from layer to layer (a patching sweep's staggered
        pass, [`joining`][safelens.backends.hf._skip.joining]); a batch-1 cache is
        broadcast without copying.
        """

        def repeat(count: int) -> Callable[[Sequence], Sequence]:
            index = torch.arange(batch).repeat(count)
            return lambda seq: seq.expand(count) if batch == 1 else seq.select(index)

        return self._derived_each([repeat(count) for count in runs])

    def clone(self) -> HFKeyValueCache:
        """An independent deep copy (same frozen flag), sharing no storage."""
        result = self._derived(Sequence.clone)
        result._frozen = self._frozen
        return result

    # -- persistence ------------------------------------------------------------------

    def save(self, path: str | PathLike[str]) -> None:
        """Write this cache to a safetensors file at `path`; the cache is unchanged.

        The file holds each layer's keys and values head-major, `[batch, n_kv_heads,
        pos_so_far, d_head]`, post-rotary keys, as `layers[l].keys` shows them, and
        metadata: format marker and version, layout (`head-major`), `n_layers`,
        `n_kv_heads`, `d_head`, dtype, sequence length, batch size, the frozen flag, each
        layer's device and checksums. Forks and `expand(n)` results save materialised.

        **Arguments:**

        - `path`: where to write (an existing file is replaced).

        **Raises:** [`CacheShapeError`][safelens.CacheShapeError] when the cache has no
        layer, a layer that holds nothing yet, or layers of differing shape or dtype;
        `FileNotFoundError` / `OSError` naming `path` when writing fails (any file
        already there is then unchanged), as [`KeyValueCache.save`][safelens.KeyValueCache.save].

        ```python
        >>> import tempfile, pathlib
        >>> cache = HFKeyValueCache()
        >>> _ = cache.update(torch.ones(1, 2, 5, 4), torch.ones(1, 2, 5, 4), 0)
        >>> folder = tempfile.TemporaryDirectory()
        >>> path = pathlib.Path(folder.name) / "prefix.safetensors"
        >>> cache.save(path)
        >>> HFKeyValueCache.load(path).layers[0].keys.shape
        torch.Size([1, 2, 5, 4])
        >>> folder.cleanup()

        ```
        """
        save_layers(self.layers, self._frozen, path)

    @classmethod
    def load(
        cls, path: str | PathLike[str], device: Devices | None = None, naming: HookNaming = "hf"
    ) -> HFKeyValueCache:
        """Read a cache written by [`save`][safelens.HFKeyValueCache.save]; runs no code.

        The loaded cache has one layer per saved layer, the saved frozen flag, and
        keys and values bitwise as saved; it continues as the saved cache would.

        **Arguments:**

        - `path`: a file written by `HFKeyValueCache.save`.
        - `device`: `None` for each layer's saved device; one device for every layer;
          or a per-layer list (or `{layer: device}` mapping naming every layer).
        - `naming`: the hook names' scheme, as for the constructor.

        **Raises:** [`CacheFileError`][safelens.CacheFileError] for a truncated,
        corrupt, hostile or foreign file, one of another format version, one saved by
        `KeyValueCache.save` (position-major, pre-rotary keys; the error says so), or
        a layer that cannot be put on its device; `FileNotFoundError` when there is no
        file; `ValueError` / `TypeError` for a bad `device`, as `KeyValueCache.load`.

        ```python
        >>> import tempfile, pathlib
        >>> cache = HFKeyValueCache()
        >>> for layer in (0, 1):
        ...     _ = cache.update(torch.ones(1, 2, 5, 4), torch.ones(1, 2, 5, 4), layer)
        >>> cache.freeze()
        >>> folder = tempfile.TemporaryDirectory()
        >>> path = pathlib.Path(folder.name) / "prefix.safetensors"
        >>> cache.save(path)
        >>> HFKeyValueCache.load(path, device="cpu", naming="bridge")
        HFKeyValueCache(layers=2, batch=1, sequence_length=5, frozen=True)
        >>> folder.cleanup()

        ```
        """
        layers, frozen = load_layers(path, device, check_naming(naming))
        cache = cls(naming=naming)
        cache.layers.extend(layers)
        cache._frozen = frozen  # after the layers: each is told
        return cache

    def check_fits(self, config: Any) -> None:
        """Check this cache fits HuggingFace `config`: layers, KV heads, `d_head`, dtype.

        Layers that hold nothing yet fit any config.

        **Arguments:**

        - `config`: a HuggingFace config (a multimodal config's text config is read),
          whose `dtype` is compared (float32 when unset); or the model itself, whose
          parameters' dtype is compared (a model cast with `.to(dtype)` keeps the dtype
          its config was made with).

        **Raises:** [`CacheConfigError`][safelens.CacheConfigError] listing every
        mismatch, expected (the config's) against found (the cache's).

        ```python
        >>> from types import SimpleNamespace
        >>> cache = HFKeyValueCache()
        >>> _ = cache.update(torch.ones(1, 2, 5, 4), torch.ones(1, 2, 5, 4), 0)
        >>> cache.check_fits(SimpleNamespace(num_hidden_layers=1, num_attention_heads=2, head_dim=4))
        >>> cache.check_fits(SimpleNamespace(num_hidden_layers=1, num_attention_heads=2, head_dim=8))
        Traceback (most recent call last):
        ...
        safelens.CacheConfigError: the cache does not fit the model config: d_head: cfg expects 8, cache has 4 (layers [0]). ...

        ```
        """
        check_layers_fit(self.layers, config)

    # -- views ------------------------------------------------------------------------

    def storages(self) -> set[int]:
        """Data pointers of all storage this cache reads, to check sharing."""
        return {ptr for layer in self.layers for ptr in layer.storages()}

    def __repr__(self) -> str:
        return (
            f"HFKeyValueCache(layers={len(self.layers)}, batch={self.batch_size}, "
            f"sequence_length={self.get_seq_length()}, frozen={self._frozen})"
        )


register_cache_pytree(HFKeyValueCache)
