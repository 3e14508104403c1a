"""Less work inside a sweep's patched pass on a HuggingFace model, for the same numbers.

Three module replacements, on the sweep's thread only
([`overriding`][safelens.backends.hf._override.overriding]), that a pass on a plain
HuggingFace model (or a bridge's plain model, `safelens.backends.bridge._plain`) takes
when no hook of the user's is attached anywhere:

- *Shared rows* (`_shared_rows`): in the first layer a pass runs, every run's rows hold
  the same hidden states until its patch (the corrupted run's residual stream, repeated
  per run), so each linear map of that layer's attention (`q_proj`, `k_proj`, ...) maps
  one run's rows and repeats the result. It checks that the rows are equal, bitwise,
  and maps them all where they are not (a patch before the map, a residual patch).
- *Last query* (`_last_position`): for a metric that reads only the last position, the
  last layer's query and output projections (`q_proj`, `o_proj`, plain `nn.Linear`s)
  map that position alone and hand zeros elsewhere. The keys and values of every
  position are mapped as usual, so the last position attends as in a full pass; what
  the other positions compute is never read (their MLP input is trimmed already,
  `safelens.patching._hf_shortcuts`).
- *Chunked MLP* (`_chunked`), on a CPU: each decoder layer's MLP maps its input a few
  rows at a time (`_CHUNK_TOKENS` positions), so its wide intermediate activations stay
  in the processor's cache instead of fresh memory. Only an MLP built of linear maps and
  activations (`_position_wise`; not a mixture of experts) is chunked: it maps each
  position on its own, so it gives the same numbers either way (to float rounding).

All three are taken only as part of the sweep's shortcuts, which are checked once per
sweep on the model itself (the unpatched corrupted tokens must give the corrupted run's
logits); a family where one does not hold runs without them. On a bridge's own
components (hook points inside its modules) none is taken.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from transformers.pytorch_utils import Conv1D

from ..backends.hf._override import Replacement
from ._hf_sites import ATTENTION_MODULES, child_named

__all__ = ["Lean"]

# Positions per chunk of an MLP's input on a CPU: a chunk's intermediate activations
# (`_CHUNK_TOKENS * intermediate_size` values) then fit a core's cache on common models.
_CHUNK_TOKENS = 256
# The parts an MLP that maps each position on its own is built of (GPT-2's `Conv1D` is
# a linear map too), and the modules that define activation functions.
_POSITION_WISE = (torch.nn.Linear, torch.nn.Dropout, torch.nn.Identity, Conv1D)
_ACTIVATIONS = ("torch.nn.modules.activation", "transformers.activations")


def _attention(layer: torch.nn.Module) -> torch.nn.Module | None:
    name = child_named(layer, ATTENTION_MODULES)
    return None if name is None else getattr(layer, name)


def _only_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The one tensor a module was called with, or `None` (other arguments too)."""
    return args[0] if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor) else None


def _linear_children(module: torch.nn.Module | None) -> list[torch.nn.Linear]:
    if module is None:
        return []
    return [child for child in module.children() if isinstance(child, torch.nn.Linear)]


def _position_wise(module: torch.nn.Module) -> bool:
    """Whether `module` is built of maps of one position each: linear maps and activations."""
    return all(
        isinstance(part, _POSITION_WISE) or type(part).__module__ in _ACTIVATIONS
        for part in module.modules()
        if part is not module
    )


def _shared_rows(runs: int) -> Replacement:
    """A linear map of `runs` runs whose rows are equal: one run's rows, mapped and repeated."""

    def forward(own: Any, *args: Any, **kwargs: Any) -> Any:
        x = _only_tensor(args, kwargs)
        if x is None or x.dim() < 2 or x.shape[0] % runs:
            return own(*args, **kwargs)
        rows = x.shape[0] // runs
        first = x[:rows]
        if not torch.equal(x.unflatten(0, (runs, rows)), first.expand(runs, *first.shape)):
            return own(x)
        return own(first).repeat(runs, *(1,) * (x.dim() - 1))

    return forward


def _last_position(own: Any, *args: Any, **kwargs: Any) -> Any:
    """A linear map of the last position alone (`[rows, positions, features]`), zeros elsewhere."""
    x = _only_tensor(args, kwargs)
    if x is None or x.dim() != 3 or x.shape[1] < 2:
        return own(*args, **kwargs)
    last = own(x[:, -1:])
    out = last.new_zeros(*x.shape[:-1], last.shape[-1])
    out[:, -1:] = last
    return out


def _chunked(own: Any, *args: Any, **kwargs: Any) -> Any:
    """A position-wise module over chunks of its input's rows, `_CHUNK_TOKENS` positions each."""
    x = _only_tensor(args, kwargs)
    if x is None or x.dim() < 3:
        return own(*args, **kwargs)
    rows = max(1, _CHUNK_TOKENS // math.prod(x.shape[1:-1]))
    if x.shape[0] <= 2 * rows:
        return own(x)
    pieces = []
    for piece in x.split(rows):
        out = own(piece)
        if not isinstance(out, torch.Tensor) or out.shape[:-1] != piece.shape[:-1]:
            return own(x)  # not a tensor per position (an MoE's router logits beside it)
        pieces.append(out)
    return torch.cat(pieces)


class Lean:
    """Which of the replacements (module notes) a model's passes can take."""

    def __init__(self, layers: Iterable[torch.nn.Module]) -> None:
        self.layers = list(layers)
        mlps = [getattr(layer, "mlp", None) for layer in self.layers]
        self.mlps: list[torch.nn.Module] = [
            mlp for mlp in mlps if isinstance(mlp, torch.nn.Module) and _position_wise(mlp)
        ]
        # Chunks pay on a CPU only: every MLP's weights there (none on a GPU, none offloaded).
        on_cpu = all(p.device.type == "cpu" for mlp in self.mlps for p in mlp.parameters())
        if not on_cpu or len(self.mlps) < len(mlps):
            self.mlps = []
        attention = _attention(self.layers[-1])
        last = [getattr(attention, name, None) for name in ("q_proj", "o_proj")]
        self.last: list[torch.nn.Module] = [
            module for module in last if isinstance(module, torch.nn.Linear)
        ]
        elsewhere = {id(module) for layer in self.layers[:-1] for module in layer.modules()}
        if len(self.last) < len(last) or any(id(module) in elsewhere for module in self.last):
            self.last = []  # not plain linear maps, or shared with another layer

    def replacements(self, first: int, runs: int, trim: bool) -> dict[torch.nn.Module, Replacement]:
        """The replacements of a pass from layer `first` with `runs` runs (`trim`: last position)."""
        chosen: dict[torch.nn.Module, Replacement] = dict.fromkeys(self.mlps[first:], _chunked)
        if trim:
            chosen.update(dict.fromkeys(self.last, _last_position))
        if runs > 1 and first < len(self.layers) - 1:
            shared = _shared_rows(runs)
            chosen.update(dict.fromkeys(_linear_children(_attention(self.layers[first])), shared))
        return chosen
