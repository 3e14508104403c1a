"""What every benchmark shares: result rows, a timer and the benchmark models."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch
import transformer_lens.patching as tl_patching
from transformer_lens import HookedTransformer, HookedTransformerConfig

import safelens


@dataclass
class Row:
    """One comparison: the same job done by safelens and by the TransformerLens way.

    `ratio` is reference time over safelens time (above 1: safelens is faster), or
    for memory rows reference bytes over safelens bytes.
    """

    job: str
    safelens: float
    reference: float
    unit: str  # "s" or "bytes"
    agree: bool
    target: str = ""
    note: str = ""
    group: str = ""  # e.g. "prefix length" for rows that make a scaling curve
    x: float | None = None  # the curve's x value for such rows

    @property
    def ratio(self) -> float:
        return self.reference / self.safelens if self.safelens else float("inf")


def logit_difference(logits: torch.Tensor) -> torch.Tensor:
    """The last position's logit of token 3 minus token 5, per row (batch 1: per run)."""
    return logits[:, -1, 3] - logits[:, -1, 5]


def declared_logit_difference(logits: torch.Tensor) -> torch.Tensor:
    """`logit_difference`, saying it reads the last position only (as `logit_diff_metric`)."""
    return logit_difference(logits)


declared_logit_difference.last_position_only = True  # type: ignore[attr-defined]


def synchronize() -> None:
    """Wait for the GPU's queued work, so a wall-clock time covers it (nothing on a CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def best_time(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """The fastest of `repeats` wall-clock runs of `fn`, after `warmup` runs."""
    for _ in range(warmup):
        fn()
    synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def best_times(fns: list[Callable[[], object]], repeats: int = 3, warmup: int = 1) -> list[float]:
    """The fastest of `repeats` wall-clock runs of each of `fns`, taken in turn.

    Alternating the runs spreads the machine's drift (clock speed, other work) evenly
    over the functions compared, where back-to-back blocks of runs would hand it to one.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    synchronize()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            synchronize()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def time_grid(
    model,
    sweep_name: str,
    activation: str,
    corrupted,
    clean_cache,
    metric,
    max_patches: int,
    repeats: int,
) -> tuple[float, float, bool, str]:
    """A by-position-and-head grid by safelens and by `transformer_lens.patching`, timed.

    Returns `(safelens seconds, TransformerLens seconds, agree within 1e-4, note)`.
    TransformerLens runs one forward per patch, so it runs an evenly spread sample of at
    most `max_patches` patches in two halves; its faster per-patch rate, scaled to the
    grid, counts (as safelens' best of `repeats` runs: a load spike in one half is not
    charged). Agreement is checked on every patch it ran.
    """
    sweep = getattr(safelens, sweep_name)
    with torch.no_grad():
        ours = sweep(model, corrupted, clean_cache, metric, progress=False)
        ours_s = best_time(
            lambda: sweep(model, corrupted, clean_cache, metric, progress=False),
            repeats=repeats,
            warmup=0,
        )
        total = ours.numel()
        flat = torch.arange(0, total, max(1, -(-total // max_patches)))
        theirs_parts, per_patch = [], float("inf")
        for half in flat.tensor_split(2 if len(flat) > 1 else 1):
            index = torch.stack(torch.unravel_index(half, ours.shape), dim=1)
            index_df = pd.DataFrame(index.tolist(), columns=["layer", "pos", "head"])
            synchronize()
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
            synchronize()
            per_patch = min(per_patch, (time.perf_counter() - start) / len(half))
        theirs_s = per_patch * total
    diff = float((ours.reshape(-1)[flat] - torch.cat(theirs_parts)).abs().max())
    note = f"max abs diff {diff:.1e}"
    if len(flat) < total:
        note += f"; TL timed on {len(flat)} of {total} patches, extrapolated"
    return ours_s, theirs_s, diff <= 1e-4, note


def rotary_model(
    n_layers: int = 4,
    d_model: int = 256,
    n_heads: int = 8,
    n_ctx: int = 4096,
    seed: int = 0,
    device: str = "cpu",
) -> HookedTransformer:
    """The SPEC §3 benchmark model: a random-weight rotary HookedTransformer on `device`."""
    cfg = HookedTransformerConfig(
        n_layers=n_layers,
        d_model=d_model,
        n_ctx=n_ctx,
        d_head=d_model // n_heads,
        n_heads=n_heads,
        d_vocab=1000,
        d_mlp=4 * d_model,
        act_fn="gelu",
        positional_embedding_type="rotary",
        normalization_type="LN",
        seed=seed,
        device=device,
    )
    model = HookedTransformer(cfg)
    model.eval()
    return model
