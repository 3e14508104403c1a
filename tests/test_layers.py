"""Safelens' layers import downward only, read from the source with `ast`.

`safelens.core` (the containers) knows no backend, experiment, patching or distributed
code; `safelens.backends` knows no experiment, patching or distributed code; and a
model family's adapter (`safelens.backends.<family>`) reaches another family only
through the shared protocol (`safelens.backends._backend`, `_supported`), with one
stated exception: the TransformerBridge wraps a HuggingFace model and its cache, so
`bridge` builds on `hf`. Imports are collected from every module's source (including
ones inside functions and `TYPE_CHECKING` blocks), not from what happens to be loaded.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "safelens"
FAMILIES = {"bridge", "hf", "hooked"}
# A family may import these other families; each arrow says why.
ALLOWED_FAMILY_ARROWS = {
    # TransformerBridge wraps a HuggingFace causal LM and keeps the HuggingFace cache.
    ("bridge", "hf"),
}
FORBIDDEN = {
    "safelens.core": ("backends", "experiments", "patching", "distributed"),
    "safelens.backends": ("experiments", "patching", "distributed"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def typing_only(tree: ast.Module) -> set[ast.AST]:
    """The nodes inside `if TYPE_CHECKING:` blocks, which never run."""
    return {
        inner
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for statement in node.body
        for inner in ast.walk(statement)
    }


def imported_modules(path: Path, *, runtime_only: bool = False) -> set[str]:
    """The safelens modules `path` imports, with relative imports made absolute."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = typing_only(tree) if runtime_only else set()
    found: set[str] = set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return {module for module in found if module.partition(".")[0] == "safelens"}


MODULES = {module_name(path): imported_modules(path) for path in PACKAGE.rglob("*.py")}
RUNTIME = {
    module_name(path): imported_modules(path, runtime_only=True) for path in PACKAGE.rglob("*.py")
}


def family(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] == ["safelens", "backends"] and len(parts) > 2 and parts[2] in FAMILIES:
        return parts[2]
    return None


def test_imports_are_read_from_source() -> None:
    assert {"safelens", "safelens.core._cache", "safelens.backends.hf._cache"} <= set(MODULES)
    assert "safelens.core._errors" in MODULES["safelens.core._cache"]
    assert "safelens.backends.hf._model" in MODULES["safelens.backends.bridge._backend"]
    assert "safelens.distributed._workers" in MODULES["safelens.distributed._job"]
    assert "safelens.distributed._workers" not in RUNTIME["safelens.distributed._job"]


def test_no_module_imports_itself_back() -> None:
    """No cycle among the imports that run (packages' `__init__` re-exports aside)."""
    packages = {
        module for module in MODULES if (PACKAGE.parent / module.replace(".", "/")).is_dir()
    }
    graph = {
        module: {target for target in targets if target in MODULES} - packages - {module}
        for module, targets in RUNTIME.items()
        if module not in packages
    }
    done: set[str] = set()

    def reaches_back(module: str, path: tuple[str, ...]) -> tuple[str, ...] | None:
        if module in path:
            return (*path[path.index(module) :], module)
        if module in done:
            return None
        for target in sorted(graph[module]):
            cycle = reaches_back(target, (*path, module))
            if cycle is not None:
                return cycle
        done.add(module)
        return None

    assert [cycle for module in sorted(graph) if (cycle := reaches_back(module, ()))] == []


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_point_down(layer: str) -> None:
    upward = {
        (module, target)
        for module, targets in MODULES.items()
        if module == layer or module.startswith(f"{layer}.")
        for target in targets
        if target.split(".")[1] in FORBIDDEN[layer]
    }
    assert upward == set()


def test_families_meet_only_through_the_shared_protocol() -> None:
    crossing = {
        (module, target)
        for module, targets in MODULES.items()
        for target in targets
        if family(module) is not None
        and family(target) not in (None, family(module))
        and (family(module), family(target)) not in ALLOWED_FAMILY_ARROWS
    }
    assert crossing == set()


def test_allowed_family_arrows_are_used() -> None:
    used = {
        (family(module), family(target))
        for module, targets in MODULES.items()
        for target in targets
        if family(module) is not None and family(target) not in (None, family(module))
    }
    assert used == ALLOWED_FAMILY_ARROWS
