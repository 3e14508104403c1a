"""Activation patching sweeps: TransformerLens' `patching` results, many runs per pass.

Each function here takes the arguments of its namesake in `transformer_lens.patching`
(`model, corrupted_tokens, clean_cache, patching_metric`) and returns a tensor of the
same shape with the same numbers (up to float rounding), on the model's device (with
one exception, ungrouped grouped-query keys and values, below). Instead
of one full forward pass per patch, patched runs are stacked along the batch and run
from the corrupted run's frozen key/value cache: a patch at layer `l`, position `p` of a
causal model only runs positions `p:` and layers `l:` (see `safelens.patching._grid`).
Every input is checked before the first patched run (see `safelens.patching._inputs`).

Models: each sweep runs on its model family's runner (`safelens.patching._runners`): a
`HookedTransformer` in `safelens.patching._hooked_sweeps`, a TransformerBridge or a
HuggingFace causal LM in `safelens.patching._hf_sweeps` (keys
and queries patched after the rotary embedding, the same patch at one position;
`resid_mid` refused in families that run attention and MLP in parallel), so this module
imports without `HookedTransformer`, which TransformerLens 4 removed. A call that
changes one of TransformerLens' keywords (`patch_setter`, `index_df`, …) is
`generic_activation_patch`'s (`safelens.patching._generic`).

`patching_metric` is best *batched*: a function of logits `[runs * batch, pos, d_vocab]`
(rows `r * batch … (r + 1) * batch - 1` are patched run `r`) returning `[runs]`, as
[`logit_diff_metric`][safelens.logit_diff_metric] does. A TransformerLens-style metric,
logits of one run to a scalar, works too (it is detected at the first call on several
runs, when it returns a scalar for all of them) but is then called once per run.

Grouped-query models: key and value patches index the heads that `hook_k`/`hook_v`
hold: the key/value heads, `[…, n_kv_heads]`, as TransformerLens does; with
`ungroup_grouped_query_attention=True`, one per query head, `[…, n_heads]` (where
TransformerLens' own sweeps cover only the first `n_kv_heads` of them).

Models: causal models reuse the corrupted run's positions before each patch;
bidirectional ones run every position of every patched run (exact, slower). Prompts
are masked as TransformerLens masks them (a tokenizer's left padding). Several threads
may sweep one model at once (see `safelens.patching._grid`). Shortformer positional
embeddings are refused.

Caveat: positions before a patch are taken from the corrupted run, so a custom
`patch_setter` passed to a sweep must not change positions before its index's `pos`
(TransformerLens' setters never do); one that does is refused with a `PatchingError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from jaxtyping import Int

from ..backends._sites import TL_NAMES
from ..backends._supported import SupportedModel
from ._front import named_sweep
from ._generic import AxisName, PatchSetter, generic_activation_patch
from ._limits import DEFAULT_MAX_BYTES, Limits
from ._metric import Metric
from ._setters import (
    SweepKeywords,
    layer_head_vector_patch_setter,
    layer_pos_head_vector_patch_setter,
    layer_pos_patch_setter,
)

if TYPE_CHECKING:
    from transformer_lens import ActivationCache


__all__ = [
    "get_act_patch_resid_pre",
    "get_act_patch_resid_mid",
    "get_act_patch_attn_out",
    "get_act_patch_mlp_out",
    "get_act_patch_attn_head_out_by_pos",
    "get_act_patch_attn_head_q_by_pos",
    "get_act_patch_attn_head_k_by_pos",
    "get_act_patch_attn_head_v_by_pos",
    "get_act_patch_attn_head_out_all_pos",
    "get_act_patch_attn_head_q_all_pos",
    "get_act_patch_attn_head_k_all_pos",
    "get_act_patch_attn_head_v_all_pos",
]


_EXAMPLE = """
    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> cfg = HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=8, d_head=4, n_heads=4, d_vocab=11, act_fn="gelu")
    >>> model = HookedTransformer(cfg)
    >>> _, clean_cache = model.run_with_cache(torch.tensor([[1, 2, 3]]))
    >>> metric = lambda logits: logits[:, -1, 0] - logits[:, -1, 1]
    >>> {name}(model, torch.tensor([[1, 5, 3]]), clean_cache, metric, progress=False).shape
    {shape}

    ```
"""


def _sweep_function(
    name: str, activation: str, what: str, by_pos: bool, with_head: bool, example: str
) -> Callable[..., Any]:
    setters = {
        (True, False): layer_pos_patch_setter,
        (True, True): layer_pos_head_vector_patch_setter,
        (False, True): layer_head_vector_patch_setter,
    }
    index_names = ("layer",) + ("pos",) * by_pos + ("head",) * with_head
    keywords = SweepKeywords(setters[by_pos, with_head], activation, index_names)

    def patch(
        model: SupportedModel,
        corrupted_tokens: Int[torch.Tensor, "batch pos"],
        clean_cache: ActivationCache,
        patching_metric: Metric,
        *,
        patch_setter: PatchSetter = keywords.patch_setter,
        activation_name: str = activation,
        index_axis_names: Sequence[AxisName] | None = index_names,  # type: ignore[assignment]
        index_df: pd.DataFrame | None = None,
        return_index_df: bool = False,
        max_batch: int | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        progress: bool = True,
    ) -> torch.Tensor | tuple[torch.Tensor, pd.DataFrame]:
        if keywords.differ(
            patch_setter, activation_name, index_axis_names, index_df, return_index_df
        ):
            return generic_activation_patch(
                model,
                corrupted_tokens,
                clean_cache,
                patching_metric,
                patch_setter,
                activation_name,
                index_axis_names,
                index_df,
                return_index_df,
                max_batch=max_batch,
                max_bytes=max_bytes,
                progress=progress,
            )
        limits = Limits(max_batch, max_bytes, progress)
        return named_sweep(
            activation,
            by_pos,
            with_head,
            model,
            corrupted_tokens,
            clean_cache,
            patching_metric,
            limits,
        )

    axes = "layer" + (", pos" if by_pos else "") + (", head" if with_head else "")
    heads = (
        " (`n_kv_heads` on grouped-query models)" if activation in ("k", "v") and with_head else ""
    )
    patch.__name__ = patch.__qualname__ = name
    patch.__doc__ = f"""Patch {what}: TransformerLens' `patching.{name}`, batched on the cache.

    Patches `blocks.{{layer}}.{TL_NAMES[activation]}` from `clean_cache`
    into the corrupted run at each [{axes}]{heads}. On a TransformerBridge or a
    HuggingFace model, the "Patching sites" page says where it patches (keys and
    queries after the rotary embedding: the same patch at one position) and what each
    family holds there.

    **Arguments:**

    - `model`: a [`SupportedModel`][safelens.SupportedModel]: a `HookedTransformer`, a
      `TransformerBridge` or a HuggingFace causal LM.
    - `corrupted_tokens`: `[batch, pos]` tokens of the corrupted run.
    - `clean_cache`: the clean run's `ActivationCache` (`model.run_with_cache`; on a
      HuggingFace model, [`run_with_patching_cache`][safelens.run_with_patching_cache]'s
      dict).
    - `patching_metric`: logits `[runs * batch, pos, d_vocab]` to `[runs]` (fast), or
      TransformerLens-style logits of one run to a scalar.
    - `patch_setter`, `activation_name`, `index_axis_names`, `index_df`,
      `return_index_df`: TransformerLens' keywords, at its defaults for this sweep; a
      call that changes one is [`generic_activation_patch`][safelens.generic_activation_patch]'s
      with them.
    - `max_batch`: at most this many patched runs per forward pass.
    - `max_bytes`: a memory budget that bounds the runs per forward pass (default 1 GiB).
    - `progress`: show a progress bar.

    **Returns:** the metric per patch, float32 `[{axes}]` on the model's device.

    **Raises:** [`TokenError`][safelens.TokenError] for corrupted tokens that are not
    token ids of this model; [`PatchingError`][safelens.PatchingError] for a model,
    clean cache, activation, metric result or limit that does not fit, naming it.
    {_EXAMPLE.format(name=name, shape=example)}"""
    return patch


get_act_patch_resid_pre = _sweep_function(
    "get_act_patch_resid_pre",
    "resid_pre",
    "the residual stream before each block",
    True,
    False,
    "torch.Size([2, 3])",
)
get_act_patch_resid_mid = _sweep_function(
    "get_act_patch_resid_mid",
    "resid_mid",
    "the residual stream between each block's attention and MLP",
    True,
    False,
    "torch.Size([2, 3])",
)
get_act_patch_attn_out = _sweep_function(
    "get_act_patch_attn_out",
    "attn_out",
    "each attention layer's output",
    True,
    False,
    "torch.Size([2, 3])",
)
get_act_patch_mlp_out = _sweep_function(
    "get_act_patch_mlp_out",
    "mlp_out",
    "each MLP layer's output",
    True,
    False,
    "torch.Size([2, 3])",
)
get_act_patch_attn_head_out_by_pos = _sweep_function(
    "get_act_patch_attn_head_out_by_pos",
    "z",
    "each head's output `z` by position",
    True,
    True,
    "torch.Size([2, 3, 4])",
)
get_act_patch_attn_head_q_by_pos = _sweep_function(
    "get_act_patch_attn_head_q_by_pos",
    "q",
    "each head's queries by position",
    True,
    True,
    "torch.Size([2, 3, 4])",
)
get_act_patch_attn_head_k_by_pos = _sweep_function(
    "get_act_patch_attn_head_k_by_pos",
    "k",
    "each head's keys by position",
    True,
    True,
    "torch.Size([2, 3, 4])",
)
get_act_patch_attn_head_v_by_pos = _sweep_function(
    "get_act_patch_attn_head_v_by_pos",
    "v",
    "each head's values by position",
    True,
    True,
    "torch.Size([2, 3, 4])",
)
get_act_patch_attn_head_out_all_pos = _sweep_function(
    "get_act_patch_attn_head_out_all_pos",
    "z",
    "each head's output `z` at all positions",
    False,
    True,
    "torch.Size([2, 4])",
)
get_act_patch_attn_head_q_all_pos = _sweep_function(
    "get_act_patch_attn_head_q_all_pos",
    "q",
    "each head's queries at all positions",
    False,
    True,
    "torch.Size([2, 4])",
)
get_act_patch_attn_head_k_all_pos = _sweep_function(
    "get_act_patch_attn_head_k_all_pos",
    "k",
    "each head's keys at all positions",
    False,
    True,
    "torch.Size([2, 4])",
)
get_act_patch_attn_head_v_all_pos = _sweep_function(
    "get_act_patch_attn_head_v_all_pos",
    "v",
    "each head's values at all positions",
    False,
    True,
    "torch.Size([2, 4])",
)
