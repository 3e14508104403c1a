"""The exceptions safelens raises.

Every error derives from [`SafelensError`][safelens.SafelensError], so one `except`
clause catches them all. Each subclass names one kind of mistake; the message says what
was expected, what arrived and, where there is one, the likely fix. The docs' errors page
lists each with its symptom, cause and fix.
"""

from __future__ import annotations

__all__ = [
    "SafelensError",
    "CacheShapeError",
    "CacheConfigError",
    "CacheFileError",
    "HookError",
    "FrozenCacheError",
    "PatchingError",
    "TokenError",
    "JobFolderError",
    "WorkerError",
]


class SafelensError(Exception):
    """Base class of every error raised by safelens."""


class CacheShapeError(SafelensError, ValueError):
    """Keys, values or a mask whose shape, dtype or device does not fit the cache."""


class CacheConfigError(SafelensError, ValueError):
    """A model config lacks what a cache needs, or a cache does not fit a model."""


class CacheFileError(SafelensError, ValueError):
    """A saved cache file is truncated, corrupt, foreign or of an unknown version."""


class HookError(SafelensError, ValueError):
    """A hook name is unknown, or a hook function returned something that does not fit."""


class FrozenCacheError(SafelensError, RuntimeError):
    """An operation that must store into the cache was asked of a frozen cache."""


class PatchingError(SafelensError, ValueError):
    """A patching sweep got a metric, grid or activation it cannot use."""


class TokenError(SafelensError, ValueError):
    """Token ids of the wrong dtype or rank, outside `[0, d_vocab)`, or past `n_ctx`."""


class JobFolderError(SafelensError, ValueError):
    """A sharded job's output folder holds another job's shards, or a shard it cannot read."""


class WorkerError(SafelensError, RuntimeError):
    """Ray workers that cannot run a sharded job: replicas differ, or a shard kills them."""
