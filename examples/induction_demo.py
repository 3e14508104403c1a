"""Find an induction circuit with safelens, end to end, in about a minute on a CPU.

1. Train a 2-layer attention-only HookedTransformer to continue repeated random token
   segments (`examples/_induction.py`).
2. Name the circuit with standard diagnostics that owe nothing to safelens: each head's
   previous-token and induction score, from its attention pattern.
3. Locate it with safelens' key and value patching sweeps, under a corruption that
   changes only *where* induction can look, and check that the sweeps' strongest
   components are the heads step 2 named.
4. Read-time versus write-time: ablate the previous-token head's cached keys/values
   (read-time, then write-time) and the induction heads' cached keys (read-time), and
   score the copied tokens from a frozen prefix.
5. Counterfactual continuations of one frozen prefix, and generation from it.

Every sentence printed is computed in this run and asserted here; every number goes to
`induction_numbers.json` next to the figures (`tests/test_examples.py` recomputes them
with TransformerLens alone).

`--hf` tells the same story on a HuggingFace `LlamaForCausalLM` trained on the same data
(attention-only, see `examples/_induction.py`), through safelens' HuggingFace backend:
head scores from HF's own attention weights, the sweeps from
`run_with_patching_cache`, and the same ablations, continuations and generation
(`tests/test_examples.py` checks them against HF alone). Its files are named
`induction_hf_*`.

Run: python examples/induction_demo.py [--out DIR | --docs] [--seed N] [--hf]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from _induction import (
    KNOWN,
    SEGMENT,
    VOCAB,
    AnswerLogProb,
    InductionData,
    attention_patterns,
    head_scores,
    is_huggingface,
    logits_of,
    one_thread,
    train_induction_model,
)

import safelens

DOCS = Path(__file__).resolve().parent.parent / "docs" / "figures"
SOURCE = SEGMENT  # where the clean prompts' answer sits in the first copy
THRESHOLD = 0.5  # a head "is" a previous-token / induction head from this score on


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _labels(n_known: int) -> list[str]:
    """Position labels of `BOS s1 … s_SEGMENT s1 … s_n_known`."""
    first = [f"s{i}" for i in range(1, SEGMENT + 1)]
    return ["BOS", *first, *first[:n_known]]


class _Prefixed:
    """A folder whose files share a stem: `_Prefixed(out, "induction_") / "x.png"`."""

    def __init__(self, folder: Path, stem: str) -> None:
        self.folder, self.stem = folder, stem

    def __truediv__(self, name: str) -> Path:
        return self.folder / f"{self.stem}{name}"


def _head(layer_head: tuple[int, int]) -> str:
    return f"L{layer_head[0]}H{layer_head[1]}"


def _cached(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's cached keys and values, position-major `[batch, pos, heads, d_head]`."""
    if isinstance(cache, safelens.HFKeyValueCache):  # HF stores head-major
        return [
            (layer.keys.transpose(1, 2), layer.values.transpose(1, 2)) for layer in cache.layers
        ]
    return [(entry.keys, entry.values) for entry in cache]


