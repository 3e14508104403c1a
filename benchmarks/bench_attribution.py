"""Attribution patching against the exact sweeps: agreement and speed.

Agreement: on the flagship demo's trained induction model (`examples/_induction.py`:
2-layer attention-only rotary, no LayerNorm, its prompts and metric), on the same
circuit trained in a plain HuggingFace Llama (`train_induction_model(0, hf=True)`), and
on random-weight models with MLPs and LayerNorm, every cell of every exact grid the
model has (k, v, q, z by position; pattern by destination and source; resid_pre,
resid_mid, attn_out, mlp_out by position) is computed with safelens' exact sweeps and
compared with `attribution_patch`, with and without the QK fix for k and q: the
Spearman rank correlation of estimate and exact value over the grid and over the cells
whose exact effect is above float noise, and the recall of the exact top-10 cells (by
|effect|) within the top-20 and top-50 estimates (where the grid has more cells).

Speed: k and v grids together, attribution (QK fix on) against the exact sweeps, on the
SPEC's 4-layer d_model=256 rotary model. At 64 tokens the exact grids run whole; at 256
and 1024 tokens they run on an evenly spread subset of positions (every head and layer)
through `generic_activation_patch`, and their time is extrapolated per patch; the 64-token
row gives the same extrapolation's error against the whole grid, in its note. `agree`
(64 tokens only): the attribution run's `verify_top_k=10` cells equal the whole exact
grids' values there.

Run: python -m benchmarks.bench_attribution [--quick] [--figures DIR] [--part agreement|speed]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd
import torch
from transformer_lens import HookedTransformer
from transformer_lens.patching import layer_pos_head_vector_patch_setter

import safelens

from ._common import Row, rotary_model, synchronize

TARGET = "≥50× faster than the exact by-position grid"
EXACT = {
    "k": safelens.get_act_patch_attn_head_k_by_pos,
    "v": safelens.get_act_patch_attn_head_v_by_pos,
    "q": safelens.get_act_patch_attn_head_q_by_pos,
    "z": safelens.get_act_patch_attn_head_out_by_pos,
    "pattern": safelens.get_act_patch_attn_head_pattern_dest_src_pos,
    "resid_pre": safelens.get_act_patch_resid_pre,
    "resid_mid": safelens.get_act_patch_resid_mid,
    "attn_out": safelens.get_act_patch_attn_out,
    "mlp_out": safelens.get_act_patch_mlp_out,
}
# The sites of an attention-only HookedTransformer (no resid_mid or MLP hook fires); the
# HuggingFace demo model's are the same plus resid_mid (its MLPs are zero modules, no
# effect to rank, so its resid_mid is the next layer's resid_pre).
ATTENTION_ONLY = ("k", "v", "q", "z", "pattern", "resid_pre", "attn_out")
HF_SITES = (*ATTENTION_ONLY, "resid_mid")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOISE = 1e-6  # below this |exact effect|, a cell's effect is float noise


def demo_task(seed: int = 0, hf: bool = False):
    """The flagship demo's trained model, prompts and metric (`examples/_induction.py`).

    A 2-layer attention-only rotary model without LayerNorm, trained to continue repeated
    random segments; 16 prompts `BOS, s_1 … s_10, s_1 … s_9` whose corrupted copy has
    `s_9` of the first segment replaced by a token outside it; the metric is the demo's
    mean log-probability of `s_10` at the last position, clean 1, corrupted 0. `hf`:
    the same circuit trained in a plain HuggingFace Llama.
    """
    sys.path.insert(0, str(EXAMPLES))  # the examples import each other by bare name
    try:
        import _induction
    finally:
        sys.path.remove(str(EXAMPLES))
    model, data, steps, accuracy = _induction.train_induction_model(seed, hf=hf)
    kind = "HuggingFace " if hf else ""
    print(f"the demo's {kind}model: {steps} steps, held-out repeat accuracy {accuracy:.3f}")
    with torch.no_grad():
        if hf:
            clean_logits, clean_cache = safelens.run_with_patching_cache(model, data.clean)
            corrupted_logits = model(data.corrupted).logits
        else:
            clean_logits, clean_cache = model.run_with_cache(data.clean)
            corrupted_logits = model(data.corrupted)
        metric = _induction.AnswerLogProb(clean_logits, corrupted_logits, data.answers)
    first = [f"s{i}" for i in range(1, _induction.SEGMENT + 1)]
    labels = ["BOS", *first, *first[:-1]]
    return model, (data.corrupted, clean_cache, metric), labels


def random_task(model: HookedTransformer, length: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    vocab = model.cfg.d_vocab
    clean, corrupted = (torch.randint(0, vocab, (1, length), generator=generator) for _ in "ab")
    return _case(model, clean, corrupted, 3, 5)


def _case(model, clean, corrupted, answer, wrong):
    with torch.no_grad():
        clean_logits, clean_cache = model.run_with_cache(clean)
        metric = safelens.logit_diff_metric(clean_logits, model(corrupted), answer, wrong)
    return corrupted, clean_cache, metric


def agreement(
    model, corrupted, clean_cache, metric, sites=tuple(EXACT), qk_fix: bool = True
) -> dict[str, dict]:
    """Per grid of `sites`: Spearman, top-10 recall at 20 and 50, with and without the QK fix.

    Spearman is taken over the whole grid and over the cells with an effect (|exact
    effect| above `NOISE`). Elsewhere (a patch that changes nothing, or a query the
    metric does not read) the estimate is 0 and the exact effect float noise, which
    ranks at random. The recall's top-10 is over the whole grid; recall at N is left
    out (None) where the grid has no more than N cells.
    """
    with torch.no_grad():
        exact = {
            name: EXACT[name](model, corrupted, clean_cache, metric, progress=False)
            for name in sites
        }
    runs = {
        "first order": safelens.attribution_patch(
            model, corrupted, clean_cache, metric, activations=sites, qk_fix=False
        )
    }
    if qk_fix:
        runs["QK fix"] = safelens.attribution_patch(
            model, corrupted, clean_cache, metric, activations=sites
        )
    table: dict[str, dict] = {}
    for name in sites:
        for label, result in runs.items():
            if name in ("k", "q"):
                label = "plain AtP" if label == "first order" else label
            elif label == "QK fix":  # the QK fix changes only k and q
                continue
            effect = (exact[name] - result.baseline).flatten()
            estimate = (result.estimates[name] - result.baseline).flatten()
            live = effect.abs() > NOISE
            cells = effect.numel()
            table[f"{name}, {label}"] = {
                "spearman": spearman(estimate, effect),
                "spearman, with effect": spearman(estimate[live], effect[live]),
                "recall@20": recall(estimate, effect, 20) if cells > 20 else None,
                "recall@50": recall(estimate, effect, 50) if cells > 50 else None,
                "cells with effect": f"{int(live.sum())}/{cells}",
                "max |error|": float((estimate - effect).abs().max()),
                "max |effect|": float(effect.abs().max()),
            }
    return table


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Rank correlation, ties at their mean rank (NaN for fewer than 2 cells)."""
    if len(x) < 2:
        return float("nan")
    return float(torch.corrcoef(torch.stack([_ranks(x), _ranks(y)]))[0, 1])


