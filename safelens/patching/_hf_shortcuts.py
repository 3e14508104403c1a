"""The shortcuts a sweep on a TransformerBridge or HuggingFace model takes, checked on the model.

What a patched run may skip is `safelens.patching._skips`' (`Skips.of`, for both pass
runners); here, how a HuggingFace model (or a bridge) takes it, on the sweep's thread
only:

- *Layers before the patch*: [`skipping`][safelens.backends.hf._skip.skipping] does not
  run them and hands the corrupted run's residual stream to the first layer a pass runs.
- *Runs of several layers in one pass*:
  [`joining`][safelens.backends.hf._skip.joining] appends the runs of each later layer
  to the batch there.
- *Last position only*: PyTorch forward pre-hooks keep the last position of the input
  of the unembedding and of the last layer's MLP (when the sweep patches a site before
  it, `Skips.last_mlp`, or the pass patches nothing in the last layer; the MLP's output is
  then added to every position of the residual stream, and only the last is read); the
  pass replacements of `safelens.patching._hf_lean` map the last query alone.

All are checked on the model itself, once per model and prompt shape (the verdicts are
kept until the model changes, `safelens.patching._hf_checked`): the unpatched corrupted
tokens run with the shortcuts from the last layer (from the first and from the middle
position) and from every other layer (the last position alone), or, staggered, from the last
layer over every position and with a run entering at each layer from layer 1 on (from
the middle and from the last position), and must give the corrupted run's logits
(within 1e-4 of the largest logit in float32, 3e-2 in half precision). A family
where a shortcut does not hold (one that carries state from layer to layer beside the
residual stream, an MLP whose output is not added to the residual stream) fails the
check, by its logits or by an error raised in the libraries' code, and runs without it:
exact, slower. An error raised in the user's code (a hook) reaches the caller.

While a hook of the user's is attached anywhere in the model (`hooked_anywhere`), no
pass runs fewer positions than the prompt's (no trims here, no reused positions in
`safelens.patching._hf_sweeps`): a hook may index positions (`tensor[:, 0]`), and sees
every position, as under TransformerLens.

Caveat: a user's hook on a skipped layer's own modules does not fire (as with
TransformerLens' `start_at_layer`; one on the skipped layer itself fires, on what it is
handed, and what it returns is not used): the corrupted run's residual stream, computed
with it, enters the first layer a pass runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backends._backend import Backend
from ..backends._override import overriding
from ..backends._sites import TL_NAMES
from ..backends.hf._seams import mlp_norm
from ..backends.hf._sites import decoder_layers
from ..backends.hf._skip import joining, output_form, skipping
from ..core._thread_hooks import LIBRARIES
from ._hf_lean import Lean, recorded
from ._skips import Skips

__all__ = ["Check", "Shortcuts", "captured", "tolerance"]

# Tolerance of the check, relative to the largest logit: float32 (and wider), else half.
_TOLERANCE = {True: 1e-4, False: 3e-2}
# `check(shortcuts, entries, start)`: whether an unpatched pass from position `start`
# whose runs enter at the layers `entries` gives the corrupted run's logits.
Check = Callable[["Shortcuts", list[int], int], bool]


def tolerance(dtype: torch.dtype) -> float:
    """How far a recomputation may stray, relative to the largest value, in `dtype`."""
    return _TOLERANCE[torch.finfo(dtype).bits >= 32]


def _last_position_input(me: int) -> Callable[..., Any]:
    """A pre-hook that keeps the last position of a module's input, in thread `me` only."""

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
        if threading.get_ident() != me or kwargs is None:  # half-registered: `core._thread_hooks`
            return None
        if args:
            return (args[0][:, -1:], *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"][:, -1:]}

    return hook


@contextmanager
def captured(backend: Backend) -> Iterator[tuple[list[Any], list[Any], dict[Any, Any]]]:
    """Within the block, this thread's pass records each decoder layer's input and output form.

    Yields `(inputs, forms, outputs)`, filled by the pass: `inputs[l]` the hidden states
    entering layer `l`, `forms[l]` how layer `l` returned its own
    ([`output_form`][safelens.backends.hf._skip.output_form]), `outputs[module]` the
    output of each module `Lean` reads (`recorded`) where that is one tensor.
    """
    _, layers = decoder_layers(backend.model, backend.n_layers)
    me = threading.get_ident()
    inputs: list[Any] = [None] * len(layers)
    forms: list[Any] = [None] * len(layers)
    outputs: dict[Any, Any] = {}

    def record(index: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
        def before(module: Any, args: tuple[Any, ...], kwargs: Any = None) -> None:
            # No `kwargs`: half-registered, in another thread's pass (`core._thread_hooks`).
            if threading.get_ident() == me and kwargs is not None:
                # A copy: the pass may edit its tensors in place.
                hidden = args[0] if args else kwargs["hidden_states"]
                inputs[index] = hidden.detach().clone()

        def after(module: Any, args: Any, *rest: Any) -> None:
            # `(kwargs, output)`; `(output,)` when half-registered (`core._thread_hooks`).
            if threading.get_ident() == me and len(rest) == 2:
                forms[index] = output_form(rest[1])

        return before, after

    def keep(module: Any, args: Any, *rest: Any) -> None:
        if threading.get_ident() == me and len(rest) == 2 and isinstance(rest[1], torch.Tensor):
            outputs[module] = rest[1].detach().clone()

    handles = []
    try:
        for index, layer in enumerate(layers):
            before, after = record(index)
            # First among the pre-hooks: the input before any of the user's edits it, as
            # `skipping` hands it on before them.
            handles.append(layer.register_forward_pre_hook(before, with_kwargs=True, prepend=True))
            handles.append(layer.register_forward_hook(after, with_kwargs=True))
        for module in recorded(list(layers)):
            handles.append(module.register_forward_hook(keep, with_kwargs=True))
        yield inputs, forms, outputs
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class Shortcuts:
    """The shortcuts one sweep takes (module notes), and how a pass takes them."""

    backend: Backend
    residuals: list[torch.Tensor]
    forms: list[int]
    # What the sweep's runs may skip (`Skips.of`); what follows is what this model takes.
    allowed: Skips
    skips: bool = False
    last_only: bool = False
    trim: bool = False
    # Whether the last layer's MLP runs the last position alone: in every pass
    # (`trim_mlp`), or in passes that patch nothing in the last layer (`trim_mlp_early`).
    trim_mlp: bool = False
    trim_mlp_early: bool = False
    # Whether a pass may run fewer positions than the prompt's (no user hook attached).
    partial: bool = True
    # The replacements inside a pass it takes (`safelens.patching._hf_lean`), if any.
    lean: Lean | None = None
    # Whether a pass's runs enter at their own layers (`joining`), in one pass.
    stagger: bool = False

    layers: torch.nn.ModuleList = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.layers = decoder_layers(self.backend.model, self.backend.n_layers)[1]

    def first_layer(self, layer: int) -> int:
        """The layer a pass whose earliest patch sits at `layer` starts at."""
        return layer if self.skips else 0

    def entries(self, first: int, runs: int, layers: list[int] | None) -> list[int]:
        """The layer each of a pass's `runs` runs enters at: its patch's `layers` when staggered.

        `layers` are in the pass's run order, which puts earlier layers first.
        """
        if not self.stagger or layers is None:
            return [first] * runs
        return [max(first, self.first_layer(layer)) for layer in layers]

    @contextmanager
    def taken(
        self,
        first: int,
        start: int,
        entries: list[int],
        last_patched: bool = True,
        positions: list[int | None] | None = None,
    ) -> Iterator[None]:
        """Within the block, this thread's pass from position `start` runs `entries`' runs.

        A run enters at its layer in `entries` (non-decreasing, the first is `first`):
        the layers before `first` are skipped, and a later run joins the batch at its
        layer with the corrupted run's residual stream (`joining`). `last_patched`:
        whether the pass patches anything in the last layer. `positions`: each run's
        patch position, where nothing before it changes (`Lean.replacements`).
        """
        me = threading.get_ident()
        runs = len(entries)
        batch = self.residuals[0].shape[0]
        at_first = entries.count(first)
        with ExitStack() as stack:
            if first:
                residual = self.residuals[first][:, start:].repeat(at_first, 1, 1)
                stack.enter_context(skipping(self.layers, first, residual, self.forms))
            if at_first < runs:
                rows = [
                    batch * sum(entry <= layer for entry in entries)
                    for layer in range(len(self.layers))
                ]
                joins = {
                    layer: self.residuals[layer][:, start:].repeat(entries.count(layer), 1, 1)
                    for layer in sorted(set(entries))
                    if layer > first
                }
                stack.enter_context(joining(self.layers, first, rows, joins))
            if self.trim:
                modules = [_unembedding(self.backend)]
                if self.trim_mlp or (self.trim_mlp_early and not last_patched):
                    modules.append(self.layers[-1].mlp)
                for module in modules:
                    handle = module.register_forward_pre_hook(
                        _last_position_input(me), with_kwargs=True
                    )
                    stack.callback(handle.remove)
            if self.lean is not None:
                chosen = self.lean.replacements(entries, self.trim, start, positions)
                stack.enter_context(overriding(chosen))
            yield

    @classmethod
    def of(
        cls,
        backend: Backend,
        activation: str,
        metric: object,
        inputs: list[Any],
        forms: list[Any],
        check: Check,
        partial: bool = True,
        outputs: dict[Any, Any] | None = None,
    ) -> Shortcuts:
        """The shortcuts `check(shortcuts, entries, start)` finds exact on this model (module notes).

        `partial=False` (a user's hook attached): passes run every position, so no
        trims, and the checks start at position 0. `outputs`: what the modules the pass
        replacements read gave in the corrupted run (`captured`).
        """
        residuals = list(inputs)
        n_layers = backend.n_layers
        # A generic sweep's site (`generic`) is none of TransformerLens' named ones.
        allowed = Skips.of(TL_NAMES.get(activation, activation), metric, partial)
        last_only = allowed.last_only
        skips = n_layers > 1 and all(
            form is not None and tensor is not None
            for form, tensor in zip(forms, inputs, strict=True)
        )
        trims = allowed.last_logits and isinstance(_unembedding(backend), torch.nn.Module)
        layers = decoder_layers(backend.model, n_layers)[1]
        mlp = getattr(layers[-1], "mlp", None)
        has_mlp = isinstance(mlp, torch.nn.Module)
        trim_mlp = allowed.last_mlp and has_mlp
        if trim_mlp and activation == "resid_mid" and backend.family == "hf":
            # The MLP's trim is a pre-hook on it, which runs before the sweep's edits: a
            # post-norm family's `resid_mid`, edited at the MLP's own input (`mlp_norm`),
            # would be written into the trimmed last position.
            trim_mlp = mlp_norm(layers[-1], n_layers - 1, backend.config) is not mlp  # type: ignore[attr-defined]
        # A plain HuggingFace model's own modules (not a bridge's, with hook points inside).
        plain = partial and backend.family == "hf"
        lean = Lean(layers, activation, outputs) if plain else None
        stagger = skips and partial
        # A site after the keys and values leaves most of the layer a run enters equal
        # across runs, which the pass replacements share when each pass starts there;
        # staggered, most runs join a pass later and share less (measured: a tenth
        # slower on attn_out grids), so those sites stagger only without them.
        own_position = allowed.own_position
        # Most shortcuts first; the pass replacements need none of the others.
        candidates = [
            (skips, trims, lean, stagger and (lean is None or not own_position)),
            (skips, trims, None, stagger),
            (skips, trims, lean, False),
            (skips, trims, None, False),
            (skips, False, lean, False),
            (skips, False, None, False),
            (False, trims, None, False),
        ]
        for skip, trim, leaner, staggered in dict.fromkeys(candidates):
            chosen = cls(
                backend,
                residuals,
                forms,
                allowed,
                skips=skip,
                last_only=last_only,
                trim=trim,
                trim_mlp=trim and trim_mlp,
                trim_mlp_early=trim and has_mlp,
                partial=partial,
                lean=leaner,
                stagger=staggered,
            )
            if (skip or trim or leaner is not None) and _holds(check, chosen):
                return chosen
        return cls(backend, residuals, forms, allowed, False, last_only, partial=partial)

    def tolerance(self) -> float:
        return tolerance(self.backend.dtype)

    def key(self) -> Hashable:
        """The shortcuts a pass takes, as a key (`safelens.patching._hf_checked`)."""
        lean = self.lean
        replacements = None if lean is None else (lean.after_heads, lean.shares, bool(lean.outputs))
        flags = (self.skips, self.last_only, self.trim, self.trim_mlp, self.trim_mlp_early)
        return (*flags, self.partial, self.stagger, replacements)


def _holds(check: Check, shortcuts: Shortcuts) -> bool:
    """Whether passes with `shortcuts` give the corrupted run's logits (module notes).

    Skipping: from the last layer over every position and from the middle one, and from
    every other layer at the last position (a family that carries state from layer to
    layer beside the residual stream fails there). Staggered: from the last layer over
    every position, and a run entering at each layer from layer 1 on (the pass skips to
    layer 1, the others join it), from the middle position (from layer 0 on in a model
    of two layers) and from the last.
    """
    length = shortcuts.residuals[0].shape[1]
    n_layers = len(shortcuts.residuals)
    last = n_layers - 1 if shortcuts.skips else 0
    if shortcuts.stagger:
        # A staggered check also skips to layer 1 (a model of two layers: one of them
        # joins at layer 1 instead): three passes cover what five checks of skipping
        # alone and two of joining did (a check's cost is mostly its pass's fixed cost).
        joined = list(range(min(1, n_layers - 2), n_layers))
        checks = [([last], 0), (joined, length // 2), (list(range(1, n_layers)), length - 1)]
    elif shortcuts.partial:
        checks = [([last], 0), ([last], length // 2)]
        checks += [([first], length - 1) for first in range(1, last)]
    else:
        checks = [([first], 0) for first in range(last, 0, -1)] or [([0], 0)]
    try:
        return all(check(shortcuts, entries, start) for entries, start in checks)
    except Exception as error:
        if not _raised_in_libraries(error):
            raise  # the user's code (a hook, a module of theirs): theirs to see
        return False  # a family the shortcut does not fit runs without it


def _raised_in_libraries(error: BaseException) -> bool:
    """Whether `error` was raised in the libraries' code (`LIBRARIES`), not the user's."""
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    module = "" if frame is None else str(frame.tb_frame.f_globals.get("__name__", ""))
    return module.partition(".")[0] in LIBRARIES


def _unembedding(backend: Backend) -> Any:
    """The module that turns the last hidden states into logits (`get_output_embeddings`)."""
    model = getattr(backend.model, "original_model", backend.model)
    getter = getattr(model, "get_output_embeddings", None)
    return getter() if callable(getter) else None
