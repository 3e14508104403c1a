"""Heatmaps of patching results: layer × position, one panel per head.

Drawn with matplotlib's Agg backend (no display needed) and saved as PNG. A result
`[layer, pos]` is one panel; `[layer, pos, head]` is one panel per head; `[layer, head]`
(an all-positions sweep) is one panel with heads along the x axis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import torch
from matplotlib.figure import Figure

from ._errors import PatchingError

__all__ = ["plot_patching_heatmap"]


def plot_patching_heatmap(
    result: torch.Tensor,
    labels: Sequence[str] | None = None,
    title: str = "activation patching",
    path: str | Path | None = None,
    x_axis: str = "position",
) -> Figure:
    """Draw a patching result as heatmaps; save a PNG when `path` is given.

    **Arguments:**

    - `result`: `[layer, pos]`, `[layer, pos, head]` or `[layer, head]` (then pass
      `x_axis="head"`), as the patching sweeps return.
    - `labels`: one label per x position, e.g. `model.to_str_tokens(tokens)`.
    - `title`: the figure title.
    - `path`: where to write the PNG, or `None` to only return the figure.
    - `x_axis`: the name of the x axis.

    **Returns:** the matplotlib `Figure` (one axes per panel, plus colour bars).

    ```python
    >>> figure = plot_patching_heatmap(torch.rand(2, 5, 3), labels=list("abcde"))
    >>> len([ax for ax in figure.axes if ax.get_label() != "<colorbar>"])
    3

    ```
    """
    if not isinstance(result, torch.Tensor) or result.dim() not in (2, 3):
        raise PatchingError(
            "result must be a tensor [layer, pos] or [layer, pos, head], got "
            f"{getattr(result, 'shape', type(result).__name__)}"
        )
    data = result.detach().float().cpu()
    panels = data.unsqueeze(-1) if data.dim() == 2 else data
    n_layers, width, n_panels = panels.shape
    if labels is not None and len(labels) != width:
        raise PatchingError(f"labels has {len(labels)} entries; the result has {width} positions")
    matplotlib.use("Agg")
    columns = min(n_panels, 2)
    rows = math.ceil(n_panels / columns)
    panel_width, panel_height = 1.5 + 0.3 * width, 1.6 + 0.4 * n_layers
    figure = Figure(figsize=(panel_width * columns, panel_height * rows + 0.6))
    limit = float(data.abs().max()) or 1.0
    for panel in range(n_panels):
        ax = figure.add_subplot(rows, columns, panel + 1)
        image = ax.imshow(
            panels[:, :, panel].numpy(), cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto"
        )
        ax.set_xlabel(x_axis)
        ax.set_ylabel("layer")
        ax.set_yticks(range(n_layers))
        if labels is not None:
            ax.set_xticks(range(width), labels=list(labels), rotation=90)
        if n_panels > 1:
            ax.set_title(f"head {panel}")
        figure.colorbar(image, ax=ax)
    figure.suptitle(title)
    figure.tight_layout()
    if path is not None:
        figure.savefig(path, format="png")
    return figure
