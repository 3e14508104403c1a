"""A patching dataset sharded on Ray: one worker against one process, N workers against one.

The job: `patch_dataset` of the residual stream by position over 64 prompt pairs on a
random-weight Llama-like model (the SPEC §3 HF model's shape; smaller in quick mode).
Three ways, on one local Ray instance holding every core of this machine:

- one process: `safelens.patch_dataset` here, torch on one thread;
- one worker: `RayWorkers(n_workers=1, num_cpus=1)` (one torch thread);
- N workers, each `num_cpus=1`, for N from 2 up to this machine's cores, at most 4.

The rows: one worker against one process (target: within 1.1×), and N workers against
one worker (target: at least 0.8·N× its throughput). Each timing is the best of a few
runs of the whole job after a warm-up run, with the workers' replicas already built
(building them is a one-time cost per `RayWorkers`, not per job). Every Ray result is
checked against the one-process result (max abs difference ≤1e-6). When the benchmark
starts Ray itself, its workers run at this process's priority (Ray's default lowers
them to niceness 15). The note gives the load average when each row was measured: on a
machine whose cores are busy with other work, N workers cannot get N cores, and the
speed-up falls short of N.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os

import torch

import safelens

from ._common import Row, best_time
from .bench_hf import FULL, VOCAB, llama_model

PAIRS = 64
MAX_WORKERS = 4


def build_model(hidden: int, layers: int) -> torch.nn.Module:
    """The HF benchmark's Llama-like model (`bench_hf.llama_model`), seeded: the same
    weights on every worker."""
    return llama_model(dataclasses.replace(FULL, hidden=hidden, layers=layers))


def metric(logits: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """The last position's logit of token 3 minus token 5, per row."""
    return logits[:, -1, 3] - logits[:, -1, 5]


metric.last_position_only = True  # type: ignore[attr-defined]


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _pairs(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    clean = torch.randint(1, VOCAB, (PAIRS, length), generator=generator)
    corrupted = clean.clone()
    corrupted[:, length // 2] = torch.randint(1, VOCAB, (PAIRS,), generator=generator)
    return clean, corrupted


def _load() -> str:
    return f"load average {os.getloadavg()[0]:.1f} on {cores()} cores"


def run(quick: bool = False) -> list[Row]:
    """The one-worker row and one row per worker count from 2 to min(4, cores)."""
    import ray

    hidden, layers, length = (64, 2, 8) if quick else (256, 4, 16)
    repeats = 1 if quick else 5
    factory = functools.partial(build_model, hidden, layers)
    clean, corrupted = _pairs(length)
    sweep = safelens.get_act_patch_resid_pre
    job = dict(clean_tokens=clean, corrupted_tokens=corrupted, metric=metric, progress=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = factory()
        with torch.no_grad():
            reference = safelens.patch_dataset(sweep, model, **job)
            one_process = best_time(lambda: safelens.patch_dataset(sweep, model, **job), repeats)
    finally:
        torch.set_num_threads(threads)
    started = not ray.is_initialized()
    if started:
        # Ray starts its workers at niceness 15, below this process; on a machine busy with
        # other work that alone would slow them. Compare like with like.
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(num_cpus=cores(), include_dashboard=False, log_to_driver=False)
    times: dict[int, float] = {}
    rows = []
    try:
        for count in [1, *range(2, min(cores(), MAX_WORKERS) + 1)]:
            with safelens.RayWorkers(factory, n_workers=count, num_cpus=1) as workers:
                result = workers.patch_dataset(sweep, **job)
                times[count] = best_time(lambda: workers.patch_dataset(sweep, **job), repeats, 0)
            difference = float((result.per_pair - reference.per_pair).abs().max())
            agree = difference <= 1e-6
            note = f"max abs diff {difference:.1e} vs one process; {_load()}"
            if count == 1:
                rows.append(
                    Row(
                        f"{PAIRS}-pair patch_dataset on Ray, 1 worker (1 CPU) vs one process "
                        "(1 thread)",
                        times[1],
                        one_process,
                        "s",
                        agree,
                        "within 1.1× of one process",
                        note,
                    )  # fmt: skip
                )
            else:
                rows.append(
                    Row(
                        f"{PAIRS}-pair patch_dataset on Ray, {count} workers vs 1 worker",
                        times[count],
                        times[1],
                        "s",
                        agree,
                        f"≥{0.8 * count:.1f}× one worker",
                        note,
                        group="Ray workers",
                        x=count,
                    )  # fmt: skip
                )
    finally:
        if started:
            ray.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run for development")
    args = parser.parse_args()
    for row in run(quick=args.quick):
        print(f"{row.job:<75} {row.ratio:>7.2f}×  {str(row.agree):<5}  {row.note}")


if __name__ == "__main__":
    main()
