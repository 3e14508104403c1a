"""The attention function of a HuggingFace model, edited in one thread's passes: `attention_edits`.

Every HuggingFace attention module computes its queries, keys and values, then calls
the function transformers' `ALL_ATTENTION_FUNCTIONS` holds under
`config._attn_implementation` (`"sdpa"`, `"eager"`, …) as `fn(module, query, key,
value, attention_mask, scaling=…, **kwargs)`. Within `attention_edits` that entry
dispatches, for the modules being edited on the calling thread, to safelens: the query
`[batch, n_heads, pos, d_head]` (after the rotary embedding, query heads even under
grouped-query attention) is edited before the model's own function runs; to read or edit
scores or patterns the layer's attention is computed here, eagerly (`_eager`): scores
`query @ key.T * scaling`, soft-capped where the family caps them, plus the attention
mask HuggingFace hands the function, then the pattern `softmax(scores)` in float32, then
`pattern @ value`. A family with attention sinks (GPT-OSS, Granite-SWA: a learned logit
per head, `s_aux`, that joins every query's softmax and attends to nothing) gets the
pattern `softmax([scores, sink])` without the sink's column (`sink_softmax`), as
GPT-OSS's eager attention returns it: each row leaves the sink's share out and sums to
less than 1. Every other module, and every other thread, runs the function it always
runs; the registry's entries are restored when the last block exits. The other seams of
a decoder layer are `safelens.backends.hf._seams`'.

Caveat: a family whose attention computes outside `ALL_ATTENTION_FUNCTIONS` (GPT-2
with `reorder_and_upcast_attn`, a model's own attention registry) never reaches this
function; `attention_edits` raises a `PatchingError` when an edited module's function
did not run through it.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from ...core._errors import PatchingError
from ...core._versions import version_of

__all__ = ["ATTENTION_POINTS", "Edit", "attention_edits", "sink_logits", "sink_softmax"]

# `edit(tensor) -> tensor | None`: what a seam's tensor becomes (`None`: as it is, or
# edited in place).
Edit = Callable[[torch.Tensor], "torch.Tensor | None"]
# What the attention function edits: queries before it, scores and pattern inside it.
ATTENTION_POINTS = ("q", "attn_scores", "pattern")
# Attention-function arguments that change the arithmetic `_eager` does not know (`s_aux`
# it knows in the form GPT-OSS passes it: one sink logit per query head).
_UNKNOWN_ARITHMETIC = ("s_aux", "sinks", "position_bias", "alibi")


_LOCK = threading.Lock()
# implementation name -> (threads editing through it, its entry in the registry's own
# mapping before, or `_MISSING`)
_INSTALLED: dict[str, tuple[int, Any]] = {}
_MISSING = object()


class _Edits(threading.local):
    """The calling thread's attention edits, by `id(module)`, and the modules that ran."""

    def __init__(self) -> None:
        self.by_module: dict[int, dict[str, Edit]] = {}
        self.ran: set[int] = set()


_EDITS = _Edits()


def _own_eager(module: torch.nn.Module) -> Callable[..., Any]:
    """The `eager_attention_forward` of `module`'s own modeling file (the `"eager"` default)."""
    own = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if own is None:
        raise PatchingError(
            f"{type(module).__name__} runs eager attention without an "
            "eager_attention_forward function in its modeling file; safelens cannot reach "
            "its attention function"
        )
    result: Callable[..., Any] = own
    return result


