"""The checked inputs of a sweep on a `HookedTransformer`: `_Sweep`, its index grid, setter.

A sweep checks everything it is given before the first patched run: the limits
(`safelens.patching._limits`), the model (a `HookedTransformer`, not shortformer), and
then, for a named sweep, what every family's named sweep checks
(`safelens.patching._clean_cache.named_inputs`: the adapter's site, the corrupted
tokens, the clean cache against the model, each layer's clean tensor at the site); for
`generic_activation_patch` with a user's setter, which may name any hook, the corrupted
tokens, the clean cache, that the activation fires inside every block of this model,
and that `clean_cache` holds it in the corrupted run's shape (batch 1 or the corrupted
batch). `_Sweep` holds what passed: the tokens on the model's device, the corrupted run
(`safelens.patching._grid.CorruptedRun`) and each layer's clean activation, on the
device of that layer's activation. A generic sweep's index grid (`index_axis_names`, or
`index_df` checked against the axis sizes) is checked here too, and so is each
`patch_setter` result as it arrives. Every failure is a `PatchingError` naming the
input (corrupted tokens that are not token ids: a `TokenError`).

Caveat: making a `_Sweep` runs the corrupted forward pass (a generic sweep's clean
activations must match its), so the checks that need no model run first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd
import torch
from transformer_lens import ActivationCache, HookedTransformer
from transformer_lens.utilities import get_act_name

from ..backends._sites import Site
from ..backends.hooked._backend import HookedBackend, lacks
from ..core._errors import PatchingError
from ._clean_cache import (
    axes_of,
    backend_sizes,
    check_clean_cache,
    named_inputs,
    shape_error,
    sweep_tokens,
)
from ._grid import CorruptedRun, Run
from ._index import check_setter_result, index_grid
from ._limits import DEFAULT_MAX_BYTES

__all__ = ["DEFAULT_MAX_BYTES"]


class _Sweep:
    """The checked inputs of one sweep: a named one's (`named`: the activation one of
    `TL_NAMES`, checked by `named_inputs` as on every family, with its `site`), or a
    generic one's (any hook `get_act_name` spells; `site` is `None`)."""

    def __init__(
        self,
        model: HookedTransformer,
        corrupted_tokens: torch.Tensor,
        clean_cache: ActivationCache | dict[str, torch.Tensor],
        activation_name: str,
        named: bool,
    ) -> None:
        if not isinstance(model, HookedTransformer):
            raise PatchingError(
                "model must be a HookedTransformer, a TransformerBridge or a HuggingFace "
                f"causal LM, got {type(model).__name__}"
            )
        if model.cfg.positional_embedding_type == "shortformer":
            raise PatchingError(
                "shortformer positional embeddings are not supported by the cached sweeps; "
                "use transformer_lens.patching for this model"
            )
        backend = HookedBackend(model)
        self.model = model
        self.activation_name = activation_name
        names = [self.hook_name(layer) for layer in range(model.cfg.n_layers)]
        self.site: Site | None = None
        if named:
            # A named sweep's inputs, checked as on every family.
            self.site, self.tokens, self.clean = named_inputs(
                backend, corrupted_tokens, clean_cache, activation_name
            )
            self.batch, self.length = self.tokens.shape
            self.corrupted = CorruptedRun.of(model, self.tokens, names)
            return
        self.tokens = sweep_tokens(backend, corrupted_tokens, "corrupted_tokens")
        check_clean_cache(clean_cache, backend_sizes(backend), backend.clean_cache_call)
        self.batch, self.length = self.tokens.shape
        self._check_hooks(names, lambda name: name in model.hook_dict)
        self.corrupted = CorruptedRun.of(model, self.tokens, names)
        self._check_hooks(names, lambda name: name in self.corrupted.activations)
        self.clean = [self._clean(clean_cache, layer) for layer in range(model.cfg.n_layers)]

    def _check_hooks(self, names: list[str], present: Callable[[str], bool]) -> None:
        """A `PatchingError` unless `present(name)` holds for every hook in `names`."""
        missing = [name for name in names if not present(name)]
        if not missing:
            return
        name = missing[0]
        where = f"model has no activation {name!r} (activation_name={self.activation_name!r})"
        why = lacks(self.model.cfg, name)
        if why is not None:
            raise PatchingError(f"{where}: {why}")
        if name in self.model.hook_dict:
            raise PatchingError(
                f"{where}: the hook point exists but this model's forward never fires it "
                "(attn.hook_result, for one, needs cfg.use_attn_result=True)"
            )
        raise PatchingError(
            f"{where}: activation_name must name an activation inside every block, as "
            "transformer_lens.utilities.get_act_name(activation_name, layer) spells it (e.g. "
            "'resid_pre', 'attn_out', 'z', 'k'); for the embeddings patch 'resid_pre' at "
            "layer 0"
        )

    def expected(self, layer: int) -> torch.Size:
        """The shape after `batch` of this activation in the corrupted run."""
        return self.corrupted.activations[self.hook_name(layer)].shape[1:]

    def hook_name(self, layer: int) -> str:
        return get_act_name(self.activation_name, layer)

    def _clean(self, clean_cache: Any, layer: int) -> torch.Tensor:
        name = self.hook_name(layer)
        try:
            clean = clean_cache[name]
        except KeyError:
            raise PatchingError(
                f"clean_cache has no activation {name!r}; run the clean prompt with "
                "model.run_with_cache(clean_tokens) and pass that cache"
            ) from None
        if not isinstance(clean, torch.Tensor) or not clean.is_floating_point():
            got = clean.dtype if isinstance(clean, torch.Tensor) else type(clean).__name__
            raise PatchingError(
                f"clean_cache[{name!r}] holds {got}; expected the clean run's floating-point "
                "activations, as model.run_with_cache(clean_tokens) gives them"
            )
        if clean.shape[0] not in (1, self.batch) or clean.shape[1:] != self.expected(layer):
            raise shape_error(
                name,
                tuple(clean.shape),
                tuple(self.expected(layer)),
                self.batch,
                axes_of(name),
                HookedBackend.clean_cache_call,
            )
        # Cast to the activation's dtype, as TransformerLens' setters' assignments do, on
        # its layer's device (`cfg.n_devices > 1` spreads the blocks over devices).
        activation = self.corrupted.activations[name]
        clean = clean.to(activation.device, activation.dtype)
        return clean.expand(self.batch, *clean.shape[1:])

    def heads(self) -> int:
        """Heads of a head index: what `hook_k`/`hook_v` hold for keys and values."""
        if self.activation_name in ("k", "v"):
            return int(self.expected(0)[1])
        return int(self.model.cfg.n_heads)


def _index_grid(
    sweep: _Sweep, index_axis_names: Sequence[str] | None, index_df: pd.DataFrame | None
) -> tuple[pd.DataFrame, tuple[int, ...]]:
    """The checked index rows of a generic sweep on `sweep`'s model, and the result's shape."""
    sizes = {"layer": sweep.model.cfg.n_layers, "pos": sweep.length, "src_pos": sweep.length}
    sizes |= {"dest_pos": sweep.length, "head_index": sweep.heads(), "head": sweep.heads()}
    return index_grid(sizes, index_axis_names, index_df)


def _check_patched(
    patched: Any, full: torch.Tensor, before: torch.Tensor, start: int, run: Run
) -> None:
    """A `PatchingError` unless `patched` fits `full` and keeps positions before `start`."""
    check_setter_result(patched, full, list(run.cell))
    if start and not torch.equal(patched[:, :start], before[:, :start]):
        raise PatchingError(
            f"patch_setter changed positions before {start} for index {list(run.cell)}, "
            f"whose pos is {run.pos}; the cached sweep reuses the corrupted run's positions "
            "before each index's pos. Give each row the first position its patch changes "
            "as pos, or leave pos out of the index columns"
        )
