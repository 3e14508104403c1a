"""A clean cache that cannot be this model's clean run is refused, naming what differs.

On every backend (`HookedTransformer`, a TransformerBridge, a plain HuggingFace model)
and every function that reads a clean cache (a sweep, a `*_every` bundle,
`generic_activation_patch`, `attribution_patch`): a cache of another model says which of
its sizes (layers, `d_model`, heads, `d_head`) differ, a clean prompt of another length
says so, and what is not a cache of activations at all (`None`, a string, a list, a
tensor) is named. Each is refused before any pass runs, leaving the model's hooks as
found.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from bridge_models import boot, bridge
from hf_models import CONFIGS, ids, model

import safelens
from safelens import PatchingError, run_with_patching_cache


def metric(logits: torch.Tensor) -> torch.Tensor:
    """One run's logits to a scalar: what every function here takes."""
    return (logits[:, -1, 0] - logits[:, -1, 1]).sum()


def _hf(layers: int = 2, **settings: Any) -> torch.nn.Module:
    """A Llama-like HF model with `settings` changed from the `hf_models` sizes."""
    torch.manual_seed(0)
    config = CONFIGS["llama"](layers)
    for key, value in settings.items():
        setattr(config, key, value)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _hooked(**sizes: Any) -> torch.nn.Module:
    from models import make_model

    return make_model(**sizes)


def _clean_cache(lm: Any, tokens: torch.Tensor) -> Any:
    if hasattr(lm, "run_with_cache"):
        return lm.run_with_cache(tokens)[1]
    return run_with_patching_cache(lm, tokens)[1]


def _tokens(lm: Any, length: int = 5, seed: int = 1) -> torch.Tensor:
    if hasattr(lm, "cfg") and not hasattr(lm, "config"):
        from models import tokens

        return tokens(1, length, seed=seed)
    return ids(1, length, seed=seed)


def _hooks(lm: Any) -> list[Any]:
    """Every torch hook of `lm`'s modules and every TransformerLens hook point's hooks."""
    state: list[Any] = [
        (list(m._forward_hooks.values()), list(m._forward_pre_hooks.values())) for m in lm.modules()
    ]
    points = getattr(lm, "hook_dict", {})
    return state + [(name, list(point.fwd_hooks)) for name, point in points.items()]


# backend -> (the model, [(label, another model, what the error must say)])
BACKENDS: dict[str, Callable[[], tuple[Any, list[tuple[str, Callable[[], Any], str]]]]] = {
    "hooked": lambda: (
        _hooked(),
        [
            ("layers", lambda: _hooked(n_layers=3), "holds activations of 3 layers .*has 2"),
            (
                "d_model",
                lambda: _hooked(d_model=32),
                "has d_model 32 where this model has d_model 64",
            ),
            (
                "heads",
                lambda: _hooked(n_heads=8),
                r"has n_(kv_)?heads 8, d_head 8 where this model has n_(kv_)?heads 4, d_head 16",
            ),
        ],
    ),
    "hf": lambda: (
        model("llama"),
        [
            ("layers", lambda: model("llama", layers=3), "holds activations of 3 layers .*has 2"),
            ("fewer layers", lambda: model("llama", layers=1), "holds activations of 1 layers"),
            (
                "d_model",
                lambda: _hf(hidden_size=64),
                "has d_model 64 where this model has d_model 32",
            ),
            (
                "kv heads",
                lambda: _hf(num_key_value_heads=4),
                "n_kv_heads 4 where this model has n_kv_heads 2",
            ),
            ("d_head", lambda: _hf(head_dim=16), "d_head 16 where this model has d_head 8"),
        ],
    ),
    "bridge": lambda: (
        bridge("llama"),
        [
            ("layers", lambda: bridge("llama", 3), "holds activations of 3 layers .*has 2"),
            (
                "sizes",
                lambda: boot(_hf(hidden_size=64, num_key_value_heads=4)),
                "has d_model 64 where this model has d_model 32",
            ),
        ],
    ),
}
PARAMS = [
    pytest.param(name, marks=[pytest.mark.hooked_transformer] if name == "hooked" else [])
    for name in BACKENDS
]


