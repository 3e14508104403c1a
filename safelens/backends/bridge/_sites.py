"""Where a sweep patches on a TransformerBridge: its hook points, keys and values at its cache.

| `activation` | hook | clean cache name |
| --- | --- | --- |
| `k` | `blocks.{l}.kv_cache.hook_k_new`, head-major, after the rotary embedding | `blocks.{l}.attn.hook_rot_k` (`attn.hook_k` without rotary) |
| `v` | `blocks.{l}.kv_cache.hook_v_new` | `blocks.{l}.attn.hook_v` |
| `pattern`, `attn_scores` | `blocks.{l}.attn.hook_pattern`, `hook_attn_scores`, `[batch, n_heads, dest_pos, src_pos]` | the same |
| the others | `blocks.{l}.{name}` as TransformerLens names it (`attn.hook_q`, `hook_resid_pre`, …) | the same |

TransformerLens patches `attn.hook_k`, before the rotary embedding; for a patch at one
position the two are the same patch, because the rotation of a position is a fixed
linear map of that position's key (the clean and the corrupted run give a position the
same rotary angle). On a bridge whose attention never fires `attn.hook_rot_k` (Phi-3's
joint projection), so that the clean cache has `attn.hook_k` alone, keys are patched at
`attn.hook_k`, as TransformerLens patches them. What attribution reads is
TransformerLens' hook points (`safelens.backends._sites.tl_site`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._sites import TL_NAMES, Site, tl_heads, tl_site
from ..hf._sites import kv_site

if TYPE_CHECKING:
    from .._backend import Backend

__all__ = ["bridge_site"]


def _has(cache: Any, name: str) -> bool:
    """Whether `cache` (an `ActivationCache`, a dict, or `None`) holds `name`."""
    try:
        return cache is not None and name in cache.keys()
    except (AttributeError, TypeError):
        return False


def bridge_site(backend: Backend, activation: str, clean_cache: Any = None) -> Site:
    """Where a sweep patches `activation` on a bridge (module notes), given its clean cache."""
    unrotated = not _has(clean_cache, "blocks.0.attn.hook_rot_k") and _has(
        clean_cache, "blocks.0.attn.hook_k"
    )
    if activation == "k" and unrotated:
        return tl_site(activation, backend.n_kv_heads)
    if activation in ("k", "v"):
        rotary = activation == "k" and "blocks.0.attn.hook_rot_k" in backend.model.hook_dict
        name = "attn.hook_rot_k" if rotary else TL_NAMES[activation]

        def clean(layer: int) -> str:
            return f"blocks.{layer}.{name}"

        return kv_site(backend, activation, clean)
    return tl_site(activation, tl_heads(backend, activation))
