"""Where a sweep patches on a TransformerBridge or a HuggingFace model, and the clean cache.

A site is one activation of every layer: the hook a patched pass edits, the clean
tensor patched in, and the layout both share. Keys and values are patched at the
cache seam (`cache.update`, the `hook_k_new` / `hook_v_new` cache hook points), head-
major `[batch, n_kv_heads, pos, d_head]`, keys *after* the rotary embedding.
TransformerLens patches `attn.hook_k`, before it; for a patch at one position the two
are the same patch, because the rotation of a position is a fixed linear map of that
position's key (the clean and the corrupted run give a position the same rotary angle:
prompts of one length, positions counted alike).

| `activation` | TransformerBridge: hook (clean cache name) | HuggingFace model: where it is patched (clean cache name) |
| --- | --- | --- |
| `k` | `blocks.{l}.kv_cache.hook_k_new` (`blocks.{l}.attn.hook_rot_k`; `attn.hook_k` without rotary) | `model.layers.{l}.kv_cache.hook_k_new` (the same) |
| `v` | `blocks.{l}.kv_cache.hook_v_new` (`blocks.{l}.attn.hook_v`) | `model.layers.{l}.kv_cache.hook_v_new` (the same) |
| `q` | `blocks.{l}.attn.hook_q` | the query the attention function gets, `[batch, n_heads, pos, d_head]`, after the rotary embedding (`blocks.{l}.attn.hook_q`, stored `[batch, pos, n_heads, d_head]`) |
| `z` | `blocks.{l}.attn.hook_z` | the output projection's input as `[batch, pos, n_heads, d_head]` (`blocks.{l}.attn.hook_z`) |
| `pattern` | `blocks.{l}.attn.hook_pattern` `[batch, n_heads, dest_pos, src_pos]` | the softmax inside the attention function, computed eagerly (`blocks.{l}.attn.hook_pattern`, the same layout) |
| `attn_scores` | `blocks.{l}.attn.hook_attn_scores` | the scores the softmax takes: scaled, soft-capped, masked (`blocks.{l}.attn.hook_attn_scores`, the same layout) |
| `resid_pre` | `blocks.{l}.hook_resid_pre` | the decoder layer's input (`blocks.{l}.hook_resid_pre`) |
| `resid_mid` | `blocks.{l}.hook_resid_mid` | the input of the norm before the MLP, edited in place (`blocks.{l}.hook_resid_mid`); none in parallel-attention families |
| `resid_post` | `blocks.{l}.hook_resid_post` | the decoder layer's output (`blocks.{l}.hook_resid_post`) |
| `attn_out` | `blocks.{l}.hook_attn_out` | the attention module's output (`blocks.{l}.hook_attn_out`) |
| `mlp_out` | `blocks.{l}.hook_mlp_out` | the MLP module's output (`blocks.{l}.hook_mlp_out`) |

On a HuggingFace model the seams of `q`, `z`, `pattern`, `attn_scores`, `resid_pre` and
`resid_mid` are `safelens.backends.hf._seams`' (a `Site` whose `hook` gives `None`,
edited by [`site_edits`][safelens.patching._hf_sites.site_edits]); queries are patched
after the rotary embedding, as keys are, which at one position is the same patch as
TransformerLens' `attn.hook_q` before it. Query-head sites (`q`, `z`, `pattern`,
`attn_scores`) have `n_heads` heads, key/value sites `n_kv_heads`. The docs' table
"Patching sites" (`docs/concepts/sites.md`) says what each holds per family.

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

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from ..backends._backend import Backend, NamesFilter, backend_of
from ..backends.hf._seams import (
    ATTENTION_MODULES,
    SEAMS,
    Edit,
    child_named,
    seam_edits,
    seam_modules,
)
from ..core._errors import PatchingError
from ..core._tokens import check_tokens

__all__ = [
    "ATTENTION_MODULES",
    "SEAMS",
    "TL_NAMES",
    "Site",
    "child_named",
    "clean_activation",
    "put",
    "run_with_patching_cache",
    "site_edits",
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
    "attn_scores": "attn.hook_attn_scores",
    "resid_post": "hook_resid_post",
}
_MODULES = {"attn_out": ATTENTION_MODULES, "mlp_out": ("mlp",)}


@dataclass(frozen=True)
class Site:
    """One activation of every layer: what a patched pass edits and where its clean tensor is.

    `hook(layer)` names the hook (a bridge, cache or module name; `None` for a seam of
    a HuggingFace model, `SEAMS`, edited by `site_edits`); `clean(layer)` the clean
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


