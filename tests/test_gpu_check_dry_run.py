"""``scripts/gpu_check.sh`` cannot rot: its dry run passes here, every step included.

``GPU_CHECK_DRY_RUN=1`` runs each step of the GPU check (the offline install, every kernel
variant against the torch backend, the float64 comparison at a Llama-3 head, the 2^31
offsets, the benchmark with its peers, verify.py under torchrun, the Triton test
selection) on CPU under Triton's interpreter at tiny sizes. A step that breaks (a script
renamed, an option gone, an import that fails) fails here, not on the one GPU run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent
STEPS = (
    "install", "variants", "llama_fp64", "large_offsets", "bench_loss", "verify", "tests",
    "bench_heads",
)  # fmt: skip


@pytest.mark.slow
def test_gpu_check_dry_run_passes_every_step(tmp_path):
    env = dict(os.environ, GPU_CHECK_DRY_RUN="1", PY=sys.executable, LOG_DIR=str(tmp_path))
    env["GPU_SITE"] = str(tmp_path / "site")
    out = subprocess.run(
        ["bash", "scripts/gpu_check.sh"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, f"{out.stdout[-6000:]}\n{out.stderr[-3000:]}"
    summary = (tmp_path / "summary.md").read_text().splitlines()
    rows = {line.split("|")[1].strip(): line for line in summary[2:]}
    assert list(rows) == list(STEPS), summary
    for line in rows.values():
        assert line.split("|")[2].strip() == "ok", line
    # The table was printed row by row as the steps finished, in order.
    printed = [line for line in out.stdout.splitlines() if line.startswith("|")]
    assert printed == summary, out.stdout
    # Each data step reported its verdict, not merely an exit status.
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in STEPS}
    for name in ("variants", "llama_fp64", "large_offsets", "bench_heads"):
        assert "OK:" in logs[name], logs[name][-2000:]
    assert "listed kernel variants ran" in logs["variants"]