def name_circuit(model: torch.nn.Module, data: InductionData, out: _Prefixed) -> dict[str, Any]:
    """Step 2: previous-token and induction scores of every head; the two heads' patterns."""
    previous, induction = head_scores(model, data.diagnostic)
    n_layers, n_heads = previous.shape
    prev_head = divmod(int(previous.argmax()), n_heads)
    induction_heads = [(layer, head) for layer, head in (induction >= THRESHOLD).nonzero().tolist()]
    top_induction = divmod(int(induction.argmax()), n_heads)
    assert previous[prev_head] >= THRESHOLD and prev_head[0] == 0, previous
    assert induction_heads and all(layer == 1 for layer, _ in induction_heads), induction
    patterns = attention_patterns(model, data.diagnostic)
    figure = _figure(11, 6.2)
    for panel, (layer, head) in enumerate((prev_head, top_induction)):
        pattern = patterns[layer][:, head].mean(0)
        ax = figure.add_subplot(1, 2, panel + 1)
        image = ax.imshow(pattern.numpy(), cmap="Blues", vmin=0, vmax=1)
        role = "previous-token head" if panel == 0 else "induction head"
        score = previous[layer, head] if panel == 0 else induction[layer, head]
        ax.set_title(f"{_head((layer, head))}, {role} (score {score:.2f})")
        labels = [*_labels(0), *(f"{label}'" for label in _labels(0)[1:])]
        ax.set_xticks(range(len(labels)), labels=labels, rotation=90, fontsize=7)
        ax.set_yticks(range(len(labels)), labels=labels, fontsize=7)
        ax.set_xlabel("attended position (key)")
        ax.set_ylabel("attending position (query)")
        figure.colorbar(image, ax=ax, shrink=0.8, label="attention weight")
    figure.suptitle(
        f"Attention patterns, mean over {len(data.diagnostic)} sequences BOS + random "
        f"{SEGMENT}-token segment s1..s{SEGMENT} + its repeat s1'..s{SEGMENT}':\nthe "
        "previous-token head reads one position back; the induction head reads, from each "
        f"repeated token,\nthe token after its first occurrence ({SEGMENT - 1} positions back)",
        fontsize=10,
    )
    figure.savefig(out / "patterns.png")
    table = ["        " + "".join(f"  head {h}" for h in range(n_heads))]
    for name, scores in (("previous-token", previous), ("induction", induction)):
        for layer in range(n_layers):
            row = "".join(f"{float(s):8.2f}" for s in scores[layer])
            table.append(f"  {name:>14} L{layer}{row}")
    return {
        "previous_token_scores": previous.tolist(),
        "induction_scores": induction.tolist(),
        "previous_token_head": list(prev_head),
        "induction_heads": [list(h) for h in induction_heads],
        "top_induction_head": list(top_induction),
        "table": table,
    }


def locate(
    model: torch.nn.Module, data: InductionData, found: dict[str, Any], out: _Prefixed
) -> dict[str, Any]:
    """Step 3: key/value patching sweeps from the clean into the corrupted prompts."""
    with torch.no_grad():
        if is_huggingface(model):
            clean_logits, clean_cache = safelens.run_with_patching_cache(model, data.clean)
        else:
            clean_logits, clean_cache = model.run_with_cache(data.clean)
        corrupted_logits = logits_of(model, data.corrupted)
    metric = AnswerLogProb(clean_logits, corrupted_logits, data.answers)
    sweeps = {}
    peaks = {}
    for name, sweep in (
        ("keys", safelens.get_act_patch_attn_head_k_by_pos),
        ("values", safelens.get_act_patch_attn_head_v_by_pos),
    ):
        with torch.no_grad():
            sweeps[name] = sweep(model, data.corrupted, clean_cache, metric, progress=False)
        flat = int(sweeps[name].argmax())
        layer, rest = divmod(flat, sweeps[name].shape[1] * sweeps[name].shape[2])
        pos, head = divmod(rest, sweeps[name].shape[2])
        peaks[name] = {"layer": layer, "position": pos, "head": head}
        peaks[name]["metric"] = float(sweeps[name][layer, pos, head])
    keys, values = peaks["keys"], peaks["values"]
    # K-composition: the induction head's key at the source, computed from what the
    # previous-token head wrote there from the position before it, restores the answer.
    assert [keys["layer"], keys["head"]] in found["induction_heads"], peaks
    assert keys["position"] == SOURCE, peaks
    assert [values["layer"], values["head"]] == found["previous_token_head"], peaks
    assert values["position"] == SOURCE - 1, peaks
    _plot_sweeps(sweeps, peaks, found, out / "kv_patching.png")
    return {
        "clean_log_prob": float(metric.clean),
        "corrupted_log_prob": float(metric.corrupted),
        "keys_peak": keys,
        "values_peak": values,
        "keys": sweeps["keys"].tolist(),
        "values": sweeps["values"].tolist(),
    }


