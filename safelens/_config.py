"""What a cache needs to know of a model config, read from TransformerLens or HF configs.

[`CacheDimensions.of`][safelens.CacheDimensions.of] reads layers, key/value heads,
`d_head`, dtype and per-layer devices from a TransformerLens `HookedTransformerConfig`
or a HuggingFace-style config, so [`KeyValueCache.init_cache`][safelens.KeyValueCache.init_cache]
works with both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._errors import CacheConfigError

__all__ = ["CacheDimensions", "parse_dtype"]

_LAYERS = ("n_layers", "n_layer", "num_hidden_layers")
_HEADS = ("n_heads", "n_head", "num_attention_heads")
_KV_HEADS = ("n_key_value_heads", "num_key_value_heads")
_D_HEAD = ("d_head", "head_dim")
_HIDDEN = ("d_model", "n_embd", "hidden_size")
_DTYPE = ("dtype", "torch_dtype")


def _first(cfg: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return None


def _required(cfg: Any, names: tuple[str, ...], role: str) -> int:
    value = _first(cfg, names)
    if value is None:
        raise CacheConfigError(
            f"cfg of type {type(cfg).__name__} has no {role}: expected one of the "
            f"attributes {', '.join(names)}"
        )
    return int(value)


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """A `torch.dtype` from a dtype, a name such as `"bfloat16"` or `"torch.float16"`.

    ```python
    >>> parse_dtype("torch.bfloat16"), parse_dtype("float16"), parse_dtype(None)
    (torch.bfloat16, torch.float16, torch.float32)

    ```
    """
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    parsed = getattr(torch, name, None)
    if not isinstance(parsed, torch.dtype):
        raise CacheConfigError(
            f"dtype must be a torch.dtype or a name such as 'float32' or "
            f"'torch.bfloat16', got {dtype!r}"
        )
    return parsed


@dataclass(frozen=True)
class CacheDimensions:
    """The sizes, dtype and devices of a model's key/value cache.

    ```python
    >>> from types import SimpleNamespace
    >>> hf = SimpleNamespace(num_hidden_layers=2, num_attention_heads=8, hidden_size=64)
    >>> CacheDimensions.of(hf)
    CacheDimensions(n_layers=2, n_kv_heads=8, d_head=8, dtype=torch.float32, n_devices=1)

    ```
    """

    n_layers: int
    n_kv_heads: int
    d_head: int
    dtype: torch.dtype
    n_devices: int = 1

    @classmethod
    def of(cls, cfg: Any) -> CacheDimensions:
        """Read the dimensions from a TransformerLens or HuggingFace-style config.

        **Raises:** [`CacheConfigError`][safelens.CacheConfigError] naming the missing
        attribute.
        """
        n_layers = _required(cfg, _LAYERS, "layer count")
        n_heads = _first(cfg, _HEADS)
        n_kv_heads = _first(cfg, _KV_HEADS) or n_heads
        if n_kv_heads is None:
            _required(cfg, _HEADS, "head count")
        d_head = _first(cfg, _D_HEAD)
        if d_head is None:
            if n_heads is None:
                _required(cfg, _HEADS, "head count (needed to derive d_head)")
            d_head = _required(cfg, _HIDDEN, "d_head or hidden size") // int(n_heads)
        return cls(
            n_layers=n_layers,
            n_kv_heads=int(n_kv_heads),
            d_head=int(d_head),
            dtype=parse_dtype(_first(cfg, _DTYPE)),
            n_devices=int(getattr(cfg, "n_devices", None) or 1),
        )

    def device_of_layer(self, layer: int, device: torch.device | str | None) -> torch.device:
        """The device TransformerLens puts layer `layer` on, starting from `device`."""
        base = torch.device(device if device is not None else "cpu")
        if base.type == "cpu" or self.n_devices <= 1:
            return base
        return torch.device(
            base.type, (base.index or 0) + (layer * self.n_devices) // self.n_layers
        )

    def empty_keys(self, batch_size: int, device: torch.device | str | None) -> torch.Tensor:
        """An empty `[batch_size, 0, n_kv_heads, d_head]` tensor in the model's dtype."""
        return torch.empty(
            (batch_size, 0, self.n_kv_heads, self.d_head), dtype=self.dtype, device=device
        )
