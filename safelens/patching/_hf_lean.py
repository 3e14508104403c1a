"""Less work inside a sweep's patched pass on a HuggingFace model, for the same numbers.

Five module replacements, on the sweep's thread only
([`overriding`][safelens.backends._override.overriding]), that a pass on a plain
HuggingFace model (or a bridge's plain model, `safelens.backends.bridge._plain`) takes
when no hook of the user's is attached anywhere:

- *Shared rows* (`_shared_rows`): in the layer a run enters (the first a pass runs, or,
  in a staggered pass, the layer where it joins), the runs entering there hold the same
  hidden states until their patches (the corrupted run's residual stream, repeated per
  run), so each linear map of that layer's attention (`nn.Linear`s such as `q_proj`,
  `k_proj`; GPT-2's `Conv1D`s `c_attn`, `c_proj`) and that layer's MLP (when built of
  maps of one position each, `_position_wise`) map the first run's rows, and of each
  other run only the positions where its rows differ from the first run's, bitwise
  (compared each time); every other position takes the first run's result (where most
  differ, every row is mapped, as without the replacement); the rows of runs that
  entered at earlier layers are mapped as they are. Which maps share follows the site:
  a patch of `mlp_out` leaves every input equal, one of `attn_out` the MLP's input
  different at its own position alone: there the output projection and the MLP share
  too; a patch of `k`, `v`, `q`, `z` or a pattern changes the head outputs from its
  position on, so only the attention's input maps share; a patch of the layer's input
  (`resid_pre`) changes the rows before the first map, so nothing shares (comparing
  rows that mostly differ costs more than it saves, measured).
- *Last query* (`_last_position`): for a metric that reads only the last position, the
  last layer's query projection (`q_proj`; none where it is joined to the keys' and
  values', as GPT-2's `c_attn`) and output projection
  ([`output_projection`][safelens.backends.hf._seams.output_projection]: `o_proj`,
  `c_proj`, `dense`, `out_proj`), where they are linear maps, map that position alone
  and hand zeros elsewhere. The keys and values of every position are mapped as usual,
  so the last position attends as in a full pass; what the other positions compute is
  never read (their MLP input is trimmed already, `safelens.patching._hf_shortcuts`).
- *Changed positions* (`_live_positions`): a sweep's own patch at position `p` changes
  nothing before `p`, so in a pass that starts before `p` (runs patched at nearby
  positions share one, `safelens.patching._grouping`) a run's rows hold the corrupted
  run's values at the positions between. Each decoder layer's MLP (when built of maps
  of one position each, `_position_wise`) maps only the positions from each run's patch
  on, gathered from every row of the pass, and hands the corrupted run's own output at
  that layer (recorded as it ran) everywhere before. Not for a generic sweep, whose
  setter may write any position.
- *Chunked MLP* (`_chunked`), on a CPU: each decoder layer's MLP maps its input a few
  rows at a time (`_CHUNK_TOKENS` positions), so its wide intermediate activations stay
  in the processor's cache instead of fresh memory. Only an MLP built of linear maps and
  activations (`_position_wise`; not a mixture of experts) is chunked: it maps each
  position on its own, so it gives the same numbers either way (to float rounding).

- *Fused activation* (`_tanh_gelu`, `safelens.patching._fused`): GPT-2's `gelu_new`
  (transformers' `NewGELUActivation`, also GPT-J's, GPT-Neo's, CodeGen's and Phi's) runs
  as PyTorch's one fused kernel, the same formula to float rounding.

All five are taken only as part of the sweep's shortcuts, which are checked on the
model itself, once per model and prompt shape (`safelens.patching._hf_checked`): the
unpatched corrupted tokens must give the corrupted run's logits, each run of the check
taken as patched part-way, so that only its later positions go through the MLPs. A
family where one does not hold runs without them. On a bridge's own components (hook
points inside its modules) none is taken. Shared rows and chunks on one MLP nest
(`_nested`): the chunks are of the rows shared rows maps; changed positions are
gathered before the chunks, and not where that layer's MLP shares rows. A projection
that maps the last position alone is not shared (it maps what it is handed as
positions of one row, not positions gathered from several runs).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch
from transformers.activations import NewGELUActivation
from transformers.pytorch_utils import Conv1D

from ..backends._override import Replacement
from ..backends.hf._seams import ATTENTION_MODULES, child_named, output_projection
from ..core._errors import PatchingError
from ._fused import tanh_gelu as _tanh_gelu
from ._skips import INPUTS, activations

__all__ = ["Lean"]

# Positions per chunk of an MLP's input on a CPU: a chunk's intermediate activations
# (`_CHUNK_TOKENS * intermediate_size` values) then fit a core's cache on common models.
_CHUNK_TOKENS = 256
# Rows a gathered matrix product is padded to a multiple of (`_live_positions`).
_BLOCK = 8
# Activations that compute GELU's tanh approximation in several tensor operations.
_TANH_GELUS = (NewGELUActivation,)
# Linear maps: GPT-2's `Conv1D` is one too (`x @ weight + bias`).
_LINEAR = (torch.nn.Linear, Conv1D)
# The parts an MLP that maps each position on its own is built of, and the modules that
# define activation functions.
_POSITION_WISE = (*_LINEAR, torch.nn.Dropout, torch.nn.Identity)
_ACTIVATIONS = ("torch.nn.modules.activation", "transformers.activations")


def _attention(layer: torch.nn.Module) -> torch.nn.Module | None:
    name = child_named(layer, ATTENTION_MODULES)
    return None if name is None else getattr(layer, name)


def _only_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The one tensor a module was called with, or `None` (other arguments too)."""
    return args[0] if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor) else None


