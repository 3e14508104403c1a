"""`generic_activation_patch` on a TransformerBridge or a HuggingFace model: any setter, many runs per pass.

TransformerLens' `generic_activation_patch` runs one forward per index, with the hook
`get_act_name(activation_name, layer)` calling `patch_setter(corrupted_activation,
index, clean_activation)`. safelens runs the same setter many indices per pass through
`safelens.patching._hf_sweeps`: each index's run holds `batch` rows of the pass, its
setter gets those rows, and every run starts at the layer of its index (the corrupted
run's residual stream entering it). A setter may change any position, so every run
runs every position; a metric that reads only the last position still gets that
position alone.

On a TransformerBridge the setter runs on the bridge's own hook points (so it sees what
it sees under TransformerLens, keys before the rotary embedding included);
`activation_name` must name a hook point inside every block (`blocks.{layer}.…`); a
bridge whose attention ignores what `hook_pattern` returns is refused for patterns, as
the pattern sweeps refuse it (`safelens.patching._pattern_hook`). On a plain HuggingFace
model it runs at the site its adapter declares (`safelens.backends.hf._sites`) for the
activation `get_act_name` names (`q`, `k`, `v`, `z`, `pattern`, `attn_scores`,
`resid_pre`, `resid_mid`, `resid_post`, `attn_out`, `mlp_out`), with the clean
activation from [`run_with_patching_cache`][safelens.run_with_patching_cache]; both
tensors the setter gets are in TransformerLens' layout (`[batch, pos, heads, d_head]`
for q, k, v and z; `[batch, n_heads, dest_pos, src_pos]` for patterns and scores), keys
and queries after the rotary embedding, as the sites hold them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..backends._backend import Backend
from ..backends._families import backend_of
from ..backends._sites import TL_NAMES, Site
from ..backends.bridge._backend import BridgeBackend
from ..core._errors import PatchingError
from ._clean_cache import (
    axes_of,
    backend_sizes,
    check_clean_cache,
    clean_tensors,
    shape_error,
    sweep_tokens,
)
from ._hf_passes import Editor
from ._index import check_setter_result
from ._pattern_hook import check_pattern_hook

__all__ = ["generic_inputs"]

PatchSetter = Callable[[torch.Tensor, Sequence[int], torch.Tensor], Any]


def generic_inputs(
    model: Any,
    corrupted_tokens: torch.Tensor,
    clean_cache: Any,
    patch_setter: PatchSetter,
    activation_name: str,
) -> tuple[Backend, Site, torch.Tensor, list[torch.Tensor], int, Editor]:
    """`generic_activation_patch`'s checked inputs on a bridge or HuggingFace model (module notes).

    `(backend, site, tokens, clean, heads, editor)`, as `_hf_sweeps.SeamSweep` takes them:
    each layer's clean tensor in TransformerLens' layout, the heads of a head index, and
    the editor that runs `patch_setter` on each run's rows.
    """
    backend = backend_of(model, "generic_activation_patch")
    tokens = sweep_tokens(backend, corrupted_tokens, "corrupted_tokens")
    check_clean_cache(clean_cache, backend_sizes(backend), backend.clean_cache_call)
    batch, length = tokens.shape
    if backend.family == "bridge":
        from transformer_lens.utilities import get_act_name

        if get_act_name(activation_name, 0).endswith("attn.hook_pattern"):
            check_pattern_hook(model, tokens, "generic_activation_patch")
        site, clean = _bridge_site(model, activation_name, clean_cache, batch)
    else:
        site, clean = _hf_site(backend, activation_name, clean_cache, batch, length)
    names = [site.clean(layer) for layer in range(backend.n_layers)]
    # TransformerLens' layout: head-major hook tensors (keys, values and queries at a
    # HuggingFace model's seams) are handed to the setter position-major.
    position_major = site.pos_axis == 2 and site.activation not in ("pattern", "attn_scores")
    clean = [tensor.transpose(1, 2) if position_major else tensor for tensor in clean]
    # A head index counts key/value heads for keys and values (`[batch, pos, heads,
    # d_head]`), query heads otherwise, as on a HookedTransformer.
    n_heads = backend.config.num_attention_heads  # type: ignore[attr-defined]
    heads = clean[0].shape[2] if activation_name in ("k", "v") else n_heads

    def editor(layer: int, at: list[tuple[int, Any]]) -> Callable[[torch.Tensor], torch.Tensor]:
        def edit(hooked: torch.Tensor) -> torch.Tensor:
            tensor = hooked.transpose(1, 2) if position_major else hooked
            if clean[layer].shape[1:] != tensor.shape[1:]:
                raise shape_error(
                    names[layer],
                    tuple(clean[layer].shape),
                    tuple(tensor.shape[1:]),
                    batch,
                    axes_of(names[layer]),
                    backend.clean_cache_call,
                )
            for place, run in at:
                rows = tensor[place * batch : (place + 1) * batch]
                patched = patch_setter(rows, list(run.cell), clean[layer])
                patched = rows if patched is None else patched
                check_setter_result(patched, rows, list(run.cell))
                if patched is not rows:
                    rows.copy_(patched)
            return hooked

        return edit

    editing: Editor = editor  # checked against the protocol
    return backend, site, tokens, clean, int(heads), editing


def _bridge_site(
    model: Any, activation_name: str, clean_cache: Any, batch: int
) -> tuple[Site, list[torch.Tensor]]:
    """The bridge's hook point of `activation_name` in every block, and its clean tensors."""
    from transformer_lens.utilities import get_act_name

    names = [get_act_name(activation_name, layer) for layer in range(len(model.blocks))]
    for layer, name in enumerate(names):
        if not name.startswith(f"blocks.{layer}.") or name not in model.hook_dict:
            raise PatchingError(
                f"activation_name {activation_name!r} names {name!r}, not a hook point inside "
                f"block {layer} of this bridge; name an activation of every block, as "
                "get_act_name spells it (e.g. 'resid_pre', 'attn_out', 'z', 'k')"
            )
    site = Site("generic", names.__getitem__, names.__getitem__, 1, 2, 0)
    return site, [_clean(clean_cache, name, batch) for name in names]


