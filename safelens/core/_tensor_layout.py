"""Which axis is which in a cache's 4-D key/value tensors: `TensorLayout`.

Every backend caches a layer's keys and values as 4-D tensors, but not the same ones:
TransformerLens' `HookedTransformer` caches position-major `[batch, pos_so_far,
n_kv_heads, d_head]` keys *before* the rotary embedding, HuggingFace attention
head-major `[batch, n_kv_heads, pos_so_far, d_head]` keys *after* it. A `TensorLayout`
names one such convention (axis order, which keys, the cache class that holds it), so
the code that reads sizes from cached tensors (saving, loading, `check_fits`) is written
once for every backend, and a file saved in one convention is refused by the other.
Each backend states its own layout; the core's [`KeyValueCache`][safelens.KeyValueCache]
holds `POSITION_MAJOR`.

Caveat: a layout records a convention, it cannot see one. A tensor in the other layout
whose sizes happen to fit is read as the layout says.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["TensorLayout", "POSITION_MAJOR"]

AXES = ("batch", "pos_so_far", "n_kv_heads", "d_head")


@dataclass(frozen=True)
class TensorLayout:
    """One backend's convention for cached keys and values.

    **Arguments:**

    - `name`: the layout's name, e.g. `"position-major"`; saved in cache files.
    - `axes`: the order of `batch`, `pos_so_far`, `n_kv_heads` and `d_head`.
    - `keys`: which keys are cached, e.g. `"pre-rotary"`.
    - `cache_class`: the class whose `save`/`load` write and read this layout.

    ```python
    >>> head_major = TensorLayout(
    ...     "head-major", ("batch", "n_kv_heads", "pos_so_far", "d_head"), "post-rotary", "HFKeyValueCache"
    ... )
    >>> head_major.shape, head_major.arrange(POSITION_MAJOR.sizes((1, 5, 2, 8)))
    ('[batch, n_kv_heads, pos_so_far, d_head]', (1, 2, 5, 8))

    ```
    """

    name: str
    axes: tuple[str, str, str, str]
    keys: str
    cache_class: str

    def __post_init__(self) -> None:
        if sorted(self.axes) != sorted(AXES):
            raise ValueError(f"axes must order {AXES}, got {self.axes}")

    @property
    def shape(self) -> str:
        """The named shape of a cached tensor, e.g. `[batch, pos_so_far, n_kv_heads, d_head]`."""
        return f"[{', '.join(self.axes)}]"

    @property
    def described(self) -> str:
        """The layout, its shape and its keys, in words."""
        return f"{self.name} {self.shape} tensors with {self.keys} keys"

    def sizes(self, shape: tuple[int, ...]) -> dict[str, int]:
        """The sizes of a 4-D tensor of this layout, by axis name."""
        return dict(zip(self.axes, shape, strict=True))

    def arrange(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """The shape of a tensor of this layout with the given sizes by axis name."""
        return tuple(sizes[axis] for axis in self.axes)


POSITION_MAJOR = TensorLayout(
    "position-major", ("batch", "pos_so_far", "n_kv_heads", "d_head"), "pre-rotary", "KeyValueCache"
)