def _plot_sweeps(
    sweeps: dict[str, torch.Tensor], peaks: dict[str, Any], found: dict[str, Any], path: Path
) -> None:
    from matplotlib.patches import Rectangle

    n_layers = sweeps["keys"].shape[0]
    stacked = torch.cat([sweeps["keys"], sweeps["values"]])
    figure = safelens.plot_patching_heatmap(
        stacked,
        labels=_labels(SEGMENT - 1),
        title=(
            "Patching clean keys (top rows) / values (bottom rows) into the corrupted run, one "
            "panel per head\ncorrupted: the first copy's s9 replaced (the final s9 has no "
            "earlier match); 1 = clean log p(s10), 0 = corrupted; boxes: each sweep's peak"
        ),
    )
    figure.set_size_inches(13, 8)
    panels = [ax for ax in figure.axes if ax.get_label() != "<colorbar>"]
    prev = tuple(found["previous_token_head"])
    induction = {tuple(h) for h in found["induction_heads"]}
    rows = [f"{kind} L{layer}" for kind in ("keys", "values") for layer in range(n_layers)]
    for head, ax in enumerate(panels):
        ax.set_yticks(range(len(rows)), labels=rows)
        ax.set_ylabel("patched activation")
        roles = [f"{_head(h)} induction" for h in sorted(induction) if h[1] == head]
        roles += [f"{_head(prev)} previous-token"] if prev[1] == head else []
        ax.set_title(f"head {head}" + (f": {', '.join(roles)}" if roles else ""), fontsize=9)
    for offset, name in ((0, "keys"), (n_layers, "values")):
        peak = peaks[name]
        ax = panels[peak["head"]]
        row = offset + peak["layer"]
        ax.add_patch(
            Rectangle((peak["position"] - 0.5, row - 0.5), 1, 1, fill=False, lw=2, ec="black")
        )
    figure.tight_layout()
    figure.savefig(path)


def _loss(scores: safelens.ContinuationScores) -> tuple[float, float]:
    """Mean negative log-probability and mean probability of the scored tokens."""
    log_probs = scores.log_probs[scores.mask]
    return float(-log_probs.mean()), float(log_probs.exp().mean())


def read_versus_write(
    model: torch.nn.Module, data: InductionData, found: dict[str, Any], out: _Prefixed
) -> dict[str, Any]:
    """Step 4: ablate the circuit's cached keys/values read-time and write-time."""
    first_copy = list(range(1, SEGMENT + 1))
    reference = safelens.prefill(model, data.references)
    prev_layer, prev_head = found["previous_token_head"]
    induction_heads = [head for _, head in found["induction_heads"]]
    previous = safelens.Ablation(
        "mean", layers=prev_layer, heads=prev_head, positions=first_copy, reference=reference
    )
    induction = safelens.Ablation(
        "mean",
        layers=1,
        heads=induction_heads,
        positions=first_copy,
        target="keys",
        reference=reference,
    )
    edits = {
        "none": lambda prefix: prefix,
        "read_previous_token_head": lambda prefix: safelens.ablate_read(prefix, previous),
        "write_previous_token_head": lambda prefix: safelens.ablate_write(model, prefix, previous),
        "read_induction_keys": lambda prefix: safelens.ablate_read(prefix, induction),
    }
    log_probs: dict[str, list[torch.Tensor]] = {name: [] for name in edits}
    n_layers = len(found["previous_token_scores"])
    reach = {name: torch.zeros(n_layers, data.prefixes.shape[1]) for name in edits}
    unchanged = True
    for tokens, continuation in zip(data.prefixes, data.continuations, strict=True):
        prefix = safelens.prefill(model, tokens[None])
        snapshot = [(k.clone(), v.clone()) for k, v in _cached(prefix.cache)]
        for name, edit in edits.items():
            edited = edit(prefix)
            scores = safelens.score_continuations(model, edited, [continuation])
            log_probs[name].append(scores.log_probs[0])
            pairs = zip(_cached(edited.cache), _cached(prefix.cache), strict=True)
            for layer, ((keys, values), (clean_k, clean_v)) in enumerate(pairs):
                change = torch.cat([keys - clean_k, values - clean_v], -1)
                size = torch.cat([clean_k, clean_v], -1)
                reach[name][layer] += (change.norm(dim=(-2, -1)) / size.norm(dim=(-2, -1)))[0]
        unchanged &= all(
            torch.equal(k, k0) and torch.equal(v, v0)
            for (k, v), (k0, v0) in zip(_cached(prefix.cache), snapshot, strict=True)
        )
    losses = {}
    for name, rows in log_probs.items():
        stacked = torch.stack(rows)
        losses[name] = {"loss": float(-stacked.mean()), "p_correct": float(stacked.exp().mean())}
    base = losses["none"]["loss"]
    read_change = losses["read_previous_token_head"]["loss"] - base
    write_change = losses["write_previous_token_head"]["loss"] - base
    chance = math.log(VOCAB)
    assert unchanged
    # The continuation reads the previous-token head's output only through the induction
    # heads' keys, computed in the prefix: editing its cache entries (read-time) cannot
    # reach them, recomputing the prefix with the edit (write-time) does.
    assert abs(read_change) < 0.05, losses
    assert write_change > 0.3 and write_change > 10 * abs(read_change), losses
    assert losses["read_induction_keys"]["loss"] > 0.5 * chance, losses
    _plot_read_write(losses, reach, len(data.prefixes), found, out / "read_write.png")
    return {
        "ablations": losses,
        "chance_loss": chance,
        "prefix_unchanged": unchanged,
        "reach": {name: (r / len(data.prefixes)).tolist() for name, r in reach.items()},
    }


