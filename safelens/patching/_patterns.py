"""Sweeps of attention patterns: TransformerLens' pattern patches, many runs per pass.

Each sweep patches `blocks.{layer}.attn.hook_pattern` `[batch, n_heads, dest_pos,
src_pos]` (after the softmax) from the clean run: a head's whole pattern, one row
(`dest_pos`), or one entry. Patterns index query heads (`n_heads`), grouped-query
models included.

Models: every family runs them as one front-end's named sweeps of the `pattern` site
(`safelens.patching._front.pattern_sweep`: a run per [layer, dest_pos, src_pos, head],
the axes the sweep has, head moved second), the numbers TransformerLens' pattern setters
give on its `generic_activation_patch`. A row or entry patch at `dest_pos` runs
positions `dest_pos:` only, on the corrupted run's cache; a plain HuggingFace causal
LM's pattern is patched inside its attention function (`safelens.backends.hf._seams`:
the layer's attention computed eagerly, the patched pattern applied to the values). A
call that changes one of TransformerLens' keywords is `generic_activation_patch`'s. This
module imports nothing from TransformerLens until a `HookedTransformer` sweep runs, so
it loads on TransformerLens 4, which removed `HookedTransformer`.

Caveat: a pattern spans every key position, so a whole-head patch
(`get_act_patch_attn_head_pattern_all_pos`) runs every position (the cost of a plain
forward pass each, batched); a row or entry patch at `dest_pos` runs positions
`dest_pos:` only, on every family (`safelens.patching._skips`' `by_row`). On a bridge a
patch takes effect only where the bridge's attention computes its output from what
`hook_pattern` returns, as TransformerLens' Llama-style (rotary, grouped-query) and
GPT-2 attention do; a bridge that runs HuggingFace's own attention (TransformerLens'
OPT adapter, for one) fires the hook after the output is computed, or not at all, and
is refused, by a check of one pass before each sweep (`safelens.patching._pattern_hook`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from jaxtyping import Float, Int

from ..backends._supported import SupportedModel
from ._front import pattern_sweep
from ._generic import generic_activation_patch
from ._limits import DEFAULT_MAX_BYTES, Limits
from ._metric import Metric
from ._setters import (
    Setter,
    SweepKeywords,
    layer_head_dest_src_pos_pattern_patch_setter,
    layer_head_pattern_patch_setter,
    layer_head_pos_pattern_patch_setter,
)

if TYPE_CHECKING:
    from transformer_lens.patching import AxisNames

__all__ = [
    "get_act_patch_attn_head_pattern_by_pos",
    "get_act_patch_attn_head_pattern_dest_src_pos",
    "get_act_patch_attn_head_pattern_all_pos",
]


def _pattern_sweep(
    sweep: str,
    keywords: SweepKeywords,
    model: torch.nn.Module,
    corrupted_tokens: torch.Tensor,
    clean_cache: Any,
    patching_metric: Metric,
    given: tuple[Any, Any, Any, Any, Any],
    max_batch: int | None,
    max_bytes: int,
    progress: bool,
) -> torch.Tensor | tuple[torch.Tensor, pd.DataFrame]:
    """The pattern sweep over the full grid of `keywords.index_axis_names` (layer, head_index, …).

    `given` holds the call's TransformerLens keywords (`patch_setter`, `activation_name`,
    `index_axis_names`, `index_df`, `return_index_df`); other than `keywords`, the call
    is `generic_activation_patch`'s; else the front-end's pattern sweep (module notes).
    """
    if keywords.differ(*given):
        return generic_activation_patch(
            model,  # type: ignore[arg-type]
            corrupted_tokens,
            clean_cache,
            patching_metric,
            *given,
            max_batch=max_batch,
            max_bytes=max_bytes,
            progress=progress,
        )
    return pattern_sweep(
        keywords.index_axis_names,
        sweep,
        model,
        corrupted_tokens,
        clean_cache,
        patching_metric,
        Limits(max_batch, max_bytes, progress),
    )


def get_act_patch_attn_head_pattern_by_pos(
    model: SupportedModel,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: Any,
    patching_metric: Metric,
    *,
    patch_setter: Setter = layer_head_pos_pattern_patch_setter,
    activation_name: str = "pattern",
    index_axis_names: Sequence[AxisNames] | None = ("layer", "head_index", "dest_pos"),
    index_df: pd.DataFrame | None = None,
    return_index_df: bool = False,
    max_batch: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: bool = True,
) -> Float[torch.Tensor, "layer n_heads dest_pos"] | tuple[torch.Tensor, pd.DataFrame]:
    """Patch each head's attention pattern row by row: TransformerLens' `patching.get_act_patch_attn_head_pattern_by_pos`.

    Patches the row `dest_pos` (every source position) of `blocks.{layer}.attn.hook_pattern`
    `[batch, n_heads, dest_pos, src_pos]` from `clean_cache` at each
    [layer, head, dest_pos]. Note the axis order: head before position, as in
    TransformerLens (the `*_by_pos` sweeps of q, k, v and z put position first).

    **Arguments:**

    - `model`: a `HookedTransformer`, a TransformerBridge or a HuggingFace causal LM.
    - `corrupted_tokens`: `[batch, pos]` tokens of the corrupted run.
    - `clean_cache`: the clean run's `ActivationCache` (`model.run_with_cache`; on a
      HuggingFace model, [`run_with_patching_cache`][safelens.run_with_patching_cache]'s
      dict), same `pos`.
    - `patching_metric`: logits `[runs * batch, pos, d_vocab]` to `[runs]` (fast), or
      TransformerLens-style logits of one run to a scalar.
    - `patch_setter`, `activation_name`, `index_axis_names`, `index_df`,
      `return_index_df`: TransformerLens' keywords, at its defaults for this sweep; a
      call that changes one is [`generic_activation_patch`][safelens.generic_activation_patch]'s
      with them.
    - `max_batch`: at most this many patched runs per forward pass.
    - `max_bytes`: a memory budget that bounds the runs per forward pass (default 1 GiB).
    - `progress`: show a progress bar.

    **Returns:** the metric per patch, float32 `[layer, n_heads, dest_pos]` on the
    model's device (`n_heads` query heads, grouped-query models included).

    **Raises:** [`TokenError`][safelens.TokenError] for corrupted tokens that are not
    token ids of this model; [`PatchingError`][safelens.PatchingError] for a
    HuggingFace model whose attention does not run through transformers' attention
    functions, a bridge whose attention does not use `hook_pattern` (module
    notes), a clean cache of another length or without `hook_pattern`, a metric result
    or a limit that does not fit, naming it.

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> cfg = HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=8, d_head=4, n_heads=4, d_vocab=11, act_fn="gelu")
    >>> model = HookedTransformer(cfg)
    >>> _, clean_cache = model.run_with_cache(torch.tensor([[1, 2, 3]]))
    >>> metric = lambda logits: logits[:, -1, 0] - logits[:, -1, 1]
    >>> get_act_patch_attn_head_pattern_by_pos(model, torch.tensor([[1, 5, 3]]), clean_cache, metric, progress=False).shape
    torch.Size([2, 4, 3])

    ```
    """
    return _pattern_sweep(
        "get_act_patch_attn_head_pattern_by_pos",
        SweepKeywords(
            layer_head_pos_pattern_patch_setter, "pattern", ("layer", "head_index", "dest_pos")
        ),
        model,
        corrupted_tokens,
        clean_cache,
        patching_metric,
        (patch_setter, activation_name, index_axis_names, index_df, return_index_df),
        max_batch,
        max_bytes,
        progress,
    )


def get_act_patch_attn_head_pattern_dest_src_pos(
    model: SupportedModel,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: Any,
    patching_metric: Metric,
    *,
    patch_setter: Setter = layer_head_dest_src_pos_pattern_patch_setter,
    activation_name: str = "pattern",
    index_axis_names: Sequence[AxisNames] | None = ("layer", "head_index", "dest_pos", "src_pos"),
    index_df: pd.DataFrame | None = None,
    return_index_df: bool = False,
    max_batch: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: bool = True,
) -> Float[torch.Tensor, "layer n_heads dest_pos src_pos"] | tuple[torch.Tensor, pd.DataFrame]:
    """Patch each entry of each head's attention pattern: TransformerLens' `patching.get_act_patch_attn_head_pattern_dest_src_pos`.

    Patches the single entry [dest_pos, src_pos] of `blocks.{layer}.attn.hook_pattern`
    from `clean_cache` at each [layer, head, dest_pos, src_pos]: `n_layers * n_heads *
    pos**2` patched runs. Entries above the diagonal (`src_pos > dest_pos`) are zero in
    both runs of a causal model, so their patches leave the corrupted run's metric.

    **Arguments:**

    - `model`: a `HookedTransformer`, a TransformerBridge or a HuggingFace causal LM.
    - `corrupted_tokens`: `[batch, pos]` tokens of the corrupted run.
    - `clean_cache`: the clean run's `ActivationCache` (`model.run_with_cache`; on a
      HuggingFace model, [`run_with_patching_cache`][safelens.run_with_patching_cache]'s
      dict), same `pos`.
    - `patching_metric`: logits `[runs * batch, pos, d_vocab]` to `[runs]` (fast), or
      TransformerLens-style logits of one run to a scalar.
    - `patch_setter`, `activation_name`, `index_axis_names`, `index_df`,
      `return_index_df`: TransformerLens' keywords, at its defaults for this sweep; a
      call that changes one is [`generic_activation_patch`][safelens.generic_activation_patch]'s
      with them.
    - `max_batch`: at most this many patched runs per forward pass.
    - `max_bytes`: a memory budget that bounds the runs per forward pass (default 1 GiB).
    - `progress`: show a progress bar.

    **Returns:** the metric per patch, float32 `[layer, n_heads, dest_pos, src_pos]` on
    the model's device (`n_heads` query heads, grouped-query models included).

    **Raises:** [`TokenError`][safelens.TokenError] for corrupted tokens that are not
    token ids of this model; [`PatchingError`][safelens.PatchingError] for a
    HuggingFace model whose attention does not run through transformers' attention
    functions, a bridge whose attention does not use `hook_pattern` (module
    notes), a clean cache of another length or without `hook_pattern`, a metric result
    or a limit that does not fit, naming it.

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> cfg = HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=8, d_head=4, n_heads=4, d_vocab=11, act_fn="gelu")
    >>> model = HookedTransformer(cfg)
    >>> _, clean_cache = model.run_with_cache(torch.tensor([[1, 2, 3]]))
    >>> metric = lambda logits: logits[:, -1, 0] - logits[:, -1, 1]
    >>> get_act_patch_attn_head_pattern_dest_src_pos(model, torch.tensor([[1, 5, 3]]), clean_cache, metric, progress=False).shape
    torch.Size([2, 4, 3, 3])

    ```
    """
    return _pattern_sweep(
        "get_act_patch_attn_head_pattern_dest_src_pos",
        SweepKeywords(
            layer_head_dest_src_pos_pattern_patch_setter,
            "pattern",
            ("layer", "head_index", "dest_pos", "src_pos"),
        ),
        model,
        corrupted_tokens,
        clean_cache,
        patching_metric,
        (patch_setter, activation_name, index_axis_names, index_df, return_index_df),
        max_batch,
        max_bytes,
        progress,
    )


def get_act_patch_attn_head_pattern_all_pos(
    model: SupportedModel,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: Any,
    patching_metric: Metric,
    *,
    patch_setter: Setter = layer_head_pattern_patch_setter,
    activation_name: str = "pattern",
    index_axis_names: Sequence[AxisNames] | None = ("layer", "head_index"),
    index_df: pd.DataFrame | None = None,
    return_index_df: bool = False,
    max_batch: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: bool = True,
) -> Float[torch.Tensor, "layer n_heads"] | tuple[torch.Tensor, pd.DataFrame]:
    """Patch each head's whole attention pattern: TransformerLens' `patching.get_act_patch_attn_head_pattern_all_pos`.

    Patches head `head` of `blocks.{layer}.attn.hook_pattern` (every destination and
    source position) from `clean_cache` at each [layer, head].

    **Arguments:**

    - `model`: a `HookedTransformer`, a TransformerBridge or a HuggingFace causal LM.
    - `corrupted_tokens`: `[batch, pos]` tokens of the corrupted run.
    - `clean_cache`: the clean run's `ActivationCache` (`model.run_with_cache`; on a
      HuggingFace model, [`run_with_patching_cache`][safelens.run_with_patching_cache]'s
      dict), same `pos`.
    - `patching_metric`: logits `[runs * batch, pos, d_vocab]` to `[runs]` (fast), or
      TransformerLens-style logits of one run to a scalar.
    - `patch_setter`, `activation_name`, `index_axis_names`, `index_df`,
      `return_index_df`: TransformerLens' keywords, at its defaults for this sweep; a
      call that changes one is [`generic_activation_patch`][safelens.generic_activation_patch]'s
      with them.
    - `max_batch`: at most this many patched runs per forward pass.
    - `max_bytes`: a memory budget that bounds the runs per forward pass (default 1 GiB).
    - `progress`: show a progress bar.

    **Returns:** the metric per patch, float32 `[layer, n_heads]` on the model's device
    (`n_heads` query heads, grouped-query models included).

    **Raises:** [`TokenError`][safelens.TokenError] for corrupted tokens that are not
    token ids of this model; [`PatchingError`][safelens.PatchingError] for a
    HuggingFace model whose attention does not run through transformers' attention
    functions, a bridge whose attention does not use `hook_pattern` (module
    notes), a clean cache of another length or without `hook_pattern`, a metric result
    or a limit that does not fit, naming it.

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> cfg = HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=8, d_head=4, n_heads=4, d_vocab=11, act_fn="gelu")
    >>> model = HookedTransformer(cfg)
    >>> _, clean_cache = model.run_with_cache(torch.tensor([[1, 2, 3]]))
    >>> metric = lambda logits: logits[:, -1, 0] - logits[:, -1, 1]
    >>> get_act_patch_attn_head_pattern_all_pos(model, torch.tensor([[1, 5, 3]]), clean_cache, metric, progress=False).shape
    torch.Size([2, 4])

    ```
    """
    return _pattern_sweep(
        "get_act_patch_attn_head_pattern_all_pos",
        SweepKeywords(layer_head_pattern_patch_setter, "pattern", ("layer", "head_index")),
        model,
        corrupted_tokens,
        clean_cache,
        patching_metric,
        (patch_setter, activation_name, index_axis_names, index_df, return_index_df),
        max_batch,
        max_bytes,
        progress,
    )
