"""What safelens needs to know of a HuggingFace model: the name of its cache argument.

transformers 5.24 renamed the forward argument `past_key_values=` to `cache=`, and the
old name now warns (TransformerBridge ignores a cache passed that way), so code that
passes a cache asks [`hf_cache_argument`][safelens.hf_cache_argument] for the name.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Literal

import torch

from ...core._errors import CacheConfigError

__all__ = ["hf_cache_argument"]


@functools.lru_cache(maxsize=64)
def _parameters(function: Callable[..., Any]) -> tuple[str, ...]:
    """The names of a method's parameters after `self` (`inspect.signature` is slow; asked
    per pass)."""
    return tuple(inspect.signature(function).parameters)[1:]


def hf_cache_argument(model: torch.nn.Module) -> Literal["cache", "past_key_values"]:
    """The name under which `model`'s forward (and so `generate`) takes a cache.

    transformers 5.24 renamed `past_key_values=` to `cache=` and warns on the old name.

    **Raises:** [`CacheConfigError`][safelens.CacheConfigError] when the forward takes
    neither.

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, vocab_size=10))
    >>> import transformers
    >>> from packaging.version import Version
    >>> renamed = Version(transformers.__version__) >= Version("5.24")
    >>> hf_cache_argument(model) == ("cache" if renamed else "past_key_values")
    True

    ```
    """
    forward = model.forward
    function = getattr(forward, "__func__", None)  # a method: its signature, once
    parameters = (
        _parameters(function)
        if function is not None
        else tuple(inspect.signature(forward).parameters)
    )
    if "cache" in parameters:
        return "cache"
    if "past_key_values" in parameters:
        return "past_key_values"
    raise CacheConfigError(
        f"{type(model).__name__}.forward takes neither cache= nor past_key_values= "
        f"(its parameters: {', '.join(parameters)}); HFKeyValueCache needs a model whose "
        "attention calls cache.update"
    )
