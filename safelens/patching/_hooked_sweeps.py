"""The sweeps' runs on a `HookedTransformer`: `HookedSweep`.

The `HookedTransformer` runner (`safelens.patching._runners`). Every sweep's runs come
from the one front-end (`safelens.patching._front`); here, how they run on this family.
`HookedSweep` checks the sweep's inputs and runs the corrupted prompt
(`safelens.patching._inputs`); its runs go through the engine's loop
(`safelens.patching._engine.run_passes`), which sets apart those that would write what
the corrupted run already holds and scores the others on `HookedPasses`
(`safelens.patching._grid`): stacked along the batch, run from the corrupted run's
frozen key/value cache, each writing the clean activation at its cell into its rows
(`_site_patcher`: at one position and head or every one, as the adapter lays the site
out, `Backend.patch_site`), or a user's `patch_setter` writing it on the run's
full-length activation (`_setter_patcher`). A TransformerBridge or a HuggingFace model
takes `safelens.patching._hf_sweeps` and `safelens.patching._hf_generic`.

Caveat: what runs here imports `HookedTransformer` code (`safelens.patching._inputs`,
`_grid`) only when called, so that the sweeps import on TransformerLens 4, which removed
it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from jaxtyping import Int

from ..backends._sites import Site
from ._engine import Patcher, Run, patch_index, put, run_passes
from ._limits import Limits
from ._metric import Metric
from ._setters import Setter

if TYPE_CHECKING:
    from transformer_lens import ActivationCache, HookedTransformer

__all__ = ["HookedSweep"]


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

        named = setter is None
        self.sweep = _Sweep(model, corrupted_tokens, clean_cache, activation_name, named)
        self.setter = setter
        self.n_layers = int(model.cfg.n_layers)
        self.length = self.sweep.length
        self.heads = self.sweep.heads()

    def run(
        self, runs: list[Run], shape: tuple[int, ...], metric: Metric, limits: Limits
    ) -> torch.Tensor:
        """Each run writes the clean values at its cell (`put`), in the layout the adapter
        declares for the site (`Backend.patch_site`), or its setter's (`_setter_patcher`);
        the engine's loop (`run_passes`) sets apart the runs that write what the corrupted
        run holds (none with a setter) and scores the others on `HookedPasses`."""
        from ._grid import HookedPasses

        sweep = self.sweep
        site: Site | None = None
        seen: dict[int, torch.Tensor] = {}
        if self.setter is None:
            site = sweep.site
            assert site is not None  # a named sweep's
            seen = {
                layer: sweep.corrupted.activations[sweep.hook_name(layer)]
                for layer in range(self.n_layers)
            }
            patcher = _site_patcher(site, sweep.clean)
        else:
            patcher = self._setter_patcher(self.setter)
        passes = HookedPasses(sweep.model, sweep.corrupted, sweep.hook_name, patcher, site, seen)
        out = torch.zeros(shape, device=sweep.model.cfg.device)
        return run_passes(passes, sweep.clean, runs, out, metric, limits)

    def _setter_patcher(self, setter: Setter) -> Patcher:
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

        return patch


def _site_patcher(site: Site, clean: list[torch.Tensor]) -> Patcher:
    """Each run writes the clean values at its cell (`put`), at its rows of the pass."""

    def patch(
        tensor: torch.Tensor, runs: list[Run], places: list[int], batch: int, start: int
    ) -> None:
        index = patch_index(places, runs, batch, tensor.device)
        put(site, tensor, clean[runs[0].layer], index, start)

    return patch
