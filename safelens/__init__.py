"""safelens: a TransformerLens-compatible key/value cache for interpretability work."""

from typing import TYPE_CHECKING, Any

from .backends.hooked._hooks import (
    add_hook,
    cache_hook_names,
    hooks,
    reset_hooks,
)
from .backends.hooked._shared_attention import shared_prefix_attention
from .core._cache import KeyValueCache
from .core._cache_entry import KeyValueCacheEntry
from .core._config import CacheDimensions, parse_dtype
from .core._errors import (
    CacheConfigError,
    CacheFileError,
    CacheShapeError,
    FrozenCacheError,
    HookError,
    PatchingError,
    SafelensError,
    TokenError,
)
from .core._hook_point import CacheHookPoint
from .core._values import concat_values, shape_of
from .experiments._ablation import ablate_read, ablate_write
from .experiments._ablation_plan import Ablation
from .experiments._capture import run_with_cache_capture
from .experiments._continuations import ContinuationScores, score_continuations
from .experiments._generation import Generation, generate, sample_logits
from .experiments._metrics import logit_diff_metric
from .experiments._prefix import Prefix, prefill
from .experiments._run import run_with_hooks
from .patching._attribution import AttributionResult, attribution_patch
from .patching._dataset import PatchingResult, patch_dataset
from .patching._every import (
    get_act_patch_attn_head_all_pos_every,
    get_act_patch_attn_head_by_pos_every,
    get_act_patch_block_every,
)
from .patching._patterns import (
    get_act_patch_attn_head_pattern_all_pos,
    get_act_patch_attn_head_pattern_by_pos,
    get_act_patch_attn_head_pattern_dest_src_pos,
)
from .patching._plotting import plot_patching_heatmap
from .patching._sweeps import (
    generic_activation_patch,
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

if TYPE_CHECKING:
    from .backends.hf._cache import HFKeyValueCache
    from .backends.hf._model import hf_cache_argument

# The HuggingFace backend is imported on first use, so `import safelens` needs no transformers.
_LAZY = {"HFKeyValueCache": ".backends.hf._cache", "hf_cache_argument": ".backends.hf._model"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'safelens' has no attribute {name!r}")
    from importlib import import_module

    try:
        module = import_module(_LAZY[name], __name__)
    except ModuleNotFoundError as error:
        raise ImportError(
            f"safelens.{name} needs the transformers package: pip install 'safelens[hf]'"
        ) from error
    return getattr(module, name)


TransformerLensKeyValueCache = KeyValueCache
TransformerLensKeyValueCacheEntry = KeyValueCacheEntry
HookedTransformerKeyValueCache = KeyValueCache
HookedTransformerKeyValueCacheEntry = KeyValueCacheEntry

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
    "logit_diff_metric",
    "patch_dataset",
    "PatchingResult",
    "attribution_patch",
    "AttributionResult",
    "plot_patching_heatmap",
    "PatchingError",
    "Prefix",
    "ContinuationScores",
    "prefill",
    "score_continuations",
    "shared_prefix_attention",
    "Generation",
    "generate",
    "sample_logits",
    "Ablation",
    "ablate_read",
    "ablate_write",
    "KeyValueCache",
    "KeyValueCacheEntry",
    "HFKeyValueCache",
    "hf_cache_argument",
    "TransformerLensKeyValueCache",
    "TransformerLensKeyValueCacheEntry",
    "HookedTransformerKeyValueCache",
    "HookedTransformerKeyValueCacheEntry",
    "CacheDimensions",
    "CacheHookPoint",
    "add_hook",
    "cache_hook_names",
    "hooks",
    "reset_hooks",
    "run_with_cache_capture",
    "run_with_hooks",
    "parse_dtype",
    "shape_of",
    "concat_values",
    "SafelensError",
    "CacheShapeError",
    "CacheConfigError",
    "CacheFileError",
    "HookError",
    "FrozenCacheError",
    "TokenError",
]