def _linear_children(module: torch.nn.Module | None) -> list[torch.nn.Module]:
    if module is None:
        return []
    return [child for child in module.children() if isinstance(child, _LINEAR)]


def _output_projection(layer: torch.nn.Module, index: int) -> torch.nn.Module | None:
    try:
        return output_projection(layer, index)
    except PatchingError:
        return None


def _position_wise(module: torch.nn.Module) -> bool:
    """Whether `module` is built of maps of one position each: linear maps and activations."""
    return all(
        isinstance(part, _POSITION_WISE) or type(part).__module__ in _ACTIVATIONS
        for part in module.modules()
        if part is not module
    )


def _shared_rows(runs: int, before: int = 0) -> Replacement:
    """A map of each position over `runs` runs: the first run's, and the others' that differ.

    Every other position of the other runs takes the first run's result there. Where
    most positions differ, every row is mapped. In a staggered pass (`before` runs
    entered at earlier layers, their rows first), those rows are mapped as they are and
    the `runs` runs entering at this layer share among themselves.
    """

    def forward(own: Any, *args: Any, **kwargs: Any) -> Any:
        x = _only_tensor(args, kwargs)
        if x is None or x.dim() < 2 or x.shape[0] % (before + runs):
            return own(*args, **kwargs)
        rows = x.shape[0] // (before + runs)
        head, x = x[: before * rows], x[before * rows :]
        seen = x.unflatten(0, (runs, rows))
        differ = (seen[1:] != seen[0]).any(-1)  # [runs - 1, rows, positions...]
        count = int(differ.sum())
        if 2 * count > differ.numel():  # gathering them would cost more than it saves
            out = own(x)
        else:
            out = own(seen[0])
            out = out.expand(runs, *out.shape).clone()
            if count:
                out[1:][differ] = own(seen[1:][differ].unsqueeze(1)).squeeze(1)
            out = out.flatten(0, 1)
        return torch.cat([own(head), out]) if before else out

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


