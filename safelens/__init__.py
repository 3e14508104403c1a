"""safelens: a TransformerLens-compatible key/value cache for interpretability work."""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from .backends._supported import SupportedModel
from .core._cache import KeyValueCache
from .core._cache_entry import KeyValueCacheEntry
from .core._config import CacheDimensions, parse_dtype
from .core._errors import (
    CacheConfigError,
    CacheFileError,
    CacheShapeError,
    FrozenCacheError,
    HookError,
    JobFolderError,
    PatchingError,
    SafelensError,
    TokenError,
    WorkerError,
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
from .patching._plotting import plot_patching_heatmap

if TYPE_CHECKING:
    from .backends.hf._cache import HFKeyValueCache
    from .backends.hf._model import hf_cache_argument
    from .backends.hf._shared_attention import shared_prefix
    from .backends.hooked._hooks import add_hook, cache_hook_names, hooks, reset_hooks
    from .backends.hooked._shared_attention import shared_prefix_attention
    from .distributed._workers import RayWorkers
    from .patching._attribution import AttributionResult, attribution_patch
    from .patching._attribution_dataset import AttributionDatasetResult, attribution_patch_dataset
    from .patching._dataset import PatchingResult, patch_dataset
    from .patching._every import (
        get_act_patch_attn_head_all_pos_every,
        get_act_patch_attn_head_by_pos_every,
        get_act_patch_block_every,
    )
    from .patching._generic import generic_activation_patch
    from .patching._hf_sites import run_with_patching_cache
    from .patching._patterns import (
        get_act_patch_attn_head_pattern_all_pos,
        get_act_patch_attn_head_pattern_by_pos,
        get_act_patch_attn_head_pattern_dest_src_pos,
    )
    from .patching._sweeps import (
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

# Imported on first use, so that `import safelens` works with transformers alone: the
# HuggingFace backend, and what needs TransformerLens' HookedTransformer, which
# TransformerLens 4 removed (its adapter, shared-prefix attention, the patching sweeps).
_LAZY_MODULES = {
    ".backends.hf._cache": ("HFKeyValueCache",),
    ".backends.hf._model": ("hf_cache_argument",),
    ".backends.hf._shared_attention": ("shared_prefix",),
    ".backends.hooked._hooks": ("add_hook", "cache_hook_names", "hooks", "reset_hooks"),
    ".backends.hooked._shared_attention": ("shared_prefix_attention",),
    ".distributed._workers": ("RayWorkers",),
    ".patching._attribution": ("AttributionResult", "attribution_patch"),
    ".patching._attribution_dataset": ("AttributionDatasetResult", "attribution_patch_dataset"),
    ".patching._dataset": ("PatchingResult", "patch_dataset"),
    ".patching._hf_sites": ("run_with_patching_cache",),
    ".patching._every": (
        "get_act_patch_attn_head_all_pos_every",
        "get_act_patch_attn_head_by_pos_every",
        "get_act_patch_block_every",
    ),
    ".patching._patterns": (
        "get_act_patch_attn_head_pattern_all_pos",
        "get_act_patch_attn_head_pattern_by_pos",
        "get_act_patch_attn_head_pattern_dest_src_pos",
    ),
    ".patching._generic": ("generic_activation_patch",),
    ".patching._sweeps": (
        "get_act_patch_attn_head_k_all_pos",
        "get_act_patch_attn_head_k_by_pos",
        "get_act_patch_attn_head_out_all_pos",
        "get_act_patch_attn_head_out_by_pos",
        "get_act_patch_attn_head_q_all_pos",
        "get_act_patch_attn_head_q_by_pos",
        "get_act_patch_attn_head_v_all_pos",
        "get_act_patch_attn_head_v_by_pos",
        "get_act_patch_attn_out",
        "get_act_patch_mlp_out",
        "get_act_patch_resid_mid",
        "get_act_patch_resid_pre",
    ),
}
_LAZY = {name: module for module, names in _LAZY_MODULES.items() for name in names}
# The lazy names whose modules need HookedTransformer itself (the rest run on a bridge).
_NEEDS_HOOKED_TRANSFORMER = frozenset(
    {
        *_LAZY_MODULES[".backends.hooked._hooks"],
        *_LAZY_MODULES[".backends.hooked._shared_attention"],
    }
)


def _missing_library(name: str, error: ImportError) -> str | None:
    """What to install for lazy name `name` whose module failed with `error`, if known."""
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    raised_in = "" if frame is None else frame.tb_frame.f_globals.get("__name__", "")
    libraries = {(error.name or "").partition(".")[0], raised_in.partition(".")[0]}
    if "transformers" in libraries:
        return f"safelens.{name} needs the transformers package: pip install 'safelens[hf]'"
    if "transformer_lens" in libraries:
        try:
            installed = f"TransformerLens {version('transformer-lens')} is installed"
            install = "pip install 'transformer-lens>=3.9,<4'"
        except PackageNotFoundError:
            installed = "TransformerLens is not installed"
            install = "pip install 'safelens[transformer-lens]' 'transformer-lens>=3.9,<4'"
        return (
            f"safelens.{name} needs TransformerLens' HookedTransformer, which TransformerLens "
            f"4 removed ({installed}): {install}. On TransformerLens 4, run the experiments "
            "on a TransformerBridge"
        )
    return None


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'safelens' has no attribute {name!r}")
    try:
        module = import_module(_LAZY[name], __name__)
    except ImportError as error:
        message = _missing_library(name, error)
        if message is None:
            raise
        raise ImportError(message) from error
    return getattr(module, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


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
    "run_with_patching_cache",
    "patch_dataset",
    "PatchingResult",
    "attribution_patch",
    "AttributionResult",
    "attribution_patch_dataset",
    "AttributionDatasetResult",
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
    "SupportedModel",
    "HFKeyValueCache",
    "hf_cache_argument",
    "shared_prefix",
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
    "JobFolderError",
    "WorkerError",
    "RayWorkers",
]


def _has_hooked_transformer() -> bool:
    """Whether the installed TransformerLens has `HookedTransformer` (3.x), from its metadata."""
    try:
        return int(version("transformer-lens").partition(".")[0]) < 4
    except (PackageNotFoundError, ValueError):
        return False


if not _has_hooked_transformer():
    # `from safelens import *` without HookedTransformer: what imports here. Each name
    # left out still says what to install when asked for (`__getattr__`).
    __all__ = [name for name in __all__ if name not in _NEEDS_HOOKED_TRANSFORMER]
