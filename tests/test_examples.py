"""Every script in examples/ runs to completion; the main demonstration reports its findings."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "induction_demo.py"
# The main demonstration has a test of its own below, which also checks what it reports.
SCRIPTS = sorted(s for s in (ROOT / "examples").glob("*.py") if s != DEMO)


def _run(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_example_runs(script: Path, tmp_path: Path) -> None:
    result = _run(script, cwd=tmp_path)
    assert result.returncode == 0, (
        f"{script.name} exited {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-3000:]}"
    )


@pytest.mark.slow
@pytest.mark.hooked_transformer
def test_induction_demo_finds_the_mechanism(tmp_path: Path) -> None:
    """The main job's summary reports a solved task, an unchanged prefix, exact replays."""
    out = tmp_path / "figures"
    result = _run(DEMO, "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = result.stdout
    accuracy = float(summary.split("repeat accuracy ")[1].split()[0])
    assert accuracy >= 0.9, summary
    assert "prefix bitwise unchanged: True" in summary, summary
    assert "reproduces the repeat: True" in summary, summary
    difference = re.search(
        r"uncached full run of the repeat: .*max abs difference (\S+)\)", summary
    )
    assert difference is not None and float(difference.group(1)) <= 1e-4, summary
    for name in ("keys", "values"):
        assert (out / f"patching_{name}_by_pos.png").stat().st_size > 0
