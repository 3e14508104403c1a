"""The one place the patching package reads a model's family: how its sweeps' runs run.

What a sweep does is written once, whatever the model, against the adapter protocol
(`safelens.backends._backend.Backend`): its runs, from its grid or index rows, and the
`*_every` bundles' checks (`safelens.patching._front`); the model's sites
(`Backend.patch_site`), its tokens and clean cache, checked
(`safelens.patching._clean_cache`); the loop that sets apart the runs that write what
the corrupted run holds (`_unchanged`) and scores the others pass by pass within the
memory budget, and the patch writer (`safelens.patching._engine`: `run_passes`, `put`);
grouping runs into passes on the corrupted run's frozen cache (`_grouping`); what a
patched run may skip (`_skips`); the metric (`_metric`). What is the family's is its
corrupted run and how one pass runs on the model (the engine's `Passes`), and so how a
sweep is prepared for it (`prepare_of(model)`):

- a `HookedTransformer` runs layer by layer through `start_at_layer`, with safelens'
  attention path (`safelens.patching._hooked_sweeps`, `_grid`, `_plan`);
- a TransformerBridge or a HuggingFace causal LM runs its own forward, with hooks at
  the seams of its decoder layers (`safelens.patching._hf_sweeps`, `_hf_passes`,
  `_hf_shortcuts`).

`prepare_of(model)` picks by the model's classes
([`family_of`][safelens.backends._families.family_of]) and refuses any other model with
a `PatchingError` naming what arrived; `sweep_backend(model, what)` is the model's
adapter for the sweeps, `patch_dataset` and the bundles' checks. Below, the family an
adapter reports (`Backend.family`) still chooses a few things a protocol method does
not say: a bridge's attention mask and plain-model passes, how a HuggingFace clean
cache is made for a dataset, and attribution's gradient pass. The `HookedTransformer`
runner imports TransformerLens' `HookedTransformer` only when it runs, so this module
loads on TransformerLens 4.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..backends._backend import Backend
from ..backends._families import backend_of, family_of, wrapper_hint
from ..backends.hooked._backend import HookedBackend
from ..core._errors import PatchingError
from ._hf_sweeps import seam_sweep
from ._hooked_sweeps import HookedSweep

if TYPE_CHECKING:
    from ._front import Prepared

__all__ = ["Prepare", "prepare_of", "sweep_backend"]

# `prepare(model, corrupted_tokens, clean_cache, activation, setter)`: the sweep's checked
# inputs and how its runs run (`safelens.patching._front.Prepared`): a named sweep's
# (`setter=None`), or `generic_activation_patch`'s with its `setter`.
Prepare = Callable[..., "Prepared"]

_PREPARE: dict[str, Prepare] = {"hooked": HookedSweep, "bridge": seam_sweep, "hf": seam_sweep}


def _family(model: Any) -> str:
    """`model`'s family, or a `PatchingError` naming what arrived."""
    family = family_of(model)
    if family is None:
        raise PatchingError(
            f"model must be a HookedTransformer, a TransformerBridge or a HuggingFace causal "
            f"LM (a PreTrainedModel with generate), got {type(model).__name__}; pass the "
            f"model the sweep runs on, not a submodule or a wrapper of it{wrapper_hint(model)}"
        )
    return family


def prepare_of(model: Any) -> Prepare:
    """How a sweep is prepared on `model`'s family, or a `PatchingError` naming what arrived."""
    return _PREPARE[_family(model)]


def sweep_backend(model: Any, what: str) -> Backend:
    """`model`'s adapter for the sweeps, or a `PatchingError` naming what arrived.

    A `HookedTransformer`'s whatever its options: not `backend_of`, whose check refuses
    what only cached passes cannot run (`ungroup_grouped_query_attention`), since the
    sweeps run every `HookedTransformer`.
    """
    if _family(model) == "hooked":
        return HookedBackend(model)
    return backend_of(model, what)
