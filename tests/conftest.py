"""Test set-up: `tests/` on the path, the test device, no gradients, the TransformerLens 4 skips.

`SAFELENS_TEST_DEVICE` picks the device the model builders use (`tests/devices.py`); a
device this machine lacks stops the run at start-up instead of skipping tests, and the
report header names the device.

TransformerLens 4 removed `HookedTransformer` (and `HookedTransformerConfig`,
`transformer_lens.components`, …). In an environment with TransformerLens 4, a test that
needs them is skipped with the reason `HOOKED_TRANSFORMER_REMOVED`: a test marked
`@pytest.mark.hooked_transformer`, a docstring example whose code names
`HookedTransformer`, a test run on a docs page or example script (a `Path` parameter)
whose code does, and a whole test file or safelens module (its doctests) whose import
fails on one of those parts. A test that fails at run time by importing one fails the
run: the code it runs should not need `HookedTransformer` unless the test says so (mark
it).
"""

import re
import sys
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from devices import DEVICE, check_device  # noqa: E402

from safelens.patching import _hf_checked  # noqa: E402

HOOKED_TRANSFORMER_REMOVED = "HookedTransformer was removed in TransformerLens 4"
HAS_HOOKED_TRANSFORMER = int(version("transformer-lens").split(".")[0]) < 4


def _needs_hooked_transformer(error: BaseException | None) -> bool:
    """Whether `error` (or what caused it) is an import of a part TransformerLens 4 removed."""
    while error is not None:
        if isinstance(error, ImportError):
            frame = error.__traceback__
            while frame is not None and frame.tb_next is not None:
                frame = frame.tb_next
            raised_in = "" if frame is None else frame.tb_frame.f_globals.get("__name__", "")
            if "transformer_lens" in {(error.name or "").split(".")[0], raised_in.split(".")[0]}:
                return True
        error = error.__cause__ or error.__context__
    return False


_PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _code_names_hooked_transformer(item: pytest.Item) -> bool:
    """Whether the item's docstring example, or the code of a page or script it runs, does."""
    examples = getattr(getattr(item, "dtest", None), "examples", ())
    code = [example.source for example in examples]
    params = getattr(getattr(item, "callspec", None), "params", {})
    for path in (value for value in params.values() if isinstance(value, Path)):
        text = path.read_text()
        code += _PYTHON_BLOCK.findall(text) if path.suffix == ".md" else [text]
    return any("HookedTransformer" in block for block in code)


def _skip_if_hooked_transformer_missing(collect: Callable[[], Any]) -> Callable[[], Any]:
    def collect_or_skip() -> Any:
        try:
            return list(collect())
        except Exception as error:
            if _needs_hooked_transformer(error):
                pytest.skip(HOOKED_TRANSFORMER_REMOVED)
            raise

    return collect_or_skip


class _WithoutHookedTransformer:
    """Hooks for an environment with TransformerLens 4, for tests/ and safelens/ alike."""

    @pytest.hookimpl(wrapper=True)
    def pytest_collect_file(self, file_path: Path, parent: pytest.Collector) -> Any:
        collectors = yield
        for collector in collectors or ():
            collector.collect = _skip_if_hooked_transformer_missing(collector.collect)
        return collectors

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        skip = pytest.mark.skip(reason=HOOKED_TRANSFORMER_REMOVED)
        for item in items:
            if item.get_closest_marker("hooked_transformer") or _code_names_hooked_transformer(
                item
            ):
                item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    problem = check_device()
    if problem is not None:
        raise pytest.UsageError(f"{problem}; unset it to test on the CPU")
    config.addinivalue_line(
        "markers",
        "hooked_transformer: needs TransformerLens' HookedTransformer (skipped on "
        "TransformerLens 4, which removed it)",
    )
    if not HAS_HOOKED_TRANSFORMER:
        config.pluginmanager.register(_WithoutHookedTransformer(), "without-hooked-transformer")


def pytest_report_header() -> str:
    return f"safelens test device: {DEVICE} (SAFELENS_TEST_DEVICE)"


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(autouse=True)
def _fresh_shortcut_checks():
    """Each test's sweeps check their shortcuts anew: tests share cached models, and some
    change what a check sees (a monkeypatched `joining`) on a model checked before."""
    _hf_checked.forget()
    yield