def _plot_read_write(
    losses: dict[str, Any], reach: dict[str, torch.Tensor], n: int, found: dict, path: Path
) -> None:
    prev = _head(tuple(found["previous_token_head"]))
    induction = ",".join(_head(tuple(h)) for h in found["induction_heads"])
    titles = {
        "read_previous_token_head": f"read-time: {prev} keys+values",
        "write_previous_token_head": f"write-time: {prev} keys+values",
        "read_induction_keys": f"read-time: {induction} keys",
    }
    figure = _figure(16, 5)
    grid = figure.add_gridspec(1, 4, width_ratios=[1, 1, 1, 1.1])
    limit = max(float(reach[name].max()) for name in titles) / n
    for column, (name, title) in enumerate(titles.items()):
        ax = figure.add_subplot(grid[0, column])
        image = ax.imshow((reach[name] / n).numpy(), cmap="Reds", vmin=0, vmax=limit, aspect="auto")
        ax.set_title(title, fontsize=9)
        labels = _labels(KNOWN)
        ax.set_xticks(range(len(labels)), labels=labels, rotation=90)
        rows = ["layer 0", "layer 1"] if column == 0 else ["", ""]
        ax.set_yticks(range(reach[name].shape[0]), labels=rows)
        ax.set_xlabel("prefix position")
    figure.colorbar(image, ax=figure.axes, label="relative change of cached keys+values")
    ax = figure.add_subplot(grid[0, 3])
    names = ["none", *titles]
    values = [losses[name]["loss"] for name in names]
    ax.bar(range(len(names)), values, color=["grey", "tab:blue", "tab:red", "tab:purple"])
    ax.axhline(math.log(VOCAB), color="black", ls="--", lw=1, label="chance (uniform)")
    ax.set_xticks(
        range(len(names)),
        labels=[
            "no ablation",
            "read-time\nprev-token",
            "write-time\nprev-token",
            "read-time\ninduction keys",
        ],
        fontsize=8,
    )
    ax.set_ylabel("loss on the copied tokens (nats/token)")
    ax.legend(fontsize=8)
    figure.suptitle(
        f"Mean-ablating the first copy's cached keys/values, {n} prefixes BOS + segment + "
        f"its first {KNOWN} tokens:\nwhere the edit reaches in the prefix cache (left, mean "
        "over prefixes) and the loss of the rest of the repeat (right)",
        fontsize=10,
    )
    figure.savefig(path)


def compare(model: torch.nn.Module, data: InductionData) -> dict[str, Any]:
    """Step 5: several continuations of one frozen prefix, scored together; then generate."""
    tokens, rest = data.prefixes[:1], data.continuations[0]
    prefix = safelens.prefill(model, tokens)
    shuffled = rest[torch.randperm(len(rest), generator=torch.Generator().manual_seed(0))]
    candidates = {
        "the repeat": rest,
        "the repeat, one token changed": torch.cat([rest[:2], (rest[2:3] % VOCAB) + 1, rest[3:]]),
        "the repeat, shuffled": shuffled,
        "the repeat, skipping a token": rest[1:],
    }
    scores = safelens.score_continuations(model, prefix, list(candidates.values()))
    with torch.no_grad():
        reference = logits_of(model, torch.cat([tokens[0], rest])[None]).log_softmax(-1)
    expected = reference[0, tokens.shape[1] - 1 : -1].gather(-1, rest[:, None]).sum()
    generated = safelens.generate(model, prefix, len(rest))
    return {
        "log_probs": dict(zip(candidates, scores.sums.tolist(), strict=True)),
        "uncached_log_prob": float(expected),
        "max_abs_difference": abs(float(expected) - float(scores.sums[0])),
        "generation_reproduces_repeat": bool(torch.equal(generated.tokens[0], rest)),
    }


