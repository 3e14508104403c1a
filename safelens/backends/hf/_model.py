"""What safelens needs to know of a HuggingFace model: the name of its cache argument.

transformers 5.24 renamed the forward argument `past_key_values=` to `cache=` (the old
name warns and is renamed), and decoder layers now hand the cache to their attention as
`cache=`. [`hf_cache_argument`][safelens.hf_cache_argument] answers the name under which
a model's forward takes a cache *that its attention then reads*, or refuses:

- a HuggingFace causal LM: the name its forward takes (`cache` on transformers >= 5.24,
  `past_key_values` before);
- a TransformerLens `TransformerBridge`: its forward hands the cache on to its HuggingFace
  model under the name it was given, and the bridge's attention components
  (TransformerLens 3.9 and 4.3) read only `past_key_values`. So the answer is
  `past_key_values` under transformers < 5.24; under 5.24 and later no argument reaches
  them (`cache=` arrives under a name they do not read, `past_key_values=` is renamed on
  the way), and `hf_cache_argument` raises, naming
  [`run_with_hooks`][safelens.run_with_hooks], which hands the cache to the bridge's
  attention itself (`safelens.backends.bridge._cache_pass`) and checks every layer read
  it. The same holds for the HuggingFace model inside a bridge (`bridge.original_model`,
  whose attention modules booting replaced with the bridge's components).

Caveat: safelens' own passes ask `forward_cache_argument` (the forward's signature only,
cached per class) on every pass; `hf_cache_argument` also walks the model's modules, once
per call, when the answer would be `cache`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Literal

import torch
import transformers

from ...core._errors import CacheConfigError

__all__ = [
    "check_cacheable",
    "forward_cache_argument",
    "forward_parameters",
    "hf_cache_argument",
]

CacheArgument = Literal["cache", "past_key_values"]


@functools.lru_cache(maxsize=64)
def _parameters(function: Callable[..., Any]) -> tuple[str, ...]:
    """The names of a method's parameters after `self` (`inspect.signature` is slow; asked
    per pass)."""
    return tuple(inspect.signature(function).parameters)[1:]


def forward_parameters(model: torch.nn.Module) -> tuple[str, ...]:
    """The names of `model.forward`'s parameters (read once per class for a method)."""
    forward = model.forward
    function = getattr(forward, "__func__", None)
    if function is not None:
        return _parameters(function)
    return tuple(inspect.signature(forward).parameters)


def forward_cache_argument(model: torch.nn.Module) -> CacheArgument:
    """The name of `model.forward`'s cache parameter, read from its signature alone.

    What safelens' own passes use (a bridge's passes go through `cache_pass`, which hands
    its attention the cache). **Raises:** [`CacheConfigError`][safelens.CacheConfigError]
    when the forward takes neither `cache` nor `past_key_values`.
    """
    parameters = forward_parameters(model)
    if "cache" in parameters:
        return "cache"
    if "past_key_values" in parameters:
        return "past_key_values"
    raise CacheConfigError(
        f"{type(model).__name__}.forward takes neither cache= nor past_key_values= "
        f"(its parameters: {', '.join(parameters)}); HFKeyValueCache needs a model whose "
        "attention calls cache.update"
    )


def _of_transformer_lens(module: torch.nn.Module, name: str) -> bool:
    """Whether `module`'s class is (or derives from) TransformerLens' class `name`."""
    return any(
        cls.__name__ == name and cls.__module__.startswith("transformer_lens.")
        for cls in type(module).__mro__
    )