def decoder_layer(backend: Backend, layer: int) -> torch.nn.Module:
    """Decoder layer `layer` of a HuggingFace causal LM (or a bridge's plain model)."""
    return _decoder_layers(backend.model, backend.n_layers)[1][layer]


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
    heads = n_heads if activation in _QUERY_HEADS else 0
    if backend.family == "bridge":
        if activation in _PATTERNS:  # [batch, n_heads, dest_pos, src_pos]
            return Site(activation, tl_name, tl_name, 2, 1, heads)
        return Site(activation, tl_name, tl_name, 1, 2, heads)
    if activation in _MODULES:
        _module_name(backend, activation, 0)  # a family without the module: say so first
        return Site(
            activation, lambda layer: _module_name(backend, activation, layer), tl_name, 1, 2, 0
        )
    if activation == "resid_post":
        prefix, _ = _decoder_layers(backend.model, backend.n_layers)
        return Site(activation, lambda layer: f"{prefix}.{layer}", tl_name, 1, 2, 0)
    _seam_modules(backend, activation)  # a family without the seam: say why first
    if activation == "q":  # hook head-major, clean position-major as TransformerLens'
        return Site(activation, _no_hook, tl_name, 2, 1, heads, transposed=True)
    if activation in _PATTERNS:
        return Site(activation, _no_hook, tl_name, 2, 1, heads)
    return Site(activation, _no_hook, tl_name, 1, 2, heads)


# Sites whose heads are the query heads, and sites laid out as attention patterns.
_QUERY_HEADS = frozenset({"q", "z", "pattern", "attn_scores"})
_PATTERNS = frozenset({"pattern", "attn_scores"})


def _no_hook(layer: int) -> None:
    return None


def _seam_modules(backend: Backend, activation: str) -> list[torch.nn.Module]:
    """The module of every layer where `activation` (one of `SEAMS`) is edited."""
    _, layers = _decoder_layers(backend.model, backend.n_layers)
    return seam_modules(layers, backend.config, activation)  # type: ignore[attr-defined]


@contextmanager
def site_edits(backend: Backend, edits: Mapping[str, Mapping[int, Edit]]) -> Iterator[None]:
    """Within the block, `edits[activation][layer]` sees (and may edit) that seam's tensor.

    For a HuggingFace model's `SEAMS`, in the hook layout of `site_of`'s `Site`
    ([`seam_edits`][safelens.backends.hf._seams.seam_edits]).
    """
    if not any(edits.values()):
        yield
        return
    _, layers = _decoder_layers(backend.model, backend.n_layers)
    with seam_edits(layers, backend.config, edits):  # type: ignore[attr-defined]
        yield


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
    how = (
        "bridge.run_with_cache(clean_tokens)"
        if backend.family == "bridge"
        else "safelens.run_with_patching_cache(model, clean_tokens)"
    )
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
    if site.transposed:
        clean = clean.transpose(1, 2)
    expected: tuple[int, ...]
    if site.activation in _PATTERNS:
        expected = (site.heads, length, length)
    elif site.pos_axis == 2:
        expected = (site.heads, length, backend.d_head)
    elif site.heads:
        expected = (length, site.heads, backend.d_head)
    else:
        expected = (length, backend.d_model)
    if (
        clean.dim() != 1 + len(expected)
        or clean.shape[0] not in (1, batch)
        or tuple(clean.shape[1:]) != expected
    ):
        raise PatchingError(
            f"clean_cache[{name!r}] has shape {tuple(clean.shape)}; expected [batch={batch} or "
            f"1, {', '.join(map(str, expected))}] to match corrupted_tokens {(batch, length)}. "
            "Clean and corrupted prompts must have the same length"
        )
    return clean.to(layer_device(backend, layer)).expand(batch, *expected)


def put(
    site: Site,
    tensor: torch.Tensor,
    clean: torch.Tensor,
    index: tuple[torch.Tensor, ...],
    start: int,
) -> torch.Tensor:
    """Write the clean values at `index` = (rows, clean rows, pos, head, source pos) into `tensor` (positions `start:`).

    `clean` is on its layer's device; `tensor` too, except a layer's input, which a
    `device_map` model hands on from the previous layer's device (accelerate moves it).
    """
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
    values = clean[_on(source, clean.device)].to(tensor.device, tensor.dtype)
    tensor[_on(target, tensor.device)] = values
    return tensor


