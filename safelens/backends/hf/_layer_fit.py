"""What an `HFCacheLayer` takes: keys and values that fit it, or the error saying why not.

Two ways in: `update` (HuggingFace attention hands it new positions, `fitted`) and an
assignment `layer.keys = …` (a client that compresses the cache replaces them,
`check_assigned`). Both are checked against what the layer holds before anything is
stored, so a refused tensor leaves the layer as it was.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core._errors import CacheShapeError, FrozenCacheError
from ...core._storage import Sequence

__all__ = ["check_assigned", "fitted"]


def fitted(layer: int, name: str, new: Any, held: Sequence | None) -> torch.Tensor:
    """`new` as a head-major tensor like `held`'s, or a `CacheShapeError` saying why not."""
    where = f"layer {layer}"
    if not isinstance(new, torch.Tensor) or new.dim() != 4 or not new.is_floating_point():
        raise CacheShapeError(
            f"{where}: {name} must be a floating tensor [batch, n_kv_heads, new_tokens, "
            f"d_head] (head-major, as HuggingFace attention passes it), got {_arrived(new)}"
        )
    if held is None:
        return new
    like = held.template
    try:
        new = new.to(device=like.device, dtype=like.dtype)
    except (RuntimeError, NotImplementedError) as error:
        raise CacheShapeError(
            f"{where}: {name} on {new.device} cannot be moved to the cache's device "
            f"{like.device} ({error}); pass tensors on {like.device}"
        ) from None
    batch, _, heads, d_head = like.shape
    if (new.shape[0], new.shape[1], new.shape[3]) == (batch, heads, d_head):
        return new
    message = (
        f"{where}: {name} of shape {tuple(new.shape)} do not fit the cache; expected "
        f"head-major [batch={batch}, n_kv_heads={heads}, new_tokens=any, d_head={d_head}]"
    )
    if new.shape[2] == heads and new.shape[3] == d_head and new.shape[1] != heads:
        message += (
            "; this looks like position-major [batch, pos, heads, d_head] layout (as "
            f"HookedTransformer caches); pass {name}.transpose(1, 2)"
        )
    elif new.shape[0] != batch and batch == 1:
        message += f". To continue a batch-1 cache with {new.shape[0]} rows, use expand(n)"
    raise CacheShapeError(message)


def check_assigned(layer: int, name: str, new: Any, held: Sequence | None, frozen: bool) -> None:
    """A refusal of `cache.layers[layer].{name} = new` where the layer cannot take it.

    **Raises:** [`FrozenCacheError`][safelens.FrozenCacheError] on a frozen cache;
    [`CacheShapeError`][safelens.CacheShapeError] on a layer that has seen nothing, or for
    a tensor of another batch, heads, head size, dtype or device than the layer holds.
    """
    call = f"cache.layers[{layer}].{name} = …"
    if frozen:
        raise FrozenCacheError(
            f"{call} replaces what a frozen cache holds; assign on cache.fork() (or "
            "unfreeze() first)"
        )
    if held is None:
        raise CacheShapeError(
            f"{call}: layer {layer} holds nothing yet, so there is nothing to replace; run a "
            "forward pass into the cache first"
        )
    like = held.template
    batch, _, heads, d_head = like.shape
    fits = (
        isinstance(new, torch.Tensor)
        and new.dim() == 4
        and (new.shape[0], new.shape[1], new.shape[3]) == (batch, heads, d_head)
        and (new.dtype, new.device) == (like.dtype, like.device)
    )
    if not fits:
        raise CacheShapeError(
            f"{call}: expected a head-major tensor [batch={batch}, n_kv_heads={heads}, "
            f"pos=any, d_head={d_head}] of {like.dtype} on {like.device}, as the layer holds; "
            f"got {_arrived(new)}"
        )


def _arrived(value: Any) -> str:
    """What arrived, for an error: a tensor's shape, dtype and device, else its type."""
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype} on {value.device}"
    return type(value).__name__
