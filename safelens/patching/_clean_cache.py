"""A sweep's clean cache, checked against the model and the corrupted prompt.

Every patching function (the `get_act_patch_*` sweeps, their `*_every` bundles,
`generic_activation_patch`, `attribution_patch`) reads the clean run's activations from
`clean_cache`, by hook name, on every backend. `check_clean_cache` refuses, before any
pass runs, what cannot be the clean run of this model: something that is not a cache
of activations by hook name (`None`, a string, a list), a cache of another number of
layers than the model has, or a residual stream of another width. `shape_error` says, for a clean
activation of the wrong shape, which size differs and what that means: another prompt
length (pad clean and corrupted prompts to one length), another batch, or another model
(its `d_model`, heads or `d_head`).

`clean_activation` reads one layer's clean tensor at a sweep's site (`Backend.patch_site`)
and checks it against the prompt, on every family; `sweep_tokens` checks the corrupted
tokens against the model (the ids it embeds, its context).

Caveat: a cache of a model with the same sizes cannot be told apart from this model's:
only sizes are checked, not where the activations came from.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import torch

from ..backends._backend import Backend
from ..backends._sites import PATTERNS, Site, tl_heads
from ..core._errors import PatchingError
from ..core._tokens import check_tokens
from ..experiments._prefix import token_limits

__all__ = [
    "ModelSizes",
    "axes_of",
    "backend_sizes",
    "check_clean_cache",
    "clean_activation",
    "clean_tensors",
    "named_inputs",
    "shape_error",
    "sweep_tokens",
]

# The axes after `batch` of the activations a clean cache holds, by the hook name after
# the layer: TransformerLens' names (`ActivationCache`, a bridge's, the HuggingFace dict
# of `run_with_patching_cache`) and `HFKeyValueCache`'s hook points (head-major).
_AXES = {
    "hook_resid_pre": ("pos", "d_model"),
    "hook_resid_mid": ("pos", "d_model"),
    "hook_resid_post": ("pos", "d_model"),
    "hook_attn_out": ("pos", "d_model"),
    "hook_mlp_out": ("pos", "d_model"),
    "attn.hook_q": ("pos", "n_heads", "d_head"),
    "attn.hook_rot_q": ("pos", "n_heads", "d_head"),
    "attn.hook_z": ("pos", "n_heads", "d_head"),
    "attn.hook_k": ("pos", "n_kv_heads", "d_head"),
    "attn.hook_rot_k": ("pos", "n_kv_heads", "d_head"),
    "attn.hook_v": ("pos", "n_kv_heads", "d_head"),
    "attn.hook_pattern": ("n_heads", "pos", "pos"),
    "attn.hook_attn_scores": ("n_heads", "pos", "pos"),
    "kv_cache.hook_k_new": ("n_kv_heads", "pos", "d_head"),
    "kv_cache.hook_v_new": ("n_kv_heads", "pos", "d_head"),
}
# The layer of a hook name: `blocks.{layer}.…` or `model.layers.{layer}.…`.
_LAYER = re.compile(r"(?:^|\.)(?:blocks|layers)\.(\d+)\.(.+)$")


class ModelSizes(NamedTuple):
    """The sizes of the model a clean cache must come from.

    `n_kv_heads` counts the heads that `attn.hook_k` / `hook_v` hold (the query heads
    on a model without grouped-query attention, or with it ungrouped).
    """

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int


def backend_sizes(backend: Backend) -> ModelSizes:
    """The sizes of `backend`'s model: query heads as `tl_heads` counts them."""
    n_heads = tl_heads(backend, "q")
    return ModelSizes(
        backend.n_layers, backend.d_model, n_heads, backend.n_kv_heads, backend.d_head
    )


