"""safelens: a TransformerLens-compatible key/value cache for interpretability work."""

from ._cache import KeyValueCache
from ._cache_entry import KeyValueCacheEntry
from ._config import CacheDimensions, parse_dtype
from ._errors import (
    CacheConfigError,
    CacheFileError,
    CacheShapeError,
    FrozenCacheError,
    HookError,
    SafelensError,
)
from ._hook_point import CacheHookPoint
from ._values import concat_values, shape_of

TransformerLensKeyValueCache = KeyValueCache
TransformerLensKeyValueCacheEntry = KeyValueCacheEntry
HookedTransformerKeyValueCache = KeyValueCache
HookedTransformerKeyValueCacheEntry = KeyValueCacheEntry

__all__ = [
    "KeyValueCache",
    "KeyValueCacheEntry",
    "TransformerLensKeyValueCache",
    "TransformerLensKeyValueCacheEntry",
    "HookedTransformerKeyValueCache",
    "HookedTransformerKeyValueCacheEntry",
    "CacheDimensions",
    "CacheHookPoint",
    "parse_dtype",
    "shape_of",
    "concat_values",
    "SafelensError",
    "CacheShapeError",
    "CacheConfigError",
    "CacheFileError",
    "HookError",
    "FrozenCacheError",
]
