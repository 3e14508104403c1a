"""Attribution patching's corrupted run: the activations and metric gradients at each site.

Attribution reads an activation where the exact sweeps patch it, on each model family:

| family | sites read | clean cache |
| --- | --- | --- |
| `HookedTransformer`, TransformerBridge | TransformerLens' hook points `blocks.{l}.…` (`get_act_name`): `attn.hook_{q,k,v,z}` `[batch, pos, heads, d_head]`, `attn.hook_pattern` `[batch, n_heads, dest_pos, src_pos]`, `hook_{resid_pre,resid_mid,attn_out,mlp_out}` `[batch, pos, d_model]` | `model.run_with_cache(clean_tokens)` |
| plain HuggingFace model | the sweeps' seams (`safelens.patching._hf_sites`): keys and values at the cache's `hook_k_new` / `hook_v_new`, head-major and keys after the rotary embedding; `resid_pre` the decoder layer's input; `attn_out`, `mlp_out` the modules' outputs | [`run_with_patching_cache`][safelens.run_with_patching_cache] |

A first-order estimate of a key patch at one position is the same on either side of the
rotary embedding: the rotation of a position is a fixed linear map `R`, and
`grad_k · Δk = (Rᵀ grad_rot) · Δk = grad_rot · (R Δk)`.

The pass is one forward through a fresh safelens cache, whose hooks keep each tensor
they see and hand that very tensor on, and one `torch.autograd.grad` of the metric with
respect to those tensors (no parameter gradients are computed). The first layer's input
is made a leaf, so that a graph exists when the parameters are frozen.

Caveat: the backward pass keeps the corrupted run's graph, about one training step's
activation memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..backends._backend import Backend
from ..backends.hf._seams import input_edits
from ..core._errors import PatchingError
from ..core._thread_hooks import thread_hooks
from ._hf_sites import TL_NAMES, Site, decoder_layer, site_of

__all__ = ["Read", "Reads", "corrupted_pass", "qk_reads", "site_for"]


@dataclass(frozen=True)
class Read:
    """One tensor of one layer the corrupted pass keeps, and whether its gradient is wanted."""

    key: tuple[str, int]  # (activation or QK role, layer)
    hook: str | None  # the hook that sees it; `None`: a HuggingFace decoder layer's input
    grad: bool


@dataclass
class Reads:
    """What the corrupted pass kept: the metric, activations and gradients by `Read.key`."""

    value: torch.Tensor
    acts: dict[tuple[str, int], torch.Tensor]
    grads: dict[tuple[str, int], torch.Tensor]


def _tl_site(activation: str, heads: int, name: str | None = None) -> Site:
    """A site at TransformerLens' hook point `blocks.{layer}.{name}` (position-major)."""
    suffix = name or TL_NAMES[activation]

    def hook(layer: int) -> str:
        return f"blocks.{layer}.{suffix}"

    if activation == "pattern" or activation == "scores":
        return Site(activation, hook, hook, 2, 1, heads)
    return Site(activation, hook, hook, 1, 2, heads)


def _heads(backend: Backend, activation: str) -> int:
    if activation in ("k", "v"):
        return backend.n_kv_heads
    if activation in ("q", "z", "pattern"):
        config = getattr(backend.model, "cfg", None) or backend.config  # type: ignore[attr-defined]
        return int(getattr(config, "n_heads", None) or config.num_attention_heads)
    return 0


def site_for(backend: Backend, activation: str, clean_cache: Any) -> Site:
    """Where attribution reads `activation` on `backend` (module notes), or a `PatchingError`."""
    if backend.family == "hf":
        return site_of(backend, activation, clean_cache)
    return _tl_site(activation, _heads(backend, activation))


def qk_reads(backend: Backend) -> dict[str, Site]:
    """The QK fix's sites by role, or a `PatchingError` where the family has none.

    Roles: `qk_q`, `qk_k` the queries and keys attention scores (after the rotary
    embedding), `scores` its scores before the softmax, `pattern` its pattern.
    """
    if backend.family == "hf":
        raise PatchingError(
            "the QK fix recomputes attention from queries, keys and scores, which a plain "
            f"HuggingFace model ({type(backend.model).__name__}) does not expose to the "
            "sweeps yet; pass qk_fix=False for plain gradient estimates of k (values, "
            "resid_pre, attn_out and mlp_out need no fix), or wrap the model in a "
            "TransformerBridge"
        )
    heads = _heads(backend, "q")
    rotary = "blocks.0.attn.hook_rot_q" in backend.model.hook_dict
    q, k = ("attn.hook_rot_q", "attn.hook_rot_k") if rotary else ("attn.hook_q", "attn.hook_k")
    return {
        "qk_q": _tl_site("q", heads, q),
        "qk_k": _tl_site("k", backend.n_kv_heads, k),
        "scores": _tl_site("scores", heads, "attn.hook_attn_scores"),
        "pattern": _tl_site("pattern", heads),
    }


