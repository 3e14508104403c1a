"""What every benchmark shares: result rows, a timer and the benchmark models."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from transformer_lens import HookedTransformer, HookedTransformerConfig


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


def best_time(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """The fastest of `repeats` wall-clock runs of `fn`, after `warmup` runs."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def rotary_model(
    n_layers: int = 4, d_model: int = 256, n_heads: int = 8, n_ctx: int = 4096, seed: int = 0
) -> HookedTransformer:
    """The SPEC §3 benchmark model: a random-weight rotary HookedTransformer on the CPU."""
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
        device="cpu",
    )
    model = HookedTransformer(cfg)
    model.eval()
    return model
