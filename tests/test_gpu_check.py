"""The GPU check (`python -m benchmarks.gpu_check`) run on the CPU, small: what CI can run."""

from __future__ import annotations

import pytest

from benchmarks import gpu_check


@pytest.mark.slow
@pytest.mark.hooked_transformer
def test_the_gpu_check_runs_on_the_cpu_and_prints_one_table(capsys):
    assert gpu_check.main(["--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    first, *lines = out.strip().splitlines()
    assert first.startswith("torch ") and "torch.cuda.is_available() = " in first
    table = [line for line in lines if line.startswith("| ")]
    assert table[0] == "| check | result | ratio / diff | time |"
    checks = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")[1] for line in table[2:]}
    assert "FAILED" not in checks.values()
    assert checks["test suite subset on cpu (1 files or tests)"] == "ok"
    assert any(name.startswith("k by-position grid") for name in checks)
    assert any(name.startswith("HF Llama: greedy generation") for name in checks)
    assert any(name.startswith("k+v attribution") for name in checks)
    assert checks["HF model split by accelerate: layers on cpu / cpu / cpu / cpu"] == "ok"
    assert checks["Ray patch_dataset, attribution: 1 GPU worker beside 2 CPU workers"] == "skipped"


def test_a_missing_cuda_device_is_refused(capsys):
    if gpu_check.torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gpu_check.main(["--device", "cuda"]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err
