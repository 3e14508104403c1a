"""Every safelens result and cache prints in one short line: shapes and lengths, no values.

The objects come from real runs on a random-weight HuggingFace Llama (a `PatchingResult`
from `patch_dataset`), and an `AttributionResult` is built from its fields (attribution
needs a backend with hook points). Each repr must name every field, give each tensor's
shape and dtype, and stay short whatever the model's vocabulary.
"""

from __future__ import annotations

import re

import hf_models
import torch

import safelens
from safelens import (
    AttributionResult,
    KeyValueCache,
    generate,
    patch_dataset,
    prefill,
    score_continuations,
)
from safelens.core._repr import summary_repr

NO_VALUES = re.compile(r"tensor\(|\d\.\d{3}")  # torch's repr of a tensor, or its numbers


def short(text: str, limit: int = 260) -> bool:
    return len(text) <= limit and "\n" not in text and not NO_VALUES.search(text)


def test_results_of_a_real_run_print_shapes_not_values() -> None:
    model = hf_models.model("llama")
    prompt = torch.randint(1, hf_models.VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    prefix = prefill(model, prompt)
    scores = score_continuations(model, prefix.select(0), [[1, 2, 3], [4, 5]])
    generation = generate(model, prefix, 4)
    assert repr(prefix) == (
        "Prefix(cache=HFKeyValueCache(layers=2, batch=2, sequence_length=12, frozen=True), "
        "tokens=Tensor[2, 12] int64, attention_mask=Tensor[2, 12] int64, "
        f"last_logits=Tensor[2, {hf_models.VOCAB}] float32, residuals=None)"
    )
    assert repr(scores) == (
        "ContinuationScores(log_probs=Tensor[2, 3] float32, mask=Tensor[2, 3] bool, "
        "sums=Tensor[2] float32)"
    )
    assert repr(generation) == (
        "Generation(tokens=Tensor[2, 4] int64, lengths=Tensor[2] int64, "
        "log_probs=Tensor[2, 4] float32)"
    )
    assert all(short(repr(x)) for x in (prefix, scores, generation, prefix.cache))
    assert str(prefix) == repr(prefix)


def test_patching_and_attribution_results_print_shapes_not_values() -> None:
    model = hf_models.model("llama")
    generator = torch.Generator().manual_seed(1)
    clean, corrupted = (
        torch.randint(1, hf_models.VOCAB, (3, 6), generator=generator) for _ in "ab"
    )

    def metric(logits: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        return logits[:, -1, 3] - logits[:, -1, 5]

    result = patch_dataset(
        safelens.get_act_patch_resid_pre, model, clean, corrupted, metric, n_bootstrap=10,
        progress=False,
    )  # fmt: skip
    grid = "Tensor[2, 6] float32"
    assert repr(result) == (
        f"PatchingResult(per_pair=Tensor[3, 2, 6] float32, mean={grid}, std_err={grid}, "
        f"ci_low={grid}, ci_high={grid}, confidence=0.95, n_bootstrap=10)"
    )
    attribution = AttributionResult(
        torch.tensor(1.5), {"k": torch.zeros(2, 6, 4)}, {"k": torch.zeros(2, 6, 4)}
    )
    assert repr(attribution) == (
        "AttributionResult(baseline=Tensor[] float32, estimates={'k': Tensor[2, 6, 4] float32}, "
        "exact={'k': Tensor[2, 6, 4] float32})"
    )
    assert short(repr(result)) and short(repr(attribution))


def test_an_ablation_prints_its_reference_caches_by_count() -> None:
    cache = KeyValueCache()
    cache.append(0, torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4))
    ablation = safelens.Ablation("mean", layers=[0, 1], heads=[1], reference=[cache] * 8)
    text = repr(ablation)
    assert text.startswith("Ablation(kind='mean', layers=(0, 1), heads=(1,), positions=None")
    assert "reference=list of 8" in text and short(text)
    long = safelens.Ablation("zero", layers=0, positions=list(range(100)))
    assert "positions=tuple of 100" in repr(long) and short(repr(long))


def test_caches_and_entries_print_their_sizes() -> None:
    cache = KeyValueCache()
    cache.append(0, torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4))
    assert repr(cache) == "KeyValueCache(layers=1, batch=1, sequence_length=3, frozen=False)"
    assert repr(cache[0]) == "KeyValueCacheEntry(layer=0, shape=(1, 3, 2, 4), frozen=False)"


def test_summary_repr_describes_sequences_dicts_and_devices() -> None:
    import dataclasses

    @dataclasses.dataclass(repr=False)
    class Result:
        same: tuple
        mixed: list
        empty: tuple
        meta: torch.Tensor
        __repr__ = summary_repr

    result = Result((torch.ones(2),) * 3, [torch.ones(1), 2], (), torch.empty(2, 3, device="meta"))
    assert repr(result) == (
        "Result(same=tuple of 3 × Tensor[2] float32, mixed=list of 2, empty=(), "
        "meta=Tensor[2, 3] float32 meta)"
    )
