"""Attention that reads a prefix shared by every row once per layer: `shared_prefix`.

When many rows continue one prefix (`HFKeyValueCache.expand(n)`), a HuggingFace
attention function gets the prefix's keys and values once per row and, with grouped
queries, once per query head: `n * n_heads` copies of the same tensors, read in one
batched matmul. Inside `with shared_prefix(model):` the model's attention runs through a
function registered in transformers' `AttentionInterface` that reads the stored, broadcast
prefix once per layer: every row's queries are scored against its keys in one matmul per
key/value head, and its values are mixed in another. Each row's own tokens are read per
row, as before. The model's code is not patched: its config names the registered
function (with the original implementation's mask function) for the block.

How the function knows the prefix: the cache's `update` (`safelens.backends.hf._layer`)
calls [`note_read`][] with the tensors it hands to attention and its stored pieces; the
function uses the pieces only when it receives exactly those tensors (the same objects),
whose leading positions are then the broadcast prefix.

Caveat: the numbers equal the model's own attention (its eager function or `sdpa`) to
float rounding, not bitwise (each matmul is split in two). A call falls back to the
model's own attention function whenever this path would not reproduce it: keys that are
not what the cache handed out (another cache, a `hook_k_full`/`hook_v_full` hook, model
code that changed them), rows that do not share a broadcast prefix, `output_attentions`,
dropout in training, gradients, attention sinks (`s_aux`), position biases, a
`None` mask on more than one query, and `sdpa` with soft-capping (which `sdpa` refuses).
Models whose attention is neither `eager` nor `sdpa` (flash, flex), and GPT-2's
`reorder_and_upcast_attn`, are left as they are.

Threads: the first thread to enter a block for a model switches its configs, the last to
leave restores them, and the registered functions are removed with the last block;
meanwhile a call from a thread that is not inside a block for that model runs the
model's own attention function, unchanged.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from jaxtyping import Float
from transformers import PretrainedConfig, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from ...core._errors import CacheConfigError
from ...core._storage import Sequence

__all__ = ["shared_prefix", "note_read"]

_HANDLED = ("eager", "sdpa")
_PREFIX = "safelens_shared_prefix_"
_REFUSED = ("s_aux", "position_bias", "sinks")


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


_THREAD = _Thread()


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
    if not _THREAD.inside:
        return
    _THREAD.read = None
    if not exact or keys is None or values is None:
        return
    shared_keys, shared_values = [], []
    for key, value in zip(keys.pieces(), values.pieces(), strict=True):
        if key.shape[0] < 2 or key.stride(0) or value.stride(0):
            break
        shared_keys.append(key[:1])
        shared_values.append(value[:1])
    if shared_keys:
        _THREAD.read = _Read(
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


def _attention(
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
    read = _THREAD.read if _THREAD.inside.get(id(getattr(module, "config", None))) else None
    if read is None or read.keys is not key or read.values is not value or args:
        return own(module, query, key, value, attention_mask, *args, **kwargs)  # type: ignore[no-any-return]
    _THREAD.read = None
    softcap = kwargs.get("softcap")
    dropout = kwargs.get("dropout", 0.0)
    if (
        kwargs.get("output_attentions")
        or any(kwargs.get(name) is not None for name in _REFUSED)
        or (dropout and module.training)
        or (softcap is not None and (implementation == "sdpa" or not _takes_softcap(own)))
        or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad))
        or not _fits(query, key, read, attention_mask)
    ):
        return own(module, query, key, value, attention_mask, **kwargs)  # type: ignore[no-any-return]
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return _shared_read(query, key, value, read, attention_mask, scaling, softcap), None


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
) -> Float[torch.Tensor, "batch pos n_heads d_head"]:
    """Eager attention, with the broadcast prefix read once for all rows.

    Works head-first, `[n_kv_heads, batch, group, pos, ...]`, so that the prefix is one
    matmul per key/value head and its slice of the pattern needs no copy.
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
    pattern = torch.softmax(scores, dim=-1, dtype=torch.float32)
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
    kept = _THREAD.mask
    if kept and kept[0] is mask and kept[1] == mask._version and kept[2].dtype == dtype:
        return kept[2], kept[3]
    if mask.dtype == torch.bool:
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        additive.masked_fill_(mask.logical_not(), float("-inf"))
        blind = not bool(mask.any(-1).all())
    else:
        additive, blind = mask.to(dtype), False
    _THREAD.mask = (mask, mask._version, additive, blind)
    return additive, blind


class _Switched:
    """One config switched to the shared read: what it named before, how many hold it."""

    __slots__ = ("config", "previous", "holders")

    def __init__(self, config: Any, previous: str) -> None:
        self.config, self.previous, self.holders = config, previous, 0


# Configs switched by some block, by id; the registry entries exist while any is.
_SWITCHED: dict[int, _Switched] = {}
_REGISTERED: dict[str, tuple[Any, Any]] = {}
_LOCK = threading.Lock()


