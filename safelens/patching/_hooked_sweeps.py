"""The sweeps on a `HookedTransformer`: patchers that write clean activations into stacked runs.

The `HookedTransformer` runner (`safelens.patching._runners`): the named sweeps
(`safelens.patching._sweeps`), the pattern sweeps (TransformerLens' pattern setters on
the generic sweep), `generic_activation_patch` (`safelens.patching._generic`), the
`*_every` bundles' clean-cache check and `patch_dataset`'s adapter (a TransformerBridge
or a HuggingFace model takes `safelens.patching._hf_sweeps` and
`safelens.patching._hf_generic`). A sweep is a list
of runs, one per index of its grid; the runs that would write what the corrupted run
already holds are set apart (`safelens.patching._unchanged`) and run no pass; the others
are stacked along the batch and run from the corrupted run's frozen key/value cache by
`safelens.patching._grid`, each run's patcher writing the clean activation at its index
into its rows: at one position (`by_pos`), at every position from the run's first, or
through a user's `patch_setter` on the run's full-length activation.

Caveat: what runs here imports `HookedTransformer` code (`safelens.patching._inputs`,
`_grid`) only when called, so that the sweeps import on TransformerLens 4, which removed
it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import pandas as pd
import torch
from jaxtyping import Int

from ..backends._backend import Backend
from ..backends._sites import TL_NAMES
from ..backends._supported import SupportedModel
from ..backends.hooked._backend import HookedBackend
from ..core._errors import PatchingError
from ._clean_cache import check_clean_cache, hooked_sizes
from ._engine import Run, patch_index, put
from ._limits import DEFAULT_MAX_BYTES, _check_limits
from ._metric import Metric
from ._setters import Setter, SweepKeywords
from ._unchanged import known_setter_axes, marked, unchanged

if TYPE_CHECKING:
    from transformer_lens import ActivationCache, HookedTransformer

    from ._inputs import _Sweep

__all__ = [
    "check_hooked_bundle",
    "hooked_backend",
    "hooked_generic",
    "hooked_patch",
    "hooked_pattern",
]


def _patcher(sweep: _Sweep) -> Callable[..., None]:
    """The sweep's patch: each run's clean values at its position and head (`put`), in
    the layout the adapter declares for the site (`Backend.patch_site`)."""
    site = HookedBackend(sweep.model).patch_site(sweep.activation_name)

    def patch(
        tensor: torch.Tensor, runs: list[Run], places: list[int], batch: int, start: int
    ) -> None:
        index = patch_index(places, runs, batch, tensor.device)
        put(site, tensor, sweep.clean[runs[0].layer], index, start)

    return patch


def _grid_runs(shape: tuple[int, ...], by_pos: bool, with_head: bool) -> list[Run]:
    from ._index import grid

    return [
        Run(
            slot,
            index[0],
            index[1] if by_pos else None,
            index[-1] if with_head else None,
            cell=index,
        )
        for slot, index in enumerate(grid(shape))
    ]


def hooked_patch(
    activation_name: str,
    by_pos: bool,
    with_head: bool,
    model: HookedTransformer,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: ActivationCache,
    patching_metric: Metric,
    *,
    max_batch: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: bool = True,
) -> torch.Tensor:
    from ._inputs import _Sweep

    _check_limits(max_batch, max_bytes, progress)
    sweep = _Sweep(model, corrupted_tokens, clean_cache, activation_name)
    shape: tuple[int, ...] = (model.cfg.n_layers,)
    if by_pos:
        shape += (sweep.length,)
    if with_head:
        shape += (sweep.heads(),)
    # The patcher writes clean[:, pos, head] (every position without pos, the whole
    # position without head).
    runs, idle = _idle(sweep, _grid_runs(shape, by_pos, with_head), [1] * by_pos + [2] * with_head)
    return sweep.run(
        runs, shape, _patcher(sweep), patching_metric, max_batch, max_bytes, progress, by_pos, idle
    )


def _idle(sweep: _Sweep, runs: list[Run], axes: list[int]) -> tuple[list[Run], list[Run]]:
    """`runs` split into those that change something and those that do not (`_unchanged`).

    A run's patch writes the clean activation at its index after the layer, on the
    activation's `axes` (every entry of the others).
    """
    same = [
        unchanged(sweep.clean[layer], sweep.corrupted.activations[sweep.hook_name(layer)], axes)
        for layer in range(sweep.model.cfg.n_layers)
    ]
    flags = marked(same, [run.cell for run in runs])
    idle = [run for run, flag in zip(runs, flags, strict=True) if flag]
    return [run for run, flag in zip(runs, flags, strict=True) if not flag], idle


def hooked_generic(
    model: SupportedModel,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: ActivationCache,
    patching_metric: Metric,
    patch_setter: Setter,
    activation_name: str,
    index_axis_names: Sequence[str] | None,
    index_df: pd.DataFrame | None,
    max_batch: int | None,
    max_bytes: int,
    progress: bool,
) -> tuple[torch.Tensor, pd.DataFrame]:
    """`generic_activation_patch` on a `HookedTransformer`: result and index rows."""
    from ._index import check_index_choice
    from ._inputs import _check_patched, _index_grid, _Sweep

    _check_limits(max_batch, max_bytes, progress)
    check_index_choice(index_axis_names, index_df)
    hooked = cast("HookedTransformer", model)  # neither a bridge nor an HF model
    sweep = _Sweep(hooked, corrupted_tokens, clean_cache, activation_name)
    index_df, shape = _index_grid(sweep, index_axis_names, index_df)
    columns = list(index_df.columns)
    pos_column = columns.index("pos") if "pos" in columns else None
    runs = []
    for slot, row in enumerate(index_df.itertuples(index=False)):
        index = tuple(int(i) for i in row)
        pos = index[pos_column] % sweep.length if pos_column is not None else None
        runs.append(Run(slot, index[0], pos, cell=index))

    def patch(
        tensor: torch.Tensor, runs: list[Run], places: list[int], batch: int, start: int
    ) -> None:
        layer = runs[0].layer
        before = sweep.corrupted.activations[sweep.hook_name(layer)]
        for run, place in zip(runs, places, strict=True):
            own = tensor[place * batch : (place + 1) * batch]
            full = torch.cat([before[:, :start], own], dim=1)
            patched = patch_setter(full, list(run.cell), sweep.clean[layer])
            _check_patched(full if patched is None else patched, full, before, start, run)
            own.copy_((full if patched is None else patched)[:, start:])

    idle: list[Run] = []
    writes = known_setter_axes(patch_setter)
    if writes is not None and all(len(run.cell) == len(writes) + 1 for run in runs):
        runs, idle = _idle(sweep, runs, writes)
    result = sweep.run(
        runs, shape, patch, patching_metric, max_batch, max_bytes, progress, idle=idle
    )
    return result, index_df


def check_hooked_bundle(
    model: HookedTransformer,
    corrupted_tokens: Any,
    clean_cache: Any,
    activations: Sequence[str],
    bundle: str,
) -> None:
    """A `PatchingError` if `clean_cache` lacks what a sweep of a `*_every` `bundle` patches."""
    check_clean_cache(clean_cache, hooked_sizes(model.cfg), HookedBackend.clean_cache_call)
    for activation in activations:
        for layer in range(model.cfg.n_layers):
            name = f"blocks.{layer}.{TL_NAMES[activation]}"
            try:
                clean_cache[name]
            except KeyError:
                fix = (
                    "the model is attention-only (cfg.attn_only=True) and has no MLP output; "
                    "call get_act_patch_resid_pre and get_act_patch_attn_out instead"
                    if model.cfg.attn_only and "mlp" in name
                    else "run the clean prompt with model.run_with_cache(clean_tokens), "
                    "without a names_filter, and pass that cache"
                )
                raise PatchingError(
                    f"clean_cache has no activation {name!r}, which {bundle} patches (it "
                    f"stacks sweeps of {', '.join(activations)}); {fix}"
                ) from None


def hooked_pattern(
    keywords: SweepKeywords,
    sweep: str,
    model: HookedTransformer,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: ActivationCache,
    patching_metric: Metric,
    max_batch: int | None,
    max_bytes: int,
    progress: bool,
) -> torch.Tensor:
    """A pattern sweep (`sweep`) as TransformerLens builds it: its setter on the generic sweep."""
    result, _ = hooked_generic(
        model,
        corrupted_tokens,
        clean_cache,
        patching_metric,
        keywords.patch_setter,
        "pattern",
        keywords.index_axis_names,
        None,
        max_batch,
        max_bytes,
        progress,
    )
    return result


def hooked_backend(model: HookedTransformer) -> Backend:
    """The adapter of a `HookedTransformer` whatever its options.

    Not `backend_of`, whose check refuses what only cached passes cannot run
    (`ungroup_grouped_query_attention`): the sweeps run every `HookedTransformer`.
    """
    return HookedBackend(model)
