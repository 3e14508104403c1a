"""Patching sweeps on a TransformerBridge: safelens against transformer_lens.patching on it.

The SPEC §3 model shape (4 layers, d_model 256, Llama-like grouped-query attention,
`bench_hf.llama_model`) behind a TransformerBridge. TransformerLens runs one full
forward pass through the bridge per patch, so it is timed on an evenly spread subset of
the grid (its own `generic_activation_patch` with an `index_df`, the loop its
`get_act_patch_*` functions run) and its time is extrapolated per patch; agreement is
checked on every patch it ran. safelens patches keys after the rotary embedding at the
cache seam, TransformerLens `attn.hook_k` before it: the same patch at one position.
The metric is a last-position logit difference, batched for safelens: the target rows
give it as `safelens.logit_diff_metric` does (it says it reads the last position only,
so the sweeps unembed that position alone), a further row as a plain function that reads
the full logits. The target rows patch between two independent random prompts, which
share no activation (the worst case); the last row patches between prompts that differ
at the middle position alone, as an experiment's pair usually shares positions, where
the patches before it change nothing and run no pass (`safelens.patching._unchanged`).
"""

from __future__ import annotations

import argparse

import torch

from ._common import Row, declared_logit_difference, logit_difference, time_grid
from .bench_hf import FULL, QUICK, VOCAB, bridge_model

TARGET = "≥10× vs transformer_lens.patching on the bridge, ≤1e-4"
NAMES = {"k": "get_act_patch_attn_head_k_by_pos", "v": "get_act_patch_attn_head_v_by_pos"}


def grid_row(
    bridge,
    activation: str,
    length: int,
    max_patches: int,
    repeats: int,
    declared: bool = True,
    shared: bool = False,
) -> Row:
    """One by-position grid on `bridge`: safelens' time, TransformerLens' extrapolated.

    `shared`: the corrupted prompt is the clean one with its middle token changed.
    """
    generator = torch.Generator().manual_seed(0)
    clean, corrupted = (
        torch.randint(1, VOCAB, (1, length), generator=generator).to(bridge.cfg.device)
        for _ in "ab"
    )
    if shared:
        corrupted = clean.clone()
        corrupted[0, length // 2] = clean[0, length // 2] % (VOCAB - 1) + 1
    metric = declared_logit_difference if declared else logit_difference
    with torch.no_grad():
        _, clean_cache = bridge.run_with_cache(clean)
    ours_s, theirs_s, agree, note = time_grid(
        bridge, NAMES[activation], activation, corrupted, clean_cache, metric, max_patches, repeats
    )
    job = f"{activation} by-position grid on the bridge, {length} tokens, {bridge.cfg.n_layers} layers"
    if not declared:
        job += ", plain metric"
    if shared:
        job += f", prompts differing at position {length // 2} alone"
    target = TARGET if declared and not shared else ""
    return Row(job, ours_s, theirs_s, "s", agree, target, note)


def run(quick: bool = False) -> list[Row]:
    """The key and value grid rows (quick: the small model, 8 tokens)."""
    sizes = QUICK if quick else FULL
    bridge = bridge_model(sizes)
    length = 8 if quick else 64
    budget = 8 if quick else 64
    rows = [grid_row(bridge, activation, length, budget, sizes.repeats) for activation in NAMES]
    plain = grid_row(bridge, "k", length, budget, sizes.repeats, declared=False)
    return [*rows, plain, grid_row(bridge, "k", length, budget, sizes.repeats, shared=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run for development")
    args = parser.parse_args()
    print(f"{'job':<95} {'ratio':>8}  agree  note")
    for row in run(quick=args.quick):
        print(f"{row.job:<95} {row.ratio:>7.2f}×  {str(row.agree):<5}  {row.note}")


if __name__ == "__main__":
    main()
