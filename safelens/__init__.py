"""safelens: a TransformerLens-compatible key/value cache for interpretability work."""

from typing import TYPE_CHECKING, Any

from ._ablation import ablate_read, ablate_write
from ._ablation_plan import Ablation
from ._cache import KeyValueCache
from ._cache_entry import KeyValueCacheEntry
from ._capture import run_with_cache_capture
from ._config import CacheDimensions, parse_dtype
from ._continuations import ContinuationScores, score_continuations
from ._errors import (
    CacheConfigError,
    CacheFileError,
    CacheShapeError,
    FrozenCacheError,
    HookError,
    PatchingError,
    SafelensError,
    TokenError,
)
from ._generation import Generation, generate, sample_logits
from ._hook_point import CacheHookPoint
from ._hooks import (
    add_hook,
    cache_hook_names,
    hooks,
    reset_hooks,
)
from ._metrics import logit_diff_metric
from ._patching import (
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
from ._patching_every import (
    get_act_patch_attn_head_all_pos_every,
    get_act_patch_attn_head_by_pos_every,
    get_act_patch_block_every,
)
from ._patching_patterns import (
    get_act_patch_attn_head_pattern_all_pos,
    get_act_patch_attn_head_pattern_by_pos,
    get_act_patch_attn_head_pattern_dest_src_pos,
)
from ._plotting import plot_patching_heatmap
from ._prefix import Prefix, prefill
from ._run import run_with_hooks
from ._shared_attention import shared_prefix_attention
from ._values import concat_values, shape_of

if TYPE_CHECKING:
    from ._hf_cache import HFKeyValueCache
    from ._hf_model import hf_cache_argument

# The HuggingFace backend is imported on first use, so `import safelens` needs no transformers.
_LAZY = {"HFKeyValueCache": "._hf_cache", "hf_cache_argument": "._hf_model"}


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
