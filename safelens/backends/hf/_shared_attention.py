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

This module switches a model's configs to that function and back, for the block and
across threads; the function itself, and how it learns where the prefix is, are
`safelens.backends.hf._shared_read`'s.

Caveat: the numbers equal the model's own attention (its eager function or `sdpa`) to
float rounding, not bitwise. Calls this path would not reproduce (listed in
`safelens.backends.hf._shared_read`) run the model's own attention function. Models
whose attention is neither `eager` nor `sdpa` (flash, flex), GPT-2's
`reorder_and_upcast_attn`, and models with a module that branches on the
implementation's name itself instead of dispatching through `ALL_ATTENTION_FUNCTIONS`
(Falcon's attention up to transformers 5.24, whose eager branch would get an `sdpa`
mask), are left as they are.

Threads: the first thread to enter a block for a model switches its configs, the last to
leave restores them, and the registered functions are removed with the last block;
meanwhile a call from a thread that is not inside a block for that model runs the
model's own attention function, unchanged.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from ...core._errors import CacheConfigError
from ._shared_read import THREAD, shared_attention

__all__ = ["shared_prefix"]

_HANDLED = ("eager", "sdpa")
_PREFIX = "safelens_shared_prefix_"


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


def _branches_on_implementation(cls: Any) -> bool:
    """Whether `cls.forward` reads `config._attn_implementation` but does not dispatch
    through `ALL_ATTENTION_FUNCTIONS` (Falcon's attention up to transformers 5.24 picks
    its own branch by the name, which a switched name would send elsewhere)."""
    forward = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    names = getattr(getattr(forward, "__code__", None), "co_names", ())
    return "_attn_implementation" in names and "ALL_ATTENTION_FUNCTIONS" not in names


def _switchable_model(model: Any) -> bool:
    """Whether switching `model`'s configs changes nothing but the attention function."""
    classes = {type(module) for module in model.modules()}
    return not any(_branches_on_implementation(cls) for cls in classes)


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
        AttentionInterface.register(name, functools.partial(shared_attention, implementation))
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
    configs = _configs(model)
    held = _hold(configs if _switchable_model(model) else [])
    inside = THREAD.inside
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
                THREAD.read = THREAD.mask = None
    finally:
        _release(held)