def _on(index: list[Any], device: torch.device) -> tuple[Any, ...]:
    """`index` with its tensors on `device` (no copy when they are there already)."""
    return tuple(part.to(device) if isinstance(part, torch.Tensor) else part for part in index)


def run_with_patching_cache(
    model: Any, tokens: torch.Tensor, *, names_filter: NamesFilter | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run a HuggingFace causal LM once; return its logits and the clean cache of the sweeps.

    `run_with_cache`'s counterpart for plain HuggingFace models, whose modules carry no
    TransformerLens hook points: the dict holds, per layer `l`, every activation the
    patching sweeps patch on such a model (the module notes' table), under
    TransformerLens' names: `blocks.{l}.hook_resid_pre`, `hook_resid_mid`,
    `hook_resid_post`, `hook_attn_out` and `hook_mlp_out` `[batch, pos, d_model]`;
    `blocks.{l}.attn.hook_q` and `hook_z` `[batch, pos, n_heads, d_head]` (queries after
    the rotary embedding); `blocks.{l}.attn.hook_pattern` and `hook_attn_scores`
    `[batch, n_heads, dest_pos, src_pos]`; and the cache's
    `model.layers.{l}.kv_cache.hook_k_new` / `hook_v_new` `[batch, n_kv_heads, pos,
    d_head]` (keys after the rotary embedding). A family without a site (no `mlp`
    module, as OPT; no residual stream between attention and MLP, as GPT-J) has no
    entries for it; the sweeps of that site say why. Positions and padding as the
    sweeps use them: the attention mask from the model's tokenizer (`model.tokenizer`,
    left padding) when it has one, else every position.

    Caveat: patterns and scores are `[batch, n_heads, pos, pos]` per layer, and while
    either is kept every layer's attention is computed eagerly (the logits then differ
    from the model's own attention by float rounding); `names_filter` keeps only what a
    sweep needs.

    **Arguments:**

    - `model`: a HuggingFace causal LM (on a TransformerBridge, use its own
      `run_with_cache`).
    - `tokens`: `[batch, pos]` token ids of the clean prompts.
    - `names_filter`: which names to keep, as in `run_with_cache`: a name, a list of
      names, or a function `fn(name) -> bool`; `None` keeps every one.

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
    >>> clean_cache["blocks.0.attn.hook_pattern"].shape
    torch.Size([1, 4, 3, 3])

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
    wanted = _names_filter(names_filter)
    captured: dict[str, torch.Tensor] = {}

    def keep(name: str, transposed: bool) -> Callable[..., None]:
        def hook(tensor: torch.Tensor, hook: Any = None) -> None:
            captured[name] = (tensor.transpose(1, 2) if transposed else tensor).detach().clone()

        return hook

    pairs: list[tuple[NamesFilter, Callable[..., None]]] = []
    seams: dict[str, dict[int, Edit]] = {}
    for activation in TL_NAMES:
        try:
            site = site_of(backend, activation)
            hooks = [site.hook(layer) for layer in range(backend.n_layers)]
        except PatchingError:  # a family without the site: its sweep says so when asked
            if activation in ("k", "v"):
                raise
            continue
        for layer, hook in enumerate(hooks):
            name = site.clean(layer)
            if not wanted(name):
                continue
            if hook is None:
                seams.setdefault(activation, {})[layer] = keep(name, site.transposed)
            else:
                pairs.append((hook, keep(name, site.transposed)))
    cache = backend.empty_cache(tokens.shape[0])
    with torch.no_grad(), site_edits(backend, seams), backend.pass_hooks(cache, pairs):
        logits = backend.forward(tokens, backend.default_mask(tokens), cache)
    return logits, captured


def _names_filter(names: NamesFilter | None) -> Callable[[str], bool]:
    """`names_filter` as a predicate, or a `PatchingError` for one of another kind."""
    if names is None:
        return lambda name: True
    if callable(names):
        return names
    listed = {names} if isinstance(names, str) else set(names)
    if not all(isinstance(name, str) for name in listed):
        raise PatchingError(
            f"names_filter must be a name, a list of names or a function fn(name) -> bool, "
            f"got {names!r}"
        )
    return listed.__contains__


def _tokens(backend: Backend, tokens: Any, what: str) -> torch.Tensor:
    """`tokens` checked as `[batch, pos]` token ids of `backend`'s model, on its device."""
    if isinstance(tokens, torch.Tensor) and tokens.dim() == 1:
        tokens = tokens[None]
    limits = SimpleNamespace(d_vocab=backend.d_vocab, n_ctx=backend.n_ctx)
    return check_tokens(tokens, limits, what).to(backend.device)
