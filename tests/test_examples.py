"""Every script in examples/ runs to completion; the main demonstration reports its findings."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "induction_demo.py"
# The main demonstration has a test of its own below, which also checks what it reports;
# modules named _*.py are the examples' helpers, not scripts.
SCRIPTS = sorted(
    s for s in (ROOT / "examples").glob("*.py") if s != DEMO and not s.name.startswith("_")
)


def _run(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_example_runs(script: Path, tmp_path: Path) -> None:
    result = _run(script, cwd=tmp_path)
    assert result.returncode == 0, (
        f"{script.name} exited {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-3000:]}"
    )


@pytest.mark.slow
@pytest.mark.hooked_transformer
def test_induction_demo_finds_the_mechanism(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every number the demonstration reports, recomputed with TransformerLens alone."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.chdir(tmp_path)
    import _induction
    import induction_demo

    numbers = induction_demo.main([])
    printed = capsys.readouterr().out
    out = tmp_path / "safelens-demo"
    saved = json.loads((out / "induction_numbers.json").read_text())
    assert saved == json.loads(json.dumps(numbers))
    for name in ("patterns", "kv_patching", "read_write"):
        assert (out / f"induction_{name}.png").stat().st_size > 10_000
    model, data, steps, accuracy = _induction.train_induction_model(0)
    assert [steps, accuracy] == [numbers["training"][k] for k in ("steps", "accuracy")]
    assert accuracy >= 0.9

    heads = numbers["heads"]
    previous, induction = _tl_head_scores(model, data.diagnostic)
    assert torch.allclose(previous, torch.tensor(heads["previous_token_scores"]), atol=1e-5)
    assert torch.allclose(induction, torch.tensor(heads["induction_scores"]), atol=1e-5)
    detected = _tl_detector_scores(model, data.diagnostic)
    assert (
        list(divmod(int(detected["previous_token_head"].argmax()), 4))
        == (heads["previous_token_head"])
    )
    found = torch.zeros(2, 4, dtype=torch.bool)
    found[tuple(torch.tensor(heads["induction_heads"]).T)] = True
    if not found.all():
        assert detected["induction_head"][found].min() > detected["induction_head"][~found].max()

    with _induction.one_thread():
        _check_patching(model, data, numbers["patching"])
        _check_ablations(model, data, numbers["read_write"], heads)
    tokens, rest = data.prefixes[0], data.continuations[0]
    with torch.no_grad():
        logits = model(torch.cat([tokens, rest])[None])[0, len(tokens) - 1 : -1]
    expected = float(logits.log_softmax(-1).gather(-1, rest[:, None]).sum())
    assert abs(numbers["continuations"]["log_probs"]["the repeat"] - expected) <= 1e-4
    assert torch.equal(logits.argmax(-1), rest)  # so greedy generation copies the repeat
    assert numbers["continuations"]["generation_reproduces_repeat"]

    for peak in ("keys_peak", "values_peak"):
        assert f"metric {numbers['patching'][peak]['metric']:+.2f})" in printed
    for loss in numbers["read_write"]["ablations"].values():
        assert f"loss {loss['loss']:5.2f} nats/token, p(correct) {loss['p_correct']:.2f}" in printed
    assert "prefix bitwise unchanged: True" in printed
    assert "reproduces the repeat: True" in printed


def _tl_head_scores(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The usual previous-token and induction scores, indexed by hand from TL's patterns."""
    length = tokens.shape[1] // 2
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    previous, induction = torch.zeros(2, 4), torch.zeros(2, 4)
    query = torch.arange(1, tokens.shape[1])
    repeat = torch.arange(length + 1, tokens.shape[1])
    for layer in range(2):
        pattern = cache["pattern", layer]
        previous[layer] = pattern[:, :, query, query - 1].mean(dim=(0, 2))
        induction[layer] = pattern[:, :, repeat, repeat - length + 1].mean(dim=(0, 2))
    return previous, induction


