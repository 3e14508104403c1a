"""Run the benchmark suite: `python -m benchmarks [--quick] [--only NAME ...] [--out DIR]`.

Imports every `benchmarks/bench_*.py`, calls its `run(quick)`, prints one table of
safelens against the TransformerLens way and writes `report.md` plus one plot per
scaling curve into `--out` (default `benchmarks/results/`). Exits 1 when any row's
numbers disagree or a benchmark fails to run, 2 for an unknown `--only` name.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from pathlib import Path

from ._common import Row
from .report import all_agree, markdown_table, write_report

HERE = Path(__file__).resolve().parent


def discover() -> list[str]:
    """The benchmark names present: `bench_cache.py` is `cache`."""
    return sorted(path.stem.removeprefix("bench_") for path in HERE.glob("bench_*.py"))


def run_benchmarks(names: list[str], quick: bool) -> tuple[list[Row], dict[str, str]]:
    """Each named benchmark's rows, and the error of each one that failed to run."""
    rows: list[Row] = []
    failures: dict[str, str] = {}
    for name in names:
        print(f"running bench_{name} ({'quick' if quick else 'full'})...", file=sys.stderr)
        try:
            module = importlib.import_module(f"{__package__}.bench_{name}")
            rows.extend(module.run(quick=quick))
        except Exception as error:
            traceback.print_exc()
            failures[name] = f"{type(error).__name__}: {error}"
    return rows, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a fast check")
    parser.add_argument(
        "--only", nargs="+", metavar="NAME", help="run only these (e.g. cache, or bench_cache)"
    )
    parser.add_argument("--out", type=Path, default=HERE / "results", help="report folder")
    args = parser.parse_args(argv)
    available = discover()
    names = available
    if args.only:
        names = [name.removeprefix("bench_").removesuffix(".py") for name in args.only]
        unknown = sorted(set(names) - set(available))
        if unknown:
            print(f"unknown benchmark(s) {unknown}; available: {available}", file=sys.stderr)
            return 2
    rows, failures = run_benchmarks(names, args.quick)
    path = write_report(rows, args.out, args.quick, failures)
    print(markdown_table(rows))
    print(f"\nreport written to {path}")
    if failures:
        print(f"benchmarks that failed to run: {sorted(failures)}", file=sys.stderr)
    if not all_agree(rows):
        disagreeing = [row.job for row in rows if not row.agree]
        print(f"rows whose numbers disagree: {disagreeing}", file=sys.stderr)
    return 0 if all_agree(rows) and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
