"""Forward-pass cost of a safelens cache with no hooks attached vs TransformerLens' cache.

The cache hook points cost nothing until a hook is attached (an empty-list check per
append). This runs a prefill and then single-token steps on the same rotary model with
both caches, and once more through `safelens.run_with_hooks` with an empty hook list,
and checks that the logits agree.

    python -m benchmarks.bench_hooks [--quick]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from transformer_lens import HookedTransformer, TransformerLensKeyValueCache

import safelens
from safelens import KeyValueCache

from ._common import Row, rotary_model

TARGET = "≥0.95× (SPEC §2: never slower than TransformerLens' cache; hooks cost nothing unused)"


def _ones(length: int) -> torch.Tensor:
    return torch.ones(1, length, dtype=torch.long)


def _plain(model: HookedTransformer, cache: object, chunk: torch.Tensor) -> torch.Tensor:
    return model(chunk, past_kv_cache=cache, attention_mask=_ones(chunk.shape[1]))


def _wrapped(model: HookedTransformer, cache: KeyValueCache, chunk: torch.Tensor) -> torch.Tensor:
    return safelens.run_with_hooks(model, chunk, cache=cache, fwd_hooks=[])


def _session(
    model: HookedTransformer,
    make_cache: Callable[[], object],
    step: Callable[..., torch.Tensor],
    prompt: torch.Tensor,
    steps: int,
) -> Callable[[], list[torch.Tensor]]:
    """A job: prefill `prompt`, then `steps` one-token passes; returns every logits."""
    tokens = torch.arange(steps).reshape(1, steps) % model.cfg.d_vocab

    def job() -> list[torch.Tensor]:
        cache = make_cache()
        logits = [step(model, cache, prompt)[:, -1]]
        for position in range(steps):
            logits.append(step(model, cache, tokens[:, position : position + 1])[:, -1])
        return logits

    return job


def _interleaved(
    a: Callable[[], object], b: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """Best wall-clock times of `a` and `b`, run alternately so load drift hits both."""
    a(), b()
    best_a = best_b = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a()
        best_a = min(best_a, time.perf_counter() - start)
        start = time.perf_counter()
        b()
        best_b = min(best_b, time.perf_counter() - start)
    return best_a, best_b


def run(quick: bool = False) -> list[Row]:
    """Rows: prefill only, prefill + single-token steps, and the same via run_with_hooks."""
    prefix_length, steps = (128, 4) if quick else (512, 32)
    model = rotary_model(n_layers=2)
    prompt = torch.randint(
        0, model.cfg.d_vocab, (1, prefix_length), generator=torch.Generator().manual_seed(0)
    )
    ours = lambda: KeyValueCache.init_cache(model.cfg, "cpu")  # noqa: E731
    theirs = lambda: TransformerLensKeyValueCache.init_cache(model.cfg, "cpu", 1)  # noqa: E731
    jobs = [
        (f"{prefix_length}-token prefill, no hooks", _plain, 0),
        (f"{prefix_length}-token prefill + {steps} single-token steps, no hooks", _plain, steps),
        ("same via safelens.run_with_hooks(fwd_hooks=[])", _wrapped, steps),
    ]
    rows = []
    with torch.no_grad():
        for job, step, count in jobs:
            safelens_job = _session(model, ours, step, prompt, count)
            reference_job = _session(model, theirs, _plain, prompt, count)
            agree = all(
                torch.allclose(a, b, atol=1e-4, rtol=1e-4)
                for a, b in zip(safelens_job(), reference_job(), strict=True)
            )
            ours_time, theirs_time = _interleaved(safelens_job, reference_job, 7)
            rows.append(
                Row(
                    job=job,
                    safelens=ours_time,
                    reference=theirs_time,
                    unit="s",
                    agree=agree,
                    target=TARGET,
                    note="2-layer d_model=256 rotary model, CPU",
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128-token prefix, 4 steps")
    rows = run(quick=parser.parse_args().quick)
    print(f"{'job':<62} {'ratio':>7} agree")
    for row in rows:
        print(f"{row.job:<62} {row.ratio:>6.2f}× {row.agree}")
    print(f"ratio = TransformerLens cache time / safelens cache time; target: {TARGET}")


if __name__ == "__main__":
    main()