def _tl_detector_scores(model, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """TransformerLens' head_detector scores ("mul"), averaged over the sequences."""
    from transformer_lens import head_detector

    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    scores = {}
    for kind in ("previous_token_head", "induction_head"):
        make = getattr(head_detector, f"get_{kind}_detection_pattern")
        total = torch.zeros(2, 4)
        for row, sequence in enumerate(tokens):
            detection = make(sequence[None])
            for layer, head in itertools.product(range(2), range(4)):
                total[layer, head] += head_detector.compute_head_attention_similarity_score(
                    cache["pattern", layer][row, head],
                    detection_pattern=detection,
                    exclude_bos=False,
                    exclude_current_token=False,
                    error_measure="mul",
                )
        scores[kind] = total / len(tokens)
    return scores


def _check_patching(model, data, patching: dict) -> None:
    """TransformerLens' own patching sweeps give the demonstration's grids."""
    from transformer_lens import patching as tl_patching

    answers = torch.arange(len(data.answers)), data.answers
    with torch.no_grad():
        clean_logits, clean_cache = model.run_with_cache(data.clean)
        corrupted_logits = model(data.corrupted)

    def log_prob(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1].log_softmax(-1)[answers].mean()

    clean, corrupted = log_prob(clean_logits), log_prob(corrupted_logits)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return (log_prob(logits) - corrupted) / (clean - corrupted)

    assert abs(float(clean) - patching["clean_log_prob"]) <= 1e-5
    for name, sweep in (
        ("keys", tl_patching.get_act_patch_attn_head_k_by_pos),
        ("values", tl_patching.get_act_patch_attn_head_v_by_pos),
    ):
        with torch.no_grad():
            expected = sweep(model, data.corrupted, clean_cache, metric)
        assert torch.allclose(expected, torch.tensor(patching[name]), atol=1e-4), name
        layer, pos, head = (int(i) for i in torch.unravel_index(expected.argmax(), expected.shape))
        peak = patching[f"{name}_peak"]
        assert [layer, pos, head] == [peak["layer"], peak["position"], peak["head"]]


def _check_ablations(model, data, read_write: dict, heads: dict) -> None:
    """Read-time: TL's own cache, edited; write-time: one run_with_hooks over the whole text."""
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

    with torch.no_grad():
        _, reference = model.run_with_cache(data.references)
    mean = {
        (layer, kind): reference[f"blocks.{layer}.attn.hook_{kind}"].mean(0)
        for layer in range(2)
        for kind in "kv"
    }
    first_copy = torch.arange(1, data.prefixes.shape[1] - 3)
    prev_layer, prev_head = heads["previous_token_head"]
    induction_heads = torch.tensor([head for _, head in heads["induction_heads"]])
    edits = {
        "none": [],
        "read_previous_token_head": [(prev_layer, "k", prev_head), (prev_layer, "v", prev_head)],
        "read_induction_keys": [(1, "k", induction_heads)],
    }

    def replaced(tensor: torch.Tensor, layer: int, kind: str, head) -> torch.Tensor:
        out = tensor.clone()
        rows, cols = first_copy[:, None], torch.as_tensor(head).reshape(1, -1)
        out[:, rows, cols] = mean[layer, kind][rows, cols]
        return out

    log_probs: dict[str, list[torch.Tensor]] = {name: [] for name in [*edits, "write"]}
    with torch.no_grad():
        for tokens, rest in zip(data.prefixes, data.continuations, strict=True):
            for name, items in edits.items():
                cache = TransformerLensKeyValueCache.init_cache(model.cfg, "cpu")
                ones = torch.ones(1, len(tokens) + len(rest), dtype=torch.long)
                first = model(
                    tokens[None], past_kv_cache=cache, attention_mask=ones[:, : len(tokens)]
                )[:, -1:]
                for layer, kind, head in items:
                    entry = cache[layer]
                    field = "past_keys" if kind == "k" else "past_values"
                    setattr(entry, field, replaced(getattr(entry, field), layer, kind, head))
                cache.freeze()
                later = model(
                    rest[None], past_kv_cache=cache, attention_mask=ones[:, len(tokens) :]
                )[:, :-1]
                logits = torch.cat([first, later], dim=1)[0]
                log_probs[name].append(logits.log_softmax(-1).gather(-1, rest[:, None])[:, 0])
            hooks = [
                (
                    f"blocks.{prev_layer}.attn.hook_{kind}",
                    lambda tensor, hook, kind=kind: replaced(tensor, prev_layer, kind, prev_head),
                )
                for kind in "kv"
            ]
            full = torch.cat([tokens, rest])[None]
            logits = model.run_with_hooks(full, fwd_hooks=hooks)[0, len(tokens) - 1 : -1]
            log_probs["write"].append(logits.log_softmax(-1).gather(-1, rest[:, None])[:, 0])
    log_probs["write_previous_token_head"] = log_probs.pop("write")
    for name, rows in log_probs.items():
        stacked = torch.stack(rows)
        measured = read_write["ablations"][name]
        assert abs(float(-stacked.mean()) - measured["loss"]) <= 1e-4, name
        assert abs(float(stacked.exp().mean()) - measured["p_correct"]) <= 1e-4, name


@pytest.mark.slow
def test_induction_demo_on_a_huggingface_llama(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--hf`: every number the demonstration reports, recomputed with HuggingFace alone."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.chdir(tmp_path)
    import _induction
    import induction_demo

    numbers = induction_demo.main(["--hf"])
    printed = capsys.readouterr().out
    out = tmp_path / "safelens-demo"
    saved = json.loads((out / "induction_hf_numbers.json").read_text())
    assert saved == json.loads(json.dumps(numbers))
    for name in ("patterns", "kv_patching", "read_write"):
        assert (out / f"induction_hf_{name}.png").stat().st_size > 10_000
    model, data, steps, accuracy = _induction.train_induction_model(0, hf=True)
    assert [steps, accuracy] == [numbers["training"][k] for k in ("steps", "accuracy")]
    assert "attention-only HuggingFace Llama" in printed

    heads = numbers["heads"]
    with torch.no_grad():
        attentions = model(data.diagnostic, output_attentions=True).attentions
    length = data.diagnostic.shape[1] // 2
    query = torch.arange(1, data.diagnostic.shape[1])
    repeat = torch.arange(length + 1, data.diagnostic.shape[1])
    previous = torch.stack([p[:, :, query, query - 1].mean(dim=(0, 2)) for p in attentions])
    induction = torch.stack(
        [p[:, :, repeat, repeat - length + 1].mean(dim=(0, 2)) for p in attentions]
    )
    assert torch.allclose(previous, torch.tensor(heads["previous_token_scores"]), atol=1e-5)
    assert torch.allclose(induction, torch.tensor(heads["induction_scores"]), atol=1e-5)

    with _induction.one_thread():
        _check_hf_patching(model, data, numbers["patching"])
        _check_hf_ablations(model, data, numbers["read_write"], heads)
    tokens, rest = data.prefixes[0], data.continuations[0]
    with torch.no_grad():
        logits = model(torch.cat([tokens, rest])[None]).logits[0, len(tokens) - 1 : -1]
    expected = float(logits.log_softmax(-1).gather(-1, rest[:, None]).sum())
    assert abs(numbers["continuations"]["log_probs"]["the repeat"] - expected) <= 1e-4
    assert torch.equal(logits.argmax(-1), rest)
    assert numbers["continuations"]["generation_reproduces_repeat"]
    for loss in numbers["read_write"]["ablations"].values():
        assert f"loss {loss['loss']:5.2f} nats/token, p(correct) {loss['p_correct']:.2f}" in printed
    assert "prefix bitwise unchanged: True" in printed


def _recorder(store: dict, key, reduce=lambda t: t.clone()):
    """A k_proj/v_proj edit that keeps `reduce(output)` in `store[key]` and edits nothing."""

    def record(output: torch.Tensor) -> None:
        store[key] = reduce(output)

    return record


def _hf_forward(model, tokens: torch.Tensor, edits: dict) -> torch.Tensor:
    """Logits of one uncached forward, `edits[(layer, "k"|"v")](output)` on k_proj/v_proj."""
    handles = []
    for (layer, kind), edit in edits.items():
        attn = model.model.layers[layer].self_attn
        module = attn.k_proj if kind == "k" else attn.v_proj
        handles.append(module.register_forward_hook(lambda m, a, output, edit=edit: edit(output)))
    try:
        return model(tokens).logits
    finally:
        for handle in handles:
            handle.remove()


def _check_hf_patching(model, data, patching: dict) -> None:
    """A loop of k_proj/v_proj-hooked forwards, one per (layer, position, head)."""
    answers = torch.arange(len(data.answers)), data.answers
    d_head = model.config.head_dim
    clean_acts: dict = {}
    record = {
        (layer, kind): _recorder(clean_acts, (layer, kind)) for layer in range(2) for kind in "kv"
    }
    with torch.no_grad():
        clean_logits = _hf_forward(model, data.clean, record)
        corrupted_logits = model(data.corrupted).logits

    def log_prob(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1].log_softmax(-1)[answers].mean()

    clean, corrupted = log_prob(clean_logits), log_prob(corrupted_logits)
    assert abs(float(clean) - patching["clean_log_prob"]) <= 1e-5
    for name, kind in (("keys", "k"), ("values", "v")):
        grid = torch.zeros(2, data.clean.shape[1], 4)
        for layer, pos, head in itertools.product(*(range(n) for n in grid.shape)):
            columns = slice(head * d_head, (head + 1) * d_head)

            def patch(t, layer=layer, pos=pos, columns=columns, kind=kind):
                t = t.clone()
                t[:, pos, columns] = clean_acts[layer, kind][:, pos, columns]
                return t

            with torch.no_grad():
                logits = _hf_forward(model, data.corrupted, {(layer, kind): patch})
            grid[layer, pos, head] = (log_prob(logits) - corrupted) / (clean - corrupted)
        assert torch.allclose(grid, torch.tensor(patching[name]), atol=1e-4), name
        layer, pos, head = (int(i) for i in torch.unravel_index(grid.argmax(), grid.shape))
        peak = patching[f"{name}_peak"]
        assert [layer, pos, head] == [peak["layer"], peak["position"], peak["head"]]


def _check_hf_ablations(model, data, read_write: dict, heads: dict) -> None:
    """Read-time: an edited copy of HF's DynamicCache; write-time: k_proj/v_proj hooks."""
    from hf_models import run
    from transformers import DynamicCache

    first_copy = torch.arange(1, data.prefixes.shape[1] - 3)
    prev_layer, prev_head = heads["previous_token_head"]
    induction_heads = [head for _, head in heads["induction_heads"]]
    with torch.no_grad():
        reference = DynamicCache()
        run(model, data.references, reference)
        projected: dict = {}
        record = {
            (prev_layer, kind): _recorder(projected, kind, lambda t: t.mean(0)) for kind in "kv"
        }
        _hf_forward(model, data.references, record)
    edits = {
        "none": [],
        "read_previous_token_head": [
            (prev_layer, "keys", [prev_head]),
            (prev_layer, "values", [prev_head]),
        ],
        "read_induction_keys": [(1, "keys", induction_heads)],
    }
    d_head = model.config.head_dim
    log_probs: dict[str, list[torch.Tensor]] = {name: [] for name in [*edits, "write"]}
    with torch.no_grad():
        for tokens, rest in zip(data.prefixes, data.continuations, strict=True):
            for name, items in edits.items():
                cache = DynamicCache()
                first = run(model, tokens[None], cache)[:, -1:]
                for layer, field, heads_ in items:
                    stored = getattr(cache.layers[layer], field)  # [1, heads, pos, d_head]
                    mean = getattr(reference.layers[layer], field).mean(0)
                    for head in heads_:
                        stored[0, head, first_copy] = mean[head, first_copy]
                later = run(model, rest[None], cache)[:, :-1]
                logits = torch.cat([first, later], dim=1)[0]
                log_probs[name].append(logits.log_softmax(-1).gather(-1, rest[:, None])[:, 0])

            def write(t, kind):
                t = t.clone()
                columns = slice(prev_head * d_head, (prev_head + 1) * d_head)
                t[0, first_copy, columns] = projected[kind][first_copy, columns]
                return t

            hooks = {(prev_layer, kind): lambda t, kind=kind: write(t, kind) for kind in "kv"}
            full = torch.cat([tokens, rest])[None]
            logits = _hf_forward(model, full, hooks)[0, len(tokens) - 1 : -1]
            log_probs["write"].append(logits.log_softmax(-1).gather(-1, rest[:, None])[:, 0])
    log_probs["write_previous_token_head"] = log_probs.pop("write")
    for name, rows in log_probs.items():
        stacked = torch.stack(rows)
        measured = read_write["ablations"][name]
        assert abs(float(-stacked.mean()) - measured["loss"]) <= 1e-4, name
        assert abs(float(stacked.exp().mean()) - measured["p_correct"]) <= 1e-4, name
