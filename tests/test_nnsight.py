"""nnsight over an `HFKeyValueCache` equals nnsight over transformers' `DynamicCache`.

One frozen safelens prefix serves many traces, several invokes (through `expand`) and
`generate` (through `fork`); safelens' cache hook points and nnsight's interventions act in
one forward. Each is compared, bitwise, with the same work on `DynamicCache` (a fresh copy
per pass, as it stores every pass), and with HuggingFace's uncached forward. The attention
mask over cached + new positions that docs/howto/nnsight.md asks for is pinned too: without
it both caches give the same wrong numbers.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import transformers
from hf_models import CONFIGS, VOCAB, tokenizer
from nnsight import LanguageModel, NNsightDeprecationWarning, TransformersModel
from packaging.version import Version

from safelens import HFKeyValueCache, hf_cache_argument

FAMILIES = ("llama", "gpt2")
PROMPT, NEW = 10, 4
CACHE_ARGUMENT_RENAMED = Version(transformers.__version__) >= Version("5.24")


@functools.cache
def wrapped(family: str) -> tuple[torch.nn.Module, TransformersModel]:
    """A random-weight model of its own (no shared test model) and nnsight's wrapper."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()
    return model, TransformersModel(model, tokenizer=tokenizer(), task="text-generation")


def mlp(model: TransformersModel, layer: int) -> Any:
    """The envoy of layer `layer`'s MLP, whatever the family names it."""
    layers = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    return layers[layer].mlp


@pytest.fixture(params=FAMILIES)
def setup(request: pytest.FixtureRequest):
    """A wrapped model, a frozen safelens prefix and the same prefix in a `DynamicCache`;
    after the test, the prefix is checked bitwise unchanged."""
    hf, model = wrapped(request.param)
    arg = hf_cache_argument(hf)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, VOCAB, (1, PROMPT), generator=generator)
    continuations = torch.randint(1, VOCAB, (3, NEW), generator=generator)
    prefix, dynamic = HFKeyValueCache(), transformers.DynamicCache()
    hf(prompt, **{arg: prefix})
    hf(prompt, **{arg: dynamic})
    prefix.freeze()
    before = [t.clone() for layer in prefix.layers for t in (layer.keys, layer.values)]
    full = torch.cat([prompt.expand(3, -1), continuations], dim=1)
    yield dict(
        model=model,
        hf=hf,
        arg=arg,
        prompt=prompt,
        continuations=continuations,
        prefix=prefix,
        dynamic=dynamic,
        uncached=hf(full).logits[:, PROMPT:],
    )
    after = [t for layer in prefix.layers for t in (layer.keys, layer.values)]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


MASK = torch.ones(1, PROMPT + NEW, dtype=torch.long)


