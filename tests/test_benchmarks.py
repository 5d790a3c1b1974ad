"""The benchmark scripts run: smoke runs of bench_loss.py and bench_filter.py at their quick shapes.

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


def run_script(script: str, args: list[str], timeout: int) -> str:
    """``python benchmarks/<script> <args>`` from the repository root; its stdout, after
    asserting that it exited 0 (the tails of both streams otherwise)."""
    out = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
def test_bench_loss_quick_runs_and_checks_losses(tmp_path):
    text = run_script(
        "bench_loss.py",
        ["--quick", "--impls", "ours_gif", "ours_gif_sync", "--dtypes", "fp32",
         "--repeats", "1", "--json", str(tmp_path / "rows.json")],
        timeout=600,
    )  # fmt: skip
    assert "| ours grad_in_forward (auto) | 1 | fp32 |" in text
    assert "| ours grad_in_forward, no overlap | 2 | fp32 |" in text
    assert "MISMATCH" not in text
    assert "grad_in_forward fp32 1 rank(s) time" in text  # the issue-10 target lines
    assert "overlap (fp32, 2 ranks):" in text
    assert "GEMM throughput, grad_in_forward fp32:" in text
    assert (tmp_path / "rows.json").stat().st_size > 0


@pytest.mark.slow
def test_bench_filter_quick_runs_on_a_trained_workload(tmp_path):
    """bench_filter.py --quick: a tiny model trained into tmp_path (the tokenizer too), then
    ours exact and filtered at 1 and 2 gloo ranks, their losses and gradient errors
    checked against the float64 reference, the skipped fraction reported."""
    text = run_script(
        "bench_filter.py",
        ["--quick", "--impls", "ours_exact", "ours_filtered", "ours_sorted", "--dtypes", "bf16",
         "--workloads", "trained", "--cache-dir", str(tmp_path),
         "--json", str(tmp_path / "rows.json")],
        timeout=900,
    )  # fmt: skip
    for world in (1, 2):
        assert f"| trained | 4096 | bf16 | {world} | ours exact (filter_eps=None) |" in text
        assert f'| trained | 4096 | bf16 | {world} | ours filtered (filter_eps="auto") |' in text
        assert f"| trained | 4096 | bf16 | {world} | ours filtered, vocabulary sorted" in text
    assert "MISMATCH" not in text and "error" not in text
    assert "filtered" in text and "tiles skipped" in text  # the issue-24 target lines
    assert list(tmp_path.glob("trained_head_V4096_*.pt"))
