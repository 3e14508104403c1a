"""`generic_activation_patch` on a TransformerBridge: any setter, many runs per pass.

TransformerLens' `generic_activation_patch` runs one forward per index, with the hook
`get_act_name(activation_name, layer)` calling `patch_setter(corrupted_activation,
index, clean_activation)`. On a TransformerBridge safelens runs the same hooks on the
bridge's own hook points (so a setter sees what it sees under TransformerLens, keys
before the rotary embedding included), many indices per pass through
`safelens.patching._hf_sweeps`: each index's run holds `batch` rows of the pass, its
setter gets those rows, and every run starts at the layer of its index (the corrupted
run's residual stream entering it). A setter may change any position, so every run
runs every position; a metric that reads only the last position still gets that
position alone.

Caveat: `activation_name` must name a hook point inside every block
(`blocks.{layer}.…`); a plain HuggingFace model, whose modules carry no TransformerLens
hook points, is refused (its `get_act_patch_*` sweeps cover keys, values, the residual
stream and the attention and MLP outputs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd
import torch

from ..backends._backend import backend_of
from ..core._errors import PatchingError
from ._clean_cache import CLEAN_CACHE_OF, axes_of, backend_sizes, check_clean_cache, shape_error
from ._hf_sites import Site, _tokens
from ._hf_sweeps import Editor, Run, run_sweep
from ._index import check_index_choice, check_setter_result, index_grid
from ._limits import _check_limits
from ._metric import Metric

__all__ = ["seam_generic"]

PatchSetter = Callable[[torch.Tensor, Sequence[int], torch.Tensor], Any]


def seam_generic(
    model: Any,
    corrupted_tokens: torch.Tensor,
    clean_cache: Any,
    patching_metric: Metric,
    patch_setter: PatchSetter,
    activation_name: str,
    index_axis_names: Sequence[str] | None,
    index_df: pd.DataFrame | None,
    max_batch: int | None,
    max_bytes: int,
    progress: bool,
) -> tuple[torch.Tensor, pd.DataFrame]:
    """`generic_activation_patch` on a TransformerBridge (module notes): result and index rows."""
    from transformer_lens.utilities import get_act_name

    backend = backend_of(model, "generic_activation_patch")
    if backend.family != "bridge":
        raise PatchingError(
            f"generic_activation_patch needs a HookedTransformer or a TransformerBridge, got "
            f"{type(model).__name__}, whose modules have no TransformerLens hook points; use "
            "the get_act_patch_* sweeps (k, v, resid_pre, attn_out, mlp_out), or wrap the "
            "model in a TransformerBridge"
        )
    _check_limits(max_batch, max_bytes, progress)
    check_index_choice(index_axis_names, index_df)
    tokens = _tokens(backend, corrupted_tokens, "corrupted_tokens")
    check_clean_cache(clean_cache, backend_sizes(backend), CLEAN_CACHE_OF["bridge"])
    batch, length = tokens.shape
    names = [get_act_name(activation_name, layer) for layer in range(backend.n_layers)]
    for layer, name in enumerate(names):
        if not name.startswith(f"blocks.{layer}.") or name not in model.hook_dict:
            raise PatchingError(
                f"activation_name {activation_name!r} names {name!r}, not a hook point inside "
                f"block {layer} of this bridge; name an activation of every block, as "
                "get_act_name spells it (e.g. 'resid_pre', 'attn_out', 'z', 'k')"
            )
    clean = [_clean(clean_cache, name, batch) for name in names]
    # A head index counts key/value heads for keys and values (`[batch, pos, heads,
    # d_head]`), query heads otherwise, as on a HookedTransformer.
    n_heads = backend.config.num_attention_heads  # type: ignore[attr-defined]
    heads = clean[0].shape[2] if activation_name in ("k", "v") else n_heads
    sizes = {"layer": backend.n_layers, "pos": length, "src_pos": length, "dest_pos": length}
    sizes |= {"head_index": int(heads), "head": int(heads)}
    index_df, shape = index_grid(sizes, index_axis_names, index_df)
    indices = [[int(i) for i in row] for row in index_df.itertuples(index=False)]
    runs: list[Run] = [(slot, index[0], None, None, None) for slot, index in enumerate(indices)]
    site = Site("generic", names.__getitem__, names.__getitem__, 1, 2, 0)

    def editor(layer: int, at: list[tuple[int, Any]]) -> Callable[[torch.Tensor], torch.Tensor]:
        def edit(tensor: torch.Tensor) -> torch.Tensor:
            if clean[layer].shape[1:] != tensor.shape[1:]:
                raise shape_error(
                    names[layer],
                    tuple(clean[layer].shape),
                    tuple(tensor.shape[1:]),
                    batch,
                    axes_of(names[layer]),
                    CLEAN_CACHE_OF["bridge"],
                )
            for place, run in at:
                rows = tensor[place * batch : (place + 1) * batch]
                index = indices[run[0]]
                patched = patch_setter(rows, list(index), clean[layer])
                patched = rows if patched is None else patched
                check_setter_result(patched, rows, index)
                if patched is not rows:
                    rows.copy_(patched)
            return tensor

        return edit

    editing: Editor = editor  # checked against the protocol
    result = run_sweep(
        backend,
        site,
        tokens,
        clean,
        runs,
        shape,
        patching_metric,
        max_batch,
        max_bytes,
        progress,
        editing,
    )
    return result, index_df


def _clean(clean_cache: Any, name: str, batch: int) -> torch.Tensor:
    """The clean activation `name`, checked for its batch."""
    try:
        clean = clean_cache[name]
    except KeyError:
        raise PatchingError(
            f"clean_cache has no activation {name!r}; pass the clean cache of "
            f"{CLEAN_CACHE_OF['bridge']}"
        ) from None
    if not isinstance(clean, torch.Tensor) or clean.shape[0] not in (1, batch):
        raise PatchingError(
            f"clean_cache[{name!r}] is {getattr(clean, 'shape', type(clean).__name__)}; expected "
            f"a tensor of batch {batch} (or 1), as corrupted_tokens"
        )
    return clean
