"""Every script in examples/ runs to completion with the project's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "examples").glob("*.py"))


def _param(script: Path) -> object:
    marks = [pytest.mark.slow] if "demo" in script.stem else []
    return pytest.param(script, id=script.name, marks=marks)


@pytest.mark.parametrize("script", [_param(s) for s in SCRIPTS])
def test_example_runs(script: Path, tmp_path: Path) -> None:
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, (
        f"{script.name} exited {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-3000:]}"
    )
