"""Heatmaps of patching results: layer × position, one panel per head.

Drawn on a bare matplotlib `Figure`, which renders PNGs with the Agg canvas (no display
needed, and the session's pyplot backend is left alone). A result `[layer, pos]` is one
panel; `[layer, pos, head]` is one panel per head; `[layer, head]` (an all-positions
sweep) is one panel with heads along the x axis.

matplotlib is an optional dependency (`pip install 'safelens[plot]'`): it is imported
when [`plot_patching_heatmap`][safelens.plot_patching_heatmap] is called, never by
`import safelens`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..core._errors import PatchingError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_patching_heatmap"]


def _figure_class() -> type[Figure]:
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "plot_patching_heatmap needs matplotlib, which is an optional dependency of "
            "safelens; install it with pip install 'safelens[plot]'"
        ) from error
    return Figure


def _check_result(result: Any) -> torch.Tensor:
    if not isinstance(result, torch.Tensor) or result.dim() not in (2, 3):
        raise PatchingError(
            "result must be a tensor [layer, pos], [layer, pos, head] or [layer, head], got "
            f"{getattr(result, 'shape', type(result).__name__)}"
        )
    if result.numel() == 0:
        raise PatchingError(
            f"result is empty (shape {tuple(result.shape)}); there is nothing to plot. "
            "Check the sweep ran over at least one layer, position and head"
        )
    if result.dtype == torch.bool or result.is_complex():
        raise PatchingError(f"result must hold real numbers, got dtype {result.dtype}")
    data = result.detach().float().cpu()
    bad = ~torch.isfinite(data)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise PatchingError(
            f"result holds {int(bad.sum())} NaN or infinite values, the first "
            f"{float(data[where])} at index {where}; a metric that divides by a zero "
            "difference gives these. Replace them first, e.g. torch.nan_to_num(result)"
        )
    return data


def _check_text(value: Any, name: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")


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
      `x_axis="head"`), as the patching sweeps return; finite real numbers.
    - `labels`: one label per x position, e.g. `model.to_str_tokens(tokens)`.
    - `title`: the figure title.
    - `path`: where to write the PNG, or `None` to only return the figure.
    - `x_axis`: the name of the x axis.

    **Returns:** the matplotlib `Figure` (one axes per panel, plus colour bars).

    **Raises:** [`PatchingError`][safelens.PatchingError] for a result that is not a
    non-empty 2-D or 3-D tensor of finite numbers, or labels of the wrong length;
    `TypeError` for labels, a title, an axis name or a path of the wrong type;
    `ImportError` naming the `plot` extra when matplotlib is not installed.

    ```python
    >>> figure = plot_patching_heatmap(torch.rand(2, 5, 3), labels=list("abcde"))
    >>> len([ax for ax in figure.axes if ax.get_label() != "<colorbar>"])
    3

    ```
    """
    data = _check_result(result)
    panels = data.unsqueeze(-1) if data.dim() == 2 else data
    n_layers, width, n_panels = panels.shape
    if labels is not None:
        if isinstance(labels, str) or not isinstance(labels, Sequence):
            raise TypeError(
                f"labels must be a sequence of one label per x position, got "
                f"{type(labels).__name__}; for one-character labels pass list(labels)"
            )
        if len(labels) != width:
            raise PatchingError(
                f"labels has {len(labels)} entries; the result has {width} positions"
            )
    _check_text(title, "title")
    _check_text(x_axis, "x_axis")
    if path is not None and not isinstance(path, str | PathLike):
        raise TypeError(f"path must be a str, a Path or None, got {type(path).__name__}")
    figure_class = _figure_class()
    columns = min(n_panels, 2)
    rows = math.ceil(n_panels / columns)
    panel_width, panel_height = 1.5 + 0.3 * width, 1.6 + 0.4 * n_layers
    figure = figure_class(figsize=(panel_width * columns, panel_height * rows + 0.6))
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
            ax.set_xticks(range(width), labels=[str(label) for label in labels], rotation=90)
        if n_panels > 1:
            ax.set_title(f"head {panel}")
        figure.colorbar(image, ax=ax)
    figure.suptitle(title)
    figure.tight_layout()
    if path is not None:
        figure.savefig(path, format="png")
    return figure
