"""Every ```python block of the docs pages and the README runs, page by page, in order.

A `print(...)` line followed by `# ...` comment lines documents its output: those lines
must be what the block prints, in order.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import os
import re
import subprocess
import sys
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


def documented_output(block: str) -> list[str]:
    """The `# ...` lines right after each one-line `print(...)` of `block`, unprefixed."""
    expected, after_print = [], False
    for line in block.splitlines():
        if after_print and (line == "#" or line.startswith("# ")):
            expected.append(line[2:])
            continue
        after_print = line.startswith("print(") and line.rstrip().endswith(")")
    return expected


def is_subsequence(expected: list[str], printed: list[str]) -> bool:
    lines = iter(line.rstrip() for line in printed)
    return all(any(want.rstrip() == line for line in lines) for want in expected)


def test_documented_output_reads_comment_lines_after_prints() -> None:
    block = "x = 1  # not output\nprint(x)\n# 1\n# two\ny = 2\n# not output\nprint(y)  # inline\n"
    assert documented_output(block) == ["1", "two"]
    assert is_subsequence(["1", "3"], ["1", "2", "3"])
    assert not is_subsequence(["3", "1"], ["1", "2", "3"])


def test_python_blocks_finds_fences_in_order() -> None:
    text = "x\n```python\na = 1\n```\n```text\nno\n```\n  ```python\n  b = a\n  ```\n"
    assert python_blocks(text) == ["a = 1", "b = a"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_code_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    blocks = python_blocks(page.read_text())
    for index, block in enumerate(blocks):
        stdout = io.StringIO()
        try:
            name = f"{page.relative_to(ROOT)}[block {index}]"
            # Registered as source, as a file's would be: nnsight reads its `with` blocks back.
            linecache.cache[name] = (len(block), None, block.splitlines(True), name)
            code = compile(block, name, "exec")
            with contextlib.redirect_stdout(stdout):
                exec(code, namespace)
        except Exception as error:
            pytest.fail(
                f"{page.relative_to(ROOT)}: python block {index} failed: "
                f"{type(error).__name__}: {error}\n--- block {index} ---\n{block}"
            )
        expected = documented_output(block)
        printed = stdout.getvalue().splitlines()
        assert is_subsequence(expected, printed), (
            f"{page.relative_to(ROOT)}: python block {index} documents the output "
            f"{expected} but printed {printed}"
        )
    plt.close("all")


API_PAGES = sorted((ROOT / "docs" / "api").glob("*.md")) + [ROOT / "docs" / "api.md"]
DIRECTIVE = re.compile(r"^:::[ \t]+(\S+)", re.M)


def undocumented(names: list[str], module: object, pages: list[str]) -> list[str]:
    """The names of `module` that no `::: safelens.<name>` directive in `pages` renders.

    A name that is another documented name's object under a second name (an alias such
    as `TransformerLensKeyValueCache`) counts as documented when a page names it.
    """
    rendered = {
        path.removeprefix("safelens.")
        for page in pages
        for path in DIRECTIVE.findall(page)
        if path.startswith("safelens.")
    }
    text = "\n".join(pages)
    missing = []
    for name in names:
        if name in rendered:
            continue
        obj = getattr(module, name)
        aliased = any(_loaded(module, other) is obj for other in rendered if "." not in other)
        if not (aliased and f"`safelens.{name}`" in text):
            missing.append(name)
    return missing


def _loaded(module: object, name: str) -> object:
    """`module.name`, or `None` where it is missing or cannot load here (a name that needs
    `HookedTransformer`, on TransformerLens 4)."""
    try:
        return getattr(module, name, None)
    except ImportError:
        return None


def test_undocumented_finds_a_missing_name_and_accepts_a_named_alias() -> None:
    import types

    module = types.SimpleNamespace(f=len, g=abs, alias=len, other=len)
    pages = ["::: safelens.f\n\n| `safelens.alias` | is `f` |\n"]
    assert undocumented(["f", "g", "alias", "other"], module, pages) == ["g", "other"]


def test_api_reference_documents_every_public_name() -> None:
    import safelens

    pages = [page.read_text() for page in API_PAGES]
    missing = undocumented(list(safelens.__all__), safelens, pages)
    assert not missing, (
        f"safelens.__all__ names missing from the API reference (docs/api/*.md): {missing}; "
        "add a `::: safelens.<name>` directive to the page of its concept"
    )


@pytest.mark.hooked_transformer  # the API pages render modules that import it; CI builds them on 3.x
def test_api_reference_renders_factory_made_sweeps(tmp_path: Path) -> None:
    # mkdocstrings' static analysis sees `get_act_patch_resid_pre = _sweep_function(...)`
    # as an attribute; docs/_ext/factory_functions.py documents it as the function it is.
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    page = (site / "api" / "patching" / "index.html").read_text()
    text = re.sub(r"<[^>]+>", "", page)
    for name in ("get_act_patch_resid_pre", "get_act_patch_attn_head_v_all_pos"):
        assert re.search(rf"{name}\(\s*model: SupportedModel,", text), name
    assert "Patch each head's values at all positions" in text
    assert "_sweep_function(" not in text


def test_gallery_shows_every_example_script() -> None:
    gallery = (ROOT / "docs" / "gallery.md").read_text()
    scripts = sorted(p.name for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
    missing = [name for name in scripts if f"`{name}`" not in gallery]
    assert not missing, f"examples missing from docs/gallery.md: {missing}"


def test_induction_story_quotes_the_published_numbers() -> None:
    # The quickstart and the edits concept page quote the demonstration's numbers; they
    # must be the ones it last published (examples/induction_demo.py --docs).
    import json

    numbers = json.loads((ROOT / "docs" / "figures" / "induction_numbers.json").read_text())
    heads, sweep = numbers["heads"], numbers["patching"]
    ablations = numbers["read_write"]["ablations"]

    def head(layer_head: list[int]) -> str:
        return f"L{layer_head[0]}H{layer_head[1]}"

    quickstart = (ROOT / "docs" / "quickstart.md").read_text()
    edits = (ROOT / "docs" / "concepts" / "edits.md").read_text()
    expected_quickstart = [
        f"trained for {numbers['training']['steps']} steps",
        f"{head(heads['previous_token_head'])} is the previous-token head",
        f"most at {head([sweep['keys_peak']['layer'], sweep['keys_peak']['head']])}",
        f"({sweep['keys_peak']['metric']:.2f};",
        f"at {head([sweep['values_peak']['layer'], sweep['values_peak']['head']])} on",
        f"({sweep['values_peak']['metric']:.2f})",
        f"raises it to {ablations['write_previous_token_head']['loss']:.2f}",
        f"gives {ablations['read_induction_keys']['loss']:.2f}",
        f"chance ({numbers['read_write']['chance_loss']:.2f})",
    ]
    missing = [text for text in expected_quickstart if text not in quickstart.replace("\n", " ")]
    assert not missing, f"docs/quickstart.md does not quote {missing}"
    for name, result in ablations.items():
        rows = [f"| {result['loss']:.{d}f} | {result['p_correct']:.2f} |" for d in (2, 3)]
        assert any(row in edits for row in rows), f"docs/concepts/edits.md lacks {rows} ({name})"


def test_patching_heatmap_quotes_the_published_numbers() -> None:
    # docs/howto/patching.md shows the demonstration's key/value figure and quotes its
    # grids (examples/induction_demo.py --docs): the numbers must be the published ones.
    import json

    numbers = json.loads((ROOT / "docs" / "figures" / "induction_numbers.json").read_text())
    sweep, training = numbers["patching"], numbers["training"]
    keys, values = sweep["keys"], sweep["values"]  # [layer][pos][head]
    source = sweep["keys_peak"]["position"]
    layer_1_keys = sorted(((keys[1][source][h], h) for h in range(4)), reverse=True)
    layer_1_values = [values[1][source - 1][h] for h in range(4)]
    page = (ROOT / "docs" / "howto" / "patching.md").read_text()
    section = page[page.index("### A heatmap from a real run") :].replace("\n", " ")
    section = section[: section.index("## TransformerBridge")]
    expected = [
        f"trained for {training['steps']} steps",
        f"continued {training['accuracy']:.0%} of held-out",
        "../figures/induction_kv_patching.png",
        ", ".join(f"L1H{head} {value:.2f}" for value, head in layer_1_keys[1:]),
        f"L1H{sweep['keys_peak']['head']} {sweep['keys_peak']['metric']:.2f} (the peak)",
        f"L{sweep['values_peak']['layer']}H{sweep['values_peak']['head']} on "
        f"`s{sweep['values_peak']['position']}` ({sweep['values_peak']['metric']:.2f}, the peak)",
        f"add {min(layer_1_values):.2f}–{max(layer_1_values):.2f}",
    ]
    missing = [text for text in expected if text not in section]
    assert not missing, f"docs/howto/patching.md's heatmap section does not quote {missing}"
    assert layer_1_keys[0][1] == sweep["keys_peak"]["head"]
    assert source == 10 and sweep["values_peak"]["position"] == 9  # the labels `s10`, `s9`


def test_benchmarks_page_opens_with_the_latest_results() -> None:
    # A reader's first screen is the latest result of each target, with date and versions.
    lines = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    sections = [line for line in lines if line.startswith("## ")]
    assert sections[:2] == ["## Latest results", "## Running it"], sections
    table = lines.index("## Latest results") + 1
    header = next(i for i in range(table, len(lines)) if lines[i].startswith("| job"))
    assert header < 20 and "measured" in lines[header] and "versions" in lines[header]
