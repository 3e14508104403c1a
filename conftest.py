"""Names that doctests in safelens docstrings may use without importing them, and a
temporary folder for the sessions of the Ray instances tests start."""

import os
import shutil
import tempfile
import time

import pytest
import torch

import safelens


@pytest.fixture(scope="session", autouse=True)
def _ray_temp_dir():
    """Ray keeps each instance's sockets and logs under `RAY_TMPDIR`: here, a folder
    removed when the tests end (Ray's default, /tmp/ray, outlives them)."""
    folder = tempfile.mkdtemp(prefix="ray")
    previous = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = folder
    yield
    if previous is None:
        del os.environ["RAY_TMPDIR"]
    else:
        os.environ["RAY_TMPDIR"] = previous
    for _ in range(50):  # Ray's helper processes may still write there as they exit
        shutil.rmtree(folder, ignore_errors=True)
        if not os.path.exists(folder):
            break
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace: dict) -> None:
    doctest_namespace["torch"] = torch
    for name in safelens.__all__:
        try:
            doctest_namespace[name] = getattr(safelens, name)
        except ImportError:  # needs HookedTransformer, gone in TransformerLens 4
            continue
