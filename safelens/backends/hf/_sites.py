"""The sites of a HuggingFace causal LM: where its activations are patched and read.

| `activation` | where it is patched and read | clean cache name |
| --- | --- | --- |
| `k`, `v` | the cache's `model.layers.{l}.kv_cache.hook_k_new` / `hook_v_new`, head-major `[batch, n_kv_heads, pos, d_head]`, keys after the rotary embedding | the same |
| `q` | the query the attention function gets, `[batch, n_heads, pos, d_head]`, after the rotary embedding | `blocks.{l}.attn.hook_q`, stored `[batch, pos, n_heads, d_head]` |
| `z` | the output projection's input as `[batch, pos, n_heads, d_head]` | `blocks.{l}.attn.hook_z` |
| `pattern` | the softmax inside the attention function, computed eagerly | `blocks.{l}.attn.hook_pattern`, the same layout |
| `attn_scores` | the scores the softmax takes: scaled, soft-capped, masked | `blocks.{l}.attn.hook_attn_scores` |
| `resid_pre` | the decoder layer's input | `blocks.{l}.hook_resid_pre` |
| `resid_mid` | the input of the norm before the MLP, edited in place; none in parallel-attention families | `blocks.{l}.hook_resid_mid` |
| `resid_post` | the decoder layer's output | `blocks.{l}.hook_resid_post` |
| `attn_out` | the attention module's output | `blocks.{l}.hook_attn_out` |
| `mlp_out` | the MLP module's output | `blocks.{l}.hook_mlp_out` |

The seams of `q`, `z`, `pattern`, `attn_scores`, `resid_pre` and `resid_mid` are
`safelens.backends.hf._seams`' (a `Site` whose `hook` gives `None`); queries are
patched after the rotary embedding, as keys are, which at one position is the same
patch as TransformerLens' `attn.hook_q` before it (the rotation of a position is a fixed
linear map of that position's vector, and the clean and corrupted runs give a position
the same angle). Query-head sites have `n_heads` heads, key/value sites `n_kv_heads`.
A family without a site's module or seam is refused with a `PatchingError` saying why.

Caveat: `attn_out` and `mlp_out` are the modules' outputs, before any norm a family
applies on the way back into the residual stream (Gemma-2's `post_attention_layernorm`,
`post_feedforward_layernorm`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...core._errors import PatchingError
from .._sites import PATTERNS, QUERY_HEADS, TL_NAMES, Site
from ._model import forward_parameters
from ._seams import ATTENTION_MODULES, child_named, seam_modules

if TYPE_CHECKING:
    from .._backend import Backend

__all__ = ["decoder_layer", "decoder_layers", "hf_site", "kv_site", "layer_device"]

# The MLP by the names families give it (`mlp`; Granite-MoE's mixture of experts:
# `block_sparse_moe`; MPT: `ffn`, refused below). Not Llama-4's `feed_forward`, whose
# mixture of experts returns its tokens flattened.
_MODULES = {"attn_out": ATTENTION_MODULES, "mlp_out": ("mlp", "block_sparse_moe", "ffn")}


def decoder_layers(model: Any, n_layers: int) -> tuple[str, torch.nn.ModuleList]:
    """The name and module list of a HuggingFace model's decoder layers."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n_layers:
            return name, module
    raise PatchingError(
        f"found no list of {n_layers} decoder layers in {type(model).__name__}; the sweeps "
        "patch HuggingFace causal LMs whose layers sit in one ModuleList"
    )


def decoder_layer(backend: Backend, layer: int) -> torch.nn.Module:
    """Decoder layer `layer` of a HuggingFace causal LM (or a bridge's plain model)."""
    return decoder_layers(backend.model, backend.n_layers)[1][layer]


def layer_device(backend: Backend, layer: int) -> torch.device:
    """The device decoder layer `layer` computes on: its parameters', or accelerate's.

    A model dispatched with a `device_map` (accelerate) runs each layer on its hook's
    `execution_device`, also when its weights are offloaded (on `meta` until used).
    """
    module = decoder_layer(backend, layer)
    execution = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if execution is not None:
        return torch.device(execution)
    weight = next(module.parameters(), None)
    return backend.device if weight is None else weight.device


def _module_name(backend: Backend, activation: str, layer: int) -> str:
    prefix, layers = decoder_layers(backend.model, backend.n_layers)
    child = child_named(layers[layer], _MODULES[activation])
    if child is None:
        raise PatchingError(
            f"decoder layer {layer} of {type(backend.model).__name__} has no "
            f"{' or '.join(_MODULES[activation])} module to patch as {activation!r}"
        )
    module = getattr(layers[layer], child)
    if "residual" in forward_parameters(module):
        # BLOOM, MPT: the module adds the residual stream to what it computes.
        after = "resid_mid" if activation == "attn_out" else "resid_post"
        raise PatchingError(
            f"{type(module).__name__} (decoder layer {layer}'s {child}) adds the residual "
            f"stream to its own output (its forward takes residual), so its output is "
            f"{after}, not {activation!r}; patch resid_pre, {after} or z instead"
        )
    return f"{prefix}.{layer}.{child}"


def _tl_name(activation: str) -> Any:
    def name(layer: int) -> str:
        return f"blocks.{layer}.{TL_NAMES[activation]}"

    return name


def _no_hook(layer: int) -> None:
    return None


def kv_site(backend: Backend, activation: str, clean: Any = None) -> Site:
    """Keys or values at the cache's hooks, head-major, after the rotary embedding.

    `clean(layer)` names the clean tensor; by default the cache hook's own name.
    """
    layout = backend.caches.layout

    def cache_name(layer: int) -> str:
        return layout.hook_name(layer, f"hook_{activation}_new")

    def full_name(layer: int) -> str:
        return layout.hook_name(layer, f"hook_{activation}_full")

    transposed = clean is not None
    return Site(
        activation,
        cache_name,
        clean or cache_name,
        2,
        1,
        backend.n_kv_heads,
        transposed,
        full=full_name,
    )


def hf_site(backend: Backend, activation: str) -> Site:
    """The site of `activation` on a HuggingFace model (module notes), or a `PatchingError`."""
    if activation in ("k", "v"):
        return kv_site(backend, activation)
    config = backend.config  # type: ignore[attr-defined]
    heads = int(config.num_attention_heads) if activation in QUERY_HEADS else 0
    tl_name = _tl_name(activation)
    if activation in _MODULES:
        _module_name(backend, activation, 0)  # a family without the module: say so first
        return Site(
            activation, lambda layer: _module_name(backend, activation, layer), tl_name, 1, 2, 0
        )
    if activation == "resid_post":
        prefix, _ = decoder_layers(backend.model, backend.n_layers)
        return Site(activation, lambda layer: f"{prefix}.{layer}", tl_name, 1, 2, 0)
    seam_modules(decoder_layers(backend.model, backend.n_layers)[1], config, activation)
    if activation == "q":  # hook head-major, clean position-major as TransformerLens'
        return Site(activation, _no_hook, tl_name, 2, 1, heads, transposed=True)
    if activation in PATTERNS:
        return Site(activation, _no_hook, tl_name, 2, 1, heads)
    return Site(activation, _no_hook, tl_name, 1, 2, heads)
