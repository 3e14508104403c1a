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


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        (
            {"result": torch.rand(0, 5)},
            PatchingError,
            r"result is empty \(shape \(0, 5\)\); there is nothing to plot",
        ),
        ({"result": torch.rand(2, 0, 3)}, PatchingError, r"result is empty \(shape \(2, 0, 3\)\)"),
        (
            {"result": torch.tensor([[0.0, float("nan")], [1.0, 2.0]])},
            PatchingError,
            r"result holds 1 NaN or infinite values, the first nan at index \(0, 1\).*torch.nan_to_num",
        ),
        (
            {"result": torch.tensor([[float("inf"), 1.0]])},
            PatchingError,
            r"the first inf at index \(0, 0\)",
        ),
        (
            {"result": torch.ones(2, 2, dtype=torch.bool)},
            PatchingError,
            "result must hold real numbers, got dtype torch.bool",
        ),
        (
            {"result": torch.ones(2, 2, dtype=torch.complex64)},
            PatchingError,
            "result must hold real numbers, got dtype torch.complex64",
        ),
        ({"result": [[0.0]]}, PatchingError, r"result must be a tensor \[layer, pos\], .*got list"),
        (
            {"labels": "abcde"},
            TypeError,
            r"labels must be a sequence of one label per x position, got str; for one-character labels pass list\(labels\)",
        ),
        (
            {"labels": 5},
            TypeError,
            "labels must be a sequence of one label per x position, got int",
        ),
        ({"title": 3}, TypeError, "title must be a str, got int"),
        ({"x_axis": None}, TypeError, "x_axis must be a str, got NoneType"),
        ({"path": 3}, TypeError, "path must be a str, a Path or None, got int"),
    ],
)
def test_bad_arguments(arguments: dict, error, match: str) -> None:
    with pytest.raises(error, match=match):
        plot_patching_heatmap(**{"result": torch.rand(2, 5), **arguments})


def test_integer_results_and_non_string_labels() -> None:
    figure = plot_patching_heatmap(torch.arange(6).reshape(2, 3), labels=[0, 1, 2])
    assert [t.get_text() for t in panels(figure)[0].get_xticklabels()] == ["0", "1", "2"]
