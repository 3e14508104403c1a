"""Where a sweep patches on a TransformerBridge or a HuggingFace model, and the clean cache.

A site is one activation of every layer: the hook a patched pass edits, the clean
tensor patched in, and the layout both share. Keys and values are patched at the
cache seam (`cache.update`, the `hook_k_new` / `hook_v_new` cache hook points), head-
major `[batch, n_kv_heads, pos, d_head]`, keys *after* the rotary embedding.
TransformerLens patches `attn.hook_k`, before it; for a patch at one position the two
are the same patch, because the rotation of a position is a fixed linear map of that
position's key (the clean and the corrupted run give a position the same rotary angle:
prompts of one length, positions counted alike).

| `activation` | TransformerBridge: hook (clean cache name) | HuggingFace model: hook (clean cache name) |
| --- | --- | --- |
| `k` | `blocks.{l}.kv_cache.hook_k_new` (`blocks.{l}.attn.hook_rot_k`; `attn.hook_k` without rotary) | `model.layers.{l}.kv_cache.hook_k_new` (the same) |
| `v` | `blocks.{l}.kv_cache.hook_v_new` (`blocks.{l}.attn.hook_v`) | `model.layers.{l}.kv_cache.hook_v_new` (the same) |
| `q`, `z` | `blocks.{l}.attn.hook_q`, `hook_z` | none: HuggingFace attention computes them inside one call |
| `pattern` | `blocks.{l}.attn.hook_pattern` `[batch, n_heads, dest_pos, src_pos]` | none, as for `q` and `z` |
| `resid_pre` | `blocks.{l}.hook_resid_pre` | the decoder layer's input (`blocks.{l}.hook_resid_pre`) |
| `resid_mid` | `blocks.{l}.hook_resid_mid` | none |
| `attn_out` | `blocks.{l}.hook_attn_out` | the attention module's output (`blocks.{l}.hook_attn_out`) |
| `mlp_out` | `blocks.{l}.hook_mlp_out` | the MLP module's output (`blocks.{l}.hook_mlp_out`) |

`clean_activation` checks a site's clean tensor against the prompt; `put` writes clean
values into the tensor a patched pass's hook sees.

On a bridge the clean cache is `bridge.run_with_cache(clean_tokens)`'s
`ActivationCache`; on a HuggingFace model it is the dict
[`run_with_patching_cache`][safelens.run_with_patching_cache] returns.

Caveat: on HuggingFace models `attn_out` and `mlp_out` are the modules' outputs, before
any norm a family applies on the way back into the residual stream (Gemma-2's
`post_attention_layernorm`, `post_feedforward_layernorm`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from ..backends._backend import Backend, NamesFilter, backend_of
from ..core._errors import PatchingError
from ..core._tokens import check_tokens
from ._clean_cache import CLEAN_CACHE_OF, shape_error

__all__ = [
    "ATTENTION_MODULES",
    "TL_NAMES",
    "TL_NAMES_ON_HF",
    "Site",
    "child_named",
    "clean_activation",
    "put",
    "run_with_patching_cache",
    "site_of",
]

# TransformerLens' names under `blocks.{layer}.` (`get_act_name`), without importing it.
TL_NAMES = {
    "resid_pre": "hook_resid_pre",
    "resid_mid": "hook_resid_mid",
    "attn_out": "hook_attn_out",
    "mlp_out": "hook_mlp_out",
    "q": "attn.hook_q",
    "k": "attn.hook_k",
    "v": "attn.hook_v",
    "z": "attn.hook_z",
    "pattern": "attn.hook_pattern",
}
# What a plain HuggingFace model can be patched at (the others need a bridge).
TL_NAMES_ON_HF = frozenset({"resid_pre", "attn_out", "mlp_out", "k", "v"})
# A decoder layer's attention module, by the names families give it (Llama and most:
# `self_attn`; GPT-2, GPT-J: `attn`; Falcon, BLOOM: `self_attention`; GPT-NeoX: `attention`).
ATTENTION_MODULES = ("self_attn", "attn", "self_attention", "attention")
_MODULES = {"attn_out": ATTENTION_MODULES, "mlp_out": ("mlp",)}


@dataclass(frozen=True)
class Site:
    """One activation of every layer: what a patched pass edits and where its clean tensor is.

    `hook(layer)` names the hook (a bridge, cache or module name; `None` for the
    decoder layer's input, patched by `residual_input`); `clean(layer)` the clean
    cache's key; the hook's tensor and the clean tensor are laid out alike, positions
    on `pos_axis` (a pattern's destination positions; its source positions follow),
    heads (if any) on `head_axis`, except that a clean tensor that is position-major
    (`transposed`: a bridge's `attn.hook_rot_k`) swaps axes 1 and 2.
    `full(layer)`, for keys and values, names the cache hook that sees every position.
    """

    activation: str
    hook: Callable[[int], str | None]
    clean: Callable[[int], str]
    pos_axis: int
    head_axis: int
    heads: int
    transposed: bool = False
    # Keys and values: the cache hook that sees every position a pass attends to
    # (`hook_k_full` / `hook_v_full`), where a patch at an earlier position still lands.
    full: Callable[[int], str] | None = None


def _decoder_layers(model: Any, n_layers: int) -> tuple[str, torch.nn.ModuleList]:
    """The name and module list of a HuggingFace model's decoder layers."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n_layers:
            return name, module
    raise PatchingError(
        f"found no list of {n_layers} decoder layers in {type(model).__name__}; the sweeps "
        "patch HuggingFace causal LMs whose layers sit in one ModuleList"
    )


def child_named(layer: torch.nn.Module, names: tuple[str, ...]) -> str | None:
    """The first of `names` that is a module of decoder layer `layer`, or `None`."""
    return next(
        (name for name in names if isinstance(getattr(layer, name, None), torch.nn.Module)), None
    )


def _module_name(backend: Backend, activation: str, layer: int) -> str:
    prefix, layers = _decoder_layers(backend.model, backend.n_layers)
    child = child_named(layers[layer], _MODULES[activation])
    if child is not None:
        return f"{prefix}.{layer}.{child}"
    raise PatchingError(
        f"decoder layer {layer} of {type(backend.model).__name__} has no "
        f"{' or '.join(_MODULES[activation])} module to patch as {activation!r}"
    )


def site_of(backend: Backend, activation: str, clean_cache: Any = None) -> Site:
    """The site of `activation` on `backend`'s model, or a `PatchingError` saying why none.

    On a bridge whose attention never fires `attn.hook_rot_k` (Phi-3's joint
    projection), so that `clean_cache` has `attn.hook_k` alone, keys are patched at
    `attn.hook_k`, before the rotary embedding, as TransformerLens patches them.
    """
    config = backend.config  # type: ignore[attr-defined]
    n_heads = int(config.num_attention_heads)
    tl = TL_NAMES[activation]
    layout = backend.caches.layout

    def tl_name(layer: int) -> str:
        return f"blocks.{layer}.{tl}"

    unrotated = not _has(clean_cache, "blocks.0.attn.hook_rot_k") and _has(
        clean_cache, "blocks.0.attn.hook_k"
    )
    if activation == "k" and backend.family == "bridge" and unrotated:
        return Site(activation, tl_name, tl_name, 1, 2, backend.n_kv_heads)
    if activation in ("k", "v"):
        point = f"hook_{activation}_new"

        def cache_name(layer: int) -> str:
            return layout.hook_name(layer, point)

        def full_name(layer: int) -> str:
            return layout.hook_name(layer, f"hook_{activation}_full")

        if backend.family != "bridge":
            return Site(
                activation, cache_name, cache_name, 2, 1, backend.n_kv_heads, full=full_name
            )
        rotary = activation == "k" and "blocks.0.attn.hook_rot_k" in backend.model.hook_dict
        name = "attn.hook_rot_k" if rotary else tl

        def clean(layer: int) -> str:
            return f"blocks.{layer}.{name}"

        return Site(activation, cache_name, clean, 2, 1, backend.n_kv_heads, True, full=full_name)
    heads = n_heads if activation in ("q", "z", "pattern") else 0
    if backend.family == "bridge":
        if activation == "pattern":  # [batch, n_heads, dest_pos, src_pos]
            return Site(activation, tl_name, tl_name, 2, 1, heads)
        return Site(activation, tl_name, tl_name, 1, 2, heads)
    if activation in _MODULES:
        _module_name(backend, activation, 0)  # a family without the module: say so first
        return Site(
            activation, lambda layer: _module_name(backend, activation, layer), tl_name, 1, 2, 0
        )
    if activation == "resid_pre":
        return Site(activation, lambda layer: None, tl_name, 1, 2, 0)
    raise PatchingError(
        f"activation {activation!r} has no hook point on a plain HuggingFace model (its "
        "attention computes queries, patterns and head outputs inside one call, and no "
        "residual stream sits between attention and MLP); sweep k, v, resid_pre, attn_out "
        "or mlp_out, or wrap the model in a TransformerLens TransformerBridge, whose hook "
        "points cover q, z, pattern and resid_mid"
    )


def _has(cache: Any, name: str) -> bool:
    """Whether `cache` (an `ActivationCache`, a dict, or `None`) holds `name`."""
    try:
        return cache is not None and name in cache.keys()
    except (AttributeError, TypeError):
        return False


def clean_activation(
    backend: Backend, site: Site, clean_cache: Any, layer: int, batch: int, length: int
) -> torch.Tensor:
    """The clean activation of `site` at `layer`, checked, in the hook's layout, `batch` rows."""
    name = site.clean(layer)
    how = CLEAN_CACHE_OF[backend.family]
    try:
        clean = clean_cache[name]
    except (KeyError, TypeError):
        raise PatchingError(
            f"clean_cache has no activation {name!r}; pass the clean cache of {how}"
        ) from None
    if not isinstance(clean, torch.Tensor):
        raise PatchingError(f"clean_cache[{name!r}] is a {type(clean).__name__}, not a tensor")
    if not clean.is_floating_point():
        raise PatchingError(
            f"clean_cache[{name!r}] holds {clean.dtype}; expected the clean run's "
            f"floating-point activations, as {how} gives them"
        )
    heads = "n_kv_heads" if site.activation in ("k", "v") else "n_heads"
    expected: tuple[int, ...]
    axes: tuple[str, ...]
    if site.activation == "pattern":
        expected, axes = (site.heads, length, length), ("n_heads", "pos", "pos")
    elif site.pos_axis == 2:
        expected, axes = (backend.n_kv_heads, length, backend.d_head), (heads, "pos", "d_head")
    elif site.heads:
        expected, axes = (length, site.heads, backend.d_head), ("pos", heads, "d_head")
    else:
        expected, axes = (length, backend.d_model), ("pos", "d_model")
    # The clean tensor's own layout: a position-major one (`transposed`) swaps axes 1, 2.
    stored, stored_axes = expected, axes
    if site.transposed:
        stored, stored_axes = (
            (expected[1], expected[0], *expected[2:]),
            (axes[1], axes[0], *axes[2:]),
        )
    if (
        clean.dim() != 1 + len(expected)
        or clean.shape[0] not in (1, batch)
        or tuple(clean.shape[1:]) != stored
    ):
        raise shape_error(name, tuple(clean.shape), stored, batch, stored_axes, how)
    if site.transposed:
        clean = clean.transpose(1, 2)
    return clean.to(backend.device).expand(batch, *expected)


def put(
    site: Site,
    tensor: torch.Tensor,
    clean: torch.Tensor,
    index: tuple[torch.Tensor, ...],
    start: int,
) -> torch.Tensor:
    """Write the clean values at `index` = (rows, clean rows, pos, head, source pos) into `tensor` (positions `start:`)."""
    rows, clean_rows, pos, head, src = index
    target: list[Any] = [slice(None)] * tensor.dim()
    source: list[Any] = [slice(None)] * clean.dim()
    target[0], source[0] = rows, clean_rows
    if pos.numel():
        target[site.pos_axis], source[site.pos_axis] = pos - start, pos
    else:  # every position: those the pass runs (the last alone, in `_passes`' last group)
        source[site.pos_axis] = slice(start, None)
    if head.numel():
        target[site.head_axis], source[site.head_axis] = head, head
    if src.numel():  # a pattern's source positions, after its destination positions
        target[site.pos_axis + 1], source[site.pos_axis + 1] = src, src
    # In place, as TransformerLens' setters: a bridge alias such as `hook_resid_mid`
    # (`ln2.hook_in`) ignores what its hook returns. Cast, as their slice assignment does.
    tensor[tuple(target)] = clean[tuple(source)].to(tensor.dtype)
    return tensor


@contextmanager
def residual_input(
    backend: Backend, hooks: Mapping[int, Callable[[torch.Tensor], torch.Tensor | None]]
) -> Iterator[None]:
    """Within the block, `hooks[layer](hidden_states)` sees (and may replace) layer `layer`'s input.

    Plain PyTorch forward pre-hooks that act in the calling thread's passes only,
    removed by their handles on exit (also on error).
    """
    if not hooks:
        yield
        return
    _, layers = _decoder_layers(backend.model, backend.n_layers)
    me = threading.get_ident()

    def pre_hook(edit: Callable[[torch.Tensor], torch.Tensor | None]) -> Any:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
            # No `kwargs`: half-registered, in another thread's pass (`core._thread_hooks`).
            if threading.get_ident() != me or kwargs is None:
                return None
            hidden = args[0] if args else kwargs["hidden_states"]
            result = edit(hidden)
            if result is None:
                return None
            if args:
                return (result, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": result}

        return hook

    handles = [
        layers[layer].register_forward_pre_hook(pre_hook(edit), with_kwargs=True)
        for layer, edit in hooks.items()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def run_with_patching_cache(
    model: Any, tokens: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run a HuggingFace causal LM once; return its logits and the clean cache of the sweeps.

    `run_with_cache`'s counterpart for plain HuggingFace models, whose modules carry no
    TransformerLens hook points: the dict holds, per layer `l`, everything the patching
    sweeps patch on such a model: `blocks.{l}.hook_resid_pre`, `blocks.{l}.hook_attn_out`
    and `blocks.{l}.hook_mlp_out` `[batch, pos, d_model]`, and the cache's
    `model.layers.{l}.kv_cache.hook_k_new` / `hook_v_new` `[batch, n_kv_heads, pos,
    d_head]` (keys after the rotary embedding). A family whose decoder layer has no
    attention module (by one of the names of `ATTENTION_MODULES`) or no `mlp` module
    (OPT computes its MLP in the layer itself) has no `hook_attn_out` or `hook_mlp_out`
    entries; the sweeps of those sites refuse it. Positions and padding as the sweeps
    use them: the attention mask from the model's tokenizer (`model.tokenizer`, left
    padding) when it has one, else every position.

    **Arguments:**

    - `model`: a HuggingFace causal LM (on a TransformerBridge, use its own
      `run_with_cache`).
    - `tokens`: `[batch, pos]` token ids of the clean prompts.

    **Returns:** `(logits, cache)`: logits `[batch, pos, d_vocab]`, and the dict above.

    **Raises:** [`TokenError`][safelens.TokenError] for tokens that are not token ids
    of this model; [`PatchingError`][safelens.PatchingError] for a TransformerBridge.

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=10))
    >>> logits, clean_cache = run_with_patching_cache(model, torch.tensor([[1, 2, 3]]))
    >>> clean_cache["model.layers.1.kv_cache.hook_k_new"].shape
    torch.Size([1, 2, 3, 4])

    ```
    """
    backend = backend_of(model, "run_with_patching_cache")
    if backend.family != "hf":
        raise PatchingError(
            "run_with_patching_cache takes a plain HuggingFace causal LM, got a "
            f"{type(model).__name__}; on a TransformerBridge the clean cache is "
            "bridge.run_with_cache(clean_tokens)[1]"
        )
    tokens = _tokens(backend, tokens, "tokens")
    captured: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(tensor: torch.Tensor, hook: Any = None) -> None:
            captured[name] = tensor.detach().clone()

        return hook

    pairs: list[tuple[NamesFilter, Callable[..., None]]] = []
    for activation in ("k", "v", "attn_out", "mlp_out"):
        try:
            site = site_of(backend, activation)
            hooks = [str(site.hook(layer)) for layer in range(backend.n_layers)]
        except PatchingError:  # a family without such a module (OPT's MLP is the layer's)
            if activation in ("k", "v"):
                raise
            continue  # its sweep says so when asked for
        pairs += [(hook, keep(site.clean(layer))) for layer, hook in enumerate(hooks)]
    inputs = {layer: keep(f"blocks.{layer}.hook_resid_pre") for layer in range(backend.n_layers)}
    cache = backend.empty_cache(tokens.shape[0])
    with torch.no_grad(), residual_input(backend, inputs), backend.pass_hooks(cache, pairs):
        logits = backend.forward(tokens, backend.default_mask(tokens), cache)
    return logits, captured


def _tokens(backend: Backend, tokens: Any, what: str) -> torch.Tensor:
    """`tokens` checked as `[batch, pos]` token ids of `backend`'s model, on its device."""
    if isinstance(tokens, torch.Tensor) and tokens.dim() == 1:
        tokens = tokens[None]
    limits = SimpleNamespace(d_vocab=backend.d_vocab, n_ctx=backend.n_ctx)
    return check_tokens(tokens, limits, what).to(backend.device)
