"""The sweeps' one front-end: a grid or index rows turned into runs, whatever the model.

Every sweep is a list of runs (`safelens.patching._engine.Run`), one per cell of its
result: a named sweep's are the cells of its grid (`named_sweep`: layer, then position,
source position and head where it has them); a pattern sweep's a named sweep's of the
`pattern` site, the head moved second as TransformerLens orders it (`pattern_sweep`);
`generic_activation_patch`'s the rows of its index (`generic_sweep`: the first column
the layer, a `pos` column the first position the setter changes). A generic sweep with
one of TransformerLens' setters, on an activation of the named sweeps, whose index
columns name the axes the setter writes, is the named sweep of its index rows: each row
is the run at that cell, and the sweep takes every shortcut a named sweep takes (patches
that change nothing, positions before the patch). The axes' sizes come from the model:
the family's `prepare` (`safelens.patching._runners.prepare_of`) checks the model,
tokens, clean cache and activation and gives a `Prepared` sweep, which runs the runs on
the family's passes and returns the metric of each at its slot. `check_bundle` checks,
before a `*_every` bundle's first sweep, what its later sweeps need, against the
adapter protocol alone.

Checks, in order: the model's family, the limits (`max_batch`, `max_bytes`,
`progress`), a generic sweep's choice of index, then what the family's `prepare` checks,
then a generic sweep's index rows against the axis sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import pandas as pd
import torch

from ..backends._sites import PATTERNS, QUERY_HEADS, TL_NAMES
from ..core._errors import PatchingError
from ._clean_cache import backend_sizes, check_clean_cache, clean_tensors, sweep_tokens
from ._engine import Run
from ._index import check_index_choice, grid, index_grid
from ._limits import Limits
from ._metric import Metric
from ._pattern_hook import check_pattern_hook
from ._runners import prepare_of, sweep_backend
from ._setters import Setter, known_setter_axes

__all__ = ["Prepared", "check_bundle", "generic_sweep", "named_sweep", "pattern_sweep"]


class Prepared(Protocol):
    """A sweep's checked inputs on its model, and how its runs run there.

    - `n_layers`, `length`: the model's layers and the prompt's positions;
    - `heads`: the heads of a head index of the sweep's activation (key/value heads for
      keys and values, query heads otherwise);
    - `run(runs, shape, metric, limits)`: a `shape` result, each run's metric at its
      slot. Each run writes the clean activation at its position, source position and
      head (every entry of an axis it does not have), or, prepared with a setter,
      whatever `setter(activation, list(run.cell), clean)` writes.
    """

    @property
    def n_layers(self) -> int: ...

    @property
    def length(self) -> int: ...

    @property
    def heads(self) -> int: ...

    def run(
        self, runs: list[Run], shape: tuple[int, ...], metric: Metric, limits: Limits
    ) -> torch.Tensor: ...


def _grid_runs(shape: tuple[int, ...], by_pos: bool, by_src: bool, with_head: bool) -> list[Run]:
    """One run per cell of `shape` (`[layer, pos?, src?, head?]`), in the result's order."""
    runs = []
    for slot, cell in enumerate(grid(shape)):
        pos = cell[1] if by_pos else None
        src = cell[1 + by_pos] if by_src else None
        runs.append(Run(slot, cell[0], pos, cell[-1] if with_head else None, src, cell))
    return runs


def named_sweep(
    activation: str,
    by_pos: bool,
    with_head: bool,
    model: Any,
    corrupted_tokens: torch.Tensor,
    clean_cache: Any,
    patching_metric: Metric,
    limits: Limits,
    by_src: bool = False,
) -> torch.Tensor:
    """A `get_act_patch_*` sweep: `[layer, pos?, src?, head?]`, the axes it has.

    Each run patches the clean `activation` at its cell: one position (`by_pos`) or every
    one, one source position of a pattern (`by_src`) or every one, one head
    (`with_head`) or every one.
    """
    prepare = prepare_of(model)
    limits = limits.checked()
    prepared = prepare(model, corrupted_tokens, clean_cache, activation, None)
    length = prepared.length
    shape = (
        prepared.n_layers,
        *((length,) if by_pos else ()),
        *((length,) if by_src else ()),
        *((prepared.heads,) if with_head else ()),
    )
    runs = _grid_runs(shape, by_pos, by_src, with_head)
    return prepared.run(runs, shape, patching_metric, limits)


def pattern_sweep(
    index_axis_names: Sequence[str],
    what: str,
    model: Any,
    corrupted_tokens: torch.Tensor,
    clean_cache: Any,
    patching_metric: Metric,
    limits: Limits,
) -> torch.Tensor:
    """A pattern sweep over `index_axis_names` (`layer, head_index, dest_pos?, src_pos?`).

    A bridge whose attention ignores what `hook_pattern` returns is refused first,
    naming `what` (`safelens.patching._pattern_hook`).
    """
    prepare_of(model)
    check_pattern_hook(model, corrupted_tokens, what)
    by_pos, by_src = "dest_pos" in index_axis_names, "src_pos" in index_axis_names
    arguments = (model, corrupted_tokens, clean_cache, patching_metric, limits, by_src)
    return named_sweep("pattern", by_pos, True, *arguments).movedim(-1, 1)


