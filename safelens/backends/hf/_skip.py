"""Start a HuggingFace model's forward at a layer, on the calling thread only: `skipping`.

A HuggingFace causal LM (and a TransformerBridge, which runs one) owns the loop over
its decoder layers, so it cannot start at a layer the way TransformerLens'
`start_at_layer` does. Within [`skipping`][safelens.backends.hf._skip.skipping], on the
calling thread, the layers before `first` are not run (each returns the hidden states
it is handed) and layer `first` receives `residual`, the residual stream entering it as
the caller supplies it, from a forward pre-hook that runs before any other on that
layer (so the user's pre-hooks there act once, on `residual`, as in a full pass). The
loop itself, its masks, its per-layer settings (hybrid attention types indexed by
layer) and the hooks on layer `first` onward run as usual; a skipped layer never calls
`cache.update`, so its cache layer keeps what it held.

How: the skipped layers' `forward` is replaced on the calling thread only
([`overriding`][safelens.backends._override.overriding]), so other threads' passes
through the model run every layer.

Within [`joining`][safelens.backends.hf._skip.joining], on the calling thread, a pass's
batch grows from layer to layer: each layer runs the rows that entered at it or before,
and rows that enter at a later layer join there (a *staggered* pass). The model's forward
builds its batch-wide arguments (masks, rotary tables, position ids) for every row; each
layer gets the rows it runs of them.

Caveat: the caller vouches for `residual` (the patching sweeps take it from the
unpatched run of the same tokens, before any pre-hook of the user's, and check once per
sweep that a skipped pass gives that run's logits); hooks on a skipped layer still
fire, on what it is handed and returns, and what they return is not used.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from .._override import Replacement, overriding

__all__ = ["joining", "output_form", "skipped_layers", "skipping"]


class _Plan(threading.local):
    """The calling thread's plan: the indices of the layers its pass skips."""

    def __init__(self) -> None:
        self.skipped: frozenset[int] = frozenset()


_PLAN = _Plan()


def skipped_layers() -> frozenset[int]:
    """The indices of the layers the calling thread's current pass skips (none outside)."""
    return _PLAN.skipped


def output_form(output: Any) -> int | None:
    """How a decoder layer returned its hidden states: `0` bare, `n` an n-tuple, or `None`.

    `None` when the rest of a tuple is not all `None` (attention weights, a cache): a
    skipped layer cannot stand in for such a layer.
    """
    if isinstance(output, torch.Tensor):
        return 0
    if isinstance(output, tuple) and output and all(item is None for item in output[1:]):
        return len(output)
    return None


def _passed_on(form: int) -> Replacement:
    """A skipped layer's forward: it returns the hidden states it is handed, in `form`."""

    def forward(own: Any, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs["hidden_states"]
        return hidden if form == 0 else (hidden, *(None,) * (form - 1))

    return forward


@contextmanager
def skipping(
    layers: torch.nn.ModuleList | Sequence[torch.nn.Module],
    first: int,
    residual: torch.Tensor,
    forms: Sequence[int],
) -> Iterator[None]:
    """Within the block, this thread's passes start at `layers[first]` with input `residual`.

    **Arguments:**

    - `layers`: the model's decoder layers, in the order its forward runs them.
    - `first`: the first layer to run; `0` runs every layer (the block does nothing).
    - `residual`: the hidden states layer `first` receives, shaped as the pass's.
    - `forms`: per layer, how it returns its hidden states ([`output_form`][safelens.backends.hf._skip.output_form]).

    The plan is the calling thread's alone and blocks do not nest on one thread.
    """
    if first == 0:
        yield
        return
    skipped = list(layers)[:first]
    if _PLAN.skipped:
        raise RuntimeError("skipping blocks do not nest on one thread")
    me = threading.get_ident()

    def enter(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
        if threading.get_ident() != me or kwargs is None:  # half-registered: `core._thread_hooks`
            return None
        if args:
            return (residual, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": residual}

    # First among the layer's pre-hooks: the user's run after it, as in an unskipped pass.
    handle = layers[first].register_forward_pre_hook(enter, with_kwargs=True, prepend=True)
    try:
        with overriding({layer: _passed_on(forms[index]) for index, layer in enumerate(skipped)}):
            _PLAN.skipped = frozenset(range(first))
            try:
                yield
            finally:
                _PLAN.skipped = frozenset()
    finally:
        handle.remove()


def _first_rows(value: Any, total: int, rows: int) -> Any:
    """`value`'s first `rows` batch rows where it is a tensor (or tuple of them) of `total` rows.

    Only tensors of two or more axes are batch-wide (a 1-D `cache_position` is not).
    """
    if isinstance(value, torch.Tensor):
        return value[:rows] if value.dim() >= 2 and value.shape[0] == total else value
    if isinstance(value, tuple):
        return tuple(_first_rows(item, total, rows) for item in value)
    return value


@contextmanager
def joining(
    layers: torch.nn.ModuleList | Sequence[torch.nn.Module],
    first: int,
    rows: Sequence[int],
    joins: dict[int, torch.Tensor],
) -> Iterator[None]:
    """Within the block, this thread's pass of `rows[-1]` rows runs `rows[l]` of them at layer `l`.

    **Arguments:**

    - `layers`: the model's decoder layers, in the order its forward runs them.
    - `first`: the first layer the pass runs (the layers before it are skipped,
      [`skipping`][safelens.backends.hf._skip.skipping], or none is: `0`).
    - `rows`: per layer, how many rows it runs (non-decreasing from `first`; the last
      layer runs every row of the pass).
    - `joins`: the hidden states of the rows entering at layer `l > first`, appended to
      the rows the layer before returns.

    Layer `first` gets the first `rows[first]` rows of its input; every layer from
    `first` gets the first `rows[l]` rows of each batch-wide argument (a tensor of two
    or more axes with a row per row of the pass), which fits a pass whose rows repeat
    the same prompts run after run.
    """
    total = rows[-1]
    me = threading.get_ident()

    def enter(index: int) -> Any:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
            if threading.get_ident() != me or kwargs is None:  # half-registered
                return None
            hidden = args[0] if args else kwargs["hidden_states"]
            if index in joins and index > first:
                hidden = torch.cat([hidden, joins[index]])
            elif hidden.shape[0] > rows[index]:
                hidden = hidden[: rows[index]]
            rest = tuple(_first_rows(arg, total, rows[index]) for arg in args[1:])
            named = {key: _first_rows(value, total, rows[index]) for key, value in kwargs.items()}
            if args:
                return (hidden, *rest), named
            return rest, {**named, "hidden_states": hidden}

        return hook

    handles = []
    try:
        for index in range(first, len(layers)):
            if rows[index] < total or index in joins:
                hook = enter(index)
                handle = layers[index].register_forward_pre_hook(
                    hook, with_kwargs=True, prepend=True
                )
                handles.append(handle)
        yield
    finally:
        for handle in handles:
            handle.remove()
