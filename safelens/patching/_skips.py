"""What a patched run may skip: the shortcuts its patch site and its metric allow.

`Skips.of` says which of them one sweep's runs may take, from its site, its metric and
whether a hook of the user's is attached; both pass runners take what it allows where
the model can run it: a `HookedTransformer` by its config (`safelens.patching._plan`,
`safelens.patching._grid`), a HuggingFace model or a TransformerBridge by checking each
shortcut on the model (once per model and prompt shape) and dropping one that does not hold
(`safelens.patching._hf_shortcuts`, `safelens.patching._hf_passes`). A patched run
needs only what its metric reads and what its patch can change:

- *Layers before the patch.* A patch at layer `l` changes nothing before it, so a run
  starts at layer `l` with the corrupted run's residual stream entering it.
- *Runs of several layers in one pass* (staggered). The runs of a pass are stacked in
  layer order: the pass starts at the earliest layer, and the runs patched at each later
  layer join the batch there with the corrupted run's residual stream.
- *Positions before the patch.* In a causal model a patch at position `p` changes
  nothing before `p`, so a run reuses the corrupted run's first `p` positions (its
  frozen key/value cache, cropped to them). Not when a layer attends both ways: there
  every run computes every position. Nor for patches of the tensors that span every key
  position (`EVERY_KEY_POSITION`: rotated keys, attention scores and patterns), whose
  runs start at position 0, except where each run patches rows of the scores or the
  pattern (`ROWS`) at one destination `p`: that changes the head's output at `p`
  alone, so the run reuses the positions before `p` (`by_row`).
- *Last position only.* A metric that says it reads only the last position's logits
  (`metric.last_position_only`, as [`logit_diff_metric`][safelens.logit_diff_metric]'s
  does) gets `[rows, 1, d_vocab]`: only that position is unembedded. In the last layer
  the queries and the head outputs are then needed at the last position alone when the
  patch sits before the queries are used (`BEFORE_QUERIES`), and the MLP when the patch
  sits before it (`BEFORE_RESID_MID`, the MLP's input included), or the pass patches
  nothing in that layer; and a last-layer patch of an activation computed after the keys
  and values (`AFTER_KEYS`) at an earlier position changes nothing the metric reads.
- *Shared inputs.* The runs entering a layer hold the corrupted run's residual stream
  there until their patches, so a patch after the attention's input maps
  (`AFTER_INPUTS`: queries, keys, values and everything computed from them) leaves
  those maps' inputs equal across the runs: they are mapped once and repeated.
- *Single position.* A by-position patch of an activation computed after the keys and
  values (`AFTER_KEYS`: q, z, the attention or MLP output) changes, at its own layer,
  nothing but the patched position: the later positions enter the next layer with the
  corrupted run's residual stream.

None of these, beyond starting at the patch's layer, while a hook of the user's is
attached anywhere in the model (`hooked_anywhere`): a hook may index positions
(`tensor[:, 0]`) and sees every position of every layer it fires in, as under
TransformerLens; a metric of the last position still gets that position alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..backends._sites import TL_NAMES
from ._metric import reads_last_position

__all__ = [
    "AFTER_INPUTS",
    "AFTER_KEYS",
    "BEFORE_QUERIES",
    "BEFORE_RESID_MID",
    "EVERY_KEY_POSITION",
    "INPUTS",
    "ROWS",
    "Skips",
    "activations",
]

# A block's hook points by where they fire, as TransformerLens names them under
# `blocks.{layer}.`; a HuggingFace model's sites go by the same names (`TL_NAMES`).
INPUTS = frozenset(
    {"hook_resid_pre", "hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input"}
)
BEFORE_QUERIES = INPUTS | {
    "ln1.hook_scale",
    "ln1.hook_normalized",
    "attn.hook_q",
    "attn.hook_k",
    "attn.hook_v",
}
AFTER_KEYS = frozenset(
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
BEFORE_RESID_MID = BEFORE_QUERIES | {
    "attn.hook_rot_q",
    "attn.hook_rot_k",
    "attn.hook_attn_scores",
    "attn.hook_pattern",
    "attn.hook_z",
    "attn.hook_result",
    "hook_attn_out",
}
# Hook points at or after the attention's query, key and value maps.
AFTER_INPUTS = (
    frozenset({"attn.hook_q", "attn.hook_k", "attn.hook_v"})
    | (BEFORE_RESID_MID - BEFORE_QUERIES)
    | AFTER_KEYS
)
# Tensors that hold every key position (the cached ones too), not the new positions.
EVERY_KEY_POSITION = frozenset({"attn.hook_rot_k", "attn.hook_attn_scores", "attn.hook_pattern"})
# Those of them laid out by destination row: a patch of rows at destination `p` changes
# the head's output at `p` alone.
ROWS = frozenset({"attn.hook_attn_scores", "attn.hook_pattern"})


def activations(hooks: Iterable[str]) -> frozenset[str]:
    """The short names (`TL_NAMES`: `k`, `resid_pre`, …) of the activations at `hooks`."""
    hooks = set(hooks)
    return frozenset(name for name, hook in TL_NAMES.items() if hook in hooks)


@dataclass(frozen=True)
class Skips:
    """What the patched runs of one sweep may skip (module notes), before asking the model.

    - `last_only`: the metric reads the last position's logits alone.
    - `partial`: no hook of the user's is attached, so a pass may run fewer positions
      than the prompt's; without it, none of the others but `last_only` is allowed.
    - `last_logits`: only the last position is unembedded (`partial` and `last_only`).
    - `last_queries`, `last_mlp`: the last layer needs its queries, or its MLP, at the
      last position alone (the patch sits before them: `BEFORE_QUERIES`;
      `BEFORE_RESID_MID` or the MLP's input).
    - `reuses_positions`: the runs may reuse the corrupted run's positions before their
      patch, in a causal model (not for `EVERY_KEY_POSITION`).
    - `by_row`: so may runs that each patch rows at one destination position (`ROWS`).
    - `own_position`: a by-position patch changes its own position alone at its layer
      (`AFTER_KEYS`: *single position*, and a last-layer patch at an earlier position
      changes nothing a last-position metric reads).
    - `shared_inputs`: the attention's input maps see equal inputs across the runs
      entering a layer (`AFTER_INPUTS`).
    """

    last_only: bool
    partial: bool
    last_logits: bool
    last_queries: bool
    last_mlp: bool
    reuses_positions: bool
    by_row: bool
    own_position: bool
    shared_inputs: bool

    @classmethod
    def of(cls, hook: str, metric: object, partial: bool) -> Skips:
        """What patches at `hook` (a name under `blocks.{layer}.`) may skip for `metric`.

        `partial`: whether no hook of the user's is attached to the model.
        """
        last_only = reads_last_position(metric)
        trims = partial and last_only
        return cls(
            last_only=last_only,
            partial=partial,
            last_logits=trims,
            last_queries=trims and hook in BEFORE_QUERIES,
            last_mlp=trims and hook in BEFORE_RESID_MID | {"hook_resid_mid"},
            reuses_positions=partial and hook not in EVERY_KEY_POSITION,
            by_row=partial and hook in ROWS,
            own_position=partial and hook in AFTER_KEYS,
            shared_inputs=partial and hook in AFTER_INPUTS,
        )