# What each axis of an activation is to a run, by its layout: position-major
# (`[batch, pos, head, …]`) or a pattern's (`[batch, head, dest_pos, src_pos]`); and the
# index columns that may name it.
_FIELDS = {False: {1: "pos", 2: "head"}, True: {1: "head", 2: "pos", 3: "src"}}
_COLUMNS = {"pos": ("pos", "dest_pos"), "head": ("head_index", "head"), "src": ("src_pos",)}


def _named_fields(setter: Setter, activation_name: str, columns: list[str]) -> list[str] | None:
    """The run field (`pos`, `head`, `src`) of each index column after the layer, where a
    generic sweep is a named sweep of its index rows; else `None`.

    It is where `setter` is one of TransformerLens' (`known_setter_axes`), the activation
    one of the named sweeps' (`TL_NAMES`), and each column is named for the axis the
    setter writes at it (so `index_grid` checked its range): the setter then writes the
    clean activation at the run's position, source position and head, as a named sweep's
    run does.
    """
    axes = known_setter_axes(setter)
    if axes is None or activation_name not in TL_NAMES or len(columns) != len(axes) + 1:
        return None
    pattern = activation_name in PATTERNS
    fields = [_FIELDS[pattern].get(axis) for axis in axes]
    if "head" in fields and not (pattern or activation_name in QUERY_HEADS | {"k", "v"}):
        return None  # a position-major activation without heads
    named = all(
        field is not None and column in _COLUMNS[field]
        for field, column in zip(fields, columns[1:], strict=True)
    )
    return [str(field) for field in fields] if named else None


def generic_sweep(
    model: Any,
    corrupted_tokens: torch.Tensor,
    clean_cache: Any,
    patching_metric: Metric,
    patch_setter: Setter,
    activation_name: str,
    index_axis_names: Sequence[str] | None,
    index_df: pd.DataFrame | None,
    limits: Limits,
) -> tuple[torch.Tensor, pd.DataFrame]:
    """`generic_activation_patch`: its result and index rows (`safelens.patching._generic`)."""
    prepare = prepare_of(model)
    limits = limits.checked()
    check_index_choice(index_axis_names, index_df)
    named = index_axis_names if index_df is None else index_df.columns
    columns = [str(name) for name in named]  # type: ignore[union-attr]
    fields = _named_fields(patch_setter, activation_name, columns)
    prepared: Prepared | None = None
    if fields is not None:
        if activation_name == "pattern":  # as the pattern sweeps (the setters' own is later)
            check_pattern_hook(model, corrupted_tokens, "generic_activation_patch")
        try:
            prepared = prepare(model, corrupted_tokens, clean_cache, activation_name, None)
        except PatchingError:  # no such named site here (a bridge's own hook point may be)
            fields = None
    if prepared is None:
        prepared = prepare(model, corrupted_tokens, clean_cache, activation_name, patch_setter)
    length, heads = prepared.length, prepared.heads
    sizes = {"layer": prepared.n_layers, "pos": length, "src_pos": length, "dest_pos": length}
    sizes |= {"head_index": heads, "head": heads}
    index_df, shape = index_grid(sizes, index_axis_names, index_df)
    pos_column = columns.index("pos") if "pos" in columns else None
    modulus = {"pos": length, "src": length, "head": heads}
    runs = []
    for slot, row in enumerate(index_df.itertuples(index=False)):
        cell = tuple(int(i) for i in row)
        if fields is not None:  # a named sweep's run at the cell
            at = {
                field: value % modulus[field] for field, value in zip(fields, cell[1:], strict=True)
            }
            runs.append(Run(slot, cell[0], at.get("pos"), at.get("head"), at.get("src"), cell))
        else:
            pos = cell[pos_column] % length if pos_column is not None else None
            runs.append(Run(slot, cell[0], pos, cell=cell))
    result = prepared.run(runs, shape, patching_metric, limits)
    return result, index_df


def check_bundle(
    model: Any, corrupted_tokens: Any, clean_cache: Any, activations: Sequence[str], bundle: str
) -> None:
    """A `PatchingError`, before a `*_every` `bundle`'s first sweep, for what a later one lacks.

    Each activation must have a site on the model (`Backend.patch_site`, which says why
    a family lacks one) and its clean tensor of every layer in `clean_cache`, checked
    as the sweep checks it; the pattern's last, as its probe pass (why a bridge may not
    have it) runs after the checks that need no forward pass.
    """
    backend = sweep_backend(model, bundle)
    tokens = sweep_tokens(backend, corrupted_tokens, "corrupted_tokens")
    check_clean_cache(clean_cache, backend_sizes(backend), backend.clean_cache_call)
    for activation in sorted(activations, key=lambda activation: activation == "pattern"):
        if activation == "pattern":
            check_pattern_hook(model, tokens, bundle)
        try:
            site = backend.patch_site(activation, clean_cache)
            for layer in range(backend.n_layers):
                site.hook(layer)  # a seam the model lacks says so here
            clean_tensors(backend, site, clean_cache, *tokens.shape)
        except PatchingError as error:
            raise PatchingError(
                f"{bundle} stacks sweeps of {', '.join(activations)}, and cannot sweep "
                f"{activation!r} here: {error}"
            ) from None
