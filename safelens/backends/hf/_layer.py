"""One layer of an [`HFKeyValueCache`][safelens.HFKeyValueCache]: `HFCacheLayer`.

HuggingFace attention hands the cache head-major keys and values, `[batch, n_kv_heads,
new_tokens, d_head]`, keys *after* the rotary embedding. A layer stores them in two
safelens `Sequence`s (see `safelens.core._storage`) in position-major layout, `[batch, pos,
n_kv_heads, d_head]`: a `Sequence` grows along axis 1, and the transpose between the two
layouts is a free view, so appends stay amortised O(1) and branches share storage
copy-on-write, exactly as in [`KeyValueCache`][safelens.KeyValueCache].

The four hook points are named `model.layers.{layer}.kv_cache.…` (`naming="hf"`) or,
for a cache used through a TransformerBridge, `blocks.{layer}.kv_cache.…`
(`naming="bridge"`, the bridge's own scheme). They see HuggingFace's head-major layout,
what `update` receives and returns: `hook_k_new`/`hook_v_new` the new post-rotary
keys/values, whose results are stored (write-time); `hook_k_full`/`hook_v_full` a copy
of all cached plus new keys/values handed to attention, never stored (read-time). With grouped-query attention
the heads axis has `num_key_value_heads` entries.

Sliding-window layers: a layer made with `sliding_window=W` (what `HFKeyValueCache(config=)`
makes of the layers `DynamicCache(config=)` makes sliding) holds only the last `W - 1`
positions after each update, as `DynamicSlidingWindowLayer` does, and reports the same
mask sizes and `get_seq_length` (every position seen). Its `hook_k_full`/`hook_v_full`
see what attention reads: the held window plus the new positions.

Caveat: a layer made without a window stores everything it is given, also for a
sliding-window model (the mask applies the window), at the cost of memory; safelens'
experiments and cache files need that full history.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, get_args

import torch
from jaxtyping import Float
from transformers.cache_utils import CacheLayerMixin, DynamicCache, DynamicSlidingWindowLayer

from ...core._errors import CacheShapeError
from ...core._hook_point import CacheHookPoint
from ...core._storage import Sequence
from ._layer_fit import check_assigned, fitted
from ._shared_read import note_read

__all__ = [
    "HFCacheLayer",
    "HookNaming",
    "hf_hook_name",
    "sliding_windows",
    "HOOK_POINTS",
    "HOOK_PREFIXES",
]

HOOK_POINTS = ("hook_k_new", "hook_v_new", "hook_k_full", "hook_v_full")
HookNaming = Literal["hf", "bridge"]
HOOK_PREFIXES: dict[str, str] = {"hf": "model.layers", "bridge": "blocks"}


def hf_hook_name(layer: int, point: str, naming: HookNaming = "hf") -> str:
    """The name of hook point `point` of layer `layer`: `{prefix}.{layer}.kv_cache.{point}`.

    The prefix is `model.layers` for `naming="hf"`, `blocks` for `naming="bridge"`.
    """
    return f"{HOOK_PREFIXES[naming]}.{layer}.kv_cache.{point}"


def sliding_windows(config: Any) -> list[int | None]:
    """Per layer, the window `DynamicCache(config=config)` keeps, or `None` for all positions.

    Only a HuggingFace config (one with `get_text_config`) says; any other gives `[]`.
    """
    if not hasattr(config, "get_text_config"):
        return []
    return [
        layer.sliding_window if isinstance(layer, DynamicSlidingWindowLayer) else None
        for layer in DynamicCache(config=config).layers
    ]


def check_naming(naming: Any) -> HookNaming:
    """`naming` if it is a hook naming scheme, else a `ValueError` listing them."""
    if naming not in get_args(HookNaming):
        raise ValueError(
            f"naming must be one of {get_args(HookNaming)} (cache hook names "
            f"model.layers.{{layer}}.kv_cache.… or blocks.{{layer}}.kv_cache.…), got {naming!r}"
        )
    result: HookNaming = naming
    return result


class HFCacheLayer(CacheLayerMixin):
    """Keys and values of one layer, stored position-major, seen head-major.

    **Arguments:**

    - `layer`: the layer index, used in hook names and error messages.
    - `keys`, `values`: `Sequence`s of `[batch, pos, n_kv_heads, d_head]`, or `None` for
      a layer that has seen nothing yet.
    - `naming`: the hook naming scheme, `"hf"` or `"bridge"` (see `hf_hook_name`).
    - `sliding_window`: keep only the last `sliding_window - 1` positions, or `None` to
      keep every position.
    - `evicted`: positions already dropped from the front of `keys`/`values`.
    """

    is_compileable = False
    is_croppable = True

    hook_k_new: CacheHookPoint
    hook_v_new: CacheHookPoint
    hook_k_full: CacheHookPoint
    hook_v_full: CacheHookPoint

    # CacheLayerMixin.__init__ is not called: it sets `keys`/`values`, properties here.
    def __init__(
        self,
        layer: int,
        keys: Sequence | None = None,
        values: Sequence | None = None,
        naming: HookNaming = "hf",
        sliding_window: int | None = None,
        evicted: int = 0,
    ) -> None:
        self.layer = layer
        self.naming = naming
        self._keys = keys
        self._values = values
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.evicted = evicted
        # Set by the cache that holds this layer: a frozen one refuses assigned keys/values.
        self.frozen = False
        # While `generate` may roll back (assisted decoding), keep what the window drops.
        self.record_past = False
        for point in HOOK_POINTS:
            name = hf_hook_name(layer, point, naming)
            setattr(self, point, CacheHookPoint(name, "[batch, n_kv_heads, pos, d_head]"))

    def __repr__(self) -> str:
        return f"HFCacheLayer(layer={self.layer}, length={self.get_seq_length()})"

    # -- what HuggingFace reads -------------------------------------------------------

    @property
    def is_initialized(self) -> bool:
        return self._keys is not None

    # HuggingFace reads them; a client that compresses the cache assigns them (`_assigned`).
    @property
    def keys(self) -> Float[torch.Tensor, "batch n_heads pos_so_far d_head"] | None:
        """The cached keys, head-major (a view of the storage), or `None`."""
        return None if self._keys is None else self._keys.view().transpose(1, 2)

    @keys.setter
    def keys(self, keys: torch.Tensor | None) -> None:
        self._keys = self._assigned("keys", keys, self._keys)

    @property
    def values(self) -> Float[torch.Tensor, "batch n_heads pos_so_far d_head"] | None:
        """The cached values, head-major (a view of the storage), or `None`."""
        return None if self._values is None else self._values.view().transpose(1, 2)

    @values.setter
    def values(self, values: torch.Tensor | None) -> None:
        self._values = self._assigned("values", values, self._values)

    def _assigned(self, name: str, new: Any, held: Sequence | None) -> Sequence:
        """What `layer.keys = new` (or `values`) stores: a copy of `new`, position-major.

        As `DynamicLayer`, where a client that compresses the cache (kvpress' presses)
        assigns fewer positions; `keys` and `values` are assigned one after the other, so
        their lengths may differ until both are. A sliding-window layer keeps counting
        every position seen, as `DynamicSlidingWindowLayer`'s `cumulative_length`.
        Checked first (`check_assigned`): the layer is then unchanged on an error.
        """
        check_assigned(self.layer, name, new, held, self.frozen)
        if name == "keys" and self.sliding_window is not None:
            self.evicted = max(self.get_seq_length() - new.shape[2], 0)
        return Sequence.of(new.transpose(1, 2).clone(memory_format=torch.contiguous_format))

    @property
    def dtype(self) -> torch.dtype:
        """The keys' dtype (as `DynamicLayer`'s, set at the first update)."""
        return self._template("dtype").dtype

    @property
    def device(self) -> torch.device:
        """The keys' device (as `DynamicLayer`'s, set at the first update)."""
        return self._template("device").device

    def _template(self, name: str) -> torch.Tensor:
        if self._keys is None:
            raise AttributeError(f"layer {self.layer} has no {name} before its first update")
        return self._keys.template

    @property
    def batch(self) -> int | None:
        """Rows of the stored tensors, `None` before the first update."""
        return None if self._keys is None else int(self._keys.template.shape[0])

    def get_seq_length(self) -> int:
        """Every position seen, evicted ones included (`DynamicCache`'s meaning)."""
        return self.evicted + (0 if self._keys is None else self._keys.length)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """`(kv_length, kv_offset)` of what attention reads, as `DynamicCache`'s layers."""
        seen, window = self.get_seq_length(), self.sliding_window
        if window is None or seen < window:
            return seen + query_length, max(seen - window + 1, 0) if window else 0
        return window - 1 + query_length, seen - window + 1

    def get_max_length(self) -> int:
        return -1 if self.sliding_window is None else self.sliding_window

    def activate_past_recording(self, **kwargs: Any) -> None:
        """Keep what the window would drop until the next `crop` (assisted decoding)."""
        self.record_past = self.is_sliding

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Start empty storage shaped like head-major `key_states`/`value_states`."""

        def empty(like: torch.Tensor) -> Sequence:
            batch, heads, _, d_head = like.shape
            return Sequence.of(like.new_empty((batch, 0, heads, d_head)))

        self._keys, self._values = empty(key_states), empty(value_states)

    # -- the seam ---------------------------------------------------------------------

    def update(
        self,
        key_states: Float[torch.Tensor, "batch n_heads new_tokens d_head"],
        value_states: Float[torch.Tensor, "batch n_heads new_tokens d_head"],
        *args: Any,
        store: bool = True,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values (unless `store=False`); return cached + new, head-major.

        Hook points fire in order `hook_k_new`, `hook_v_new` (their results are what is
        stored), then `hook_k_full`, `hook_v_full` on copies of the returned tensors.
        `args`/`kwargs` are what HuggingFace attention passes along; they are ignored.

        **Raises:** [`CacheShapeError`][safelens.CacheShapeError] for keys or values that
        do not fit; [`HookError`][safelens.HookError] for a hook returning a tensor of
        another shape. What was stored may then have changed: the cache's `update`
        restores the whole cache.
        """
        new_keys = fitted(self.layer, "key_states", key_states, self._keys)
        new_values = fitted(self.layer, "value_states", value_states, self._values)
        if (new_keys.shape[0], new_keys.shape[2]) != (new_values.shape[0], new_values.shape[2]):
            raise CacheShapeError(
                f"layer {self.layer}: key_states of shape {tuple(new_keys.shape)} and "
                f"value_states of shape {tuple(new_values.shape)} need the same batch and "
                "new_tokens sizes ([batch, n_kv_heads, new_tokens, d_head])"
            )
        if self.hook_k_new.fwd_hooks:
            new_keys = self.hook_k_new(new_keys)
        if self.hook_v_new.fwd_hooks:
            new_values = self.hook_v_new(new_values)
        if store and self._keys is None:
            self.lazy_initialization(new_keys, new_values)
        # What the returned tensors begin with: a sliding layer replaces its storage.
        keys_read, values_read = self._keys, self._values
        if self.sliding_window is None:
            full_keys = _write(self._keys, new_keys, store)
            full_values = _write(self._values, new_values, store)
            exact = True
        else:
            full_keys, full_values, exact = self._slide(new_keys, new_values, store)
        # A read-time hook gets a tensor of its own, so nothing it does reaches storage.
        if self.hook_k_full.fwd_hooks:
            full_keys = self.hook_k_full(full_keys.clone())
        if self.hook_v_full.fwd_hooks:
            full_values = self.hook_v_full(full_values.clone())
        # Under `shared_prefix`, attention may read a broadcast prefix from storage instead.
        exact = exact and not (self.hook_k_full.fwd_hooks or self.hook_v_full.fwd_hooks)
        note_read(keys_read, values_read, full_keys, full_values, exact)
        return full_keys, full_values

    def _slide(
        self, new_keys: torch.Tensor, new_values: torch.Tensor, store: bool
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Held + new, head-major, as far as the window reads; store the last `W - 1`.

        As `DynamicSlidingWindowLayer.update`: the join is a new tensor and the layer keeps
        a view of its tail, so it holds what `DynamicCache` holds.
        """
        if self._keys is None or self._values is None or self.sliding_window is None:
            return new_keys, new_values, True  # a frozen layer that holds nothing yet
        keep = self.sliding_window - 1
        full_keys = self._keys.joined(new_keys.transpose(1, 2))
        full_values = self._values.joined(new_values.transpose(1, 2))
        length, visible = full_keys.shape[1], keep + new_keys.shape[2]
        if store:
            kept = length if self.record_past else min(length, keep)
            self.evicted += length - kept
            self._keys = Sequence.of(full_keys.narrow(1, length - kept, kept))
            self._values = Sequence.of(full_values.narrow(1, length - kept, kept))
        if length > visible:
            full_keys = full_keys.narrow(1, length - visible, visible)
            full_values = full_values.narrow(1, length - visible, visible)
        return full_keys.transpose(1, 2), full_values.transpose(1, 2), length <= visible

    # -- branching --------------------------------------------------------------------

    def derived(self, op: Callable[[Sequence], Sequence]) -> HFCacheLayer:
        """A new layer whose storage is `op` of this one's, with empty hook points."""
        window = self.sliding_window
        if self._keys is None or self._values is None:
            return HFCacheLayer(self.layer, naming=self.naming, sliding_window=window)
        keys, values = op(self._keys), op(self._values)
        return HFCacheLayer(self.layer, keys, values, self.naming, window, self.evicted)

    def replace(self, op: Callable[[Sequence], Sequence]) -> None:
        """In place: this layer's storage becomes `op` of it (hooks stay attached)."""
        if self._keys is not None and self._values is not None:
            self._keys, self._values = op(self._keys), op(self._values)

    def reset(self) -> None:
        """In place: drop the storage, as if the layer had seen nothing."""
        self._keys = self._values = None
        self.evicted = 0

    def crop_(self, tokens_to_remove: int) -> None:
        """In place: drop the last `tokens_to_remove` positions (HuggingFace's `crop(-k)`).

        A sliding-window layer then keeps its last `W - 1` positions again, as
        `DynamicSlidingWindowLayer.crop` does; once it has dropped positions, only what it
        recorded since `activate_past_recording` can be dropped.

        **Raises:** [`CacheShapeError`][safelens.CacheShapeError] for positions a
        sliding-window layer no longer holds; the layer is then unchanged.
        """
        if self._keys is None or self._values is None:
            return
        held = self._keys.length
        if self.sliding_window is None:
            tokens_to_remove = min(tokens_to_remove, held)
        elif tokens_to_remove > held or (
            self.evicted and tokens_to_remove and not self.record_past
        ):
            raise CacheShapeError(
                f"crop(-{tokens_to_remove}): layer {self.layer} is a sliding-window layer "
                f"that holds only its last {held} of {self.get_seq_length()} positions, so it "
                "cannot drop positions past them; call cache.activate_past_recording() before "
                "the passes to undo (as DynamicCache needs)"
            )
        kept = held - tokens_to_remove
        start = 0 if self.sliding_window is None else max(kept - self.sliding_window + 1, 0)
        if kept == held and start == 0:
            return  # nothing to drop: the storage (and its spare room) stays
        self._keys = Sequence.of(self._keys.view().narrow(1, start, kept - start))
        self._values = Sequence.of(self._values.view().narrow(1, start, kept - start))
        self.evicted += start

    def snapshot(self) -> Callable[[], None]:
        """A function that puts this layer's storage back as it is now."""
        keys, values, evicted = self._keys, self._values, self.evicted
        states = [(s, s.snapshot()) for s in (keys, values) if s is not None]

        def restore() -> None:
            self._keys, self._values, self.evicted = keys, values, evicted
            for sequence, state in states:
                sequence.restore(state)

        return restore

    def storages(self) -> list[int]:
        """Data pointers of the storage this layer reads, for sharing checks."""
        return [p for s in (self._keys, self._values) if s is not None for p in s.storages()]


def _write(held: Sequence | None, new: torch.Tensor, store: bool) -> torch.Tensor:
    """`held` followed by head-major `new`, head-major; stored in `held` when `store`."""
    if held is None:
        return new
    new = new.transpose(1, 2)
    full = held.append_(new) if store else held.joined(new)
    return full.transpose(1, 2)
