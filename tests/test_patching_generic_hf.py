"""`generic_activation_patch` on a TransformerBridge, against TransformerLens' own.

The reference is `transformer_lens.patching.generic_activation_patch` on the same bridge
(one `run_with_hooks` per index), with TransformerLens' setters and a setter of our own
that changes several positions; four-layer Llama (rotary, grouped-query) and GPT-2
bridges, index grids by axis names and by `index_df`, batched and per-run metrics.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from bridge_models import bridge
from hf_models import ids, model
from transformer_lens import patching

import safelens
from safelens import PatchingError, run_with_patching_cache

TOL = 1e-5  # tighter than the sweeps' 1e-4: some pattern patches move the metric by 1e-4
LENGTH = 7


def metric(logits: torch.Tensor) -> torch.Tensor:
    """TransformerLens-style: one run's logits to a scalar, reading every position."""
    return logits[:, :, 3].mean() - logits[:, -1, 5].mean()


def pair(batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    clean = ids(batch, LENGTH, seed=2)
    corrupted = clean.clone()
    corrupted[:, 2] = 9
    corrupted[:, 5] = 11
    return clean, corrupted


def smear(corrupted_activation, index, clean_activation):
    """Patch positions pos and every later one (a setter TransformerLens' sweeps lack)."""
    layer, pos = index
    corrupted_activation[:, pos:] = clean_activation[:, pos:]
    return corrupted_activation


CASES = [
    ("resid_pre", patching.layer_pos_patch_setter, ("layer", "pos")),
    ("k", patching.layer_pos_head_vector_patch_setter, ("layer", "pos", "head_index")),
    ("z", patching.layer_head_vector_patch_setter, ("layer", "head_index")),
    ("mlp_out", smear, ("layer", "pos")),
    ("resid_mid", patching.layer_pos_patch_setter, ("layer", "pos")),
    ("pattern", patching.layer_head_pattern_patch_setter, ("layer", "head_index")),
]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_bridge_generic_equals_transformer_lens(name):
    lm = bridge(name, layers=4)
    clean, corrupted = pair()
    _, clean_cache = lm.run_with_cache(clean)
    for activation, setter, axes in CASES:
        got = safelens.generic_activation_patch(
            lm, corrupted, clean_cache, metric, setter, activation, axes, progress=False
        )
        expected = patching.generic_activation_patch(
            lm, corrupted, clean_cache, metric, setter, activation, axes
        )
        assert got.shape == expected.shape, activation
        assert (got - expected).abs().max() <= TOL, activation
        assert (got - got.flatten()[0]).abs().max() > 1e-6, activation  # the patches matter
    assert all(not point._forward_hooks for point in lm.hook_dict.values())


def test_bridge_generic_takes_an_index_df_a_batch_and_a_last_position_metric():
    lm = bridge("llama", layers=4)
    clean, corrupted = pair(2)
    _, clean_cache = lm.run_with_cache(clean)
    index_df = pd.DataFrame(
        [[3, 6, 1], [0, 2, 0], [2, -1, 3], [1, 5, 2]], columns=["layer", "pos", "head_index"]
    )

    def last(logits):
        return (logits[:, -1, 3] - logits[:, -1, 5]).reshape(-1, 2).mean(-1)

    last.last_position_only = True
    got, rows = safelens.generic_activation_patch(
        lm,
        corrupted,
        clean_cache,
        last,
        patching.layer_pos_head_vector_patch_setter,
        "q",
        index_df=index_df,
        return_index_df=True,
        max_batch=2,
        progress=False,
    )
    expected = patching.generic_activation_patch(
        lm,
        corrupted,
        clean_cache,
        lambda logits: last(logits).mean(),
        patching.layer_pos_head_vector_patch_setter,
        "q",
        index_df=index_df,
    )
    assert rows is index_df and got.shape == (4,)
    assert (got - expected).abs().max() <= TOL


def test_bridge_generic_refuses_what_it_cannot_patch():
    lm = bridge("gpt2", layers=4)
    clean, corrupted = pair()
    _, clean_cache = lm.run_with_cache(clean)
    generic = safelens.generic_activation_patch
    with pytest.raises(PatchingError, match="not a hook point inside block 0"):
        generic(lm, corrupted, clean_cache, metric, smear, "embed", ("layer", "pos"))
    with pytest.raises(PatchingError, match="patch_setter returned shape"):
        generic(
            lm, corrupted, clean_cache, metric, lambda a, i, c: a[:, :1], "resid_pre", ("layer",)
        )
    with pytest.raises(
        PatchingError, match="clean_cache has no activation 'blocks.0.hook_resid_pre'"
    ):
        generic(lm, corrupted, {}, metric, smear, "resid_pre", ("layer", "pos"), progress=False)
    with pytest.raises(PatchingError, match="Clean and corrupted prompts must have the same"):
        generic(lm, corrupted[:, :5], clean_cache, metric, smear, "resid_pre", ("layer", "pos"))
    with pytest.raises(PatchingError, match="pass exactly one of index_axis_names"):
        generic(lm, corrupted, clean_cache, metric, smear, "resid_pre")
    assert all(not point._forward_hooks for point in lm.hook_dict.values())


def test_generic_on_a_plain_huggingface_model_names_what_it_patches():
    lm = model("llama")
    clean, corrupted = pair()
    _, clean_cache = run_with_patching_cache(lm, clean)
    with pytest.raises(PatchingError, match="which safelens does not patch on a HuggingFace"):
        safelens.generic_activation_patch(
            lm, corrupted, clean_cache, metric, smear, "embed", ("layer", "pos")
        )
    with pytest.raises(PatchingError, match="clean_cache has no activation 'blocks.0.attn.hook_q'"):
        safelens.generic_activation_patch(
            lm, corrupted, {}, metric, smear, "q", ("layer", "pos"), progress=False
        )