def _hf_site(
    backend: Backend, activation_name: str, clean_cache: Any, batch: int, length: int
) -> tuple[Site, list[torch.Tensor]]:
    """The site of `activation_name` on a HuggingFace model, and its clean tensors (hook layout)."""
    from transformer_lens.utilities import get_act_name

    name = get_act_name(activation_name, 0)
    activation = next((key for key, tl in TL_NAMES.items() if name == f"blocks.0.{tl}"), None)
    if activation is None:
        raise PatchingError(
            f"activation_name {activation_name!r} names {name!r}, which safelens does not "
            "patch on a HuggingFace model; name one of "
            f"{', '.join(sorted(TL_NAMES))}, as get_act_name spells them"
        )
    site = backend.patch_site(activation, clean_cache)
    clean = clean_tensors(backend, site, clean_cache, batch, length)
    return dataclasses.replace(site, full=None), clean


def _clean(clean_cache: Any, name: str, batch: int) -> torch.Tensor:
    """The clean activation `name`, checked for its batch."""
    try:
        clean = clean_cache[name]
    except KeyError:
        raise PatchingError(
            f"clean_cache has no activation {name!r}; pass the clean cache of "
            f"{BridgeBackend.clean_cache_call}"
        ) from None
    if not isinstance(clean, torch.Tensor) or clean.shape[0] not in (1, batch):
        raise PatchingError(
            f"clean_cache[{name!r}] is {getattr(clean, 'shape', type(clean).__name__)}; expected "
            f"a tensor of batch {batch} (or 1), as corrupted_tokens"
        )
    return clean
