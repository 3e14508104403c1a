"""`import safelens.patching as patching` in place of `transformer_lens.patching`.

Every public function of TransformerLens 3.9's `patching` module is in
`safelens.patching` under its name, with its parameters (same names, order, kinds and
defaults; safelens adds keyword-only ones after them), and gives its results: the
setters and `make_df_from_ranges` equal TransformerLens' own, and a sweep called with
TransformerLens' keywords (`index_df`, `return_index_df`, another setter) is the
generic patch TransformerLens runs.
"""

from __future__ import annotations

import functools
import inspect
import subprocess
import sys
from typing import Any

import pandas as pd
import pytest
import torch

import safelens.patching as patching
from safelens import PatchingError

pytestmark = pytest.mark.hooked_transformer


def _theirs() -> Any:
    from transformer_lens import patching as tl_patching

    return tl_patching


def _public_functions(module: Any) -> dict[str, Any]:
    """The functions a module defines (partials of its own functions included)."""
    found = {}
    for name, value in vars(module).items():
        target = value.func if isinstance(value, functools.partial) else value
        if not name.startswith("_") and inspect.isfunction(target):
            if target.__module__ == module.__name__:
                found[name] = value
    return found


def _same_default(ours: Any, theirs: Any) -> bool:
    if inspect.isfunction(theirs):
        return inspect.isfunction(ours) and ours.__name__ == theirs.__name__
    return bool(ours == theirs)


def test_every_public_function_of_transformer_lens_patching_is_here() -> None:
    theirs = _public_functions(_theirs())
    assert len(theirs) == 26  # 18 sweeps, generic_activation_patch, 6 setters, a frame
    missing = sorted(set(theirs) - set(patching.__all__))
    assert not missing
    assert all(callable(getattr(patching, name)) for name in theirs)


@pytest.mark.parametrize("name", sorted(_public_functions(_theirs())))
def test_each_takes_transformer_lens_parameters(name: str) -> None:
    theirs = list(inspect.signature(getattr(_theirs(), name)).parameters.values())
    ours = list(inspect.signature(getattr(patching, name)).parameters.values())
    assert [p.name for p in ours[: len(theirs)]] == [p.name for p in theirs]
    for mine, their in zip(ours, theirs, strict=False):
        assert mine.kind == their.kind, mine.name
        assert _same_default(mine.default, their.default), mine.name
    extra = ours[len(theirs) :]
    assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in extra)


@pytest.mark.parametrize(
    "setter, shape, index",
    [
        ("layer_pos_patch_setter", (2, 5, 8), [1, 3]),
        ("layer_pos_head_vector_patch_setter", (2, 5, 4, 8), [0, -1, 2]),
        ("layer_head_vector_patch_setter", (2, 5, 4, 8), [1, 3]),
        ("layer_head_pattern_patch_setter", (2, 4, 5, 5), [0, 2]),
        ("layer_head_pos_pattern_patch_setter", (2, 4, 5, 5), [0, 2, 4]),
        ("layer_head_dest_src_pos_pattern_patch_setter", (2, 4, 5, 5), [0, 2, 4, 1]),
    ],
)
def test_setters_write_what_transformer_lens_writes(setter: str, shape, index) -> None:
    generator = torch.Generator().manual_seed(0)
    corrupted, clean = (
        torch.randn(shape, generator=generator),
        torch.randn(shape, generator=generator),
    )
    expected = getattr(_theirs(), setter)(corrupted.clone(), index, clean)
    given = corrupted.clone()
    result = getattr(patching, setter)(given, index, clean)
    assert result is given and torch.equal(result, expected)
    with pytest.raises(PatchingError, match=r"this patch setter takes index \[layer, "):
        getattr(patching, setter)(corrupted.clone(), index + [0], clean)


def test_make_df_from_ranges_is_transformer_lens() -> None:
    expected = _theirs().make_df_from_ranges([2, 3, 2], ["layer", "pos", "head"])
    pd.testing.assert_frame_equal(
        patching.make_df_from_ranges([2, 3, 2], ["layer", "pos", "head"]), expected
    )


def test_a_sweep_given_transformer_lens_keywords_is_their_generic_patch() -> None:
    from models import make_model, tokens

    model = make_model()
    clean, corrupted = tokens(1, 5, seed=1), tokens(1, 5, seed=2)
    _, clean_cache = model.run_with_cache(clean)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1, 3] - logits[:, -1, 5]

    index_df = pd.DataFrame({"layer": [1, 0, 1], "pos": [4, 2, 0]})
    keywords = dict(index_axis_names=None, index_df=index_df, return_index_df=True)
    ours, ours_df = patching.get_act_patch_resid_pre(
        model, corrupted, clean_cache, metric, **keywords, progress=False
    )
    theirs, theirs_df = _theirs().get_act_patch_resid_pre(
        model, corrupted, clean_cache, metric, **keywords
    )
    torch.testing.assert_close(ours, theirs.to(ours), atol=1e-5, rtol=1e-5)
    pd.testing.assert_frame_equal(ours_df, theirs_df)
    # Another setter and activation through a sweep, as TransformerLens' partial takes them.
    other = dict(activation_name="attn_out", index_axis_names=("layer", "pos"))
    torch.testing.assert_close(
        patching.get_act_patch_resid_pre(model, corrupted, clean_cache, metric, **other),
        _theirs().get_act_patch_resid_pre(model, corrupted, clean_cache, metric, **other),
        atol=1e-5,
        rtol=1e-5,
    )
    pattern = dict(index_axis_names=("layer", "head_index"))
    torch.testing.assert_close(
        patching.get_act_patch_attn_head_pattern_by_pos(
            model,
            corrupted,
            clean_cache,
            metric,
            patch_setter=patching.layer_head_pattern_patch_setter,
            **pattern,
            progress=False,
        ),
        _theirs().get_act_patch_attn_head_pattern_by_pos(
            model,
            corrupted,
            clean_cache,
            metric,
            patch_setter=_theirs().layer_head_pattern_patch_setter,
            **pattern,
        ),
        atol=1e-5,
        rtol=1e-5,
    )


def test_import_safelens_patching_imports_neither_transformer_lens_nor_pandas() -> None:
    code = (
        "import sys, safelens.patching as p; "
        "print(sorted(m for m in ('transformer_lens', 'transformers', 'pandas') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
