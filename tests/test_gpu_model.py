"""The GPU performance model (``benchmarks/gpu_model.py``): calibrated against the first
GPU run, and the plan it models within the launch budget."""

from __future__ import annotations

import pytest

from benchmarks import gpu_model as model

H200 = model.GPUS["h200"]


def test_the_model_reproduces_the_measured_floor():
    """The first GPU run timed the three GEMMs of 8192 x 4096 x 128256 (bf16) at 37.2 ms
    and of 8192 x 2304 x 256000 at 41.8 ms: the model's floor is within 1% of both."""
    assert model.floor_ms(8192, 4096, 128256, H200) == pytest.approx(37.2, rel=0.01)
    assert model.floor_ms(8192, 2304, 256000, H200) == pytest.approx(41.8, rel=0.01)


@pytest.mark.parametrize("row", model.ROWS, ids=lambda r: r.key)
def test_the_plan_keeps_the_launch_budget(row):
    """The plan's launches: at most 6 per chunk (more where the comment says), at
    most 64 per call where the chunks allow it; and its GEMMs' FLOPs are those of its
    structure (each GEMM over the whole head once: no chunk counted twice)."""
    parts, peak, chunking = model.plan_parts(row.plan, row.tokens, row.hidden, row.vocab)
    chunks = int(chunking.split()[0])
    launches = sum(p.launches for p in parts)
    # Two heads' logits made twice: 8; the replay's top-C pass beside the statistics: 7.
    assert launches <= {"kd_columns": 8, "stats_replay": 7}.get(row.plan, 6) * chunks
    if chunks <= 10:
        assert launches <= 64
    one = 2.0 * row.tokens * row.hidden * row.vocab  # one GEMM over the whole head
    gemms = [p for p in parts if p.gemm]
    assert sum(p.flops for p in gemms) == pytest.approx(one * len(gemms), rel=1e-9)
    assert 0 < peak < 4 * (1 << 30)


def test_the_report_names_the_measured_figures_and_a_verdict(capsys):
    assert model.main(["--row", "ce_default", "--parts"]) == 0
    out = capsys.readouterr().out
    assert "69.3 ms (1.86x floor)" in out and "plan (model)" in out
    assert "met (predicted)" in out and "grad_weight" in out
