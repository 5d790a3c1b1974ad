"""The benchmark scripts run: a smoke run of bench_loss.py at its quick shape.

Not a timing test (times on a shared CI machine mean nothing): it checks that the
script's child processes, the gloo ranks, the loss check against the naive reference,
the grad_in_forward overlap rows and the GEMM-throughput line all work, so that the
commands in docs/benchmarks.md keep running.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_bench_loss_quick_runs_and_checks_losses(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_loss.py",
            "--quick",
            "--impls",
            "ours_gif",
            "ours_gif_sync",
            "--dtypes",
            "fp32",
            "--repeats",
            "1",
            "--json",
            str(tmp_path / "rows.json"),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "| ours grad_in_forward (auto) | 1 | fp32 |" in text
    assert "| ours grad_in_forward, no overlap | 2 | fp32 |" in text
    assert "MISMATCH" not in text
    assert "grad_in_forward fp32 1 rank(s) time" in text  # the issue-10 target lines
    assert "overlap (fp32, 2 ranks):" in text
    assert "GEMM throughput, grad_in_forward fp32:" in text
    assert (tmp_path / "rows.json").stat().st_size > 0
