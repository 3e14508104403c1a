"""What a model family declares for patching: its sites.

A site is one activation of every layer, as the patching experiments reach it: the hook
where a patch is written (or where attribution reads the activation and its gradient),
the clean cache's name for it, and the layout both share (positions on `pos_axis`,
heads on `head_axis`, how many heads). Each family's adapter declares its own
(`Backend.patch_site`, `Backend.read_site`, `Backend.qk_sites`):

- TransformerLens' hook points, `blocks.{l}.{name}` (`tl_site`), for a
  `HookedTransformer` and for what attribution reads on a TransformerBridge: keys and
  queries *before* the rotary embedding at `attn.hook_k` / `attn.hook_q`, after it at
  `attn.hook_rot_k` / `attn.hook_rot_q`; key/value heads `n_key_value_heads` under
  grouped-query attention.
- A HuggingFace causal LM's seams and cache hooks (`safelens.backends.hf._sites`): keys
  and queries *after* the rotary embedding.
- A TransformerBridge's patches (`safelens.backends.bridge._sites`): its hook points,
  keys and values at its cache's hooks, after the rotary embedding.

The docs' table "Patching sites" (`docs/concepts/sites.md`) says what each holds per
family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._backend import Backend

__all__ = ["PATTERNS", "QUERY_HEADS", "TL_NAMES", "Site", "tl_heads", "tl_site"]

# TransformerLens' names under `blocks.{layer}.` (`get_act_name`), without importing it.
TL_NAMES = {
    "resid_pre": "hook_resid_pre",
    "resid_mid": "hook_resid_mid",
    "attn_out": "hook_attn_out",
    "mlp_out": "hook_mlp_out",
    "q": "attn.hook_q",
    "k": "attn.hook_k",
    "v": "attn.hook_v",
    "z": "attn.hook_z",
    "pattern": "attn.hook_pattern",
    "attn_scores": "attn.hook_attn_scores",
    "resid_post": "hook_resid_post",
}
# Sites whose heads are the query heads, and sites laid out as attention patterns
# (`[batch, n_heads, dest_pos, src_pos]`).
QUERY_HEADS = frozenset({"q", "z", "pattern", "attn_scores"})
PATTERNS = frozenset({"pattern", "attn_scores", "scores"})


@dataclass(frozen=True)
class Site:
    """One activation of every layer: what a patched pass edits and where its clean tensor is.

    `hook(layer)` names the hook (a bridge, cache or module name; `None` for a seam of
    a HuggingFace model, edited by `safelens.patching._hf_sites.site_edits`);
    `clean(layer)` the clean cache's key; the hook's tensor and the clean tensor are laid
    out alike, positions on `pos_axis` (a pattern's destination positions; its source
    positions follow), heads (if any) on `head_axis`, except that a clean tensor that is
    position-major (`transposed`: a bridge's `attn.hook_rot_k`) swaps axes 1 and 2.
    `full(layer)`, for keys and values, names the cache hook that sees every position.
    """

    activation: str
    hook: Callable[[int], str | None]
    clean: Callable[[int], str]
    pos_axis: int
    head_axis: int
    heads: int
    transposed: bool = False
    # Keys and values: the cache hook that sees every position a pass attends to
    # (`hook_k_full` / `hook_v_full`), where a patch at an earlier position still lands.
    full: Callable[[int], str] | None = None


def tl_site(activation: str, heads: int, name: str | None = None) -> Site:
    """A site at TransformerLens' hook point `blocks.{layer}.{name}` (position-major).

    `name` defaults to the activation's own (`TL_NAMES`); patterns and scores are
    head-major.
    """
    suffix = name or TL_NAMES[activation]

    def hook(layer: int) -> str:
        return f"blocks.{layer}.{suffix}"

    if activation in PATTERNS:
        return Site(activation, hook, hook, 2, 1, heads)
    return Site(activation, hook, hook, 1, 2, heads)


def tl_heads(backend: Backend, activation: str) -> int:
    """The heads of `activation` at TransformerLens' hook points: key/value, query, or none."""
    if activation in ("k", "v"):
        return backend.n_kv_heads
    if activation in QUERY_HEADS:
        config = getattr(backend.model, "cfg", None) or backend.config  # type: ignore[attr-defined]
        return int(getattr(config, "n_heads", None) or config.num_attention_heads)
    return 0