def _live_positions(starts: list[int], corrupted: torch.Tensor) -> Replacement | None:
    """A map of each position that maps only the positions each run's patch can change.

    `corrupted` is the module's output in the corrupted run, `[batch, positions,
    features]`, over the positions the pass runs; `starts[r]` the first of them run `r`'s
    patch can change (its rows, `batch` each, in run order). Before it the run's rows
    hold the corrupted run's input, so they take `corrupted` there; the positions from
    it on are gathered from every row and mapped as one batch. `None` where too few
    positions are unchanged to pay for gathering.
    """
    batch, positions = corrupted.shape[:2]
    first = torch.tensor(starts, device=corrupted.device).repeat_interleave(batch)
    live = torch.arange(positions, device=corrupted.device) >= first[:, None]
    count = sum(positions - start for start in starts) * batch
    # A matrix product's rows can round otherwise with the number of rows beside them
    # (a CPU's BLAS kernels take rows in blocks of 4 or 8, and a lone row otherwise):
    # padded to whole blocks, the gathered rows add no such dependence on how the
    # sweep's runs are cut into passes (`max_batch`, `max_bytes`) beyond the model's own.
    pad = -count % _BLOCK
    if count + pad >= live.numel():
        return None

    def forward(own: Any, *args: Any, **kwargs: Any) -> Any:
        x = _only_tensor(args, kwargs)
        if x is None or x.dim() != 3 or x.shape[:2] != live.shape:
            return own(*args, **kwargs)  # the last position alone (trimmed), or not ours
        gathered = x[live]
        mapped = own(torch.cat([gathered, gathered[-1:].expand(pad, -1)]).unsqueeze(1))
        if not isinstance(mapped, torch.Tensor) or mapped.shape[:2] != (count + pad, 1):
            return own(x)  # not a tensor per position
        out = corrupted.to(mapped.dtype).repeat(len(starts), 1, 1)
        out[live] = mapped[:count, 0]
        return out

    return forward


def _nested(replacements: list[Replacement]) -> Replacement:
    """One replacement of several on one module: each calls the one before as its forward."""
    if len(replacements) == 1:
        return replacements[0]

    def forward(own: Any, *args: Any, **kwargs: Any) -> Any:
        for replacement in replacements:
            own = functools.partial(replacement, own)
        return own(*args, **kwargs)

    return forward


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