def hf_cache_argument(model: torch.nn.Module) -> CacheArgument:
    """The name under which `model`'s forward (and so `generate`) takes a cache its attention reads.

    `cache` on transformers >= 5.24 (which renamed `past_key_values=` and warns on the old
    name), else `past_key_values`. A TransformerBridge (or its `original_model`) takes a
    cache as `past_key_values` under transformers < 5.24 and through no argument from
    5.24 on (see the module notes): there, pass caches through
    [`run_with_hooks`][safelens.run_with_hooks] (and `prefill`, `score_continuations`,
    `generate`), the one way that runs every model family over a safelens cache.

    **Raises:** [`CacheConfigError`][safelens.CacheConfigError] when the forward takes
    neither name, or when the cache would reach no attention module through it (a
    TransformerBridge under transformers >= 5.24), naming `run_with_hooks`.

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
    bridge = _of_transformer_lens(model, "TransformerBridge")
    # A bridge hands the cache on to its HuggingFace model under the name it was given.
    hf_model: Any = model.original_model if bridge else model
    name = forward_cache_argument(hf_model)
    if name == "cache" and any(
        _of_transformer_lens(module, "AttentionBridge") for module in hf_model.modules()
    ):
        what = (
            "a TransformerBridge"
            if bridge
            else f"{type(model).__name__} (its attention modules are a TransformerBridge's)"
        )
        raise CacheConfigError(
            f"{what} takes a cache through no forward argument under transformers "
            f"{transformers.__version__}: the model hands the cache to attention as cache=, "
            "and the bridge's attention components read only past_key_values, so "
            "bridge(tokens, cache=cache) (or past_key_values=cache) leaves the cache empty "
            "and returns logits that ignore it, with no error. Run passes over a cache "
            "with safelens.run_with_hooks(bridge, tokens, cache=cache), which hands the "
            "cache to the bridge's attention and checks that every layer read it (for "
            "prefixes: prefill, score_continuations, generate)"
        )
    return name


# The layer kinds transformers' own cache gives a key/value layer: safelens' cache holds
# the keys and values of every layer, attended in full or in a window.
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
# What the other kinds keep instead (transformers' names).
_KEEPS = {
    "conv": "a convolution state",
    "linear_attention": "a recurrent state (state-space or linear attention)",
    "hybrid": "a recurrent state beside its keys and values",
    "hybrid_sliding": "a recurrent state beside its keys and values",
    "dummy": "no keys and values of its own (it reuses another layer's, or has no attention)",
}


def _check_attention_layers(config: Any, what: str) -> None:
    """Refuse a model (`what`, its text `config`) with a layer that stores no keys and values.

    The kinds are transformers' own (`get_layer_types_and_kwargs`, as `DynamicCache`
    reads them; a config's `layer_types` on a transformers without it): a state-space,
    convolution or linear-attention layer (Mamba, Jamba, Zamba, Qwen3-Next, Falcon-H1,
    MiniMax, LFM2), or one that reuses another layer's keys and values.

    **Raises:** [`CacheConfigError`][safelens.CacheConfigError] naming the family, the
    first such layer and its kind.
    """
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        kinds = list(get_layer_types_and_kwargs(config)[0])
    except Exception:  # noqa: BLE001 - an older transformers, or a config it cannot read
        kinds = list(getattr(config, "layer_types", None) or ())
    # Older hybrid configs name their layers' kinds here instead (Jamba, Zamba).
    kinds = kinds or [str(kind) for kind in getattr(config, "layers_block_type", None) or ()]
    other = [
        (index, kind)
        for index, kind in enumerate(kinds)
        if kind not in ATTENTION_LAYERS and kind != "attention"
    ]
    if other:
        index, kind = other[0]
        raise CacheConfigError(
            f"{what} has layers that are not attention layers safelens can cache: layer "
            f"{index} is {kind!r} ({len(other)} such layers), which keeps "
            f"{_KEEPS.get(kind, 'a state other than keys and values')}; safelens' cache "
            "holds the keys and values every layer stores and attends "
            f"({', '.join(sorted(ATTENTION_LAYERS))}). Run this model without a safelens cache"
        )


def _key_and_value_sizes(config: Any) -> tuple[int, int] | None:
    """A config's key and value head sizes where it names them apart (latent attention)."""
    value = getattr(config, "v_head_dim", None)
    key = getattr(config, "qk_head_dim", None) or (
        (getattr(config, "qk_nope_head_dim", None) or 0)
        + (getattr(config, "qk_rope_head_dim", None) or 0)
    )
    if isinstance(value, int) and isinstance(key, int) and key:
        return key, value
    return None


def _layers_of_each(values: list[Any]) -> str:
    """`values` (one per layer) as `8 (layers 0, 1), 512 (layer 2)`, a few layers each."""
    layers: dict[str, list[int]] = {}
    for index, value in enumerate(values):
        layers.setdefault(repr(value), []).append(index)
    parts = []
    for value, indices in layers.items():
        shown = ", ".join(map(str, indices[:4])) + (", …" if len(indices) > 4 else "")
        parts.append(f"{value} (layer{'s' if len(indices) > 1 else ''} {shown})")
    return ", ".join(parts)


def _check_one_config_for_every_layer(config: Any, what: str) -> None:
    """Refuse a config that sets attributes per layer (transformers' heterogeneous configs).

    Gemma 4's global-attention layers have another head size than its sliding ones; such
    a config raises when its per-layer attributes are read once for the model, which
    safelens' caches and sweeps do.
    """
    if not getattr(config, "is_heterogeneous", False):
        return
    spec = getattr(config, "_heterogeneity_spec", None)
    names = sorted(getattr(spec, "per_layer_attributes", None) or ())
    layers = list(config.per_layer_config)
    varying = []
    for name in names:
        values = [getattr(layer, name, None) for layer in layers]
        if len({repr(value) for value in values}) > 1:
            varying.append(f"{name} {_layers_of_each(values)}")
    shown = "; ".join(varying) if varying else ", ".join(names)
    raise CacheConfigError(
        f"{what} sets attributes per layer ({shown}): safelens reads one value of each "
        "for the whole model, and its caches hold keys and values of one head size. Run "
        "this model without a safelens cache"
    )


def check_cacheable(config: Any, what: str) -> None:
    """Refuse a model (`what`, its text `config`) whose cache safelens cannot hold.

    Its layers must all store keys and values (`_check_attention_layers`), with one
    config for every layer (not Gemma 4's, which gives its global layers another head
    size: `_check_one_config_for_every_layer`), of one head size: multi-head latent
    attention (DeepSeek-V2/V3, MiniCPM3, Kimi, Mistral 4: `kv_lora_rank`) stores keys of
    `qk_nope_head_dim + qk_rope_head_dim` and values of `v_head_dim` per head.

    **Raises:** [`CacheConfigError`][safelens.CacheConfigError] naming what does not fit.
    """
    _check_attention_layers(config, what)
    _check_one_config_for_every_layer(config, what)
    sizes = _key_and_value_sizes(config)
    if getattr(config, "kv_lora_rank", None) is not None or (sizes and sizes[0] != sizes[1]):
        shown = f"keys of {sizes[0]} and values of {sizes[1]} per head" if sizes else "a latent"
        raise CacheConfigError(
            f"{what} uses multi-head latent attention ({shown}; kv_lora_rank="
            f"{getattr(config, 'kv_lora_rank', None)}): safelens' caches hold keys and "
            "values of one head size. Run this model without a safelens cache"
        )
