"""Read-time and write-time ablations against TransformerLens references."""

from __future__ import annotations

import copy

import pytest
import torch
from models import make_model, tokens
from test_prefix import assert_unchanged, snapshot
from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

from safelens import (
    Ablation,
    CacheShapeError,
    ablate_read,
    ablate_write,
    prefill,
    score_continuations,
)

PREFIX = 10


def prompt_and_continuations() -> tuple[torch.Tensor, torch.Tensor]:
    return tokens(1, PREFIX, seed=1)[0], tokens(3, 4, seed=2)


def replace(tensor: torch.Tensor, ablation: Ablation, layer: int, target: str) -> torch.Tensor:
    """The edit done by hand on a full [batch, pos, heads, d_head] tensor."""
    positions = (
        torch.arange(PREFIX) if ablation.positions is None else torch.tensor(ablation.positions)
    )
    heads = (
        torch.arange(tensor.shape[2])
        if ablation.heads is None
        else torch.tensor(ablation.heads).reshape(-1)
    )
    out = tensor.clone()
    index = (positions[:, None], heads[None, :])
    if ablation.kind == "zero":
        out[:, index[0], index[1]] = 0
    elif ablation.kind == "function":
        assert ablation.fn is not None
        out[:, index[0], index[1]] = ablation.fn(tensor[:, index[0], index[1]], layer, target)
    else:
        refs = ablation.reference if isinstance(ablation.reference, list) else [ablation.reference]
        stacked = torch.cat([getattr(r.cache[layer], target) for r in refs])
        source = stacked.mean(0, keepdim=True) if ablation.kind == "mean" else stacked
        out[:, index[0], index[1]] = source[:, index[0], index[1]].to(out.dtype)
    return out


def make_ablations(model) -> list[Ablation]:
    others = [prefill(model, tokens(2, PREFIX, seed=s)) for s in (5, 6)]
    return [
        Ablation("zero", layers=1, heads=[0, 1], positions=[3, 4, 7]),
        Ablation("mean", layers=[0, 1], positions=[5], reference=others, target="values"),
        Ablation("resample", layers=0, heads=1, positions=[2, 9], reference=others[0].select(1)),
        Ablation("function", layers=1, fn=lambda t, layer, target: 2 * t + 1, target="keys"),
    ]


def read_reference(model, prompt, continuations, ablation) -> torch.Tensor:
    """Continuation log-probs through TL with an edited deep copy of TL's own cache."""
    tl_cache = TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, 1)
    first = model(
        prompt[None], past_kv_cache=tl_cache, attention_mask=torch.ones(1, PREFIX, dtype=torch.long)
    )
    edited = copy.deepcopy(tl_cache)
    for layer in ablation.layer_list(model.cfg.n_layers):
        entry = edited[layer]
        for target in ablation.targets():
            name = "past_keys" if target == "keys" else "past_values"
            setattr(entry, name, replace(getattr(entry, name), ablation, layer, target))
    rows = []
    for continuation in continuations:
        branch = copy.deepcopy(edited)
        logits = model(
            continuation[None],
            past_kv_cache=branch,
            attention_mask=torch.ones(1, len(continuation), dtype=torch.long),
        )
        all_logits = torch.cat([first[:, -1:], logits[:, :-1]], dim=1)[0]
        rows.append(all_logits.log_softmax(-1).gather(-1, continuation[:, None])[:, 0])
    return torch.stack(rows)


def write_reference(model, prompt, continuations, ablation) -> torch.Tensor:
    """Log-probs from one run_with_hooks over prefix + continuation with the edit."""
    hooks = []
    for layer in ablation.layer_list(model.cfg.n_layers):
        for target in ablation.targets():

            def edit(tensor, hook, layer=layer, target=target):
                head = replace(tensor[:, :PREFIX], ablation, layer, target)
                return torch.cat([head, tensor[:, PREFIX:]], dim=1)

            hooks.append((f"blocks.{layer}.attn.hook_{target[0]}", edit))
    full = torch.cat([prompt.expand(len(continuations), -1), continuations], dim=1)
    logits = model.run_with_hooks(full, fwd_hooks=hooks)
    log_probs = logits[:, PREFIX - 1 : -1].log_softmax(-1)
    return log_probs.gather(-1, continuations[..., None])[..., 0]


@pytest.mark.parametrize(
    "model_args", [{"positional": "rotary"}, {"positional": "rotary", "n_kv_heads": 2}]
)
@pytest.mark.parametrize("index", range(4))
def test_read_time_equals_edited_copy_of_tl_cache(model_args: dict, index: int) -> None:
    model = make_model(**model_args)
    prompt, continuations = prompt_and_continuations()
    ablation = make_ablations(model)[index]
    prefix = prefill(model, prompt)
    before = snapshot(prefix.cache)
    edited = ablate_read(prefix, ablation)
    assert torch.equal(edited.last_logits, prefix.last_logits)
    got = score_continuations(model, edited, continuations).log_probs
    expected = read_reference(model, prompt, continuations, ablation)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert_unchanged(prefix.cache, before)


