"""The benchmark aggregator's machinery on made-up rows (nothing is timed here)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

import benchmarks.__main__ as cli
from benchmarks._common import Row
from benchmarks.report import markdown_table, minimum_ratio, plot_title, target_met, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def curve(group: str, ratios: list[float], agree: bool = True) -> list[Row]:
    return [
        Row(f"job at {x}", 1.0, ratio, "s", agree, target="≥2× faster", group=group, x=x)
        for x, ratio in zip([64, 256, 1024], ratios, strict=True)
    ]


@pytest.mark.parametrize(
    ("target", "least"),
    [
        ("≥15× faster than one TransformerLens forward", 15.0),
        (">=10x faster", 10.0),
        ("≥0.95× TransformerLens' cached generation", 0.95),
        ("within 1.15× of the ideal", 1 / 1.15),
        ("≥32× less memory", 32.0),
        ("identical tokens", None),
        ("", None),
    ],
)
def test_minimum_ratio_parses_simple_targets(target: str, least: float | None) -> None:
    assert minimum_ratio(target) == (pytest.approx(least) if least else None)


def test_target_met_compares_the_ratio() -> None:
    assert target_met(Row("a", 1.0, 16.0, "s", True, "≥15× faster")) is True
    assert target_met(Row("a", 1.0, 14.0, "s", True, "≥15× faster")) is False
    assert target_met(Row("a", 1.1, 1.0, "s", True, "within 1.15×")) is True
    assert target_met(Row("a", 1.2, 1.0, "s", True, "within 1.15×")) is False
    assert target_met(Row("a", 1.0, 2.0, "s", True, "same tokens")) is None


def test_markdown_table_has_a_line_per_row_and_marks_disagreement() -> None:
    rows = [
        Row("fast job", 0.002, 0.05, "s", True, "≥15× faster"),
        Row("memory | prefix", 1 << 20, 32 << 20, "bytes", False, "≥32× less"),
    ]
    lines = markdown_table(rows).splitlines()
    assert lines[0].startswith("| job | safelens | TransformerLens way | ratio |")
    assert len(lines) == 4
    assert "| fast job | 2 ms | 50 ms | 25.00× | yes | ≥15× faster | yes |" == lines[2]
    assert "memory \\| prefix" in lines[3] and "1 MiB" in lines[3] and "32 MiB" in lines[3]
    assert "**NO**" in lines[3] and lines[3].endswith("| yes |")


def test_plot_title_names_what_the_jobs_share_and_the_scaling_variable() -> None:
    grid = [
        Row(f"k patching grid, {n} tokens", 1.0, 2.0, "s", True, group="tokens", x=n)
        for n in (16, 128)
    ]
    assert plot_title(grid, "time") == "k patching grid: time vs tokens"
    memory = [
        Row(f"P=512: {n} continuations", 1.0, 2.0, "bytes", True, group="continuations", x=n)
        for n in (1, 8)
    ]
    assert plot_title(memory, "memory held") == "P=512: memory held vs continuations"
    assert plot_title(curve("layers", [1.0, 2.0, 3.0]), "time") == "time vs layers"
    assert (
        plot_title([Row("x", 1, 1, "s", True, group="layers", x=2)], "time") == "x: time vs layers"
    )


def test_write_report_writes_table_header_and_one_plot_per_group(tmp_path: Path) -> None:
    rows = curve("prefix length", [2.0, 4.0, 8.0]) + curve("continuations", [1.0, 1.5, 3.0])
    rows.append(Row("lone job", 1.0, 3.0, "s", True))
    path = write_report(rows, tmp_path, quick=True, failures={"broken": "RuntimeError: x"})
    text = path.read_text()
    assert "- torch: " in text and "- transformer_lens: " in text and "- device: " in text
    assert text.count("| job at 64 |") == 2 and "| lone job |" in text
    assert "![prefix_length](prefix_length.png)" in text and "`broken`: RuntimeError" in text
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["continuations.png", "prefix_length.png"]
    assert all((tmp_path / name).read_bytes().startswith(PNG_MAGIC) for name in pngs)


@pytest.fixture
def fake_benchmarks(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Row]]:
    results = {"good": curve("layers", [2.0, 3.0, 4.0]), "bad": curve("x", [1, 1, 1], False)}
    for name, rows in results.items():
        module = types.ModuleType(f"benchmarks.bench_{name}")
        module.run = lambda quick=False, rows=rows: rows  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, f"benchmarks.bench_{name}", module)
    monkeypatch.setattr(cli, "discover", lambda: sorted(results))
    return results


def test_main_exits_zero_when_every_row_agrees(
    fake_benchmarks: dict[str, list[Row]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--quick", "--only", "bench_good", "--out", str(tmp_path)]) == 0
    assert "| job at 1024 | 1 s | 4 s | 4.00× | yes | ≥2× faster | yes |" in capsys.readouterr().out
    assert (tmp_path / "report.md").exists() and (tmp_path / "layers.png").exists()


def test_main_exits_nonzero_on_disagreement_and_unknown_names(
    fake_benchmarks: dict[str, list[Row]], tmp_path: Path
) -> None:
    assert cli.main(["--out", str(tmp_path)]) == 1
    assert "**NO**" in (tmp_path / "report.md").read_text()
    assert cli.main(["--only", "nothing", "--out", str(tmp_path)]) == 2


def test_main_reports_a_benchmark_that_raises(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    module = types.ModuleType("benchmarks.bench_crash")

    def run(quick: bool = False) -> list[Row]:
        raise RuntimeError("model exploded")

    module.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "benchmarks.bench_crash", module)
    monkeypatch.setattr(cli, "discover", lambda: ["crash"])
    assert cli.main(["--out", str(tmp_path)]) == 1
    assert "`crash`: RuntimeError: model exploded" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_attribution_benchmark_runs_in_quick_mode() -> None:
    from benchmarks import bench_attribution

    rows = bench_attribution.run(quick=True)
    assert [row.x for row in rows] == [16] and all(row.agree for row in rows)
