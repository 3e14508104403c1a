"""Names that doctests in safelens docstrings may use without importing them."""

import pytest
import torch

import safelens


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace: dict) -> None:
    doctest_namespace["torch"] = torch
    for name in safelens.__all__:
        try:
            doctest_namespace[name] = getattr(safelens, name)
        except ImportError:  # needs HookedTransformer, gone in TransformerLens 4
            continue