def axes_of(name: str) -> tuple[str, ...] | None:
    """The axes after `batch` of hook `name`'s activation, or `None` if not known here.

    ```python
    >>> axes_of("blocks.3.attn.hook_k"), axes_of("blocks.0.mlp.hook_post")
    (('pos', 'n_kv_heads', 'd_head'), None)

    ```
    """
    match = _LAYER.search(name)
    return _AXES.get(match.group(2)) if match else None


def check_clean_cache(clean_cache: Any, sizes: ModelSizes, how: str) -> None:
    """A `PatchingError` unless `clean_cache` can be the clean run of a model of `sizes`.

    **Arguments:**

    - `clean_cache`: what the user passed as the clean cache.
    - `sizes`: the model's sizes.
    - `how`: the call that makes a clean cache of this model, for the message.

    **Raises:** [`PatchingError`][safelens.PatchingError] naming `clean_cache` for
    something that is not activations by hook name, one that holds activations of
    another number of layers than the model has, or a residual stream of another
    `d_model`.
    """
    if not callable(getattr(clean_cache, "keys", None)) or not hasattr(clean_cache, "__getitem__"):
        raise PatchingError(
            f"clean_cache must be the clean run's activations by hook name (an "
            f"ActivationCache or a dict of tensors, as {how} gives them), got "
            f"{type(clean_cache).__name__}"
        )
    layers: dict[int, list[str]] = {}
    for name in map(str, clean_cache.keys()):
        match = _LAYER.search(name)
        if match:
            layers.setdefault(int(match.group(1)), []).append(name)
    if not layers:
        return
    held = max(layers) + 1
    if held != sizes.n_layers:
        fewer = (
            " (or keeps only some layers: pass the whole cache, without a names_filter)"
            if held < sizes.n_layers
            else ""
        )
        raise PatchingError(
            f"clean_cache holds activations of {held} layers ({layers[held - 1][0]!r} "
            f"among them); this model has {sizes.n_layers}, so the clean cache comes from "
            f"another model{fewer}. Run the clean prompt through this model: {how}"
        )
    for name in layers[min(layers)]:
        axes, shape = axes_of(name), getattr(clean_cache[name], "shape", None)
        if axes is None or shape is None or len(shape) != 1 + len(axes):
            continue
        differ = [
            (axis, got)
            for axis, got in zip(axes, shape[1:], strict=True)
            if axis != "pos" and got != getattr(sizes, axis)
        ]
        if differ:
            names = [axis for axis, _ in differ]
            raise PatchingError(
                f"clean_cache[{name!r}] has shape {tuple(shape)} [batch, {', '.join(axes)}]: "
                + _another_model([got for _, got in differ], names, sizes._asdict(), how)
            )


def _another_model(got: list[int], axes: list[str], sizes: dict[str, int], how: str) -> str:
    """The end of the message for a clean cache whose `axes` hold `got`, not the model's `sizes`."""
    held = ", ".join(f"{axis} {size}" for axis, size in zip(axes, got, strict=True))
    own = ", ".join(f"{axis} {sizes[axis]}" for axis in axes)
    return (
        f"the clean cache has {held} where this model has {own}, so it comes from another "
        f"model. Run the clean prompt through this model: {how}"
    )


