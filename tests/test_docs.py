"""Every ```python block of the docs pages and the README runs, page by page, in order."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```python[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S
)


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fences in `text`, dedented by their fence's indent."""
    blocks = []
    for match in FENCE.finditer(text):
        indent = len(match["indent"])
        lines = match["body"].splitlines()
        blocks.append("\n".join(line[indent:] for line in lines))
    return blocks


def test_python_blocks_finds_fences_in_order() -> None:
    text = "x\n```python\na = 1\n```\n```text\nno\n```\n  ```python\n  b = a\n  ```\n"
    assert python_blocks(text) == ["a = 1", "b = a"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_code_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    blocks = python_blocks(page.read_text())
    for index, block in enumerate(blocks):
        try:
            code = compile(block, f"{page.relative_to(ROOT)}[block {index}]", "exec")
            exec(code, namespace)
        except Exception as error:
            pytest.fail(
                f"{page.relative_to(ROOT)}: python block {index} failed: "
                f"{type(error).__name__}: {error}\n--- block {index} ---\n{block}"
            )
    plt.close("all")
