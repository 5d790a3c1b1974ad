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
def test_bench_loss_in_process_runs_every_row_in_one_process_with_the_floor(tmp_path):
    """--in-process: the rows of a dtype in one process, a "floor" row (the three GEMMs as
    torch.mm calls, timed in that process) and an "x floor" column; the losses are still
    checked against the reference; the peers a CPU lacks are reported, not fatal."""
    text = run_script(
        "bench_loss.py",
        ["--in-process", "--device", "cpu", "--bt", "96", "--hidden", "32", "--vocab", "300",
         "--impls", "ours_gif", "ours_ms", "ours_hp", "liger", "cce_exact", "--dtypes", "bf16",
         "--worlds", "1", "--repeats", "1", "--json", str(tmp_path / "rows.json")],
        timeout=600,
    )  # fmt: skip
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert "| x floor |" in table[0]
    assert table[2].startswith("| floor: x @ W.T, G @ W, G.T @ x as torch.mm | 1 | bf16 |")
    assert table[2].split("|")[7].strip() == "1.00"  # the floor is 1.00x itself
    for name in ("F.cross_entropy(F.linear)", "ours grad_in_forward (auto)", "ours memory_saving"):
        row = next(line for line in table if line.startswith(f"| {name} | 1 | bf16 |"))
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert cells[-1] == "ok" and float(cells[6]) > 0, row  # x floor: time / floor
        assert float(cells[9].split()[0]) < 1e-1, row  # |loss - ref| (checked: no MISMATCH)
    assert "| Liger fused linear CE | 1 | bf16 |" in text and "n/a on CPU" in text
    assert "MISMATCH" not in text and "Ours or naive did not run" not in text
    assert "GEMM throughput, grad_in_forward bf16:" in text
    assert "(--in-process)" in text  # the legend says how it was measured
    assert (tmp_path / "rows.json").stat().st_size > 0


def test_in_process_child_reports_a_failing_implementation_and_goes_on(monkeypatch):
    """One implementation that raises is its row's status; the next still runs, and the
    reference losses and the floor come from the same process."""
    from benchmarks import bench_loss

    monkeypatch.setattr(bench_loss.harness, "report_partial", lambda result: None)
    case = dict(device="cpu", bt=16, h=8, v=40, repeats=1, seed=0, ds_chunk=512,
                coll_timeout=60, dtype="fp32", world=1, impl="in-process",
                impls=["naive", "no_such_impl", "ours_gif"])  # fmt: skip
    out = bench_loss.run_case(case)
    assert out["complete"] and out["floor_s"] > 0
    assert out["impls"]["no_such_impl"]["error"].startswith("error: ValueError: unknown")
    for impl in ("naive", "ours_gif"):
        assert abs(out["impls"][impl]["loss"] - out["ref"]["fp32"]) < 1e-4 * out["ref"]["fp32"]
        assert len(out["impls"][impl]["times_s"]) == 1


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
