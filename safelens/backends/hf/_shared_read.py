"""The attention function that reads a broadcast prefix once per layer: `shared_attention`.

`shared_prefix` (`safelens.backends.hf._shared_attention`) registers it in transformers'
`AttentionInterface` for the block; this module is what it computes. Every row's
queries are scored against the prefix's keys in one matmul per key/value head, and its
values are mixed in another; each row's own tokens are read per row.

How the function knows the prefix: the cache's `update` (`safelens.backends.hf._layer`)
calls [`note_read`][] with the tensors it hands to attention and its stored pieces; the
function uses the pieces only when it receives exactly those tensors (the same objects),
whose leading positions are then the broadcast prefix. What it knows is kept per thread
(`THREAD`): which configs' blocks the thread is inside, the last read, the last mask.

Caveat: the numbers equal the model's own attention (its eager function or `sdpa`) to
float rounding, not bitwise (each matmul is split in two). A call falls back to the
model's own attention function whenever this path would not reproduce it: keys that are
not what the cache handed out (another cache, a `hook_k_full`/`hook_v_full` hook, model
code that changed them), rows that do not share a broadcast prefix, `output_attentions`,
dropout in training, gradients, attention sinks (`s_aux`) other than one logit per query
head (GPT-OSS's, which join each query's softmax here), position biases, a `None` mask
on more than one query, and `sdpa` with soft-capping (which `sdpa` refuses).
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float
from transformers.modeling_utils import AttentionInterface

from ...core._storage import Sequence
from ...core._versions import version_of
from ._attention_edits import sink_logits, sink_softmax

__all__ = ["THREAD", "note_read", "shared_attention"]

_REFUSED = ("position_bias", "sinks")


class _Read:
    """What the cache handed to attention last, and its broadcast leading positions."""

    __slots__ = ("keys", "values", "shared_keys", "shared_values")

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        shared_keys: Float[torch.Tensor, "1 n_kv_heads prefix d_head"],
        shared_values: Float[torch.Tensor, "1 n_kv_heads prefix d_head"],
    ) -> None:
        self.keys, self.values = keys, values
        self.shared_keys, self.shared_values = shared_keys, shared_values


class _Thread(threading.local):
    """Per thread: the configs whose blocks it is inside (by id), and the last read."""

    def __init__(self) -> None:
        self.inside: dict[int, int] = {}
        self.read: _Read | None = None
        self.mask: tuple[torch.Tensor, int, torch.Tensor, bool] | None = None


THREAD = _Thread()


def note_read(
    keys: Sequence | None,
    values: Sequence | None,
    full_keys: torch.Tensor,
    full_values: torch.Tensor,
    exact: bool,
) -> None:
    """Tell attention which leading positions of `full_keys`/`full_values` are broadcast.

    The cache layer calls it from `update` with its stored sequences (position-major) and
    the head-major tensors it returns; `exact` is False when a read-time hook may have
    changed them. Only a thread inside a `shared_prefix` block keeps the note, and only
    until the next update.
    """
    if not THREAD.inside:
        return
    THREAD.read = None
    if not exact or keys is None or values is None:
        return
    shared_keys, shared_values = [], []
    for key, value in zip(keys.pieces(), values.pieces(), strict=True):
        if key.shape[0] < 2 or key.stride(0) or value.stride(0):
            break
        shared_keys.append(key[:1])
        shared_values.append(value[:1])
    if shared_keys:
        THREAD.read = _Read(
            full_keys,
            full_values,
            torch.cat(shared_keys, dim=1).transpose(1, 2),
            torch.cat(shared_values, dim=1).transpose(1, 2),
        )


def _own_attention(implementation: str, module: torch.nn.Module) -> Callable[..., Any]:
    """The attention function `module` runs under `implementation` without this block."""
    if implementation == "sdpa":
        registered: dict[str, Any] = AttentionInterface._global_mapping
        return registered["sdpa"]  # type: ignore[no-any-return]
    return sys.modules[type(module).__module__].eager_attention_forward  # type: ignore[no-any-return]


@functools.cache
def _takes_softcap(function: Callable[..., Any]) -> bool:
    return "softcap" in inspect.signature(function).parameters


def shared_attention(
    implementation: str,
    module: torch.nn.Module,
    query: Float[torch.Tensor, "batch n_heads pos d_head"],
    key: Float[torch.Tensor, "batch n_kv_heads pos_so_far d_head"],
    value: Float[torch.Tensor, "batch n_kv_heads pos_so_far d_head"],
    attention_mask: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The registered attention function: the shared read, or the model's own function."""
    own = _own_attention(implementation, module)
    read = THREAD.read if THREAD.inside.get(id(getattr(module, "config", None))) else None
    if read is None or read.keys is not key or read.values is not value or args:
        return own(module, query, key, value, attention_mask, *args, **kwargs)  # type: ignore[no-any-return]
    THREAD.read = None
    softcap = kwargs.get("softcap")
    dropout = kwargs.get("dropout", 0.0)
    s_aux = kwargs.get("s_aux")
    sinks = sink_logits(s_aux, query)
    if (
        kwargs.get("output_attentions")
        or any(kwargs.get(name) is not None for name in _REFUSED)
        or (s_aux is not None and sinks is None)
        or (dropout and module.training)
        or (softcap is not None and (implementation == "sdpa" or not _takes_softcap(own)))
        or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad))
        or not _fits(query, key, read, attention_mask)
    ):
        return own(module, query, key, value, attention_mask, **kwargs)  # type: ignore[no-any-return]
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return _shared_read(query, key, value, read, attention_mask, scaling, softcap, sinks), None


