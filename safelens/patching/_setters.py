"""TransformerLens' patch setters and index frames, without importing TransformerLens.

`transformer_lens.patching` builds every sweep from `generic_activation_patch`, a
`patch_setter` that writes the clean activation into the corrupted one at an index, and
an index grid (`make_df_from_ranges`). These are the same functions, with the same
arguments and results, so that `safelens.patching` offers every name of
`transformer_lens.patching` on an install without TransformerLens (plain HuggingFace
models). Each setter edits `corrupted_activation` in place and returns it; the index
starts with the layer, which the setter does not read.

Caveat: a setter assumes its activation's layout, as TransformerLens' do: `[batch, pos,
...]` for the `layer_pos_*` and `layer_head_vector_*` setters (every activation but
attention patterns and scores), `[batch, head_index, dest_pos, src_pos]` for the
`layer_head_*pattern*` ones.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import pandas as pd
import torch

from ..core._errors import PatchingError
from ._index import grid

__all__ = [
    "layer_head_dest_src_pos_pattern_patch_setter",
    "layer_head_pattern_patch_setter",
    "layer_head_pos_pattern_patch_setter",
    "layer_head_vector_patch_setter",
    "layer_pos_head_vector_patch_setter",
    "layer_pos_patch_setter",
    "make_df_from_ranges",
    "SETTER_AXES",
    "SweepKeywords",
    "known_setter_axes",
]

Setter = Callable[[torch.Tensor, Sequence[int], torch.Tensor], Any]


def make_df_from_ranges(
    column_max_ranges: Sequence[int], column_names: Sequence[str]
) -> pd.DataFrame:
    """Every index below `column_max_ranges`, one row each, the last column fastest.

    ```python
    >>> make_df_from_ranges([2, 3], ["layer", "pos"]).values.tolist()
    [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]

    ```
    """
    return pd.DataFrame(grid(tuple(column_max_ranges)), columns=list(column_names))


def _index(index: Sequence[int], names: str) -> Sequence[int]:
    """`index`, refused unless it has one entry per name in `names` ("layer pos")."""
    if len(index) != len(names.split()):
        raise PatchingError(
            f"this patch setter takes index [{', '.join(names.split())}], got {list(index)}; "
            "pair it with index_axis_names (or index_df columns) of those axes"
        )
    return index


def layer_pos_patch_setter(
    corrupted_activation: torch.Tensor, index: Sequence[int], clean_activation: torch.Tensor
) -> torch.Tensor:
    """Patch position `pos` of an activation `[batch, pos, ...]`; `index = [layer, pos]`."""
    _, pos = _index(index, "layer pos")
    corrupted_activation[:, pos, ...] = clean_activation[:, pos, ...]
    return corrupted_activation


def layer_pos_head_vector_patch_setter(
    corrupted_activation: torch.Tensor, index: Sequence[int], clean_activation: torch.Tensor
) -> torch.Tensor:
    """Patch one head at one position of `[batch, pos, head_index, ...]`; `index = [layer, pos, head_index]`."""
    _, pos, head_index = _index(index, "layer pos head_index")
    corrupted_activation[:, pos, head_index] = clean_activation[:, pos, head_index]
    return corrupted_activation


def layer_head_vector_patch_setter(
    corrupted_activation: torch.Tensor, index: Sequence[int], clean_activation: torch.Tensor
) -> torch.Tensor:
    """Patch one head at every position of `[batch, pos, head_index, ...]`; `index = [layer, head_index]`."""
    _, head_index = _index(index, "layer head_index")
    corrupted_activation[:, :, head_index] = clean_activation[:, :, head_index]
    return corrupted_activation


def layer_head_pattern_patch_setter(
    corrupted_activation: torch.Tensor, index: Sequence[int], clean_activation: torch.Tensor
) -> torch.Tensor:
    """Patch one head's whole pattern `[batch, head_index, dest_pos, src_pos]`; `index = [layer, head_index]`."""
    _, head_index = _index(index, "layer head_index")
    corrupted_activation[:, head_index, :, :] = clean_activation[:, head_index, :, :]
    return corrupted_activation


def layer_head_pos_pattern_patch_setter(
    corrupted_activation: torch.Tensor, index: Sequence[int], clean_activation: torch.Tensor
) -> torch.Tensor:
    """Patch one row of a head's pattern; `index = [layer, head_index, dest_pos]`."""
    _, head_index, dest_pos = _index(index, "layer head_index dest_pos")
    corrupted_activation[:, head_index, dest_pos, :] = clean_activation[:, head_index, dest_pos, :]
    return corrupted_activation


def layer_head_dest_src_pos_pattern_patch_setter(
    corrupted_activation: torch.Tensor, index: Sequence[int], clean_activation: torch.Tensor
) -> torch.Tensor:
    """Patch one entry of a head's pattern; `index = [layer, head_index, dest_pos, src_pos]`."""
    _, head_index, dest_pos, src_pos = _index(index, "layer head_index dest_pos src_pos")
    corrupted_activation[:, head_index, dest_pos, src_pos] = clean_activation[
        :, head_index, dest_pos, src_pos
    ]
    return corrupted_activation


# The activation axes each setter writes at the index after the layer, in its order
# (`safelens.patching._front`: a generic sweep with one of them is a named sweep).
SETTER_AXES = {
    layer_pos_patch_setter: [1],
    layer_pos_head_vector_patch_setter: [1, 2],
    layer_head_vector_patch_setter: [2],
    layer_head_pattern_patch_setter: [1],
    layer_head_pos_pattern_patch_setter: [1, 2],
    layer_head_dest_src_pos_pattern_patch_setter: [1, 2, 3],
}


def known_setter_axes(patch_setter: Any) -> list[int] | None:
    """The activation axes a TransformerLens setter writes at the index after the layer.

    Its own (`transformer_lens.patching`'s, when imported) or `safelens.patching`'s of
    the same name. `None` for any other setter: it may write anything.
    """
    theirs = sys.modules.get("transformer_lens.patching")
    for setter, axes in SETTER_AXES.items():
        if patch_setter is setter or patch_setter is getattr(theirs, setter.__name__, None):
            return axes
    return None


class SweepKeywords(NamedTuple):
    """What TransformerLens' partial of `generic_activation_patch` fixes for one sweep.

    Each `get_act_patch_*` sweep takes TransformerLens' keyword arguments with these
    defaults; a call that changes one of them (or passes `index_df` or
    `return_index_df=True`) is a generic patch, and `differ` says so.
    """

    patch_setter: Setter
    activation_name: str
    index_axis_names: tuple[str, ...]

    def differ(
        self,
        patch_setter: Any,
        activation_name: Any,
        index_axis_names: Any,
        index_df: Any,
        return_index_df: Any,
    ) -> bool:
        """Whether a call's keywords ask for something other than this sweep."""
        axes = index_axis_names
        if isinstance(axes, Sequence) and not isinstance(axes, str):
            axes = tuple(axes)
        return (
            patch_setter is not self.patch_setter
            or activation_name != self.activation_name
            or axes != self.index_axis_names
            or index_df is not None
            or return_index_df is not False
        )
