"""Any patch setter over any index grid: `generic_activation_patch`, TransformerLens' general sweep.

It takes the arguments of `transformer_lens.patching.generic_activation_patch` and
returns its tensor (and index frame), with many patched runs per forward pass. The
first index column is the layer; a `pos` column, when there is one, is the first
position the setter changes. Its runs, one per index row, come from the sweeps' one
front-end (`safelens.patching._front.generic_sweep`) and run on the family's runner: on a
`HookedTransformer` in `safelens.patching._hooked_sweeps` (positions before each patch
reused from the corrupted run); on a TransformerBridge or a HuggingFace causal LM in
`safelens.patching._hf_generic`. The named sweeps (`safelens.patching._sweeps`) are this
function at TransformerLens' setters and indices, and call it when a keyword changes.

Caveat: positions before a patch are taken from the corrupted run, so a custom
`patch_setter` must not change positions before its index's `pos` (TransformerLens'
setters never do); one that does is refused with a `PatchingError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

import pandas as pd
import torch
from jaxtyping import Int

from ..backends._supported import SupportedModel
from ..core._errors import PatchingError
from ._front import generic_sweep
from ._limits import DEFAULT_MAX_BYTES, Limits
from ._metric import Metric

if TYPE_CHECKING:
    from transformer_lens import ActivationCache

__all__ = ["AxisName", "PatchSetter", "generic_activation_patch"]

AxisName = Literal["layer", "pos", "head_index", "head", "src_pos", "dest_pos"]
PatchSetter = Callable[[torch.Tensor, Sequence[int], torch.Tensor], torch.Tensor]


def generic_activation_patch(
    model: SupportedModel,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: ActivationCache,
    patching_metric: Metric,
    patch_setter: PatchSetter,
    activation_name: str,
    index_axis_names: Sequence[AxisName] | None = None,
    index_df: pd.DataFrame | None = None,
    return_index_df: bool = False,
    *,
    max_batch: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, pd.DataFrame]:
    """Patch with any setter over any index grid, as `transformer_lens.patching` does.

    Same arguments and result as TransformerLens' `generic_activation_patch`: the first
    index column is the layer; a `pos` column, when there is one, is the first position
    `patch_setter` changes (positions before it are reused from the corrupted run; a
    negative `pos` counts from the end). `patch_setter(corrupted_activation, index,
    clean_activation)` is called once per patch on that run's full-length activation
    `[batch, pos, …]`, and returns it patched (or `None` after editing it in place).
    With one of TransformerLens' own setters, a patch that writes what the corrupted run
    holds runs no pass; any other setter runs for
    every index.
    Patches of `rot_k`, `attn_scores` or `pattern`, whose tensors span every key
    position, always run every position. On a TransformerBridge the setter runs on the
    bridge's own hook points, every position of each run; on a plain HuggingFace model
    at the site of `activation_name` (the "Patching sites" page says where each is),
    both tensors in TransformerLens' layout.

    **Arguments:**

    - `model`, `corrupted_tokens`, `clean_cache`, `patching_metric`, `patch_setter`,
      `activation_name`, `index_axis_names`, `index_df`, `return_index_df`: as in
      TransformerLens.
    - `max_batch`: at most this many patched runs per forward pass.
    - `max_bytes`: a memory budget that bounds the runs per forward pass (default 1 GiB).
    - `progress`: show a progress bar.

    **Returns:** the metric per patch, `[*axis sizes]`, or `[len(index_df)]` when
    `index_df` is given (and `index_df` itself with `return_index_df=True`).

    **Raises:** [`TokenError`][safelens.TokenError] for corrupted tokens that are not
    token ids of this model; [`PatchingError`][safelens.PatchingError] for a model,
    clean cache, activation, index, setter result, metric result or limit that does not
    fit, naming it.

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> from transformer_lens.patching import layer_pos_patch_setter
    >>> cfg = HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=8, d_head=4, n_heads=4, d_vocab=11, act_fn="gelu")
    >>> model = HookedTransformer(cfg)
    >>> _, clean_cache = model.run_with_cache(torch.tensor([[1, 2, 3]]))
    >>> metric = lambda logits: logits[:, -1, 0]
    >>> generic_activation_patch(model, torch.tensor([[1, 5, 3]]), clean_cache, metric,
    ...     layer_pos_patch_setter, "resid_pre", ("layer", "pos"), progress=False).shape
    torch.Size([2, 3])

    ```
    """
    if not isinstance(activation_name, str):
        raise PatchingError(
            f"activation_name must be a str such as 'resid_pre', 'z' or 'k', as "
            f"get_act_name spells it, got {type(activation_name).__name__} {activation_name!r}"
        )
    result, index_df = generic_sweep(
        model,
        corrupted_tokens,
        clean_cache,
        patching_metric,
        patch_setter,
        activation_name,
        index_axis_names,
        index_df,
        Limits(max_batch, max_bytes, progress),
    )
    return (result, index_df) if return_index_df else result
