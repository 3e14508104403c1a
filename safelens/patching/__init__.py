"""Activation patching: a drop-in for `transformer_lens.patching`, batched on the cache.

`import safelens.patching as patching` gives every public function of
`transformer_lens.patching` under its name, with its arguments: the 18 `get_act_patch_*`
sweeps, `generic_activation_patch`, the patch setters and `make_df_from_ranges`. The
sweeps return TransformerLens' tensors with its numbers, many patched runs per forward
pass (`safelens.patching._sweeps`), on a `HookedTransformer`, a TransformerBridge or a
HuggingFace causal LM; each also takes `max_batch`, `max_bytes` and `progress`. Beyond
TransformerLens: attribution patching, datasets of prompt pairs, the clean cache of a
HuggingFace model, a batched logit difference and a heatmap.

```python
>>> import safelens.patching as patching
>>> from transformer_lens import HookedTransformer, HookedTransformerConfig
>>> model = HookedTransformer(HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=8,
...     d_head=4, n_heads=4, d_vocab=11, act_fn="gelu"))
>>> _, clean_cache = model.run_with_cache(torch.tensor([[1, 2, 3]]))
>>> metric = lambda logits: logits[:, -1, 0] - logits[:, -1, 1]
>>> patching.get_act_patch_resid_pre(model, torch.tensor([[1, 5, 3]]), clean_cache, metric,
...     progress=False).shape
torch.Size([2, 3])

```

Each name is imported on first use, so that `import safelens` needs neither
TransformerLens nor transformers.

Inside, one engine serves every family. Each model family's adapter declares its sites
(`Backend.patch_site`: where an activation is read and written, its layout and heads).
Written once, for every family: the runs of a sweep and the loop that scores them
(`_engine`: idle runs, the memory budget of each pass, the metric per run, the one
patch writer `put`), how runs are grouped into passes and share the corrupted run's
frozen cache (`_grouping`), which patches write what the corrupted run holds
(`_unchanged`), what a patched run may skip (`_skips`), the memory estimate (`_limits`)
and the metric (`_metric`). What runs one pass is the family's, as `Backend.forward` is:
on a `HookedTransformer` `_grid` with its shortcuts in `_plan` (TransformerLens'
`start_at_layer`, its own attention path); on a HuggingFace model or a bridge
`_hf_passes` with `_hf_shortcuts` and `_hf_lean` (checked on the model once per model
and prompt shape, `_hf_checked`).
`_runners` is the one place that reads a model's family: every sweep, the bundles,
`generic_activation_patch` and `patch_dataset` ask it for the family's runner.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..experiments._metrics import logit_diff_metric
    from ._attribution import AttributionResult, attribution_patch
    from ._attribution_dataset import AttributionDatasetResult, attribution_patch_dataset
    from ._dataset import PatchingResult, patch_dataset
    from ._every import (
        get_act_patch_attn_head_all_pos_every,
        get_act_patch_attn_head_by_pos_every,
        get_act_patch_block_every,
    )
    from ._generic import generic_activation_patch
    from ._hf_sites import run_with_patching_cache
    from ._patterns import (
        get_act_patch_attn_head_pattern_all_pos,
        get_act_patch_attn_head_pattern_by_pos,
        get_act_patch_attn_head_pattern_dest_src_pos,
    )
    from ._plotting import plot_patching_heatmap
    from ._setters import (
        layer_head_dest_src_pos_pattern_patch_setter,
        layer_head_pattern_patch_setter,
        layer_head_pos_pattern_patch_setter,
        layer_head_vector_patch_setter,
        layer_pos_head_vector_patch_setter,
        layer_pos_patch_setter,
        make_df_from_ranges,
    )
    from ._sweeps import (
        get_act_patch_attn_head_k_all_pos,
        get_act_patch_attn_head_k_by_pos,
        get_act_patch_attn_head_out_all_pos,
        get_act_patch_attn_head_out_by_pos,
        get_act_patch_attn_head_q_all_pos,
        get_act_patch_attn_head_q_by_pos,
        get_act_patch_attn_head_v_all_pos,
        get_act_patch_attn_head_v_by_pos,
        get_act_patch_attn_out,
        get_act_patch_mlp_out,
        get_act_patch_resid_mid,
        get_act_patch_resid_pre,
    )

_LAZY_MODULES = {
    "._generic": ("generic_activation_patch",),
    "._sweeps": (
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
    ),
    "._patterns": (
        "get_act_patch_attn_head_pattern_by_pos",
        "get_act_patch_attn_head_pattern_dest_src_pos",
        "get_act_patch_attn_head_pattern_all_pos",
    ),
    "._every": (
        "get_act_patch_attn_head_all_pos_every",
        "get_act_patch_attn_head_by_pos_every",
        "get_act_patch_block_every",
    ),
    "._setters": (
        "layer_pos_patch_setter",
        "layer_pos_head_vector_patch_setter",
        "layer_head_vector_patch_setter",
        "layer_head_pattern_patch_setter",
        "layer_head_pos_pattern_patch_setter",
        "layer_head_dest_src_pos_pattern_patch_setter",
        "make_df_from_ranges",
    ),
    "._attribution": ("attribution_patch", "AttributionResult"),
    "._attribution_dataset": ("attribution_patch_dataset", "AttributionDatasetResult"),
    "._dataset": ("patch_dataset", "PatchingResult"),
    "._hf_sites": ("run_with_patching_cache",),
    "._plotting": ("plot_patching_heatmap",),
    "..experiments._metrics": ("logit_diff_metric",),
}
_LAZY = {name: module for module, names in _LAZY_MODULES.items() for name in names}

__all__ = [
    "generic_activation_patch",
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
    "get_act_patch_attn_head_pattern_by_pos",
    "get_act_patch_attn_head_pattern_dest_src_pos",
    "get_act_patch_attn_head_pattern_all_pos",
    "get_act_patch_attn_head_all_pos_every",
    "get_act_patch_attn_head_by_pos_every",
    "get_act_patch_block_every",
    "layer_pos_patch_setter",
    "layer_pos_head_vector_patch_setter",
    "layer_head_vector_patch_setter",
    "layer_head_pattern_patch_setter",
    "layer_head_pos_pattern_patch_setter",
    "layer_head_dest_src_pos_pattern_patch_setter",
    "make_df_from_ranges",
    "attribution_patch",
    "AttributionResult",
    "attribution_patch_dataset",
    "AttributionDatasetResult",
    "patch_dataset",
    "PatchingResult",
    "run_with_patching_cache",
    "plot_patching_heatmap",
    "logit_diff_metric",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'safelens.patching' has no attribute {name!r}")
    try:
        module = import_module(_LAZY[name], __name__)
    except ImportError as error:
        from .. import _missing_library

        message = _missing_library(name, error)
        if message is None:
            raise
        raise ImportError(message) from error
    return getattr(module, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
