"""`import safelens` needs only the core dependencies; optional parts name their extra.

A fresh virtual environment needs the network, so these tests prove the import graph
instead: safelens' own module-level imports are all core dependencies (or theirs), and a
subprocess in which every installed distribution outside the core dependencies' closure
is hidden (as if never installed) imports every safelens module.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import safelens

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "safelens"


def core_dependencies() -> list[Requirement]:
    with (ROOT / "pyproject.toml").open("rb") as file:
        return [Requirement(d) for d in tomllib.load(file)["project"]["dependencies"]]


def extra_dependencies() -> list[Requirement]:
    with (ROOT / "pyproject.toml").open("rb") as file:
        extras = tomllib.load(file)["project"]["optional-dependencies"]
    return [Requirement(d) for name, deps in extras.items() if name != "dev" for d in deps]


def core_closure() -> set[str]:
    """Distributions `pip install .` (no extras) brings: the core ones and theirs."""
    seen = {"safelens"}
    todo = [(requirement, {""}) for requirement in core_dependencies()]
    while todo:
        requirement, extras = todo.pop()
        name = canonicalize_name(requirement.name)
        marker = requirement.marker
        if marker is not None and not any(marker.evaluate({"extra": e}) for e in extras):
            continue
        if name in seen:
            continue
        seen.add(name)
        try:
            children = importlib.metadata.requires(requirement.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [(Requirement(child), {"", *requirement.extras}) for child in children]
    return seen


def owners(module: str) -> set[str]:
    """The installed distributions that provide top-level module `module`."""
    found = importlib.metadata.packages_distributions().get(module, [])
    return {canonicalize_name(name) for name in found}


def import_time_modules(path: Path) -> set[str]:
    """Top-level names a module imports when it is imported (not in functions, not
    under `if TYPE_CHECKING:`)."""
    names: set[str] = set()
    statements = list(ast.parse(path.read_text()).body)
    while statements:
        node = statements.pop()
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
        elif isinstance(node, ast.If) and ast.unparse(node.test) != "TYPE_CHECKING":
            statements += node.body + node.orelse
        elif isinstance(node, ast.Try):
            statements += node.body + node.orelse + node.finalbody
            statements += [s for handler in node.handlers for s in handler.body]
    return names - set(sys.stdlib_module_names) - {"__future__"}


def third_party_imports() -> dict[str, set[str]]:
    """Each third-party top-level module safelens imports at import time, by module."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.glob("*.py")):
        for name in import_time_modules(path):
            found.setdefault(name, set()).add(path.name)
    return found


def test_module_level_imports_are_core_dependencies() -> None:
    closure = core_closure()
    outside = {
        name: sorted(files)
        for name, files in third_party_imports().items()
        if not owners(name) & closure
    }
    assert outside == {}, f"imported at module level but not a core dependency: {outside}"
    assert "matplotlib" not in third_party_imports()


def test_direct_imports_are_declared() -> None:
    declared = {canonicalize_name(r.name) for r in core_dependencies() + extra_dependencies()}
    undeclared = {
        name: sorted(files)
        for name, files in third_party_imports().items()
        if not owners(name) & declared
    }
    assert undeclared == {}, f"imported directly but not declared in dependencies: {undeclared}"


def test_plotting_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"needs matplotlib.*pip install 'safelens\[plot\]'"):
        safelens.plot_patching_heatmap(torch.rand(2, 3))


# Run in a fresh interpreter: hide every distribution outside ALLOWED (find_spec and
# importlib.metadata both stop seeing it, as in an environment where it was never
# installed), then import safelens and each of its modules, and call the plot helper.
HIDDEN_ENVIRONMENT = r"""
import importlib, importlib.metadata, json, pkgutil, re, sys

allowed = set(json.loads(sys.argv[1]))
canon = lambda name: re.sub(r"[-_.]+", "-", name).lower()
owners = {k: {canon(d) for d in v} for k, v in importlib.metadata.packages_distributions().items()}
attempts = []


def hidden(module):
    found = owners.get(module.partition(".")[0], set())
    return bool(found) and not found & allowed


class Only:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if hidden(name):
            attempts.append(name)
            return None
        find = getattr(self.finder, "find_spec", None)
        return None if find is None else find(name, path, target)

    def find_distributions(self, *args, **kwargs):
        find = getattr(self.finder, "find_distributions", None)
        found = [] if find is None else find(*args, **kwargs)
        return (d for d in found if canon(d.metadata["Name"] or "") in allowed)

    def invalidate_caches(self):
        getattr(self.finder, "invalidate_caches", lambda: None)()


sys.meta_path[:] = [Only(finder) for finder in sys.meta_path]
report = {"failures": {}}
import safelens

report["attempted_by_import"] = sorted(set(attempts))
report["modules"] = ["safelens"]
for info in pkgutil.walk_packages(safelens.__path__, "safelens."):
    report["modules"].append(info.name)
    try:
        importlib.import_module(info.name)
    except Exception as error:
        report["failures"][info.name] = repr(error)
import torch
try:
    safelens.plot_patching_heatmap(torch.rand(2, 3))
except ImportError as error:
    report["plot_error"] = str(error)
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def hidden_run() -> dict:
    result = subprocess.run(
        [sys.executable, "-c", HIDDEN_ENVIRONMENT, json.dumps(sorted(core_closure()))],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_transformer_lens_is_an_extra_and_the_dev_environment_keeps_it() -> None:
    # A plain `pip install safelens` serves plain HuggingFace models; TransformerLens (and
    # the wandb, datasets, pyarrow, accelerate it brings) is `safelens[transformer-lens]`.
    with (ROOT / "pyproject.toml").open("rb") as file:
        project = tomllib.load(file)["project"]
    core = {canonicalize_name(Requirement(d).name) for d in project["dependencies"]}
    assert core == {
        "torch", "einops", "jaxtyping", "numpy", "pandas", "safetensors", "tqdm", "transformers"
    }  # fmt: skip
    extras = project["optional-dependencies"]
    for extra in ("transformer-lens", "dev"):
        assert "transformer-lens>=3.9,<5" in extras[extra], extra
    assert not {"transformer-lens", "wandb", "datasets", "pyarrow", "accelerate"} & core_closure()


@pytest.mark.slow
def test_every_module_imports_with_only_core_dependencies(hidden_run: dict) -> None:
    # Only what needs HookedTransformer (its adapter, the patching grid it runs) fails,
    # and only on TransformerLens; the HuggingFace backend and the experiments import.
    failures = hidden_run["failures"]
    assert all("transformer_lens" in error for error in failures.values()), failures
    assert failures.keys() <= {
        name
        for name in hidden_run["modules"]
        if name.startswith(("safelens.backends.hooked.", "safelens.backends.bridge."))
        or name
        in {"safelens.patching._plan", "safelens.patching._grid", "safelens.patching._inputs"}
    }, failures
    expected = {
        f"safelens.{path.stem}" for path in PACKAGE.glob("_*.py") if path.stem != "__init__"
    }
    assert expected <= set(hidden_run["modules"])
    assert "matplotlib" not in hidden_run["attempted_by_import"]
    assert "transformer_lens" not in hidden_run["attempted_by_import"]


@pytest.mark.slow
def test_plotting_in_a_core_only_environment_names_the_extra(hidden_run: dict) -> None:
    assert "pip install 'safelens[plot]'" in hidden_run["plot_error"]