def report(numbers: dict[str, Any]) -> str:
    """The story, every number from `numbers`."""
    heads, sweep, rw = numbers["heads"], numbers["patching"], numbers["read_write"]
    prev = _head(tuple(heads["previous_token_head"]))
    induction = ", ".join(_head(tuple(h)) for h in heads["induction_heads"])
    keys, values = sweep["keys_peak"], sweep["values_peak"]
    lines = [
        f"1. trained a 2-layer attention-only {numbers['training']['model']}: "
        f"{numbers['training']['steps']} steps, "
        f"repeat accuracy {numbers['training']['accuracy']:.2f}",
        "2. which heads are which? attention-pattern scores on repeated random segments",
        *heads["table"],
        f"  previous-token head: {prev}; induction heads (score >= {THRESHOLD}): {induction}",
        "3. where is the mechanism? key/value patching sweeps (1 = clean log p(answer))",
        "  clean: BOS s1..s10 s1..s9, answer s10; corrupted: the first copy's s9 replaced "
        "by a token outside the segment,",
        "  so the final s9 has no earlier match: the corruption changes where induction "
        "looks, not what the source s10 holds",
        f"  keys  : strongest at {_head((keys['layer'], keys['head']))}, position "
        f"{keys['position']} (s10, the source; metric {keys['metric']:+.2f})",
        f"  values: strongest at {_head((values['layer'], values['head']))}, position "
        f"{values['position']} (s9, one before the source; metric {values['metric']:+.2f})",
        f"  agreement: the key peak is induction head {_head((keys['layer'], keys['head']))} "
        f"at the source, the value peak is the previous-token head {prev} one position "
        "before it:",
        "  layer 0's output at the source feeds layer 1's keys there (K-composition)",
        "4. read-time vs write-time: mean-ablate the first copy's cached keys/values, score "
        "the rest of the repeat",
    ]
    explained = {
        "none": "no ablation",
        "read_previous_token_head": f"read-time {prev} keys+values: the continuation reads "
        "them only for its own layer-0 attention, which looks at its own previous token",
        "write_previous_token_head": f"write-time {prev} keys+values: the prefix is recomputed, "
        "so layer 1's keys at the first copy lose 'previous token' and induction cannot match",
        "read_induction_keys": f"read-time {induction} keys: the induction heads cannot find "
        "the source, the copy is gone",
    }
    for name, text in explained.items():
        loss = rw["ablations"][name]
        lines.append(
            f"  loss {loss['loss']:5.2f} nats/token, p(correct) {loss['p_correct']:.2f}  {text}"
        )
    lines.append(
        f"  (chance: {rw['chance_loss']:.2f} nats/token); prefix bitwise unchanged: "
        f"{rw['prefix_unchanged']}"
    )
    continuation = numbers["continuations"]
    lines.append("5. counterfactual continuations of one frozen prefix")
    for name, value in continuation["log_probs"].items():
        lines.append(f"  {name:31}: log p = {value:7.2f}")
    lines.append(
        f"  (uncached full run of the repeat: {continuation['uncached_log_prob']:.2f}; "
        f"max abs difference {continuation['max_abs_difference']:.1e})"
    )
    lines.append(
        "  greedy generation from the frozen prefix reproduces the repeat: "
        f"{continuation['generation_reproduces_repeat']}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=Path("safelens-demo"), help="figure folder")
    where.add_argument("--docs", action="store_true", help=f"write the figures to {DOCS}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hf", action="store_true", help="use an attention-only HuggingFace Llama instead"
    )
    args = parser.parse_args(argv)
    out = DOCS if args.docs else args.out
    out.mkdir(parents=True, exist_ok=True)
    stem = "induction_hf_" if args.hf else "induction_"

    with one_thread():
        model, data, steps, accuracy = train_induction_model(args.seed, hf=args.hf)
        assert accuracy >= 0.9, accuracy
        kind = "HuggingFace Llama" if args.hf else "model"
        numbers: dict[str, Any] = {
            "training": {"model": kind, "steps": steps, "accuracy": accuracy}
        }
        files = _Prefixed(out, stem)
        numbers["heads"] = name_circuit(model, data, files)
        numbers["patching"] = locate(model, data, numbers["heads"], files)
        with torch.no_grad():
            numbers["read_write"] = read_versus_write(model, data, numbers["heads"], files)
            numbers["continuations"] = compare(model, data)
    continuation = numbers["continuations"]
    assert continuation["max_abs_difference"] <= 1e-4, continuation
    assert continuation["generation_reproduces_repeat"], continuation
    print(report(numbers))
    (files / "numbers.json").write_text(json.dumps(numbers, indent=1) + "\n")
    print(f"figures and numbers written to {out.resolve()}")
    return numbers


if __name__ == "__main__":
    main()
