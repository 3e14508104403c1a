"""The one place the patching package reads a model's family: the runner its sweeps take.

What a sweep does is written once, whatever the model: its runs, from its grid or index
rows (`safelens.patching._front`), the loop that scores them, the memory budget and the patch writer (`safelens.patching._engine`), grouping
runs into passes on the corrupted run's frozen cache (`_grouping`), setting apart
patches that write what the corrupted run holds (`_unchanged`), what a patched run may
skip (`_skips`), the metric (`_metric`). Each adapter declares its sites
(`Backend.patch_site`). What is the family's is how a sweep's inputs are checked (its
runner's `prepare`) and how one pass runs on the model:

- a `HookedTransformer` runs layer by layer through `start_at_layer`, with safelens'
  attention path (`safelens.patching._hooked_sweeps`, `_grid`, `_plan`);
- a TransformerBridge or a HuggingFace causal LM runs its own forward, with hooks at
  the seams of its decoder layers (`safelens.patching._hf_sweeps`, `_hf_passes`,
  `_hf_shortcuts`).

`runner_of(model)` picks the runner by the model's classes
([`family_of`][safelens.backends._families.family_of]) and refuses any other model with
a `PatchingError` naming what arrived. The front-end (the named sweeps, the pattern
sweeps, `generic_activation_patch`), the `*_every` bundles and `patch_dataset` ask it
for their runner; below the runners, the family an adapter reports (`Backend.family`) still
chooses a few things a protocol method does not say: a bridge's attention mask and
plain-model passes, how a HuggingFace clean cache is made for a dataset, and
attribution's gradient pass and reference sweep. What the adapter declares (its sites,
`Backend.patch_site`; the call that makes its clean cache, `Backend.clean_cache_call`)
is read from it. The `HookedTransformer` runner imports TransformerLens'
`HookedTransformer` only when it runs, so this module loads on TransformerLens 4.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..backends._backend import Backend
from ..backends._families import backend_of, family_of, wrapper_hint
from ..core._errors import PatchingError
from ._hf_sweeps import check_seam_bundle, seam_sweep
from ._hooked_sweeps import HookedSweep, check_hooked_bundle, hooked_backend

if TYPE_CHECKING:
    from ._front import Prepared

__all__ = ["Runner", "runner_of"]


@dataclass(frozen=True)
class Runner:
    """How one family's sweeps run: each field is that family's function.

    - `prepare(model, corrupted_tokens, clean_cache, activation, setter)`: the sweep's
      checked inputs and how its runs run (`safelens.patching._front.Prepared`): a named
      sweep's (`setter=None`), or `generic_activation_patch`'s with its `setter`.
    - `check_bundle(model, corrupted_tokens, clean_cache, activations, bundle)`: a
      `PatchingError` before a `*_every` bundle's first sweep for what a later one lacks.
    - `backend(model)`: the model's adapter, for `patch_dataset`.
    """

    prepare: Callable[..., Prepared]
    check_bundle: Callable[..., None]
    backend: Callable[[Any], Backend]


_HOOKED = Runner(HookedSweep, check_hooked_bundle, hooked_backend)
_SEAMS = Runner(seam_sweep, check_seam_bundle, lambda model: backend_of(model, "patch_dataset"))
_RUNNERS = {"hooked": _HOOKED, "bridge": _SEAMS, "hf": _SEAMS}


def runner_of(model: Any) -> Runner:
    """The runner of `model`'s family, or a `PatchingError` naming what arrived."""
    family = family_of(model)
    if family is None:
        raise PatchingError(
            f"model must be a HookedTransformer, a TransformerBridge or a HuggingFace causal "
            f"LM (a PreTrainedModel with generate), got {type(model).__name__}; pass the "
            f"model the sweep runs on, not a submodule or a wrapper of it{wrapper_hint(model)}"
        )
    return _RUNNERS[family]