def recorded(layers: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules whose output in the corrupted run `Lean` uses: each layer's MLP, where
    it sits in that layer alone (one shared by several layers gives several outputs, and
    is left out)."""
    owners: dict[torch.nn.Module, set[int]] = {}
    for index, layer in enumerate(layers):
        for module in layer.modules():
            owners.setdefault(module, set()).add(index)
    mlps = [(index, getattr(layer, "mlp", None)) for index, layer in enumerate(layers)]
    return [mlp for index, mlp in mlps if mlp is not None and owners.get(mlp) == {index}]


# Activations patched after the attention's head outputs.
_AFTER_HEADS = frozenset({"attn_out", "resid_mid", "mlp_out", "resid_post"})


class Lean:
    """Which of the replacements (module notes) a model's passes can take."""

    def __init__(
        self,
        layers: Iterable[torch.nn.Module],
        activation: str | None = None,
        outputs: dict[torch.nn.Module, torch.Tensor] | None = None,
    ) -> None:
        self.layers = list(layers)
        # What `recorded` modules gave in the corrupted run (`_live_positions`).
        self.outputs = outputs or {}
        # Where the runs entering a layer can hold equal rows: a patch of `activation`
        # leaves the output projection's and the MLP's inputs equal, or different at its
        # own position alone, only when it sits after the head outputs (`_AFTER_HEADS`);
        # before them they differ from the patch on, and comparing them costs more than
        # the few equal positions save (a sixth of a resid_pre grid, measured).
        self.after_heads = activation in _AFTER_HEADS
        # A patch of a layer's input (`INPUTS`) makes the rows of the runs entering it
        # differ before its first map: nothing there to share.
        self.shares = activation not in activations(INPUTS)
        mlps = [getattr(layer, "mlp", None) for layer in self.layers]
        # Each layer's MLP if it maps each position (so each row) on its own, else `None`.
        self.row_wise: list[torch.nn.Module | None] = [
            mlp if isinstance(mlp, torch.nn.Module) and _position_wise(mlp) else None
            for mlp in mlps
        ]
        # Chunks pay on a CPU only: every MLP's weights there (none on a GPU, none offloaded).
        chunks = all(
            mlp is not None and all(p.device.type == "cpu" for p in mlp.parameters())
            for mlp in self.row_wise
        )
        self.mlps = [mlp for mlp in self.row_wise if mlp is not None] if chunks else []
        # Each layer's tanh-approximation GELUs (`_tanh_gelu`).
        self.gelus = [
            [part for part in layer.modules() if type(part) in _TANH_GELUS] for layer in self.layers
        ]
        query = getattr(_attention(self.layers[-1]), "q_proj", None)
        output = _output_projection(self.layers[-1], len(self.layers) - 1)
        elsewhere = {id(module) for layer in self.layers[:-1] for module in layer.modules()}
        # Linear maps, and not shared with another layer (whose positions are all read).
        self.last: list[torch.nn.Module] = [
            module
            for module in (query, output)
            if isinstance(module, _LINEAR) and id(module) not in elsewhere
        ]

    def replacements(
        self,
        entries: list[int],
        trim: bool,
        start: int = 0,
        positions: list[int | None] | None = None,
    ) -> dict[torch.nn.Module, Replacement]:
        """The replacements of a pass whose runs enter at the layers `entries` (in order).

        `trim`: the last layer's projections map the last position alone. `positions`:
        the position of each run's patch (`None`: every position), for a pass of the
        positions from `start` whose runs change nothing before their patch's position
        (a sweep's own patches): each MLP then maps the positions a run's patch can
        change alone (`_live_positions`).
        """
        chosen: dict[torch.nn.Module, list[Replacement]] = {
            mlp: [_chunked] for mlp in self.mlps[entries[0] :]
        }
        chosen.update(
            {module: [_tanh_gelu] for gelus in self.gelus[entries[0] :] for module in gelus}
        )
        last = self.last if trim else []
        chosen.update({module: [_last_position] for module in last})
        for layer in sorted(set(entries)):
            runs = entries.count(layer)
            if runs < 2 or not self.shares:
                continue
            shared = _shared_rows(runs, sum(entry < layer for entry in entries))
            mlp = self.row_wise[layer] if self.after_heads else None
            maps = _linear_children(_attention(self.layers[layer]))
            if not self.after_heads:
                output = _output_projection(self.layers[layer], layer)
                maps = [module for module in maps if module is not output]
            for module in [*maps, *([] if mlp is None else [mlp])]:
                if module not in last:
                    chosen.setdefault(module, []).append(shared)
        if positions is not None:
            self._live(chosen, entries, start, positions)
        return {module: _nested(replacements) for module, replacements in chosen.items()}

    def _live(
        self,
        chosen: dict[torch.nn.Module, list[Replacement]],
        entries: list[int],
        start: int,
        positions: list[int | None],
    ) -> None:
        """Add to `chosen` each MLP's `_live_positions` (module notes), except where the
        MLP shares rows: the runs present at a layer are those entered by then."""
        first = [0 if pos is None else max(0, pos - start) for pos in positions]
        for layer in range(entries[0], len(self.layers)):
            mlp = self.row_wise[layer]
            corrupted = None if mlp is None else self.outputs.get(mlp)
            if mlp is None or corrupted is None or chosen.get(mlp, [_chunked]) != [_chunked]:
                continue
            present = sum(entry <= layer for entry in entries)
            live = _live_positions(first[:present], corrupted[:, start:])
            if live is not None:
                chosen.setdefault(mlp, []).append(live)