def trace_logits(model: TransformersModel, tokens: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    with model.trace(tokens, **kwargs):
        logits = model.output.logits.save()
    return logits


def test_many_traces_share_one_frozen_prefix(setup: dict[str, Any]) -> None:
    model, arg, prefix = setup["model"], setup["arg"], setup["prefix"]
    for row, continuation in enumerate(setup["continuations"]):
        tokens = continuation[None]
        ours = trace_logits(model, tokens, attention_mask=MASK, **{arg: prefix})
        theirs = trace_logits(
            model, tokens, attention_mask=MASK, **{arg: copy.deepcopy(setup["dynamic"])}
        )
        assert torch.equal(ours, theirs)
        torch.testing.assert_close(ours[0], setup["uncached"][row], atol=1e-5, rtol=0)
    assert prefix.get_seq_length() == PROMPT


def invokes(model: TransformersModel, continuations: torch.Tensor, masks: bool, **cache: Any):
    with model.trace(**cache) as tracer:
        for continuation in continuations:
            kwargs = {"attention_mask": MASK} if masks else {}
            with tracer.invoke(continuation[None], **kwargs):
                pass
        with tracer.invoke():
            logits = model.output.logits.save()
    return logits


@pytest.mark.parametrize("masks", [True, False], ids=["masks", "no-masks"])
def test_several_invokes_over_an_expanded_prefix(setup: dict[str, Any], masks: bool) -> None:
    model, arg = setup["model"], setup["arg"]
    repeated = copy.deepcopy(setup["dynamic"])
    repeated.batch_repeat_interleave(3)
    ours = invokes(model, setup["continuations"], masks, **{arg: setup["prefix"].expand(3)})
    theirs = invokes(model, setup["continuations"], masks, **{arg: repeated})
    assert torch.equal(ours, theirs)
    # The documented need: a mask over cached + new positions, for DynamicCache too.
    close = torch.allclose(ours, setup["uncached"], atol=1e-5)
    assert close == masks


def test_one_trace_without_a_mask_is_wrong_only_under_the_renamed_argument(
    setup: dict[str, Any],
) -> None:
    model, arg = setup["model"], setup["arg"]
    tokens = setup["continuations"][:1]
    ours = trace_logits(model, tokens, **{arg: setup["prefix"]})
    theirs = trace_logits(model, tokens, **{arg: copy.deepcopy(setup["dynamic"])})
    assert torch.equal(ours, theirs)
    close = torch.allclose(ours, setup["uncached"][:1], atol=1e-5)
    assert close != CACHE_ARGUMENT_RENAMED


def test_cache_hook_points_and_nnsight_interventions_in_one_forward(
    setup: dict[str, Any],
) -> None:
    model, arg = setup["model"], setup["arg"]
    tokens = setup["continuations"][:1]
    seen = {}

    def zero_values(values: torch.Tensor, hook: Any) -> torch.Tensor:
        seen[hook.name] = tuple(values.shape)
        values[:, 1, 3:7] = 0  # KV head 1 at prompt positions 3..6, read-time
        return values

    def halved(cache: Any) -> torch.Tensor:
        with model.trace(tokens, attention_mask=MASK, **{arg: cache}):
            mlp(model, 1).output[:] = mlp(model, 1).output * 0.5
            logits = model.output.logits.save()
        return logits

    branch = setup["prefix"].fork()
    (name,) = [n for n in branch.hook_points() if n.endswith(".0.kv_cache.hook_v_full")]
    with branch.hooks([(name, zero_values)]):
        ours = halved(branch)
    edited = copy.deepcopy(setup["dynamic"])
    edited.layers[0].values[:, 1, 3:7] = 0
    assert torch.equal(ours, halved(edited))
    assert seen[name][2] == PROMPT + NEW and branch.get_seq_length() == PROMPT + NEW
    assert not torch.allclose(ours, halved(copy.deepcopy(setup["dynamic"])), atol=1e-3)


@pytest.mark.parametrize("intervene", [False, True], ids=["plain", "intervened"])
def test_generate_through_a_fork_gives_dynamic_caches_tokens(
    setup: dict[str, Any], intervene: bool
) -> None:
    model, arg = setup["model"], setup["arg"]
    tokens = torch.cat([setup["prompt"], setup["continuations"][:1]], dim=1)

    def generated(cache: Any) -> torch.Tensor:
        with model.generate(tokens, max_new_tokens=6, do_sample=False, **{arg: cache}) as tracer:
            if intervene:
                for _ in tracer.iter[0:6]:
                    mlp(model, 1).output[:] = 0
            ids = tracer.result.save()
        return ids

    ours = generated(setup["prefix"].fork())
    assert torch.equal(ours, generated(copy.deepcopy(setup["dynamic"])))
    if not intervene:
        assert torch.equal(ours, setup["hf"].generate(tokens, max_new_tokens=6, do_sample=False))


def test_language_model_the_deprecated_name_runs_the_same(setup: dict[str, Any]) -> None:
    with pytest.warns(NNsightDeprecationWarning, match="LanguageModel is deprecated"):
        model = LanguageModel(setup["hf"], tokenizer=tokenizer())
    tokens, arg = setup["continuations"][:1], setup["arg"]
    ours = trace_logits(model, tokens, attention_mask=MASK, **{arg: setup["prefix"]})
    theirs = trace_logits(setup["model"], tokens, attention_mask=MASK, **{arg: setup["prefix"]})
    assert torch.equal(ours, theirs)
