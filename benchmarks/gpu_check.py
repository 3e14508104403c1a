"""Check a machine's accelerator in one command: `python -m benchmarks.gpu_check`.

Runs, on `--device` (default `cuda` when there is one, else `cpu`), and prints one
table of check, result, ratio or difference, and time:

1. the correctness subset of the test suite (caches, HF cache, generation,
   continuations, key/value patching on HookedTransformer and HF models, attribution,
   devices), with `SAFELENS_TEST_DEVICE` set to the device;
2. the benchmark rows (continuations, key/value grids, attribution, generation)
   against TransformerLens and HuggingFace on the same device, each row's numbers
   checked against the reference;
3. a HuggingFace model split by accelerate between `cuda:0` and the CPU (on a CPU
   machine: dispatched onto the CPU alone), every experiment equal to the unsplit model;
4. a Ray job with one GPU worker beside CPU workers, when `safelens.RayWorkers` and a
   GPU are there.

It installs nothing. `--quick` runs small sizes and a one-file test subset (what CI
runs on the CPU, in under a minute); a full run on one GPU takes about five minutes.
Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ._common import Row
from .report import target_met

ROOT = Path(__file__).resolve().parent.parent
TESTS = [
    "tests/test_cache.py",
    "tests/test_hf_cache.py",
    "tests/test_generation.py",
    "tests/test_prefix.py",
    "tests/test_hf_experiments.py",
    "tests/test_patching.py::test_sweep_equals_transformer_lens",
    "tests/test_patching.py::test_key_value_sweeps_equal_transformer_lens_in_each_dtype",
    "tests/test_patching_hf.py::test_hf_sweeps_equal_a_loop_of_hooked_forwards",
    "tests/test_attribution.py",
    "tests/test_devices.py",
]
QUICK_TESTS = ["tests/test_config.py::test_layer_devices_match_transformer_lens"]
SPLIT_TOLERANCE = 1e-4


@dataclass
class Check:
    """One line of the table."""

    name: str
    result: str  # "ok", "FAILED", "slow" (agrees, misses its speed target) or "skipped"
    measure: str  # a ratio, a difference, or test counts
    seconds: float


def _tests_on_path() -> None:
    """Let the test suite's model builders (`tests/split_models.py`) be imported."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))


def _timed(name: str, fn: Callable[[], Check | list[Check]]) -> list[Check]:
    start = time.perf_counter()
    try:
        checks = fn()
    except Exception as error:  # a check that crashes is a failed check, the rest still run
        message = f"{type(error).__name__}: {error}"[:160]
        return [Check(name, "FAILED", message, time.perf_counter() - start)]
    if isinstance(checks, list):
        return checks
    checks.seconds = time.perf_counter() - start
    return [checks]


def test_subset(device: str, quick: bool, timeout: int) -> Check:
    """The correctness subset of the test suite, run by pytest on `device`."""
    tests = QUICK_TESTS if quick else TESTS
    env = {**os.environ, "SAFELENS_TEST_DEVICE": device}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    name = f"test suite subset on {device} ({len(tests)} files or tests)"
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return Check(name, "FAILED", f"timed out after {timeout} s", float(timeout))
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    counts = ", ".join(re.findall(r"\d+ (?:passed|failed|skipped|errors?|deselected)", summary))
    if done.returncode != 0:
        print(done.stdout[-4000:], done.stderr[-2000:], sep="\n", file=sys.stderr)
    return Check(name, "ok" if done.returncode == 0 else "FAILED", counts or summary, 0.0)


def _timed_rows(fn: Callable[[], list[Row]]) -> list[Check]:
    """`fn`'s rows as checks, each with the wall-clock time of the whole call."""
    start = time.perf_counter()
    with torch.no_grad():
        rows = fn()
    elapsed = time.perf_counter() - start
    checks = []
    for row in rows:
        met = target_met(row)
        result = "FAILED" if not row.agree else ("slow" if met is False else "ok")
        measure = f"{row.ratio:.2f}× ({row.note})" if row.note else f"{row.ratio:.2f}×"
        checks.append(Check(row.job, result, measure, elapsed))
    return checks


def benchmark_rows(device: str, quick: bool) -> list[Check]:
    """The benchmark suite's rows on `device`, against TransformerLens and HF there.

    A row's time is that of the call that made it (a call makes one to three rows).
    """
    from . import bench_attribution, bench_cache, bench_continuations, bench_hf, bench_patching
    from ._common import rotary_model

    sizes = bench_hf.QUICK if quick else bench_hf.FULL
    length, repeats = (32, 1) if quick else (512, 3)
    grid_length, budget = (8, 16) if quick else (64, 512)
    prompt, new = (16, 8) if quick else (1024, 512)
    model = rotary_model(device=device)
    hf_model = bench_hf.llama_model(sizes, device=device)

    def continuations() -> list[Row]:
        (ours_s, ours), *references = bench_continuations._rows_for(model, length, 32, 8, repeats)
        rows = []
        for label, (seconds, reference) in zip(
            ("one TL forward each", "TL cache, batched"), references, strict=True
        ):
            diff = float((ours - reference).abs().max())
            job = f"32 continuations × 8 after {length} tokens vs {label}"
            rows.append(Row(job, ours_s, seconds, "s", diff <= 1e-4, note=f"max diff {diff:.1e}"))
        return rows

    def grid(activation: str) -> list[Row]:
        ours_s, theirs_s, agree, note = bench_patching._compare(
            activation, 4, grid_length, budget, device=device
        )
        job = f"{activation} by-position grid, {grid_length} tokens vs transformer_lens.patching"
        return [Row(job, ours_s, theirs_s, "s", agree, note=note)]

    return [
        *_timed_rows(continuations),
        *_timed_rows(lambda: grid("k")),
        *_timed_rows(lambda: grid("v")),
        *_timed_rows(lambda: bench_cache.generation_rows(model, prompt, new, 1 if quick else 2)),
        *_timed_rows(lambda: bench_hf.continuation_rows(hf_model, hf_model, sizes, "HF Llama")),
        *_timed_rows(lambda: [bench_hf.generation_row(hf_model, hf_model, sizes, "HF Llama")]),
        *_timed_rows(lambda: [bench_attribution.speed_row(16 if quick else 256, None, device)]),
    ]


