"""Every public exception reports its public path, `safelens.<Name>`.

Tracebacks, reprs and pickles (which Ray workers use to send errors back) name the class
by its `__module__`; a private module path there would point users at a file they should
not import from.
"""

from __future__ import annotations

import pickle
import traceback

import pytest

import safelens
from safelens.core import _errors

ERRORS = [getattr(safelens, name) for name in _errors.__all__]


def test_every_error_is_exported_from_safelens() -> None:
    assert all(name in safelens.__all__ for name in _errors.__all__)
    assert all(issubclass(error, safelens.SafelensError) for error in ERRORS)


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: error.__name__)
def test_error_reports_its_public_path(error: type[safelens.SafelensError]) -> None:
    raised = error("what arrived")
    assert error.__module__ == "safelens"
    assert traceback.format_exception_only(raised) == [f"safelens.{error.__name__}: what arrived\n"]
    restored = pickle.loads(pickle.dumps(raised))
    assert type(restored) is error and restored.args == ("what arrived",)
