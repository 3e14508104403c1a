"""What a patching sweep may skip: the shortcuts its patch site and its metric allow.

A patched run needs only what its metric reads and what its patch can change:

- *Positions before the patch.* In a causal model a patch at position `p` changes
  nothing before `p`, so a run may reuse the corrupted run's first `p` positions. Not
  when any layer attends both ways (`cfg.attention_dir`, or a layer's own override):
  there every run computes every position. Nor for patches of `hook_rot_k`,
  `hook_attn_scores` or `hook_pattern`, whose tensors span every key position: those
  runs start at position 0.
- *Last position only.* A metric that says it reads only the last position's logits
  (`metric.last_position_only`, as [`logit_diff_metric`][safelens.logit_diff_metric]'s
  does) gets `[rows, 1, d_vocab]`: only that position is unembedded. At the last layer,
  attention then runs the last query alone when the patch sits before the queries are
  used (the residual stream, q, k, v), and the MLP runs the last position alone when
  the patch sits before `hook_resid_mid`.
- *Single position.* A by-position patch of an activation computed after the keys and
  values (q, z, the attention or MLP output) changes, at its own layer, nothing but the
  patched position. That layer then runs the patched position alone; the later
  positions enter the next layer with the corrupted run's residual stream. Not with
  dynamic NTK rotary (`cfg.use_dynamic_ntk_rope`), whose rotation depends on how many
  positions a pass holds.

None of these while a hook of the user's is attached anywhere in the model
(`hooked_anywhere`): a hook may index positions (`tensor[:, 0]`), and sees every
position of every layer it fires in, as under TransformerLens; a metric of the last
position still gets that position alone.

Caveat: the last-query shortcut needs safelens' attention path (see
[`shared_prefix_attention`][safelens.shared_prefix_attention]); a last layer it does
not cover, or one with hooks on `hook_rot_k`, runs every query.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformer_lens import HookedTransformer

from ..backends.hooked._shared_attention import supports
from ..core._thread_hooks import hooked_anywhere, hooked_here
from ._metric import reads_last_position

__all__ = ["Plan", "causal", "reads_last_position"]

# Hook points of a block by where they fire, as names under `blocks.{layer}.`.
_INPUTS = frozenset(
    {"hook_resid_pre", "hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input"}
)
_BEFORE_QUERIES = _INPUTS | {
    "ln1.hook_scale",
    "ln1.hook_normalized",
    "attn.hook_q",
    "attn.hook_k",
    "attn.hook_v",
}
_AFTER_KEYS = frozenset(
    {
        "attn.hook_q",
        "attn.hook_rot_q",
        "attn.hook_z",
        "attn.hook_result",
        "hook_attn_out",
        "hook_resid_mid",
        "hook_mlp_in",
        "ln2.hook_scale",
        "ln2.hook_normalized",
        "mlp.hook_pre",
        "mlp.hook_post",
        "hook_mlp_out",
        "hook_resid_post",
    }
)
_BEFORE_RESID_MID = _BEFORE_QUERIES | {
    "attn.hook_rot_q",
    "attn.hook_rot_k",
    "attn.hook_attn_scores",
    "attn.hook_pattern",
    "attn.hook_z",
    "attn.hook_result",
    "hook_attn_out",
}

# Tensors that hold every key position (the cached ones too), not the new positions.
_EVERY_KEY_POSITION = frozenset({"attn.hook_rot_k", "attn.hook_attn_scores", "attn.hook_pattern"})

Hook = Callable[[torch.Tensor, object], torch.Tensor]


def causal(model: HookedTransformer) -> bool:
    """Whether every attention layer of `model` attends only to earlier positions."""
    return all(
        (block.attn._attention_dir_override or model.cfg.attention_dir) == "causal"
        for block in model.blocks
    )


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

    @classmethod
    def of(cls, model: HookedTransformer, site: str, single_position: bool, metric: object) -> Plan:
        """The plan for patches at `site` (a name under `blocks.{layer}.`)."""
        last_only = reads_last_position(metric)
        if hooked_anywhere(model):
            return cls(last_only, False, False, (), partial=False)
        trims: list[tuple[str, Hook]] = []
        if last_only:
            cfg = model.cfg
            prefix = f"blocks.{cfg.n_layers - 1}."
            attn = model.blocks[-1].attn
            rot_k = getattr(attn, "hook_rot_k", None)
            unhooked = rot_k is None or not hooked_here(rot_k)
            if site in _BEFORE_QUERIES and supports(attn) and unhooked:
                trims.append((prefix + "attn.hook_q", _last_position))
            if site in _BEFORE_RESID_MID and not (cfg.attn_only or cfg.parallel_attn_mlp):
                trims.append((prefix + "hook_resid_mid", _last_position))
        reuses = causal(model) and site not in _EVERY_KEY_POSITION
        single = (
            single_position
            and reuses
            and site in _AFTER_KEYS
            and not model.cfg.use_dynamic_ntk_rope
        )
        return cls(last_only, reuses, single, tuple(trims))
