"""plot_patching_heatmap writes a PNG with one panel per head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from safelens import PatchingError, plot_patching_heatmap


def panels(figure) -> list:
    return [ax for ax in figure.axes if ax.get_label() != "<colorbar>"]


@pytest.mark.parametrize(("shape", "count"), [((2, 5), 1), ((2, 5, 3), 3), ((3, 4, 6), 6)])
def test_writes_png_with_panel_per_head(tmp_path: Path, shape: tuple, count: int) -> None:
    path = tmp_path / "heatmap.png"
    labels = [f"t{i}" for i in range(shape[1])]
    figure = plot_patching_heatmap(torch.rand(shape), labels=labels, title="k", path=path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(panels(figure)) == count
    ax = panels(figure)[0]
    assert ax.get_xlabel() == "position" and ax.get_ylabel() == "layer"
    assert [t.get_text() for t in ax.get_xticklabels()] == labels


def test_bad_result_and_labels() -> None:
    with pytest.raises(PatchingError, match=r"result must be a tensor \[layer, pos\]"):
        plot_patching_heatmap(torch.rand(5))
    with pytest.raises(PatchingError, match="labels has 2 entries; the result has 5"):
        plot_patching_heatmap(torch.rand(2, 5), labels=["a", "b"])
