"""Turn benchmark rows into the report: a markdown table, target checks and plots."""

from __future__ import annotations

import math
import os
import platform
import re
from collections.abc import Iterable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch

from ._common import Row

COLUMNS = ("job", "safelens", "TransformerLens way", "ratio", "agree", "target", "met?")

_AT_LEAST = re.compile(r"(?:≥|>=)\s*([0-9]*\.?[0-9]+)\s*[×x]")
_WITHIN = re.compile(r"within\s*([0-9]*\.?[0-9]+)\s*[×x]")


def minimum_ratio(target: str) -> float | None:
    """The smallest `Row.ratio` (reference over safelens) that meets `target`, if simple.

    "≥15× faster" (or "≥8× less" memory, "≥0.95×") asks for a ratio of at least 15 (8,
    0.95); "within 1.15×" of a reference asks for safelens to take at most 1.15 times
    the reference, a ratio of at least 1 / 1.15. Anything else gives `None`.
    """
    if match := _AT_LEAST.search(target):
        return float(match[1])
    if match := _WITHIN.search(target):
        return 1 / float(match[1])
    return None


def target_met(row: Row) -> bool | None:
    """Whether `row` meets its target (`None` when the target is absent or not simple)."""
    least = minimum_ratio(row.target)
    return None if least is None else row.ratio >= least


def _amount(value: float, unit: str) -> str:
    if unit == "bytes":
        for scale, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if abs(value) >= scale:
                return f"{value / scale:.3g} {name}"
        return f"{value:.0f} B"
    if unit == "s":
        if abs(value) >= 1:
            return f"{value:.3g} s"
        return f"{value * 1e3:.3g} ms"
    return f"{value:.4g} {unit}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table_rows(rows: Iterable[Row]) -> list[tuple[str, ...]]:
    """One tuple of cells per row, in the order of `COLUMNS`."""
    cells = []
    for row in rows:
        met = target_met(row)
        cells.append(
            (
                row.job,
                _amount(row.safelens, row.unit),
                _amount(row.reference, row.unit),
                f"{row.ratio:.2f}×",
                "yes" if row.agree else "**NO**",
                row.target,
                "" if met is None else ("yes" if met else "**no**"),
            )
        )
    return cells


def markdown_table(rows: Iterable[Row]) -> str:
    """The rows as a markdown table with the report's columns."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for cells in table_rows(rows):
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, str]:
    """Where the benchmarks ran: device, library versions and thread count."""
    info = {
        "device": f"CPU ({_cpu_name()}, {torch.get_num_threads()} torch threads)",
        "torch": torch.__version__,
        "transformer_lens": metadata.version("transformer-lens"),
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["cuda device available"] = torch.cuda.get_device_name(0)
    return info


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "group"


def _log_axis(values: list[float]) -> bool:
    positive = [v for v in values if v > 0]
    return len(positive) == len(values) and max(positive) / min(positive) >= 8


def plot_title(members: list[Row], quantity: str) -> str:
    """`"<what the jobs share>: <quantity> vs <scaling variable>"`, e.g. for a curve's rows.

    What the jobs share is their names' common start, cut back to the last `,` or `:`
    (`"k patching grid, 16 tokens"` and `"… 256 tokens"` share `"k patching grid"`).
    """
    shared = os.path.commonprefix([row.job for row in members])
    if len(members) > 1:
        shared = shared[: max(shared.rfind(","), shared.rfind(":"), 0)]
    subject = f"{quantity} vs {members[0].group}"
    return f"{shared.strip()}: {subject}" if shared.strip() else subject


def plot_groups(rows: Iterable[Row], out_dir: Path) -> list[Path]:
    """One PNG per row group with x values: safelens against the reference, cost vs x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    groups: dict[str, list[Row]] = {}
    for row in rows:
        if row.group and row.x is not None:
            # Time and memory rows of one scaling variable get plots of their own.
            name = row.group if row.unit == "s" else f"{row.group} ({row.unit})"
            groups.setdefault(name, []).append(row)
    paths = []
    for group, members in groups.items():
        members.sort(key=lambda r: float(r.x or 0))
        xs = [float(r.x or 0) for r in members]
        unit = members[0].unit
        figure, axes = plt.subplots(figsize=(6, 4))
        axes.plot(xs, [r.safelens for r in members], "o-", label="safelens")
        axes.plot(xs, [r.reference for r in members], "s--", label="TransformerLens way")
        if _log_axis(xs):
            axes.set_xscale("log")
            # Label the measured x values themselves; log-axis minor labels overlap.
            axes.xaxis.set_minor_formatter(NullFormatter())
        axes.set_xticks(xs, labels=[f"{x:g}" for x in xs])
        if _log_axis([r.safelens for r in members] + [r.reference for r in members]):
            axes.set_yscale("log")
        quantity = "memory held" if unit == "bytes" else "time"
        axes.set_xlabel(members[0].group)
        axes.set_ylabel(f"{quantity} ({unit})")
        axes.set_title(plot_title(members, quantity))
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
        figure.tight_layout()
        path = out_dir / f"{_slug(group)}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        paths.append(path)
    return paths


def report_markdown(
    rows: list[Row], plots: list[Path], quick: bool, failures: dict[str, str] | None = None
) -> str:
    """The whole `report.md`: header with the environment, the table, plots, failures."""
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# safelens benchmark report",
        "",
        f"- run: {stamp}, {'quick' if quick else 'full'} mode",
        *(f"- {name}: {value}" for name, value in environment().items()),
        "",
        "ratio = TransformerLens way / safelens (above 1: safelens is cheaper). "
        "agree: safelens and the TransformerLens way gave the same numbers. "
        "Timings are best-of-n wall clock; compare ratios, not seconds.",
        "",
        markdown_table(rows),
    ]
    if plots:
        lines += ["", "## Scaling curves", ""]
        lines += [f"![{path.stem}]({path.name})" for path in plots]
    if failures:
        lines += ["", "## Benchmarks that failed to run", ""]
        lines += [f"- `{name}`: {error}" for name, error in failures.items()]
    notes = [row for row in rows if row.note]
    if notes:
        lines += ["", "## Notes", ""]
        lines += [f"- {row.job}: {row.note}" for row in notes]
    return "\n".join(lines) + "\n"


def write_report(
    rows: list[Row], out_dir: Path, quick: bool, failures: dict[str, str] | None = None
) -> Path:
    """Write `report.md` and the plots into `out_dir`; return the report's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plot_groups(rows, out_dir)
    path = out_dir / "report.md"
    path.write_text(report_markdown(rows, plots, quick, failures))
    return path


def all_agree(rows: Iterable[Row]) -> bool:
    """Whether every row's safelens and reference numbers agreed (and are finite)."""
    return all(row.agree and math.isfinite(row.safelens) for row in rows)
