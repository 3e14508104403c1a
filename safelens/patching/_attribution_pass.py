"""Attribution patching's corrupted run: the activations and metric gradients at each site.

Attribution reads an activation where the exact sweeps patch it, on each model family:

| family | sites read | clean cache |
| --- | --- | --- |
| `HookedTransformer`, TransformerBridge | TransformerLens' hook points `blocks.{l}.…` (`get_act_name`): `attn.hook_{q,k,v,z}` `[batch, pos, heads, d_head]`, `attn.hook_pattern` `[batch, n_heads, dest_pos, src_pos]`, `hook_{resid_pre,resid_mid,attn_out,mlp_out}` `[batch, pos, d_model]` | `model.run_with_cache(clean_tokens)` |
| plain HuggingFace model | the sweeps' sites (`safelens.patching._hf_sites`): keys and values at the cache's `hook_k_new` / `hook_v_new`, head-major and keys after the rotary embedding; queries, scores and patterns at the attention function, head-major; `z` the output projection's input; `resid_pre`, `resid_mid` the inputs of the decoder layer and of the norm before the MLP; `attn_out`, `mlp_out` the modules' outputs | [`run_with_patching_cache`][safelens.run_with_patching_cache] |

A first-order estimate of a key or query patch at one position is the same on either
side of the rotary embedding: the rotation of a position is a fixed linear map `R`, and
`grad_k · Δk = (Rᵀ grad_rot) · Δk = grad_rot · (R Δk)`.

The pass is one forward through a fresh safelens cache, whose hooks keep each tensor
they see and hand that very tensor on, and one `torch.autograd.grad` of the metric with
respect to those tensors (no parameter gradients are computed). The first layer's input
is made a leaf, so that a graph exists when the parameters are frozen.

Caveat: the backward pass keeps the corrupted run's graph, about one training step's
activation memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..backends._backend import Backend
from ..core._errors import PatchingError
from ..core._thread_hooks import thread_hooks
from ._hf_sites import site_edits

__all__ = ["Read", "Reads", "corrupted_pass"]


@dataclass(frozen=True)
class Read:
    """One tensor of one layer the corrupted pass keeps, and whether its gradient is wanted."""

    key: tuple[str, int]  # (activation or QK role, layer)
    hook: str | None  # the hook that sees it; `None`: the HuggingFace seam of `seam`
    grad: bool
    seam: str


@dataclass
class Reads:
    """What the corrupted pass kept: the metric, activations and gradients by `Read.key`."""

    value: torch.Tensor
    acts: dict[tuple[str, int], torch.Tensor]
    grads: dict[tuple[str, int], torch.Tensor]


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

    # Under `torch.inference_mode()` too: gradients need it off, and an inference tensor
    # (tokens made under it) cannot be saved for the backward pass, so a copy runs.
    with torch.inference_mode(False), torch.enable_grad():
        tokens = tokens.clone() if tokens.is_inference() else tokens
        logits = _logits(backend, tokens, [(read, keep(read.key)) for read in reads])
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
            what = missing[0].hook or f"the {missing[0].seam} of layer {missing[0].key[1]}"
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


Hooked = list[tuple[Read, Callable[..., torch.Tensor]]]


def _logits(backend: Backend, tokens: torch.Tensor, hooked: Hooked) -> torch.Tensor:
    """The corrupted logits through a fresh cache, with `hooked` on this thread's pass."""
    model = backend.model
    cache = backend.empty_cache(tokens.shape[0])
    named = [(read.hook, fn) for read, fn in hooked if read.hook is not None]
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
    kept: dict[str, dict[int, list[Callable[..., torch.Tensor]]]] = {}
    for read, fn in hooked:
        if read.hook is None:
            kept.setdefault(read.seam, {}).setdefault(read.key[1], []).append(fn)
    seams = {
        seam: {layer: _own(seam, fns) for layer, fns in by_layer.items()}
        for seam, by_layer in kept.items()
    }
    inputs = seams.setdefault("resid_pre", {})
    inputs[0] = _leaf_first(inputs.get(0))
    with site_edits(backend, seams), backend.pass_hooks(cache, named):
        return backend.forward(tokens, backend.default_mask(tokens), cache)


def _own(
    seam: str, keep: list[Callable[..., torch.Tensor]]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The `keep` hooks of one HuggingFace seam, handing on a tensor the pass then uses.

    A seam may show a view of what the pass computes with (`z`: the output projection's
    input split into heads), used on only when an edit returns another tensor, so each
    gets a view of its own; `resid_mid` is the residual stream itself, edited in place,
    kept as it is.
    """

    def edit(tensor: torch.Tensor) -> torch.Tensor:
        if seam != "resid_mid":
            tensor = tensor.view_as(tensor)
        for fn in keep:
            tensor = fn(tensor)
        return tensor

    return edit


def _leaf_first(
    keep: Callable[[torch.Tensor], torch.Tensor] | None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The first decoder layer's input made a leaf (a graph with frozen parameters), kept."""

    def first(hidden: torch.Tensor) -> torch.Tensor:
        leaf = _leaf(hidden)
        return leaf if keep is None else keep(leaf)

    return first


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
