"""The shortcut checks' verdicts on a model, kept for the sweeps after the first.

Before a sweep on a HuggingFace model or a TransformerBridge takes a shortcut, it checks
the shortcut on the model itself (`safelens.patching._hf_shortcuts`: unpatched passes
that take it must give the corrupted run's logits). Whether one holds follows from the
model's code and structure, not from its weights or the prompt's tokens, and the checks'
passes cost a sweep of a short prompt about a tenth of its time, so each verdict is kept
for the model, under a fingerprint of everything that could change it:

- every module: its identity and class, its class's `forward` and one set on the module
  itself (a wrapper's, such as nnsight's, or an `overriding` on another thread), and
  its training flag;
- the config's attributes, and the attention function its implementation names;
- the parameters' dtype and device;
- the prompt's batch and length, and whether its mask hides any position;
- the sweep's site and the shortcuts checked.

A change to any of them checks again, as does a model the fingerprint has not seen.
Verdicts live as long as the model (a weak reference) and are read and written under a
lock. `forget()` drops every verdict.

Caveat: what the fingerprint does not see, such as a function of a model's module
replaced by assignment in transformers' code, is not checked again on a model that was
checked before.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

__all__ = ["fingerprint", "forget", "remembered"]

_VERDICTS: weakref.WeakKeyDictionary[torch.nn.Module, dict[Hashable, bool]] = (
    weakref.WeakKeyDictionary()
)
_LOCK = threading.Lock()


def fingerprint(model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> Hashable:
    """What a shortcut check's verdict on `model` for this prompt's shape depends on."""
    modules = tuple(
        (
            id(module),
            type(module),
            id(getattr(type(module), "forward", None)),
            id(module.__dict__.get("forward")),
            module.training,
        )
        for module in model.modules()
    )
    config = getattr(model, "config", None)
    settings = tuple(sorted((k, repr(v)) for k, v in vars(config).items())) if config else ()
    implementation = getattr(config, "_attn_implementation", None)
    attention = id(ALL_ATTENTION_FUNCTIONS.get(implementation)) if implementation else None
    parameter = next(model.parameters(), None)
    where = (parameter.dtype, parameter.device) if parameter is not None else None
    return (modules, settings, attention, where, tuple(tokens.shape), bool(mask.all()))


def remembered(model: torch.nn.Module, key: Hashable, check: Callable[[], bool]) -> bool:
    """`check()`'s verdict, or the one kept for `model` under `key` (see `fingerprint`)."""
    with _LOCK:
        kept = _VERDICTS.get(model, {}).get(key)
    if kept is not None:
        return kept
    verdict = check()
    with _LOCK:
        _VERDICTS.setdefault(model, {})[key] = verdict
    return verdict


def forget() -> None:
    """Drop every kept verdict: the next sweep on any model checks again."""
    with _LOCK:
        _VERDICTS.clear()