def corrupted_pass(
    backend: Backend,
    tokens: torch.Tensor,
    reads: list[Read],
    metric: Callable[[torch.Tensor], Any],
    rows: int | None = None,
) -> Reads:
    """Run the corrupted `tokens` keeping `reads`; differentiate `metric(logits).sum()`.

    `metric` returns one value (`rows=None`, `attribution_patch`) or one per row of the
    batch (`rows`, `attribution_patch_dataset`), each row's gradient then its own.
    """
    kept: dict[tuple[str, int], torch.Tensor] = {}

    def keep(key: tuple[str, int]) -> Callable[..., torch.Tensor]:
        # Returned, so that what follows is computed from this very tensor: a bridge
        # hands its hooks a converted copy (heads split out), used on only when returned.
        def hook(tensor: torch.Tensor, hook: Any = None) -> torch.Tensor:
            kept[key] = tensor
            return tensor

        return hook

    with torch.enable_grad():
        logits = _logits(backend, tokens, [(read.hook, read.key, keep(read.key)) for read in reads])
        value = metric(logits)
        _check_value(value, tuple(logits.shape), rows)
        if not value.requires_grad:
            raise PatchingError(
                "patching_metric's value does not depend differentiably on the logits (it "
                "has no gradient); attribution patching differentiates it, so compute it with "
                "torch operations on the logits, without .item(), argmax or detach()"
            )
        missing = [read for read in reads if read.key not in kept]
        if missing:
            what = missing[0].hook or f"the input of decoder layer {missing[0].key[1]}"
            raise PatchingError(
                f"the corrupted run fired no {what} (of {len(missing)} hook points "
                f"attribution_patch reads), so this {type(backend.model).__name__}'s attention "
                "does not expose it; pass activations without it, or qk_fix=False"
            )
        wanted = [read.key for read in reads if read.grad and kept[read.key].requires_grad]
        grads = torch.autograd.grad(value.sum(), [kept[key] for key in wanted], allow_unused=True)
    gradients = {
        key: torch.zeros_like(kept[key]) if grad is None else grad
        for key, grad in zip(wanted, grads, strict=True)
    }
    for read in reads:
        if read.grad and read.key not in gradients:  # no path to the metric
            gradients[read.key] = torch.zeros_like(kept[read.key])
    acts = {key: tensor.detach() for key, tensor in kept.items()}
    return Reads(value.detach(), acts, gradients)


Hooked = list[tuple[str | None, tuple[str, int], Callable[..., torch.Tensor]]]


def _logits(backend: Backend, tokens: torch.Tensor, hooked: Hooked) -> torch.Tensor:
    """The corrupted logits through a fresh cache, with `hooked` on this thread's pass."""
    model = backend.model
    cache = backend.empty_cache(tokens.shape[0])
    named = [(hook, fn) for hook, _, fn in hooked if hook is not None]
    if backend.family == "hooked":
        from ._grid import _attention_mask_of

        points = [(model.hook_dict[name], fn) for name, fn in named]
        full = _attention_mask_of(model, tokens)
        mask = torch.ones_like(tokens) if full is None else full
        with thread_hooks(points):
            embedded = model(tokens, attention_mask=mask, stop_at_layer=0)
            embedded = embedded.detach().requires_grad_()
            return model(embedded, start_at_layer=0, past_kv_cache=cache, attention_mask=mask)  # type: ignore[no-any-return]
    if backend.family == "bridge":
        # As the sweeps and `bridge(tokens)`: every position attended.
        mask = torch.ones_like(tokens)
        if "hook_embed" in model.hook_dict:
            named = [("hook_embed", _leaf), *named]
        with backend.pass_hooks(cache, named):
            return backend.forward(tokens, mask, cache)
    inputs = {key[1]: fn for hook, key, fn in hooked if hook is None}
    with _layer_inputs(backend, inputs), backend.pass_hooks(cache, named):
        return backend.forward(tokens, backend.default_mask(tokens), cache)


@contextmanager
def _layer_inputs(backend: Backend, keep: dict[int, Callable[..., torch.Tensor]]) -> Iterator[None]:
    """The first decoder layer's input made a leaf; `keep[layer]` sees layer `layer`'s input."""

    def first(hidden: torch.Tensor) -> torch.Tensor:
        leaf = _leaf(hidden)
        return keep[0](leaf) if 0 in keep else leaf

    edits = {**keep, 0: first}
    with input_edits({decoder_layer(backend, layer): edit for layer, edit in edits.items()}):
        yield


def _leaf(tensor: torch.Tensor, hook: Any = None) -> torch.Tensor:
    return tensor.detach().requires_grad_()


def _check_value(value: Any, logits_shape: tuple[int, ...], rows: int | None) -> None:
    """Refuse a metric value that is not one value (`rows=None`) or one per row."""
    expected = 1 if rows is None else rows
    if not isinstance(value, torch.Tensor) or value.numel() != expected:
        got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else value
        wanted = (
            "one differentiable value for the run (a scalar, or a batched metric's [1])"
            if rows is None
            else f"one differentiable value per pair, [{rows}]"
        )
        raise PatchingError(
            f"patching_metric returned {got} for the corrupted logits {logits_shape}; "
            f"attribution needs {wanted}"
        )