def _configs(model: Any) -> list[Any]:
    """The distinct configs `model`'s modules read (the model's and any sub-configs)."""
    if not isinstance(model, torch.nn.Module) or not isinstance(
        getattr(model, "config", None), PretrainedConfig
    ):
        raise CacheConfigError(
            f"model must be a HuggingFace model (a torch.nn.Module with a PretrainedConfig "
            f"at .config), got {type(model).__name__}; for a HookedTransformer use "
            "shared_prefix_attention"
        )
    found: dict[int, Any] = {id(model.config): model.config}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            found.setdefault(id(config), config)
    return list(found.values())


def _switchable(config: Any) -> bool:
    implementation = config._attn_implementation_internal
    return implementation in _HANDLED and not (
        implementation == "eager" and getattr(config, "reorder_and_upcast_attn", False)
    )


def _register() -> None:
    """Put the shared-read functions (and their masks) in transformers' registries."""
    for implementation in _HANDLED:
        name = _PREFIX + implementation
        _REGISTERED[name] = (
            AttentionInterface._global_mapping.get(name),
            AttentionMaskInterface._global_mapping.get(name),
        )
        masks: dict[str, Any] = AttentionMaskInterface._global_mapping
        AttentionInterface.register(name, functools.partial(_attention, implementation))
        AttentionMaskInterface.register(name, masks[implementation])


def _unregister() -> None:
    """Put transformers' registries back as `_register` found them."""
    for name, previous in _REGISTERED.items():
        for interface, entry in zip(
            (AttentionInterface, AttentionMaskInterface), previous, strict=True
        ):
            if entry is None:
                del interface._global_mapping[name]
            else:
                interface._global_mapping[name] = entry
    _REGISTERED.clear()


def _hold(configs: list[Any]) -> list[_Switched]:
    """Switch each config this block may switch (unless a block already has); count it."""
    held: list[_Switched] = []
    with _LOCK:
        for config in configs:
            switched = _SWITCHED.get(id(config))
            if switched is None:
                if not _switchable(config):
                    continue
                if not _SWITCHED:
                    _register()
                switched = _Switched(config, config._attn_implementation_internal)
                config._attn_implementation_internal = _PREFIX + switched.previous
                _SWITCHED[id(config)] = switched
            switched.holders += 1
            held.append(switched)
    return held


def _release(held: list[_Switched]) -> None:
    """Count this block out; the last one out restores each config and the registries."""
    with _LOCK:
        for switched in held:
            switched.holders -= 1
            if switched.holders == 0:
                switched.config._attn_implementation_internal = switched.previous
                del _SWITCHED[id(switched.config)]
        if not _SWITCHED and _REGISTERED:
            _unregister()


@contextmanager
def shared_prefix(model: PreTrainedModel) -> Iterator[None]:
    """Within the block, `model`'s attention reads a prefix broadcast to every row once.

    Use it around forward passes on an [`HFKeyValueCache`][safelens.HFKeyValueCache]
    expanded from one prefix (`prefix.expand(n)`, frozen or not): each layer scores every
    row's queries against the prefix's keys in one matmul per key/value head, instead of
    reading `n` copies. The numbers equal the model's own attention to float rounding;
    calls this path cannot reproduce run the model's own attention function (see the
    module notes). Blocks nest and may be entered by several threads at once.

    Safe from threads: only calls made by a thread inside a block for `model` read the
    prefix this way; when the last block for `model` is left, its configs and
    transformers' attention registries are as they were, even if a block raised.

    **Arguments:**

    - `model`: a HuggingFace causal LM (a `PreTrainedModel`).

    **Raises:** [`CacheConfigError`][safelens.CacheConfigError] when `model` is not a
    HuggingFace model.

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from safelens import HFKeyValueCache, hf_cache_argument
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, vocab_size=10)).eval()
    >>> arg = hf_cache_argument(model)  # "cache" on transformers >= 5.24
    >>> prefix = HFKeyValueCache(model.config)
    >>> _ = model(torch.tensor([[1, 2, 3, 4]]), **{arg: prefix})
    >>> rows = prefix.expand(3)
    >>> rows.freeze()
    >>> with torch.no_grad(), shared_prefix(model):
    ...     logits = model(torch.tensor([[5], [6], [7]]), **{arg: rows}).logits
    >>> logits.shape
    torch.Size([3, 1, 10])

    ```
    """
    held = _hold(_configs(model))
    inside = _THREAD.inside
    keys = [id(switched.config) for switched in held]
    try:
        for key in keys:
            inside[key] = inside.get(key, 0) + 1
        try:
            yield
        finally:
            for key in keys:
                inside[key] -= 1
                if not inside[key]:
                    del inside[key]
            if not inside:
                _THREAD.read = _THREAD.mask = None
    finally:
        _release(held)
