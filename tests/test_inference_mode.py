"""Everything a researcher wraps in `torch.inference_mode()` gives the `no_grad` numbers.

Tensors made under `torch.inference_mode()` count no in-place edits (reading
`tensor._version` raises) and cannot be saved for a backward pass. The clean cache, the
sweeps (patterns included, whose scores safelens reads), attribution patching (which
differentiates the metric) and their datasets run inside it, and on prompts and clean
caches made inside it, on a HuggingFace model, a `HookedTransformer` and a bridge; the
reference is the same call under `torch.no_grad()`.
"""

from __future__ import annotations

import pytest
import torch
from bridge_models import bridge
from hf_models import ids, model

import safelens
from safelens import attribution_patch, attribution_patch_dataset, run_with_patching_cache


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 3] - logits[:, -1, 5]


def pair_metric(logits: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 3] - logits[:, -1, 5]


def _model(family: str):
    if family == "hf":
        return model("llama")
    if family == "bridge":
        return bridge("llama")
    from models import make_model

    return make_model()


def _clean_cache(lm, clean):
    if hasattr(lm, "run_with_cache"):  # a HookedTransformer or a bridge
        return lm.run_with_cache(clean)[1]
    return run_with_patching_cache(lm, clean)[1]


FAMILIES = ["hf", pytest.param("hooked", marks=pytest.mark.hooked_transformer), "bridge"]
SWEEPS = [
    "get_act_patch_resid_pre",
    "get_act_patch_attn_head_k_by_pos",
    "get_act_patch_attn_head_pattern_by_pos",
]


def _all(lm, clean, corrupted) -> dict[str, torch.Tensor]:
    """Every result this file compares, from prompts and a clean cache made here."""
    clean_cache = _clean_cache(lm, clean)
    results = {
        name: getattr(safelens, name)(lm, corrupted, clean_cache, metric, progress=False)
        for name in SWEEPS
    }
    attribution = attribution_patch(
        lm, corrupted, clean_cache, metric, activations=["k", "q", "resid_pre"], qk_fix=True
    )
    results["baseline"] = attribution.baseline
    results |= {f"attribution {name}": grid for name, grid in attribution.estimates.items()}
    dataset = attribution_patch_dataset(
        lm,
        torch.cat([clean, clean.flip(1)]),
        torch.cat([corrupted, corrupted.flip(1)]),
        pair_metric,
        activations=["v", "attn_out"],
        n_bootstrap=10,
        progress=False,
    )
    results |= {f"dataset {name}": grid.per_pair for name, grid in dataset.estimates.items()}
    return results


@pytest.mark.parametrize("family", FAMILIES)
def test_every_call_under_inference_mode_gives_the_no_grad_numbers(family):
    lm = _model(family)
    clean, corrupted = ids(1, 6, seed=1), ids(1, 6, seed=2)
    with torch.no_grad():
        expected = _all(lm, clean, corrupted)
    with torch.inference_mode():
        inside = _all(lm, clean, corrupted)
        made_inside = clean.clone(), corrupted.clone()
    with torch.no_grad():
        outside = _all(lm, *made_inside)  # inference tensors handed in from outside it
    for got in (inside, outside):
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-6, msg=name)