def shape_error(
    name: str,
    shape: tuple[int, ...],
    expected: tuple[int, ...],
    batch: int,
    axes: tuple[str, ...] | None,
    how: str,
) -> PatchingError:
    """The error for clean activation `name` of `shape` where `[batch or 1, *expected]` fits.

    `axes` names the axes after `batch` (`axes_of`), or `None` when unknown; the message
    says which sizes differ and why that may be.

    ```python
    >>> print(shape_error("blocks.0.attn.hook_k", (1, 6, 8, 8), (6, 4, 16), 1,
    ...     axes_of("blocks.0.attn.hook_k"), "model.run_with_cache(clean_tokens)"))
    clean_cache['blocks.0.attn.hook_k'] has shape (1, 6, 8, 8); expected [batch=1,
    6, 4, 16] to match corrupted_tokens and the model: the clean cache has n_kv_heads 8,
    d_head 8 where this model has n_kv_heads 4, d_head 16, so it comes from another model.
    Run the clean prompt through this model: model.run_with_cache(clean_tokens)

    ```
    """
    start = (
        f"clean_cache[{name!r}] has shape {shape}; expected [batch={batch}{' or 1' * (batch > 1)}, "
        f"{', '.join(map(str, expected))}] to match corrupted_tokens and the model"
    )
    if len(shape) != 1 + len(expected) or axes is None or len(axes) != len(expected):
        return PatchingError(f"{start}: pass the clean cache of {how}")
    differ = [
        i for i, (got, want) in enumerate(zip(shape[1:], expected, strict=True)) if got != want
    ]
    model_axes = [i for i in differ if axes[i] != "pos"]
    if model_axes:
        own = {axes[i]: expected[i] for i in model_axes}
        held = [shape[1 + i] for i in model_axes]
        return PatchingError(f"{start}: " + _another_model(held, list(own), own, how))
    if differ:
        length = expected[differ[0]]
        return PatchingError(
            f"{start}: the clean prompt has {shape[1 + differ[0]]} positions and the "
            f"corrupted one {length}. Clean and corrupted prompts must have the same length: "
            "pad them to one length"
        )
    rows = f"1 (one clean prompt for every corrupted row) or {batch} (one per row)"
    return PatchingError(
        f"{start}: the clean cache has batch {shape[0]}; pass a clean cache of batch "
        f"{rows if batch > 1 else 1}"
    )


def clean_activation(
    backend: Backend, site: Site, clean_cache: Any, layer: int, batch: int, length: int
) -> torch.Tensor:
    """The clean activation of `site` at `layer`, checked, in the hook's layout, `batch` rows."""
    name = site.clean(layer)
    how = backend.clean_cache_call
    try:
        clean = clean_cache[name]
    except (KeyError, TypeError):
        raise PatchingError(
            f"clean_cache has no activation {name!r}; pass the clean cache of {how}, "
            "without a names_filter that leaves it out"
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
    if site.activation in PATTERNS:
        expected, axes = (site.heads, length, length), ("n_heads", "pos", "pos")
    elif site.pos_axis == 2:
        expected, axes = (site.heads, length, backend.d_head), (heads, "pos", "d_head")
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
    return clean.to(backend.layer_device(layer)).expand(batch, *expected)


def clean_tensors(
    backend: Backend, site: Site, clean_cache: Any, batch: int, length: int
) -> list[torch.Tensor]:
    """`clean_activation` of every layer: the clean tensors a sweep of `site` writes."""
    return [
        clean_activation(backend, site, clean_cache, layer, batch, length)
        for layer in range(backend.n_layers)
    ]


def sweep_tokens(backend: Backend, tokens: Any, what: str) -> torch.Tensor:
    """`tokens` checked as `[batch, pos]` token ids of `backend`'s model, on its device."""
    if isinstance(tokens, torch.Tensor) and tokens.dim() == 1:
        tokens = tokens[None]
    return check_tokens(tokens, token_limits(backend), what).to(backend.device)


def named_inputs(
    backend: Backend, corrupted_tokens: Any, clean_cache: Any, activation: str
) -> tuple[Site, torch.Tensor, list[torch.Tensor]]:
    """A named sweep's checked inputs on any family: `(site, tokens, clean)`.

    The adapter's site of `activation` (`Backend.patch_site`, which says why a family
    lacks one), the corrupted tokens (`sweep_tokens`), and each layer's clean tensor at
    the site (`clean_tensors`), after `clean_cache` is checked against the model.
    """
    site = backend.patch_site(activation, clean_cache)
    tokens = sweep_tokens(backend, corrupted_tokens, "corrupted_tokens")
    check_clean_cache(clean_cache, backend_sizes(backend), backend.clean_cache_call)
    return site, tokens, clean_tensors(backend, site, clean_cache, *tokens.shape)
