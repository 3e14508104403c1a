"""`import safelens` works with TransformerLens 3.9, with 4.x, and with transformers alone.

What needs `HookedTransformer` (its adapter, shared-prefix attention, the patching
sweeps) loads on first use and, where TransformerLens 4 removed it or TransformerLens is
missing, fails on use with an `ImportError` saying what to install. The environment
without TransformerLens is a subprocess in which importing it fails as if it were not
installed; CI's second environment has TransformerLens 4.3 for real.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from types import ModuleType

import pytest

import safelens

ROOT = Path(__file__).resolve().parents[1]
# The sweeps dispatch to TransformerBridge and HuggingFace models without TransformerLens.
ANY_BACKEND = (
    ".backends.hf.",
    ".patching._sweeps",
    ".patching._generic",
    ".patching._hf_sites",
    ".patching._every",
    ".patching._patterns",
    ".patching._dataset",
    ".patching._attribution",
    ".distributed.",
)
HOOKED_ONLY = {
    name
    for module, names in safelens._LAZY_MODULES.items()
    if not module.startswith(ANY_BACKEND)
    for name in names
}
INSTALL = "pip install 'transformer-lens>=3.9,<4'"
HOOKED = int(version("transformer-lens").split(".")[0]) < 4

WITHOUT_TRANSFORMER_LENS = r"""
import importlib.metadata, json, sys


class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "transformer_lens":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
installed_version = importlib.metadata.version


def version(name):
    if name.replace("_", "-").lower() == "transformer-lens":
        raise importlib.metadata.PackageNotFoundError(name)
    return installed_version(name)


importlib.metadata.version = version

import torch
import safelens
from transformers import LlamaConfig, LlamaForCausalLM

report = {"missing": {}, "loaded": []}
star = {}
exec("from safelens import *", star)
report["star"] = sorted(name for name in star if name != "__builtins__")
for name in sorted({*safelens.__all__, *safelens._LAZY}):
    try:
        getattr(safelens, name)
        report["loaded"].append(name)
    except ImportError as error:
        report["missing"][name] = str(error)
model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=2, vocab_size=20)).eval()
with torch.no_grad():
    prefix = safelens.prefill(model, torch.tensor([[1, 2, 3, 4]]))
    scores = safelens.score_continuations(model, prefix, [[5, 6]])
report["scores"] = list(scores.log_probs.shape)
report["imported"] = sorted(m for m in sys.modules if m.partition(".")[0] == "transformer_lens")
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def without_transformer_lens() -> dict:
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRANSFORMER_LENS],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report: dict = json.loads(result.stdout.strip().splitlines()[-1])
    return report


def test_without_transformer_lens_the_hf_experiments_run(without_transformer_lens):
    assert without_transformer_lens["imported"] == []
    assert without_transformer_lens["scores"] == [1, 2]
    loaded = set(without_transformer_lens["loaded"])
    assert {"HFKeyValueCache", "prefill", "run_with_hooks", "KeyValueCache"} <= loaded


def test_without_transformer_lens_hooked_names_say_what_to_install(without_transformer_lens):
    missing = without_transformer_lens["missing"]
    assert set(missing) == HOOKED_ONLY
    assert set(without_transformer_lens["star"]) == set(without_transformer_lens["loaded"])
    for name, message in missing.items():
        assert message.startswith(f"safelens.{name} needs TransformerLens' HookedTransformer")
        assert "TransformerLens is not installed" in message
        assert "pip install 'safelens[transformer-lens]' 'transformer-lens>=3.9,<4'" in message


def test_every_public_name_loads_or_names_what_to_install_here():
    """TransformerLens 3.x: everything loads. 4.x: exactly the HookedTransformer parts fail."""
    failed = {}
    for name in {*safelens.__all__, *safelens._LAZY}:
        try:
            getattr(safelens, name)
        except ImportError as error:
            failed[name] = str(error)
    assert set(failed) == (set() if HOOKED else HOOKED_ONLY)
    for message in failed.values():
        assert "which TransformerLens 4 removed" in message and INSTALL in message


def test_all_lists_every_public_name():
    """Every public name the package defines or loads lazily, and each once."""
    helpers = {"TYPE_CHECKING", "Any", "PackageNotFoundError", "import_module", "version"}
    public = {
        name
        for name, value in vars(safelens).items()
        if not name.startswith("_") and not isinstance(value, ModuleType)
    }
    exported = set(safelens.__all__)
    loadable = set(safelens._LAZY) - (set() if HOOKED else HOOKED_ONLY)
    assert public - helpers <= exported and loadable <= exported
    assert exported <= public | loadable
    assert len(safelens.__all__) == len(exported)


def test_star_import_gives_every_name_that_loads_here():
    """On TransformerLens 4, `from safelens import *` leaves out the HookedTransformer parts."""
    names: dict = {}
    exec("from safelens import *", names)
    expected = set(safelens.__all__) | set(safelens._LAZY)
    assert set(names) - {"__builtins__"} == expected - (set() if HOOKED else HOOKED_ONLY)


def _imports_of(path: Path, package: str) -> set[str]:
    """The safelens modules `path` imports anywhere (type-checking and function-level too)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("safelens"):
            found.add(str(node.module))
    return found


def test_the_backends_import_each_other_without_cycles():
    """Arrows point down: no module under safelens/backends imports back into its importers."""
    modules = {}
    for path in (ROOT / "safelens" / "backends").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = ".".join(parts[:-1])
        modules[name] = _imports_of(path, package)
    graph = {name: {m for m in imported if m in modules} for name, imported in modules.items()}
    visiting: list[str] = []
    done: set[str] = set()

    def visit(name: str) -> None:
        assert name not in visiting, " -> ".join([*visiting[visiting.index(name) :], name])
        if name in done:
            return
        visiting.append(name)
        for other in sorted(graph[name]):
            visit(other)
        visiting.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)