def _ranks(x: torch.Tensor) -> torch.Tensor:
    _, inverse, counts = torch.unique(x, return_inverse=True, return_counts=True)
    last = counts.cumsum(0).double()
    return (last - (counts - 1) / 2)[inverse]


def recall(estimate: torch.Tensor, effect: torch.Tensor, within: int, top: int = 10) -> float:
    truth = set(effect.abs().argsort(descending=True)[:top].tolist())
    found = set(estimate.abs().argsort(descending=True)[:within].tolist())
    return len(truth & found) / top


def _timed(fn):
    synchronize()
    start = time.perf_counter()
    value = fn()
    synchronize()
    return value, time.perf_counter() - start


def _spread(length: int, count: int) -> list[int]:
    """`count` positions in evenly spread runs of 4 (the exact sweep batches 4 positions)."""
    starts = range(0, length, length * 4 // count)
    return [start + offset for start in starts for offset in range(4) if start + offset < length]


def _exact_subset_time(model, corrupted, clean_cache, metric, positions: list[int]) -> float:
    """Seconds per patch of the exact k and v sweeps over `positions` (all layers, heads)."""
    cfg = model.cfg
    heads = cfg.n_key_value_heads or cfg.n_heads
    rows = [(layer, p, h) for layer in range(cfg.n_layers) for p in positions for h in range(heads)]
    index_df = pd.DataFrame(rows, columns=["layer", "pos", "head_index"])
    total = 0.0
    for name in ("k", "v"):
        _, seconds = _timed(
            lambda name=name: safelens.generic_activation_patch(
                model,
                corrupted,
                clean_cache,
                metric,
                layer_pos_head_vector_patch_setter,
                name,
                index_df=index_df,
                progress=False,
            )
        )
        total += seconds
    return total / (2 * len(rows))


def speed_row(length: int, subset: int | None, device: str = "cpu") -> Row:
    """Attribution (k and v, QK fix) against the exact k and v grids at `length` tokens."""
    model = rotary_model(n_layers=4, device=device)
    corrupted, clean_cache, metric = random_task(model, length)
    run = lambda: safelens.attribution_patch(  # noqa: E731
        model, corrupted, clean_cache, metric, activations=["k", "v"]
    )
    run()
    result, ours = _timed(run)
    checked = safelens.attribution_patch(
        model, corrupted, clean_cache, metric, activations=["k", "v"], verify_top_k=10
    )
    cells = 2 * model.cfg.n_layers * length * model.cfg.n_heads
    note = "exact: whole k and v grids"
    with torch.no_grad():
        if subset is None:
            exact = {}
            theirs = 0.0
            for name in ("k", "v"):
                exact[name], seconds = _timed(
                    lambda name=name: EXACT[name](
                        model, corrupted, clean_cache, metric, progress=False
                    )
                )
                theirs += seconds
            agree = all(
                torch.allclose(
                    checked.exact[n][checked.exact[n].isfinite()],
                    exact[n][checked.exact[n].isfinite()],
                    atol=1e-4,
                )
                for n in ("k", "v")
            )
            positions = _spread(length, 8)
            per_patch = _exact_subset_time(model, corrupted, clean_cache, metric, positions)
            note += f"; the per-patch extrapolation used at longer prompts gives {per_patch * cells / theirs:.2f}× this"
        else:
            positions = _spread(length, subset)
            theirs = _exact_subset_time(model, corrupted, clean_cache, metric, positions) * cells
            agree = True  # no whole exact grid to compare the verified cells with
            note = f"exact: extrapolated from {len(positions)} evenly spread positions"
    del result
    return Row(
        f"k+v attribution vs exact grids, {length} tokens",
        ours,
        theirs,
        "s",
        agree,
        TARGET if length == 256 else "",
        note,
        "tokens",
        length,
    )


def figure(model, corrupted, clean_cache, metric, path: Path, labels=None, title="") -> None:
    """Exact, QK-fixed and plain k grids of one model, side by side (`labels`: positions)."""
    from matplotlib.figure import Figure

    with torch.no_grad():
        exact = EXACT["k"](model, corrupted, clean_cache, metric, progress=False)
    fixed = safelens.attribution_patch(model, corrupted, clean_cache, metric, activations=["k"])
    plain = safelens.attribution_patch(
        model, corrupted, clean_cache, metric, activations=["k"], qk_fix=False
    )
    panels = [
        ("exact sweep", exact),
        ("attribution, QK fix", fixed.estimates["k"]),
        ("attribution, plain AtP", plain.estimates["k"]),
    ]
    layers, length, heads = exact.shape
    fig = Figure(figsize=(12, 3.5), layout="constrained")
    fig.suptitle(title)
    axes = fig.subplots(1, 3, sharey=True)
    limit = float((exact - fixed.baseline).abs().max())
    for ax, (title, grid) in zip(axes, panels, strict=True):
        image = (grid - fixed.baseline).permute(0, 2, 1).reshape(layers * heads, length)
        shown = ax.imshow(image.numpy(), cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto")
        ax.set_title(title)
        ax.set_xlabel("position")
        if labels is not None:
            ax.set_xticks(range(length), labels, rotation=90, fontsize=7)
    axes[0].set_yticks(
        range(layers * heads), [f"L{layer}H{h}" for layer in range(layers) for h in range(heads)]
    )
    fig.colorbar(shown, ax=list(axes), label="metric change (key patch)")
    fig.savefig(path, dpi=110)


_HEADER = (
    "| grid, method | Spearman | Spearman, cells with effect | recall@20 | recall@50 | "
    "cells with effect | max abs error | max abs effect |"
)


def _print_agreement(label: str, table: dict[str, dict]) -> None:
    """One markdown table: `label` as its heading, a row per grid."""
    print(f"\n**{label}**\n\n{_HEADER}\n" + "| --- " * 8 + "|", flush=True)
    for name, values in table.items():
        cells = " | ".join(
            f"{value:.3g}" if isinstance(value, float) else "—" if value is None else str(value)
            for value in values.values()
        )
        print(f"| {name} | {cells} |", flush=True)


def accuracy(quick: bool = False, figures: Path | None = None) -> None:
    """Print the agreement tables (one per model, a markdown row per grid); draw the
    heatmaps into `figures`.

    The trained models are the demo's (trained in full even when `quick`: about 10 s for
    the HookedTransformer, longer for the HuggingFace Llama, which `quick` leaves out).
    """
    model, case, labels = demo_task()
    sites = ("k", "v") if quick else ATTENTION_ONLY
    _print_agreement("trained induction (demo)", agreement(model, *case, sites))
    if not quick:
        hf_model, hf_case, _ = demo_task(hf=True)
        label = "trained induction, HF Llama"
        _print_agreement(label, agreement(hf_model, *hf_case, HF_SITES))
    for seed in [] if quick else [0, 1]:
        random = rotary_model(n_layers=2, d_model=128, n_heads=4, seed=seed)
        _print_agreement(f"random, seed {seed}", agreement(random, *random_task(random, 32, seed)))
    if figures is not None:
        figures.mkdir(parents=True, exist_ok=True)
        title = "Trained induction model of the demo (2 attention-only layers, 4 heads)"
        figure(model, *case, figures / "attribution_induction_k.png", labels, title)
        random = rotary_model(n_layers=2, d_model=128, n_heads=4, seed=0)
        title = "Random-weight model, seed 0 (2 layers with MLPs and LayerNorm, 4 heads)"
        figure(random, *random_task(random, 32), figures / "attribution_random_k.png", None, title)


def speed(quick: bool = False) -> list[Row]:
    """Speed rows by prompt length, each printed as it is measured."""
    rows = []
    for length, subset in [(16, None)] if quick else [(64, None), (256, 8), (1024, 8)]:
        row = speed_row(length, subset)
        print(
            f"{row.job:50} ours {row.safelens:.3g}s exact {row.reference:.3g}s "
            f"{row.ratio:7.1f}x agree={row.agree}  {row.note}",
            flush=True,
        )
        rows.append(row)
    return rows


def run(quick: bool = False, figures: Path | None = None) -> list[Row]:
    """The speed rows; the agreement table is printed."""
    accuracy(quick, figures)
    return speed(quick)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short prompts, brief training")
    parser.add_argument("--figures", type=Path, help="write the heatmap PNGs here")
    parser.add_argument("--part", choices=["all", "agreement", "speed"], default="all")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a shared machine: one thread per process thrashes least
    if args.part != "speed":
        accuracy(args.quick, args.figures)
    if args.part != "agreement":
        speed(args.quick)


if __name__ == "__main__":
    main()
