"""The one place the patching package reads a model's family (`safelens.patching._runners`).

Every entry point (the named sweeps, the pattern sweeps, the `*_every` bundles,
`generic_activation_patch`, `patch_dataset`) refuses a model of no family with the same
`PatchingError`, naming what arrived, before it runs anything: a stray module, `None`,
the decoder inside a HuggingFace causal LM (which has no language-model head), and a
safelens adapter in place of its model. Before, on TransformerLens 4 such a model
reached the `HookedTransformer` runner and failed with TransformerLens' `ImportError`
about `HookedTransformer`'s removal. Runs in both CI environments.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import hf_models
import pytest
import torch

import safelens
import safelens.patching as patching
from safelens import PatchingError
from safelens.backends._families import backend_of


def _metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 0]


def _entry_points() -> dict[str, Callable[[Any, torch.Tensor], Any]]:
    tokens_only = {"progress": False}
    return {
        "get_act_patch_resid_pre": lambda model, tokens: patching.get_act_patch_resid_pre(
            model, tokens, {}, _metric, **tokens_only
        ),
        "get_act_patch_attn_head_k_by_pos": lambda model, tokens: (
            patching.get_act_patch_attn_head_k_by_pos(model, tokens, {}, _metric, **tokens_only)
        ),
        "get_act_patch_attn_head_pattern_all_pos": lambda model, tokens: (
            patching.get_act_patch_attn_head_pattern_all_pos(
                model, tokens, {}, _metric, **tokens_only
            )
        ),
        "get_act_patch_block_every": lambda model, tokens: patching.get_act_patch_block_every(
            model, tokens, {}, _metric, **tokens_only
        ),
        "get_act_patch_attn_head_by_pos_every": lambda model, tokens: (
            patching.get_act_patch_attn_head_by_pos_every(model, tokens, {}, _metric, **tokens_only)
        ),
        "generic_activation_patch": lambda model, tokens: patching.generic_activation_patch(
            model,
            tokens,
            {},
            _metric,
            patching.layer_pos_patch_setter,
            "resid_pre",
            ("layer", "pos"),
            **tokens_only,
        ),
        "patch_dataset": lambda model, tokens: safelens.patch_dataset(
            patching.get_act_patch_resid_pre,
            model,
            tokens,
            tokens,
            lambda logits, pair: logits[:, -1, 0],
            **tokens_only,
        ),
    }


def _not_models() -> dict[str, tuple[Any, str]]:
    """Models of no family, by name: (the model, the type name the error must give)."""
    lm = hf_models.model("llama")
    return {
        "linear": (torch.nn.Linear(2, 2), "Linear"),
        "none": (None, "NoneType"),
        "decoder": (lm.model, type(lm.model).__name__),
        "adapter": (backend_of(lm), "HFBackend"),
    }


@pytest.mark.parametrize("entry", sorted(_entry_points()))
@pytest.mark.parametrize("what", ["linear", "none", "decoder", "adapter"])
def test_a_model_of_no_family_is_refused_by_every_entry_point_naming_it(entry, what):
    model, name = _not_models()[what]
    before = [p.detach().clone() for p in getattr(model, "parameters", lambda: [])()]
    tokens = hf_models.ids(1, 4)
    with pytest.raises(
        PatchingError,
        match=r"model must be a HookedTransformer, a TransformerBridge or a HuggingFace causal "
        rf"LM \(a PreTrainedModel with generate\), got {name}; pass the model the sweep runs on",
    ):
        _entry_points()[entry](model, tokens)
    after = list(getattr(model, "parameters", lambda: [])())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_the_causal_lm_around_a_refused_decoder_runs():
    """The refusal above is the family's, not the inputs': the same call on the LM runs."""
    lm = hf_models.model("llama")
    tokens = hf_models.ids(1, 4)
    _, cache = safelens.run_with_patching_cache(lm, hf_models.ids(1, 4, seed=2))
    result = patching.get_act_patch_resid_pre(lm, tokens, cache, _metric, progress=False)
    assert result.shape == (lm.config.num_hidden_layers, 4)


def _wrappers(lm: torch.nn.Module) -> dict[str, tuple[Any, str]]:
    """Wrappers of `lm` a user may hold instead of it: (the wrapper, where it keeps `lm`)."""
    from nnsight import TransformersModel

    nnsight_model = TransformersModel(lm, tokenizer=hf_models.tokenizer(), task="text-generation")
    with warnings.catch_warnings():  # torch's own, importing its compiler
        warnings.simplefilter("ignore", DeprecationWarning)
        compiled = torch.compile(lm)
    return {
        "nnsight": (nnsight_model, "_module"),
        "compiled": (compiled, "_orig_mod"),
        "data_parallel": (torch.nn.DataParallel(lm), "module"),
    }


@pytest.mark.parametrize("wrapper", ["nnsight", "compiled", "data_parallel"])
def test_a_wrapper_of_a_model_is_refused_saying_where_the_model_is(wrapper):
    lm = hf_models.model("llama")
    wrapped, attribute = _wrappers(lm)[wrapper]
    assert getattr(wrapped, attribute) is lm
    hint = rf"{type(wrapped).__name__} wraps a LlamaForCausalLM: pass that model \(`model\.{attribute}`\)"
    with pytest.raises(PatchingError, match=hint):
        patching.get_act_patch_resid_pre(wrapped, hf_models.ids(1, 4), {}, _metric, progress=False)
    with pytest.raises(TypeError, match=hint):
        safelens.prefill(wrapped, hf_models.ids(1, 4))
