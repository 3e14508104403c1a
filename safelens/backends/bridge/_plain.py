"""The HuggingFace model under a TransformerBridge, without the bridge's components.

A TransformerBridge puts a component of its own in place of each module of its
HuggingFace model and keeps the module inside it (`_original_component`); the
component's forward does the bridge's work (hook points, hook conversions, its own
attention code) around the module's arithmetic. `plain_model` rebuilds the model as
HuggingFace wrote it: shallow copies of the original modules, their children unwrapped,
holding the very same parameter and buffer objects (nothing is copied, and the bridge
is not touched). Only a copy whose parameters are exactly the bridge's, object for
object, is returned: where the bridge holds weights of its own (GPT-2's and Phi-3's
split query/key/value projections, which an edit of the bridge's weights would change
alone), there is none.

It runs the same arithmetic without the components' per-call work (and with
HuggingFace's attention kernels rather than the bridge's own attention), so safelens
runs passes on it where no hook of the user's is attached and it gives the bridge's
numbers: a sweep's patched passes when the copy's corrupted run equals the bridge's
(`safelens.patching._hf_sweeps`), and `prefill`, `score_continuations` and `generate`
when a pass of the prefix's last position gives the bridge's logits
(`BridgeBackend.twin`, `agrees`).

Caveat: each copy has its own lists of torch hooks, starting as copies of the
originals' (the libraries' own), so a hook attached to a copy never fires on the bridge;
a module whose `forward` was replaced on the instance (accelerate's device hooks) keeps
calling the original module, components included.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["agrees", "plain_model"]

# How far the plain model's logits may stray from the bridge's, relative to the largest
# logit: float32 (and wider), else half precision.
_TOLERANCE = {True: 1e-4, False: 3e-2}
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def plain_model(bridge: Any) -> torch.nn.Module | None:
    """`bridge.original_model` without the bridge's components, or `None` (module notes)."""
    twin = _unwrapped(bridge.original_model)
    ours = {id(tensor) for tensor in (*bridge.parameters(), *bridge.buffers())}
    theirs = {id(tensor) for tensor in (*twin.parameters(), *twin.buffers())}
    return twin if ours == theirs else None


def _is_component(module: torch.nn.Module) -> bool:
    return "_original_component" in module._modules and type(module).__module__.startswith(
        "transformer_lens."
    )


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of `module` (the original inside a component) with unwrapped children."""
    while _is_component(module):
        module = module._modules["_original_component"]  # type: ignore[assignment]
    twin = copy.copy(module)
    twin._modules = {
        name: None if child is None else _unwrapped(child)
        for name, child in module._modules.items()
    }
    for name in _HOOK_DICTS:
        if name in module.__dict__:
            held = module.__dict__[name]
            twin.__dict__[name] = type(held)(held)
    return twin


def agrees(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether `got` (the plain model's logits) equals `expected` (the bridge's) to rounding."""
    bound = _TOLERANCE[torch.finfo(expected.dtype).bits >= 32] * (1 + float(expected.abs().max()))
    return got.shape == expected.shape and float((got - expected).abs().max()) <= bound
