"""The GPU performance model (``benchmarks/gpu_model.py``): calibrated against the first
GPU run, and the structure of the code it models (its GEMMs, its memory, its choices)."""

from __future__ import annotations

import pytest

from benchmarks import gpu_model as model

H200 = model.GPUS["h200"]


def test_the_model_reproduces_the_measured_floor():
    """The first GPU run timed the three GEMMs of 8192 x 4096 x 128256 (bf16) at 37.2 ms
    and of 8192 x 2304 x 256000 at 41.8 ms: the model's floor is within 1% of both."""
    assert model.floor_ms(8192, 4096, 128256, H200) == pytest.approx(37.2, rel=0.01)
    assert model.floor_ms(8192, 2304, 256000, H200) == pytest.approx(41.8, rel=0.01)


# Every row with its fused epilogue; the distillation's also with today's torch epilogue.
MODELS = [(r, True) for r in model.ROWS] + [(r, False) for r in model.ROWS if r.plan[:2] == "kd"]


@pytest.mark.parametrize(("row", "fused"), MODELS, ids=lambda v: getattr(v, "key", str(v)))
def test_each_gemm_covers_the_head_once_and_memory_is_bounded(row, fused):
    """The modelled GEMMs are those of the code's structure: each over the whole head
    once (no chunk counted twice or left out), whatever the chunking; the extra memory
    is positive and below 4.5 GiB."""
    shape = (row.tokens, row.hidden, row.vocab)
    parts, extra, chunking = model.plan_parts(row.plan, *shape, fused, row.kept)
    one = 2.0 * row.tokens * row.hidden * row.vocab  # one GEMM over the whole head
    gemms = [p for p in parts if p.gemm]
    # Filtering: the backward's two GEMMs over the kept columns (all, above DENSE_ABOVE)
    f = 1.0 if row.kept is None or row.kept >= model.DENSE_ABOVE else row.kept
    expected = one * (len(gemms) - 2 + 2 * f)
    assert sum(p.flops for p in gemms) == pytest.approx(expected, rel=1e-9)
    assert len(gemms) == {"ce_ms": 4, "stats": 4, "stats_replay": 4, "kd_columns": 6,
                          "kd": 4, "kd_jsd": 4}.get(row.plan, 3)  # fmt: skip
    assert 0 < extra < 4.5 * (1 << 30)


def test_the_policy_keeps_g_where_it_is_at_most_twice_the_accumulators():
    """The memory policy's choice, as the model sees it: G kept at the Llama-3 head and
    the Gemma-like head (no fp32 accumulator traffic), accumulated where G would be over
    twice the accumulators (the Llama-3 head at 32768 tokens)."""
    _, extra, chunking = model.plan_parts("ce_gif", 8192, 4096, 128256)
    assert chunking == "4 token chunks of 2048 rows, G kept"
    assert extra / (1 << 20) <= 2560
    parts, _, chunking = model.plan_parts("ce_gif", 8192, 2304, 256000)
    assert chunking.endswith("G kept")
    assert not any("accumulator" in p.name for p in parts)
    parts, _, chunking = model.plan_parts("ce_gif", 32768, 4096, 128256)
    assert chunking.endswith("G accumulated")
    assert any("accumulator" in p.name for p in parts)


def test_the_report_names_the_measured_figures_and_a_verdict(capsys):
    assert model.main(["--row", "ce_default", "--parts"]) == 0
    out = capsys.readouterr().out
    assert "69.3 ms (1.86x floor)" in out and "today's code (model)" in out
    assert "met (predicted)" in out and "grad_weight" in out
    assert model.main(["--row", "forward_kl_ms", "--parts"]) == 0
    out = capsys.readouterr().out  # memory-saving distillation: the fused epilogue's passes
    assert "forward: statistics (one pass)" in out and "torch ops" not in out
    assert model.main(["--row", "filter_trained", "--kept", "0.3"]) == 0
    assert "(30% of the columns kept)" in capsys.readouterr().out


def test_filtering_pays_with_what_it_leaves_out():
    """Nothing left out: the exact products and a mask pass, within 5% of exact; the
    less the filter keeps, the faster (two GEMMs of three shrink with it)."""
    gpu = model.GPUS["h200"]

    def ms(kept):
        parts, _, _ = model.plan_parts("ce_gif", 8192, 4096, 128256, True, kept)
        return sum(p.ms(gpu) for p in parts)

    exact = ms(None)
    assert exact < ms(1.0) <= 1.05 * exact
    assert ms(0.2) < ms(0.5) < ms(0.7) <= ms(1.0)
