"""The index grid of a generic patching sweep: which patches, and the result's shape.

TransformerLens' `generic_activation_patch` takes either the names of the axes to sweep
(`("layer", "pos")`: every index of those axes, in row-major order, the result shaped
by them) or an `index_df` of the indices themselves (the result one value per row).
The first column is the layer. Nothing here depends on the model family: the caller
gives each axis' size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
import torch

from ..core._errors import PatchingError

__all__ = ["check_index_choice", "check_setter_result", "grid", "index_grid"]


def check_index_choice(index_axis_names: Any, index_df: Any) -> None:
    """A `PatchingError` unless exactly one is given: axis names, each once, or a DataFrame."""
    if (index_df is None) == (index_axis_names is None):
        raise PatchingError(
            "pass exactly one of index_axis_names (a tuple such as ('layer', 'pos')) and "
            f"index_df; got index_axis_names={index_axis_names!r} and "
            f"index_df={'a DataFrame' if index_df is not None else None}"
        )
    if isinstance(index_axis_names, str) or (
        index_axis_names is not None and not isinstance(index_axis_names, Sequence)
    ):
        raise PatchingError(
            "index_axis_names must be a sequence of axis names such as ('layer', 'pos'), got "
            f"{type(index_axis_names).__name__} {index_axis_names!r}; for one axis pass "
            "('layer',)"
        )
    if index_axis_names is not None and len(set(index_axis_names)) != len(index_axis_names):
        raise PatchingError(
            f"index_axis_names {tuple(index_axis_names)!r} names an axis more than once; name "
            "each axis once"
        )
    if index_df is not None and not isinstance(index_df, pd.DataFrame):
        raise PatchingError(
            f"index_df must be a pandas DataFrame of indices, got {type(index_df).__name__}"
        )


def index_grid(
    sizes: dict[str, int], index_axis_names: Sequence[str] | None, index_df: pd.DataFrame | None
) -> tuple[pd.DataFrame, tuple[int, ...]]:
    """The checked index rows of a generic sweep, and the shape of its result.

    `sizes` gives each axis' length (`layer`, `pos`, `head_index`, ...).
    """
    if index_df is not None:
        _check_index_df(index_df, sizes)
        return index_df, (len(index_df),)
    assert index_axis_names is not None
    unknown = [name for name in index_axis_names if name not in sizes]
    if unknown:
        raise PatchingError(f"index_axis_names {unknown} unknown; allowed: {sorted(sizes)}")
    shape = tuple(sizes[name] for name in index_axis_names)
    return pd.DataFrame(grid(shape), columns=list(index_axis_names)), shape


def _check_index_df(index_df: pd.DataFrame, sizes: dict[str, int]) -> None:
    """A `PatchingError` unless every column holds integer indices within its axis."""
    if not len(index_df.columns):
        raise PatchingError("index_df has no columns; the first column must be the layer")
    for number, column in enumerate(index_df.columns):
        values = index_df[column]
        if not pd.api.types.is_integer_dtype(values) or pd.api.types.is_bool_dtype(values):
            raise PatchingError(
                f"index_df column {column!r} holds {values.dtype}; expected integer indices "
                "(index_df.astype(int) if they are whole numbers)"
            )
        name = "layer" if number == 0 else column
        if name not in sizes or not len(values):
            continue
        size = sizes[name]
        low = 0 if name == "layer" else -size
        bad = values[(values < low) | (values >= size)]
        if len(bad):
            raise PatchingError(
                f"index_df column {column!r} holds {int(bad.iloc[0])}; expected a {name} "
                f"index in [{low}, {size}) for this model and corrupted_tokens"
            )


def grid(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every index of `shape` in row-major order (the last axis fastest)."""
    grid = torch.cartesian_prod(*(torch.arange(n) for n in shape)).reshape(-1, len(shape))
    return [tuple(row) for row in grid.tolist()]


def check_setter_result(patched: Any, given: torch.Tensor, index: list[int]) -> None:
    """A `PatchingError` unless `patch_setter`'s result `patched` is shaped as `given`."""
    if not isinstance(patched, torch.Tensor) or patched.shape != given.shape:
        got = (
            f"shape {tuple(patched.shape)}"
            if isinstance(patched, torch.Tensor)
            else type(patched).__name__
        )
        raise PatchingError(
            f"patch_setter returned {got} for index {index}; expected the activation it was "
            f"given, shape {tuple(given.shape)} (or None after editing it in place)"
        )
