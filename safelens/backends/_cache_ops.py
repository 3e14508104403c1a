"""What an experiment does to a cache without the model: `CacheOps`; `cache_ops`.

Read-time ablations take no model, so they reach a cache through
[`CacheOps`][safelens.backends._cache_ops.CacheOps]: read a layer's keys/values, make a
new cache with some layers replaced, crop. One per cache class: `KeyValueCache`
(position-major, pre-rotary keys) and `HFKeyValueCache` (head-major, post-rotary keys),
described by a [`CacheLayout`][safelens.backends._cache_ops.CacheLayout].
[`cache_ops`][safelens.backends._cache_ops.cache_ops] finds a cache's by its class,
importing only that family's adapter.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from importlib import import_module
from typing import Any, ClassVar, Literal, NamedTuple

import torch
from jaxtyping import Int

__all__ = ["CacheLayout", "CacheOps", "CacheShape", "ancestry_of", "cache_ops"]


class CacheLayout(NamedTuple):
    """How a cache class lays out keys and values, and what its keys are.

    **Fields:**

    - `pos_axis`, `heads_axis`: the axes of positions and of key/value heads in the
      4-D tensors the cache holds and its hooks see (batch is always axis 0, `d_head`
      axis 3): `1, 2` for position-major `[batch, pos, n_kv_heads, d_head]`, `2, 1` for
      head-major `[batch, n_kv_heads, pos, d_head]`.
    - `rotary`: `"pre"` when keys are stored before the rotary embedding (the model
      rotates the whole cached sequence on every pass), `"post"` when stored rotated.
    - `hook_prefix`: the cache hook names' prefix, with `{layer}`:
      `"blocks.{layer}.kv_cache"` or `"model.layers.{layer}.kv_cache"`; the four hook
      points are `{hook_prefix}.hook_k_new`, `hook_v_new`, `hook_k_full`, `hook_v_full`.

    ```python
    >>> layout = CacheLayout(pos_axis=2, heads_axis=1, rotary="post", hook_prefix="model.layers.{layer}.kv_cache")
    >>> layout.hook_name(3, "hook_k_new"), layout.shape_names()
    ('model.layers.3.kv_cache.hook_k_new', '[batch, n_kv_heads, pos, d_head]')

    ```
    """

    pos_axis: int
    heads_axis: int
    rotary: Literal["pre", "post"]
    hook_prefix: str

    def hook_name(self, layer: int, point: str) -> str:
        """The name of cache hook point `point` (`"hook_k_new"` …) of layer `layer`."""
        return f"{self.hook_prefix.format(layer=layer)}.{point}"

    def shape_names(self) -> str:
        """The layout in words, for error messages: `[batch, pos, n_kv_heads, d_head]`."""
        axes = ["batch", "", "", "d_head"]
        axes[self.pos_axis], axes[self.heads_axis] = "pos", "n_kv_heads"
        return f"[{', '.join(axes)}]"


class CacheShape(NamedTuple):
    """The sizes of a filled cache: every layer holds one shape of keys and values."""

    n_layers: int
    batch: int
    length: int
    n_kv_heads: int
    d_head: int


class CacheOps(ABC):
    """What experiments do to one cache class without a model; stateless, one instance.

    Besides these, the experiments call the cache's own methods, which every safelens
    cache class has with these meanings: `fork()`, `expand(n)`, `select(rows)` (new
    caches sharing storage, unfrozen), `freeze()`, and `frozen` (truthy when frozen).
    """

    layout: ClassVar[CacheLayout]
    cache_class_name: ClassVar[str]
    keeps_mask: ClassVar[bool]
    """Whether the cache stores the attention mask of its positions (then a pass is
    given only the new tokens' mask by the model family)."""

    @abstractmethod
    def shape(self, cache: Any, what: str) -> CacheShape:
        """The sizes of `cache`, read without changing it.

        **Raises:** [`CacheShapeError`][safelens.CacheShapeError] naming `what` for a
        cache with no layers, a layer without tensors, or layers of several shapes.
        """

    @abstractmethod
    def layer(self, cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s stored `(keys, values)` in `layout`, as read-only views."""

    @abstractmethod
    def stored_mask(self, cache: Any) -> Int[torch.Tensor, "batch pos"] | None:
        """The attention mask the cache stores for its positions, or `None` if it has none."""

    @abstractmethod
    def is_frozen(self, cache: Any) -> bool:
        """Whether `cache` (and every part of it that could store) is frozen."""

    @abstractmethod
    def replaced(self, cache: Any, layers: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """A new frozen cache: `cache` with `layers[l] = (keys, values)` (in `layout`).

        Layers not replaced share `cache`'s storage; `cache` is not changed.
        """

    @abstractmethod
    def cropped(self, cache: Any, length: int) -> Any:
        """A new unfrozen cache of `cache`'s first `length` positions, sharing storage."""

    @abstractmethod
    def length(self, cache: Any) -> int:
        """Positions cached so far (0 for an empty cache)."""

    @abstractmethod
    def batch_size(self, cache: Any) -> int:
        """Rows of the cache, or `0` when it holds nothing yet."""


# (cache class name, its module, the module of its CacheOps, the CacheOps instance)
_CACHES = (
    ("KeyValueCache", "safelens.core._cache", ".hooked._backend", "KEY_VALUE_CACHE"),
    ("HFKeyValueCache", "safelens.backends.hf._cache", ".hf._backend", "HF_CACHE"),
)


def ancestry_of(obj: Any) -> set[tuple[str, str]]:
    """`(module, name)` of `obj`'s class and of each of its bases."""
    return {(cls.__module__, cls.__name__) for cls in type(obj).__mro__}


def cache_ops(cache: Any, what: str = "cache") -> CacheOps:
    """The [`CacheOps`][safelens.backends._cache_ops.CacheOps] of `cache`'s class.

    **Raises:** `TypeError` naming `what` for an object that is no safelens cache.

    ```python
    >>> cache_ops(KeyValueCache()).layout.shape_names()
    '[batch, pos, n_kv_heads, d_head]'

    ```
    """
    ancestry = ancestry_of(cache)
    for name, defined_in, module, ops in _CACHES:
        if (defined_in, name) in ancestry:
            found: CacheOps = getattr(import_module(module, __package__), ops)
            return found
    raise TypeError(
        f"{what} must be a safelens KeyValueCache or HFKeyValueCache, got {type(cache).__name__}"
    )