def _dispatching(own: Callable[..., Any] | None) -> Callable[..., Any]:
    def attention(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        function = own if own is not None else _own_eager(module)
        edits = _EDITS.by_module.get(id(module))
        if edits is None:  # not edited on this thread
            return function(module, *args, **kwargs)
        _EDITS.ran.add(id(module))
        return _edited(function, edits, module, *args, **kwargs)

    return attention


def _applied(edit: Edit, tensor: torch.Tensor) -> torch.Tensor:
    result = edit(tensor)
    return tensor if result is None else result


def _edited(
    function: Callable[..., Any],
    edits: dict[str, Edit],
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    if "q" in edits:
        query = _applied(edits["q"], query)
    if "attn_scores" not in edits and "pattern" not in edits:
        return function(module, query, key, value, attention_mask, *args, **kwargs)
    unknown = [name for name in _UNKNOWN_ARITHMETIC if kwargs.get(name) is not None]
    if "s_aux" in unknown and sink_logits(kwargs["s_aux"], query) is not None:
        unknown.remove("s_aux")
    if args or unknown:
        raise PatchingError(
            f"{type(module).__name__}'s attention takes "
            f"{unknown[0] if unknown else 'positional arguments'} that safelens' eager "
            "attention does not compute with; its scores and patterns cannot be patched"
        )
    output, pattern, changed = _eager(module, query, key, value, attention_mask, edits, **kwargs)
    if not changed:
        # Scores and pattern only read: the layer's output is the model's own, bitwise.
        return function(module, query, key, value, attention_mask, **kwargs)
    return output, pattern


def _eager(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    edits: dict[str, Edit],
    scaling: float | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    **ignored: Any,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Attention computed here, with its scores and pattern edited (module notes).

    Also returns whether an edit changed the scores or the pattern (returned another
    tensor or wrote into it), or only read them.
    """
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else 1 / math.sqrt(query.shape[-1])
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    floor = torch.finfo(scores.dtype).min
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if causal:  # bottom-right: query i sits at key position offset + i
            queries, keys = scores.shape[-2:]
            rows = torch.arange(queries, device=scores.device)[:, None] + keys - queries
            allowed = rows >= torch.arange(keys, device=scores.device)
            scores = scores.masked_fill(~allowed, floor)
    elif attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask[..., : key.shape[-2]], floor)
    else:
        scores = scores + attention_mask[..., : key.shape[-2]]
    changed = False
    if "attn_scores" in edits:
        scores, changed = _read_or_edited(edits["attn_scores"], scores)
    pattern = sink_softmax(scores, sink_logits(s_aux, query)).to(query.dtype)
    if "pattern" in edits:
        pattern, edited = _read_or_edited(edits["pattern"], pattern)
        changed |= edited
    output = torch.matmul(pattern, value).transpose(1, 2).contiguous()
    return output, pattern, changed


def sink_logits(s_aux: Any, query: torch.Tensor) -> torch.Tensor | None:
    """`s_aux` as `[1, n_heads, 1, 1]` sink logits, or `None` if it is not one per query head.

    `query` is `[batch, n_heads, pos, d_head]`.
    """
    heads = query.shape[1]
    if not isinstance(s_aux, torch.Tensor) or s_aux.dim() != 1 or s_aux.numel() != heads:
        return None
    return s_aux.reshape(1, heads, 1, 1)


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The float32 softmax of `scores` over the last axis, with a sink logit per row if given.

    `sinks` broadcasts to `scores[..., :1]`: one more logit per row, whose share attends
    to nothing and is left out, so a row then sums to less than 1.
    """
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    column = sinks.to(scores.device, torch.float32).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores.to(torch.float32), column], dim=-1)
    return torch.softmax(combined, dim=-1)[..., :-1]


def _read_or_edited(edit: Edit, tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """What `edit` makes of `tensor`, and whether it changed it (in place counts).

    An inference tensor counts no edits (`version_of`): a copy taken before tells.
    """
    version = version_of(tensor)
    before = tensor.clone() if version is None else None
    result = edit(tensor)

    def edited() -> bool:
        if before is not None:
            return not torch.equal(tensor, before)
        return tensor._version != version

    if result is None:
        return tensor, edited()
    return result, result is not tensor or edited()


def _implementation(module: torch.nn.Module) -> str:
    name = getattr(getattr(module, "config", None), "_attn_implementation", None)
    return name if isinstance(name, str) else "eager"


@contextmanager
def attention_edits(edits: Mapping[torch.nn.Module, Mapping[str, Edit]]) -> Iterator[None]:
    """Within the block, on this thread, each attention module's function runs with its edits.

    `edits[module][point]`, `point` one of `ATTENTION_POINTS`: `"q"` sees the query
    `[batch, n_heads, pos, d_head]`, `"attn_scores"` and `"pattern"` `[batch, n_heads,
    query_pos, key_pos]` (module notes). On a clean exit, a `PatchingError` names the
    first edited module whose function did not run through the seam.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mine = _EDITS.by_module
    if any(id(module) in mine for module in edits):
        raise RuntimeError("an attention module is edited once at a time on one thread")
    names = sorted({_implementation(module) for module in edits})
    with _LOCK:
        for name in names:
            count, before = _INSTALLED.get(name, (0, _MISSING))
            if count == 0:
                before = ALL_ATTENTION_FUNCTIONS._local_mapping.get(name, _MISSING)
                own = ALL_ATTENTION_FUNCTIONS[name] if name in ALL_ATTENTION_FUNCTIONS else None
                ALL_ATTENTION_FUNCTIONS[name] = _dispatching(own)
            _INSTALLED[name] = (count + 1, before)
    ran = _EDITS.ran
    try:
        mine.update({id(module): dict(points) for module, points in edits.items()})
        yield
        missed = [module for module in edits if id(module) not in ran]
        if missed:
            raise PatchingError(
                f"{type(missed[0]).__name__} computes its attention without "
                "transformers' ALL_ATTENTION_FUNCTIONS (its "
                f"config._attn_implementation={_implementation(missed[0])!r}), so its "
                "queries, scores and patterns cannot be reached; patch k, v, z, resid_pre, "
                "attn_out or mlp_out instead"
            )
    finally:
        for module in edits:
            mine.pop(id(module), None)
            ran.discard(id(module))
        with _LOCK:
            for name in names:
                count, before = _INSTALLED.pop(name)
                if count > 1:
                    _INSTALLED[name] = (count - 1, before)
                elif before is _MISSING:
                    del ALL_ATTENTION_FUNCTIONS[name]
                else:
                    ALL_ATTENTION_FUNCTIONS[name] = before