def split_model(device: str) -> Check:
    """Every experiment on a model split between `device` and the CPU, against one device."""
    _tests_on_path()
    from split_models import N_LAYERS, experiments, split_llama, unsplit

    half = N_LAYERS // 2
    devices = [device] * half + ["cpu"] * (N_LAYERS - half)
    if device == "cpu":
        devices = ["cpu"] * N_LAYERS
    name = f"HF model split by accelerate: layers on {' / '.join(devices)}"
    with torch.no_grad():
        whole, split = experiments(unsplit()), experiments(split_llama(devices))
    diff = max(float((split[key] - whole[key]).abs().max()) for key in whole)
    result = "ok" if diff <= SPLIT_TOLERANCE else "FAILED"
    return Check(name, result, f"max diff {diff:.1e} over {len(whole)} experiments", 0.0)


def _small_llama() -> torch.nn.Module:
    """A 2-layer random-weight Llama-like model, the same weights at every call."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=50, bos_token_id=0, eos_token_id=None,
        pad_token_id=None,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def ray_job(device: str) -> Check:
    """`patch_dataset` and `attribution_patch_dataset` on a Ray GPU worker beside two CPU
    workers, against one process."""
    name = "Ray patch_dataset, attribution: 1 GPU worker beside 2 CPU workers"
    try:
        from safelens import RayWorkers
    except (ImportError, AttributeError):
        return Check(name, "skipped", "not available yet: safelens.RayWorkers is absent", 0.0)
    if device == "cpu":
        return Check(name, "skipped", "no GPU for the GPU worker", 0.0)
    import ray

    from safelens import attribution_patch_dataset, get_act_patch_resid_pre, patch_dataset

    generator = torch.Generator().manual_seed(0)
    clean = torch.randint(1, 50, (16, 6), generator=generator)
    corrupted = clean.clone()
    corrupted[:, 2] = torch.randint(1, 50, (16,), generator=generator)

    def metric(logits: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        return logits[:, -1, 3] - logits[:, -1, 5]

    sites = ["v", "resid_pre"]
    with torch.no_grad():
        here = patch_dataset(get_act_patch_resid_pre, _small_llama(), clean, corrupted, metric)
    estimated = attribution_patch_dataset(
        _small_llama(), clean, corrupted, metric, activations=sites, progress=False
    ).estimates
    # The workers cannot import this module by name: the factory travels by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=3, num_gpus=1, include_dashboard=False)
    try:
        gpu = RayWorkers(_small_llama, n_workers=1, num_cpus=1, num_gpus=1)
        cpus = RayWorkers(_small_llama, n_workers=2, num_cpus=1)
        results = [w.patch_dataset(get_act_patch_resid_pre, clean, corrupted, metric,
                                   progress=False) for w in (gpu, cpus)]  # fmt: skip
        attributions = [w.attribution_patch_dataset(clean, corrupted, metric, activations=sites,
                                                    progress=False) for w in (gpu, cpus)]  # fmt: skip
    finally:
        ray.shutdown()
    diffs = [(r.per_pair - here.per_pair).abs().max() for r in results]
    diffs += [
        (a.estimates[site].per_pair - estimated[site].per_pair).abs().max()
        for a in attributions
        for site in sites
    ]
    diff = max(float(d) for d in diffs)
    result = "ok" if diff <= SPLIT_TOLERANCE else "FAILED"
    return Check(name, result, f"max diff {diff:.1e} vs one process", 0.0)


def table(checks: list[Check]) -> str:
    """The checks as a markdown table."""
    lines = ["| check | result | ratio / diff | time |", "| --- | --- | --- | --- |"]
    for check in checks:
        cells = (check.name, check.result, check.measure, f"{check.seconds:.2f} s")
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


def header(device: str) -> str:
    """torch's version, whether CUDA is there, and the device's name."""
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
    return (
        f"torch {torch.__version__}; torch.cuda.is_available() = {cuda}; "
        f"device {device}: {name}; {os.cpu_count()} CPU cores"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes, one test file")
    parser.add_argument("--skip-tests", action="store_true", help="leave out the test subset")
    args = parser.parse_args(argv)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {device}, but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    print(header(device), flush=True)
    steps: dict[str, Callable[[], Check | list[Check]]] = {}
    if not args.skip_tests:
        steps["test suite subset"] = lambda: test_subset(device, args.quick, timeout=300)
    steps["benchmark rows"] = lambda: benchmark_rows(device, args.quick)
    steps["split model"] = lambda: split_model(device)
    steps["Ray job"] = lambda: ray_job(device)
    checks = [check for name, step in steps.items() for check in _timed(name, step)]
    print(table(checks))
    return 1 if any(check.result == "FAILED" for check in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
