"""The shortcuts a sweep on a `HookedTransformer` takes: its `Plan`.

What a patched run may skip is `safelens.patching._skips`' (`Skips.of`, for both pass
runners); here, what a `HookedTransformer` takes of it. Runs start at the layer of their
patch (`start_at_layer`), several layers in one staggered pass
(`safelens.patching._grid`). Positions before the patch are reused unless a layer
attends both ways (`cfg.attention_dir`, or a layer's own override), or the patch spans
every key position (not a by-position sweep's rows of the scores or pattern,
`Skips.by_row`). For a metric of the last position, the last layer runs the last query
alone through safelens' attention path (`attn.hook_q` trimmed) and the MLP the last
position alone (`hook_resid_mid` trimmed). The single-position shortcut is not taken
with dynamic NTK rotary (`cfg.use_dynamic_ntk_rope`), whose rotation depends on how many
positions a pass holds. The runs entering a layer map their attention inputs once
([`shared_inputs`][safelens.backends.hooked._shared_attention.shared_inputs]) when the
patch sits after those maps.

Caveat: the last-query shortcut needs safelens' attention path (see
[`shared_prefix_attention`][safelens.shared_prefix_attention]); a last layer it does
not cover, or one with hooks on `hook_rot_k`, runs every query.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformer_lens import HookedTransformer

from ..backends.hooked._backend import HookedBackend
from ..backends.hooked._shared_attention import supports
from ..core._thread_hooks import hooked_anywhere, hooked_here
from ._skips import Skips

__all__ = ["Plan", "causal"]

Hook = Callable[[torch.Tensor, object], torch.Tensor]


def causal(model: HookedTransformer) -> bool:
    """Whether every attention layer of `model` attends only to earlier positions."""
    return HookedBackend(model).bidirectional() is None


def _last_position(tensor: torch.Tensor, hook: object) -> torch.Tensor:
    return tensor[:, -1:]


@dataclass(frozen=True)
class Plan:
    """The shortcuts one sweep takes (see the module notes)."""

    last_only: bool
    reuses_positions: bool
    single_position: bool
    last_layer_trims: tuple[tuple[str, Hook], ...]
    # Whether a pass may run fewer positions than the prompt's (no user hook attached).
    partial: bool = True
    # Whether the runs entering a layer map their attention inputs once (`_skips`).
    shares_inputs: bool = False

    @classmethod
    def of(cls, model: HookedTransformer, site: str, single_position: bool, metric: object) -> Plan:
        """The plan for patches at `site` (a name under `blocks.{layer}.`)."""
        skips = Skips.of(site, metric, not hooked_anywhere(model))
        if not skips.partial:
            return cls(skips.last_only, False, False, (), partial=False)
        cfg = model.cfg
        prefix = f"blocks.{cfg.n_layers - 1}."
        attn = model.blocks[-1].attn
        rot_k = getattr(attn, "hook_rot_k", None)
        unhooked = rot_k is None or not hooked_here(rot_k)
        trims: list[tuple[str, Hook]] = []
        if skips.last_queries and supports(attn) and unhooked:
            trims.append((prefix + "attn.hook_q", _last_position))
        # The MLP's trim sits on `hook_resid_mid`, where it cannot follow a patch there.
        if skips.last_mlp and site != "hook_resid_mid":
            if not (cfg.attn_only or cfg.parallel_attn_mlp):
                trims.append((prefix + "hook_resid_mid", _last_position))
        # A by-position sweep's runs each patch one position (of a pattern: one row).
        by_row = skips.by_row and single_position
        reuses = (skips.reuses_positions or by_row) and causal(model)
        single = single_position and reuses and skips.own_position
        single = single and not cfg.use_dynamic_ntk_rope
        return cls(skips.last_only, reuses, single, tuple(trims), shares_inputs=skips.shared_inputs)
