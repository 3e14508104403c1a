"""Patching sweeps: safelens' cached, batched grids against transformer_lens.patching.

TransformerLens runs one full forward pass per patch, so at long prompts it is timed
on an evenly spread subset of the grid (its own `generic_activation_patch` with an
`index_df`) and its time is extrapolated per patch; such rows say so in their note.
Agreement is checked on every patch TransformerLens ran. The metric is
`logit_diff_metric`, which reads only the last position and says so; one row repeats
the k grid with the same metric as a plain function, which the sweeps cannot skip
positions for. The grids patch between two independent random prompts, which share no
activation (the worst case); one row patches between prompts that differ at the middle
position alone, as an experiment's pair usually shares positions: the patches before it
change nothing and run no pass (`safelens.patching._unchanged`). That row's metric is the
raw logit difference: one token barely moves the normalised metric's denominator.
"""

from __future__ import annotations

import argparse

import torch

import safelens

from ._common import Row, declared_logit_difference, rotary_model, time_grid

TARGET = "≥10× faster than TransformerLens' patching functions, max abs difference ≤1e-4"
GRIDS = {"k": "k", "v": "v", "q": "q", "z": "out"}


def _setup(n_layers: int, length: int, shared: bool = False, device: str = "cpu"):
    model = rotary_model(n_layers=n_layers, device=device)
    generator = torch.Generator().manual_seed(0)
    clean, corrupted = (torch.randint(0, 1000, (1, length), generator=generator) for _ in "ab")
    if shared:  # the clean prompt with its middle token changed
        corrupted = clean.clone()
        corrupted[0, length // 2] = (clean[0, length // 2] + 1) % 1000
    with torch.no_grad():
        clean_logits, clean_cache = model.run_with_cache(clean)
        metric = safelens.logit_diff_metric(clean_logits, model(corrupted), 3, 5)
    if shared:
        # One token moves the normalised metric's denominator (clean minus corrupted)
        # little, which would magnify float rounding a hundredfold: the raw difference.
        metric = declared_logit_difference
    return model, corrupted, clean_cache, metric


def _compare(
    activation: str,
    n_layers: int,
    length: int,
    max_patches: int,
    declared: bool = True,
    shared: bool = False,
    device: str = "cpu",
) -> tuple:
    model, corrupted, clean_cache, metric = _setup(n_layers, length, shared, device)
    if not declared:
        metric = _undeclared(metric)
    name = f"get_act_patch_attn_head_{GRIDS[activation]}_by_pos"
    repeats = 2 if length <= 64 else 1
    return time_grid(model, name, activation, corrupted, clean_cache, metric, max_patches, repeats)


def _undeclared(metric):
    """The same metric as a plain function, so the sweeps hand it every position's logits."""
    return lambda logits: metric(logits)


def run(quick: bool = False) -> list[Row]:
    """Grid rows (k, v, q, z by position), then scaling rows by prompt length and layers."""
    rows = []
    length = 8 if quick else 64
    budget = 16 if quick else 512
    for activation in GRIDS:
        ours, theirs, agree, note = _compare(activation, 4, length, budget)
        job = f"{activation} by-position grid, {length} tokens, 4 layers"
        rows.append(Row(job, ours, theirs, "s", agree, TARGET, note))
    ours, theirs, agree, note = _compare("k", 4, length, budget, declared=False)
    note += "; metric not declared last-position-only: every position unembedded"
    rows.append(
        Row(
            f"k by-position grid, {length} tokens, plain metric", ours, theirs, "s", agree, "", note
        )
    )
    ours, theirs, agree, note = _compare("k", 4, length, budget, shared=True)
    job = f"k by-position grid, {length} tokens, prompts differing at position {length // 2} alone"
    rows.append(Row(job, ours, theirs, "s", agree, "", note))
    for length in (8, 16) if quick else (16, 32, 64, 128, 256):
        ours, theirs, agree, note = _compare("k", 4, length, 16 if quick else 128)
        job = f"k patching grid, {length} tokens"
        rows.append(Row(job, ours, theirs, "s", agree, "", note, "tokens", length))
    for n_layers in (2,) if quick else (2, 4, 8):
        ours, theirs, agree, note = _compare("k", n_layers, 32, 16 if quick else 128)
        job = f"k patching grid, 32 tokens, {n_layers} layers"
        rows.append(Row(job, ours, theirs, "s", agree, "", note, "layers", n_layers))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter prompts, fewer rows")
    args = parser.parse_args()
    print(f"{'job':75} {'ratio':>7} agree  note")
    for row in run(quick=args.quick):
        print(f"{row.job:75} {row.ratio:6.1f}x {str(row.agree):5}  {row.note}")


if __name__ == "__main__":
    main()
