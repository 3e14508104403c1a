"""The sweeps' runs on a `HookedTransformer`: `HookedSweep`, the `*_every` check, the adapter.

The `HookedTransformer` runner (`safelens.patching._runners`). Every sweep's runs come
from the one front-end (`safelens.patching._front`); here, how they run on this family.
`HookedSweep` checks the sweep's inputs and runs the corrupted prompt
(`safelens.patching._inputs`); the runs that would write what the corrupted run already
holds are set apart (`safelens.patching._unchanged`) and run no pass; the others are
stacked along the batch and run from the corrupted run's frozen key/value cache by
`safelens.patching._grid`, each run writing the clean activation at its cell into its
rows (`run`: at one position and head or every one, as the adapter lays the site out,
`Backend.patch_site`), or a user's `patch_setter` writing it on the run's full-length
activation (`_run_setter`). A TransformerBridge or a HuggingFace model takes
`safelens.patching._hf_sweeps` and `safelens.patching._hf_generic`.

Caveat: what runs here imports `HookedTransformer` code (`safelens.patching._inputs`,
`_grid`) only when called, so that the sweeps import on TransformerLens 4, which removed
it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Int

from ..backends._backend import Backend
from ..backends._sites import TL_NAMES
from ..backends.hooked._backend import HookedBackend
from ..core._errors import PatchingError
from ._clean_cache import check_clean_cache, hooked_sizes
from ._engine import Run, patch_index, put
from ._limits import Limits
from ._metric import Metric
from ._setters import Setter
from ._unchanged import idle_runs

if TYPE_CHECKING:
    from transformer_lens import ActivationCache, HookedTransformer

__all__ = ["HookedSweep", "check_hooked_bundle", "hooked_backend"]


class HookedSweep:
    """A sweep's checked inputs on a `HookedTransformer` (`_inputs._Sweep`), and its runs' passes.

    The runner's `prepare` and the front-end's `Prepared` (`safelens.patching._front`) on
    this family, a named sweep's or (with `setter`) a generic one's: the corrupted
    run has run (`_Sweep`), and `run` sets apart the runs that would write what it
    holds and runs the others through `safelens.patching._grid`: each writes the clean
    activation at its cell, or `setter` (`generic_activation_patch`'s) writes its patch.
    """

    def __init__(
        self,
        model: HookedTransformer,
        corrupted_tokens: Int[torch.Tensor, "batch pos"],
        clean_cache: ActivationCache,
        activation_name: str,
        setter: Setter | None = None,
    ) -> None:
        from ._inputs import _Sweep

        self.sweep = _Sweep(model, corrupted_tokens, clean_cache, activation_name)
        self.setter = setter
        self.n_layers = int(model.cfg.n_layers)
        self.length = self.sweep.length
        self.heads = self.sweep.heads()

    def run(
        self, runs: list[Run], shape: tuple[int, ...], metric: Metric, limits: Limits
    ) -> torch.Tensor:
        """Each run writes the clean values at its cell (`put`), in the layout the adapter
        declares for the site (`Backend.patch_site`), or its setter's (`_run_setter`)."""
        if self.setter is not None:
            return self._run_setter(self.setter, runs, shape, metric, limits)
        sweep = self.sweep
        site = HookedBackend(sweep.model).patch_site(sweep.activation_name)
        seen = {
            layer: sweep.corrupted.activations[sweep.hook_name(layer)]
            for layer in range(self.n_layers)
        }
        idle = idle_runs(site, sweep.clean, seen, runs)
        skipped = {run.slot for run in idle}

        def patch(
            tensor: torch.Tensor, runs: list[Run], places: list[int], batch: int, start: int
        ) -> None:
            index = patch_index(places, runs, batch, tensor.device)
            put(site, tensor, sweep.clean[runs[0].layer], index, start)

        single_position = bool(runs) and all(run.pos is not None for run in runs)
        runs = [run for run in runs if run.slot not in skipped]
        return sweep.run(runs, shape, patch, metric, limits, single_position, idle)

    def _run_setter(
        self,
        setter: Setter,
        runs: list[Run],
        shape: tuple[int, ...],
        metric: Metric,
        limits: Limits,
    ) -> torch.Tensor:
        """Each run's patch is `setter`'s on its rows at full length; positions before the
        run's `pos` are the corrupted run's, and a setter that changes one is refused."""
        from ._inputs import _check_patched

        sweep = self.sweep

        def patch(
            tensor: torch.Tensor, runs: list[Run], places: list[int], batch: int, start: int
        ) -> None:
            layer = runs[0].layer
            before = sweep.corrupted.activations[sweep.hook_name(layer)]
            for run, place in zip(runs, places, strict=True):
                own = tensor[place * batch : (place + 1) * batch]
                full = torch.cat([before[:, :start], own], dim=1)
                patched = setter(full, list(run.cell), sweep.clean[layer])
                _check_patched(full if patched is None else patched, full, before, start, run)
                own.copy_((full if patched is None else patched)[:, start:])

        return sweep.run(runs, shape, patch, metric, limits)


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


def hooked_backend(model: HookedTransformer) -> Backend:
    """The adapter of a `HookedTransformer` whatever its options.

    Not `backend_of`, whose check refuses what only cached passes cannot run
    (`ungroup_grouped_query_attention`): the sweeps run every `HookedTransformer`.
    """
    return HookedBackend(model)