def _calls(lm: Any) -> dict[str, Callable[[torch.Tensor, Any], Any]]:
    """Every function of `lm`'s backend that reads a clean cache."""
    from transformer_lens.patching import layer_pos_patch_setter

    calls: dict[str, Callable[[torch.Tensor, Any], Any]] = {
        "resid_pre": lambda x, c: safelens.get_act_patch_resid_pre(
            lm, x, c, metric, progress=False
        ),
        "k_by_pos": lambda x, c: safelens.get_act_patch_attn_head_k_by_pos(
            lm, x, c, metric, progress=False
        ),
        "block_every": lambda x, c: safelens.get_act_patch_block_every(
            lm, x, c, metric, progress=False
        ),
    }
    if hasattr(lm, "hook_dict"):  # a HookedTransformer or a bridge
        calls["generic"] = lambda x, c: safelens.generic_activation_patch(
            lm, x, c, metric, layer_pos_patch_setter, "resid_pre", ("layer", "pos"), progress=False
        )
        calls["attribution"] = lambda x, c: safelens.attribution_patch(lm, x, c, metric)
    return calls


@pytest.mark.parametrize("backend", PARAMS)
def test_a_clean_cache_of_another_model_is_refused_naming_what_differs(backend: str) -> None:
    lm, others = BACKENDS[backend]()
    corrupted = _tokens(lm, seed=2)
    before = _hooks(lm)
    for label, other, says in others:
        foreign = _clean_cache(other(), _tokens(lm))
        for name, call in _calls(lm).items():
            with pytest.raises(PatchingError, match=f"{says}.*another model") as caught:
                call(corrupted, foreign)
            assert "Run the clean prompt through this model" in str(caught.value), (label, name)
            assert _hooks(lm) == before, (label, name)


@pytest.mark.parametrize("backend", PARAMS)
@pytest.mark.parametrize(
    "value", [None, "clean", [torch.zeros(1)], torch.zeros(1, 5, 32)], ids=repr
)
def test_what_is_not_a_clean_cache_is_named(backend: str, value: Any) -> None:
    lm, _ = BACKENDS[backend]()
    before = _hooks(lm)
    for call in _calls(lm).values():
        with pytest.raises(
            PatchingError,
            match=f"clean_cache must be the clean run's activations by hook name .*got "
            f"{type(value).__name__}",
        ):
            call(_tokens(lm, seed=2), value)
        assert _hooks(lm) == before


@pytest.mark.parametrize("backend", PARAMS)
def test_a_clean_prompt_of_another_length_says_so(backend: str) -> None:
    lm, _ = BACKENDS[backend]()
    clean_cache = _clean_cache(lm, _tokens(lm, length=6))
    for call in _calls(lm).values():
        with pytest.raises(
            PatchingError,
            match="the clean prompt has 6 positions and the corrupted one 5. Clean and "
            "corrupted prompts must have the same length",
        ):
            call(_tokens(lm, seed=2), clean_cache)


@pytest.mark.parametrize("backend", PARAMS)
def test_a_clean_cache_of_another_batch_says_so(backend: str) -> None:
    lm, _ = BACKENDS[backend]()
    clean_cache = {
        name: tensor.expand(3, *tensor.shape[1:])
        for name, tensor in _clean_cache(lm, _tokens(lm)).items()
    }
    with pytest.raises(
        PatchingError,
        match=r"expected \[batch=2 or 1, .*the clean cache has batch 3; pass a "
        r"clean cache of batch 1 \(one clean prompt for every corrupted row\) or 2",
    ):
        safelens.get_act_patch_resid_pre(
            lm, _tokens(lm, seed=2).expand(2, -1), clean_cache, metric, progress=False
        )