def _fits(query: torch.Tensor, key: torch.Tensor, read: _Read, mask: torch.Tensor | None) -> bool:
    """Whether the shapes are the ones `_shared_read` computes for."""
    batch, n_heads, pos, _ = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if n_heads % kv_heads or key.shape[0] != batch or read.shared_keys.shape[2] > length:
        return False
    if mask is None:
        return pos == 1
    return (
        mask.dim() == 4
        and mask.shape[0] in (1, batch)
        and mask.shape[1] in (1, n_heads)
        and mask.shape[-2:] == (pos, length)
    )


def _shared_read(
    query: Float[torch.Tensor, "batch n_heads pos d_head"],
    key: Float[torch.Tensor, "batch n_kv_heads pos_so_far d_head"],
    value: Float[torch.Tensor, "batch n_kv_heads pos_so_far d_head"],
    read: _Read,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> Float[torch.Tensor, "batch pos n_heads d_head"]:
    """Eager attention, with the broadcast prefix read once for all rows.

    `sinks`: `[1, n_heads, 1, 1]` logits that join each query's softmax and attend to
    nothing (`sink_logits`). Works head-first, `[n_kv_heads, batch, group, pos, ...]`,
    so that the prefix is one matmul per key/value head and its slice of the pattern
    needs no copy.
    """
    batch, n_heads, pos, d_head = query.shape
    kv_heads = key.shape[1]
    group = n_heads // kv_heads
    prefix = read.shared_keys.shape[2]
    queries = query.reshape(batch, kv_heads, group * pos, d_head).transpose(0, 1)
    queries = queries.reshape(kv_heads, batch * group * pos, d_head) * scaling
    own_queries = queries.view(kv_heads, batch, group * pos, d_head)
    scores = torch.cat(
        [
            (queries @ read.shared_keys[0].transpose(1, 2)).view(
                kv_heads, batch, group * pos, prefix
            ),
            own_queries @ key[:, :, prefix:].transpose(0, 1).transpose(2, 3),
        ],
        dim=-1,
    )
    length = scores.shape[-1]
    scores = scores.view(kv_heads, batch, group, pos, length)
    if softcap is not None:
        scores = torch.tanh(scores / softcap).mul_(softcap)
    blind = False
    if mask is not None:
        additive, blind = _additive(mask, scores.dtype)
        heads_mask = (
            additive[None]
            if mask.shape[1] == 1
            else additive.reshape(mask.shape[0], kv_heads, group, pos, length).transpose(0, 1)
        )
        scores = scores.add_(heads_mask)
    if sinks is not None:
        sinks = sinks.view(kv_heads, 1, group, 1, 1)  # head-first, as the scores
    pattern = sink_softmax(scores, sinks)
    if blind:
        # A query that may see no key gets zeros, as `sdpa` gives it.
        pattern = torch.nan_to_num(pattern, nan=0.0)
    pattern = pattern.to(value.dtype).view(kv_heads, batch * group * pos, length)
    out = (pattern[..., :prefix] @ read.shared_values[0]).view(kv_heads, batch, group * pos, d_head)
    own = pattern[..., prefix:].view(kv_heads, batch, group * pos, length - prefix)
    out = out + own @ value[:, :, prefix:].transpose(0, 1)
    out = out.view(kv_heads, batch, group, pos, d_head).permute(1, 3, 0, 2, 4)
    return out.reshape(batch, pos, n_heads, d_head)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """`mask` as scores to add (-inf where False), and whether some query sees no key.

    Kept for the next layers, which get the same mask object (unless changed in place).
    """
    kept, version = THREAD.mask, version_of(mask)
    if kept and kept[0] is mask and kept[1] == version and kept[2].dtype == dtype:
        return kept[2], kept[3]
    if mask.dtype == torch.bool:
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        additive.masked_fill_(mask.logical_not(), float("-inf"))
        blind = not bool(mask.any(-1).all())
    else:
        additive, blind = mask.to(dtype), False
    # An inference mask counts no edits (`version_of`): nothing is kept for it.
    THREAD.mask = None if version is None else (mask, version, additive, blind)
    return additive, blind
