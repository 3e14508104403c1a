"""Importing Ray on first use, with what to install when it is missing.

Ray is an optional dependency (`pip install 'safelens[ray]'`): `import safelens` and
everything outside `safelens.distributed` run without it.
"""

from __future__ import annotations

from types import ModuleType

__all__ = ["ray_module"]


def ray_module() -> ModuleType:
    """The `ray` package, or an `ImportError` saying to install `safelens[ray]`."""
    try:
        import ray
    except ImportError as error:
        raise ImportError(
            "safelens.RayWorkers needs Ray, which is an optional dependency of safelens; "
            "install it with pip install 'safelens[ray]'"
        ) from error
    return ray