@pytest.mark.parametrize("keep_residuals", [True, False])
@pytest.mark.parametrize(
    "model_args", [{"positional": "rotary"}, {"positional": "standard", "n_kv_heads": 2}]
)
@pytest.mark.parametrize("index", range(4))
def test_write_time_equals_run_with_hooks(
    model_args: dict, index: int, keep_residuals: bool
) -> None:
    model = make_model(**model_args)
    prompt, continuations = prompt_and_continuations()
    ablation = make_ablations(model)[index]
    prefix = prefill(model, prompt, keep_residuals=keep_residuals)
    before = snapshot(prefix.cache)
    edited = ablate_write(model, prefix, ablation)
    got = score_continuations(model, edited, continuations).log_probs
    expected = write_reference(model, prompt, continuations, ablation)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert_unchanged(prefix.cache, before)
    assert bool(edited.cache.frozen)


def test_write_time_reuses_what_the_edit_cannot_change() -> None:
    model = make_model("rotary", n_layers=3)
    prompt, _ = prompt_and_continuations()
    prefix = prefill(model, prompt)
    edited = ablate_write(model, prefix, Ablation("zero", layers=1, positions=[6]))
    assert edited.cache[0].storages() == prefix.cache[0].storages()
    assert torch.equal(edited.cache[2].keys[:, :6], prefix.cache[2].keys[:, :6])
    assert not torch.equal(edited.cache[2].keys[:, 6:], prefix.cache[2].keys[:, 6:])
    assert edited.residuals is not None and prefix.residuals is not None
    assert not torch.equal(edited.residuals[2], prefix.residuals[2])
    again = ablate_write(model, edited, Ablation("zero", layers=2, positions=[8]))
    two_at_once = ablate_write(
        model,
        prefix,
        [Ablation("zero", layers=1, positions=[6]), Ablation("zero", layers=2, positions=[8])],
    )
    torch.testing.assert_close(again.last_logits, two_at_once.last_logits)


def test_left_padded_batch_write_and_read() -> None:
    model = make_model("rotary")
    batch = tokens(2, PREFIX, seed=3)
    mask = torch.ones(2, PREFIX, dtype=torch.long)
    mask[0, :3] = 0
    prefix = prefill(model, batch, attention_mask=mask)
    ablation = Ablation("zero", layers=0, positions=[5, 6])
    written = ablate_write(model, prefix, ablation)
    unpadded = batch[0, 3:]
    shifted = Ablation("zero", layers=0, positions=[2, 3])
    alone = ablate_write(model, prefill(model, unpadded), shifted)
    torch.testing.assert_close(written.last_logits[:1], alone.last_logits, atol=1e-5, rtol=1e-5)
    read = ablate_read(prefix, ablation).select(0)
    continuation = [tokens(1, 3, seed=8)[0]]
    torch.testing.assert_close(
        score_continuations(model, read, continuation).log_probs,
        score_continuations(
            model, ablate_read(prefill(model, unpadded), shifted), continuation
        ).log_probs,
        atol=1e-5,
        rtol=1e-5,
    )


def test_bfloat16_write_time() -> None:
    model = make_model("rotary", dtype=torch.bfloat16)
    prompt, continuations = prompt_and_continuations()
    ablation = Ablation("zero", layers=1, heads=[2], positions=[4])
    edited = ablate_write(model, prefill(model, prompt), ablation)
    got = score_continuations(model, edited, continuations).log_probs
    expected = write_reference(model, prompt, continuations, ablation).float()
    torch.testing.assert_close(got, expected, atol=0.1, rtol=0.05)


def test_bad_ablations() -> None:
    model = make_model("rotary")
    prefix = prefill(model, tokens(1, 4))
    with pytest.raises(
        ValueError, match=r"kind must be one of \('zero', 'mean', 'resample', 'function'\)"
    ):
        Ablation("shuffle", layers=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"target must be one of"):
        Ablation("zero", layers=0, target="queries")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match='kind="mean" needs reference='):
        Ablation("mean", layers=0)
    with pytest.raises(IndexError, match="positions 9 out of range: there are 4"):
        ablate_read(prefix, Ablation("zero", layers=0, positions=9))
    with pytest.raises(IndexError, match="layers 5 out of range: there are 2"):
        ablate_write(model, prefix, Ablation("zero", layers=5))
    short = prefill(model, tokens(1, 2))
    with pytest.raises(CacheShapeError, match="reference cache has 2 positions"):
        ablate_read(prefix, Ablation("resample", layers=0, positions=[3], reference=short))
    with pytest.raises(CacheShapeError, match=r"fn returned .* expected shape \(1, 4, 4, 16\)"):
        ablate_read(prefix, Ablation("function", layers=0, fn=lambda t, layer, target: t[:, :1]))
    before = snapshot(prefix.cache)
    with pytest.raises(CacheShapeError):
        ablate_write(
            model, prefix, Ablation("function", layers=0, fn=lambda t, layer, target: t[:, :1])
        )
    assert_unchanged(prefix.cache, before)
