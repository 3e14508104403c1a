"""Patching sweeps: safelens' cached, batched grids against transformer_lens.patching.

TransformerLens runs one full forward pass per patch, so at long prompts it is timed
on an evenly spread subset of the grid (its own `generic_activation_patch` with an
`index_df`) and its time is extrapolated per patch; such rows say so in their note.
Agreement is checked on every patch TransformerLens ran. The metric is
`logit_diff_metric`, which reads only the last position and says so; one row repeats
the k grid with the same metric as a plain function, which the sweeps cannot skip
positions for.
"""

from __future__ import annotations

import argparse
import time

import pandas as pd
import torch
import transformer_lens.patching as tl_patching

import safelens

from ._common import Row, best_time, rotary_model

TARGET = "≥10× faster than TransformerLens' patching functions, max abs difference ≤1e-4"
GRIDS = {"k": "k", "v": "v", "q": "q", "z": "out"}


def _setup(n_layers: int, length: int):
    model = rotary_model(n_layers=n_layers)
    generator = torch.Generator().manual_seed(0)
    clean, corrupted = (torch.randint(0, 1000, (1, length), generator=generator) for _ in "ab")
    with torch.no_grad():
        clean_logits, clean_cache = model.run_with_cache(clean)
        metric = safelens.logit_diff_metric(clean_logits, model(corrupted), 3, 5)
    return model, corrupted, clean_cache, metric


def _compare(
    activation: str, n_layers: int, length: int, max_patches: int, declared: bool = True
) -> tuple:
    model, corrupted, clean_cache, metric = _setup(n_layers, length)
    if not declared:
        metric = _undeclared(metric)
    name = f"get_act_patch_attn_head_{GRIDS[activation]}_by_pos"
    with torch.no_grad():
        sweep = getattr(safelens, name)
        ours = sweep(model, corrupted, clean_cache, metric, progress=False)
        repeats = 2 if length <= 64 else 1
        ours_s = best_time(
            lambda: sweep(model, corrupted, clean_cache, metric, progress=False),
            repeats=repeats,
            warmup=0,
        )
        total = ours.numel()
        step = max(1, -(-total // max_patches))
        flat = torch.arange(0, total, step)
        # TransformerLens runs the sample in two halves and its faster per-patch rate counts,
        # as safelens' best of repeated runs does: a load spike in one half is not charged.
        theirs_parts, per_patch = [], float("inf")
        for half in flat.tensor_split(2 if len(flat) > 1 else 1):
            index = torch.stack(torch.unravel_index(half, ours.shape), dim=1)
            index_df = pd.DataFrame(index.tolist(), columns=["layer", "pos", "head"])
            start = time.perf_counter()
            theirs_parts.append(
                tl_patching.generic_activation_patch(
                    model,
                    corrupted,
                    clean_cache,
                    metric,
                    tl_patching.layer_pos_head_vector_patch_setter,
                    activation,
                    index_df=index_df,
                )
            )
            per_patch = min(per_patch, (time.perf_counter() - start) / len(half))
        theirs = torch.cat(theirs_parts)
        theirs_s = per_patch * total
    diff = float((ours.reshape(-1)[flat] - theirs).abs().max())
    note = f"max abs diff {diff:.1e}"
    if len(flat) < total:
        note += f"; TL timed on {len(flat)} of {total} patches, extrapolated"
    return ours_s, theirs_s, diff <= 1e-4, note


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
    print(f"{'job':45} {'ratio':>7} agree  note")
    for row in run(quick=args.quick):
        print(f"{row.job:45} {row.ratio:6.1f}x {str(row.agree):5}  {row.note}")


if __name__ == "__main__":
    main()
