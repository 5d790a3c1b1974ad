"""``launch/train.py`` end to end under torchrun: a smoke run, and checkpoint/resume.

Each test starts ``torchrun --standalone`` (a free port every time) on gloo with a tiny
model, a 512-token BPE vocabulary and the first 300 kB of the embedded corpus, so that a
run takes seconds (the helpers and the shared fixture are in ``launch_helpers.py``). The
tokenizer is trained once per session (the first run's rank 0) and cached for the others,
as in real use. Every subprocess has a timeout and is killed with its whole process group
on expiry, so a hung rank cannot hang the suite. The launcher's faults and bad inputs are
tested in ``test_launch_faults.py``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from launch_helpers import ROOT, RUN_TIMEOUT_S, TRAIN, common, make_corpus_and_cache, torchrun  # noqa: E402

from launch.data import TokenData  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def corpus_and_cache(tmp_path_factory):
    return make_corpus_and_cache(tmp_path_factory)


def test_smoke_two_ranks(corpus_and_cache, tmp_path):
    """TP 2: progress, log, PNG, summary; the loss falls; the unsharded copy agrees."""
    run_dir = tmp_path / "run"
    args = [*common(corpus_and_cache), "--run-dir", str(run_dir), "--steps", "12", "--tp", "2",
            "--eval-every", "6", "--log-every", "4", "--check-against-unsharded"]  # fmt: skip
    out = torchrun(2, args)

    summary = json.loads((run_dir / "summary.json").read_text())
    losses = summary["history"]["loss"]
    assert summary["steps"] == 12 and len(losses) == 12
    assert (summary["world"], summary["tp"], summary["dp"]) == (2, 2, 1)
    assert all(np.isfinite(losses)) and np.isfinite(summary["final_val_loss"])
    assert np.mean(losses[-3:]) < losses[0] - 0.5, losses  # ln(512) = 6.2 at the start
    assert [v[0] for v in summary["history"]["val"]] == [6, 12]
    assert summary["tokens_per_s"] > 0 and summary["peak_memory_mib"] > 0
    assert summary["tp_replicas_in_sync"] is True
    # The vocabulary-parallel head and F.cross_entropy on full logits: same training.
    assert summary["max_abs_loss_difference"] < 1e-4, summary["max_abs_loss_difference"]
    assert abs(summary["final_val_loss"] - summary["final_val_loss_unsharded"]) < 1e-4

    png = (run_dir / "loss_curve.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    log = (run_dir / "train.log").read_text()
    assert "step 12/12: loss" in log and "validation loss" in log
    assert "world 2 = TP 2 x DP 1" in out and "train: 100%" in out
    assert "largest |difference|" in out


def run_resume_case(corpus_and_cache, tmp_path, nproc: int, extra: list[str], env=None):
    """8 steps straight vs. 5 steps (checkpoints at 3; 4 and 5 are lost) then --resume."""
    base = [*common(corpus_and_cache), "--steps", "8", "--eval-every", "4", *extra]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    torchrun(nproc, [*base, "--run-dir", str(straight)], extra_env=env)
    out = torchrun(
        nproc, [*base, "--run-dir", str(broken), "--save-every", "3", "--stop-at", "5"],
        extra_env=env,
    )  # fmt: skip
    assert "stopping here without saving" in out
    assert not (broken / "summary.json").exists()
    assert (broken / "checkpoints" / "latest").read_text().strip() == "step_000003"
    out = torchrun(
        nproc, [*base, "--run-dir", str(broken), "--save-every", "3", "--resume"], extra_env=env
    )
    assert "resumed from step 3" in out

    a = json.loads((straight / "summary.json").read_text())["history"]
    b = json.loads((broken / "summary.json").read_text())["history"]
    assert b["step"] == list(range(1, 9))
    # Exactly: same parameters, optimizer state, batches and learning rates after resume.
    assert b["loss"] == a["loss"]
    assert b["val"] == a["val"]
    assert b["grad_norm"] == a["grad_norm"]
    assert sorted(p.name for p in (broken / "checkpoints").glob("step_*")) == [
        "step_000006",
        "step_000008",
    ]  # keep_checkpoints: 2


def test_resume_torch_tp2_dp2(corpus_and_cache, tmp_path):
    """4 ranks (TP 2 x DP 2): sharded head, DP averaging and the unsharded copy resume."""
    run_resume_case(corpus_and_cache, tmp_path, 4, ["--tp", "2", "--check-against-unsharded"])


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_resume_deepspeed(corpus_and_cache, tmp_path):
    """DeepSpeed engine, ZeRO-1 (optimizer states in DeepSpeed's partitioned files), TP 2."""
    run_resume_case(
        corpus_and_cache,
        tmp_path,
        2,
        ["--tp", "2", "--engine", "deepspeed", "--zero-stage", "1"],
        env={"DS_ACCELERATOR": "cpu"},
    )


@pytest.mark.parametrize(
    "config", ["train_tiny_cpu.yaml", "train_llama3_8b_head_tp8.yaml", "train_two_nodes.yaml"]
)
def test_configs_dry_run(config):
    """Every shipped config parses and builds (groups, model on the meta device)."""
    out = subprocess.run(
        [sys.executable, str(TRAIN), "--config", str(ROOT / "configs" / config), "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[dry-run] world" in out.stdout


def test_batches_are_a_function_of_seed_step_and_rank():
    data = TokenData(np.arange(10_000, dtype=np.uint16), val_fraction=0.1)
    kw = dict(batch_size=3, context=8)
    x, y = data.batch(seed=1, step=5, dp_rank=0, **kw)
    assert x.shape == y.shape == (3, 8)
    assert (y == x + 1).all()  # next-token targets (the stream counts up)
    again = data.batch(seed=1, step=5, dp_rank=0, **kw)
    assert (again[0] == x).all()
    for other in (dict(seed=2, step=5, dp_rank=0), dict(seed=1, step=6, dp_rank=0),
                  dict(seed=1, step=5, dp_rank=1)):  # fmt: skip
        assert not (data.batch(**other, **kw)[0] == x).all()
    assert int(x.max()) < 9_000  # never the validation tail
    val = data.val_batches(dp_rank=1, dp_size=2, batch_size=2, context=8, max_batches=3)
    assert len(val) == 3 and all(int(v[0].min()) >= 9_000 for v in val)


@pytest.mark.parametrize(
    "layout",
    # context 31: the two TP ranks' token slices are uneven (16 and 15)
    [["--sequence-parallel", "--context", "31"], ["--tp-style", "dtensor"]],
    ids=["sequence_parallel", "dtensor"],
)
def test_parallel_layouts_match_unsharded(corpus_and_cache, tmp_path, layout):
    """TP 2 with the head's other layouts (sequence-parallel tokens; a ColwiseParallel
    DTensor weight): the same training as the unsharded head, replicas in sync."""
    run_dir = tmp_path / "run"
    args = [*common(corpus_and_cache), "--run-dir", str(run_dir), "--steps", "4", "--tp", "2",
            "--log-every", "2", "--check-against-unsharded", *layout]  # fmt: skip
    out = torchrun(2, args)

    summary = json.loads((run_dir / "summary.json").read_text())
    losses = summary["history"]["loss"]
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert (summary["tp"], summary["dp"]) == (2, 1)
    assert summary["tp_replicas_in_sync"] is True
    assert summary["max_abs_loss_difference"] < 1e-4, summary["max_abs_loss_difference"]
    assert abs(summary["final_val_loss"] - summary["final_val_loss_unsharded"]) < 1e-4
    if layout[0] == "--sequence-parallel":
        assert summary["sequence_parallel"] is True and "sequence parallel" in out
    else:
        assert summary["tp_style"] == "dtensor" and "ColwiseParallel DTensor" in out


@pytest.mark.parametrize("flag", [["--sequence-parallel"], ["--tp-style", "dtensor"]])
def test_deepspeed_refuses_torch_only_layouts(flag):
    """The sequence-parallel and DTensor heads are the torch engine's: a usage error."""
    out = subprocess.run(
        [sys.executable, str(TRAIN), "--engine", "deepspeed", *flag, "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "needs the torch engine" in out.stderr, out.stderr


def test_dry_run_plans_the_dtensor_head():
    """--dry-run (meta device, fake process group) plans a DTensor, sequence-parallel head:
    rank 0's rows as torch.chunk gives them (V 128,250 on TP 8: 16,032 a rank)."""
    config = ROOT / "configs" / "train_two_nodes.yaml"
    out = subprocess.run(
        [sys.executable, str(TRAIN), "--config", str(config), "--engine", "torch",
         "--tp-style", "dtensor", "--sequence-parallel", "--vocab-size", "128250", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "head shard of rank 0: rows 0..16,032" in out.stdout, out.stdout


def test_filtered_run_records_what_it_left_out(corpus_and_cache, tmp_path):
    """--filter-eps auto: the run trains, each step's share of G's tiles left out is in
    summary.json and in the log lines; the loss is that of the exact run at step 1 (the
    forward is never filtered; the first update is where the runs may part)."""
    runs = {}
    for name, extra in (("exact", []), ("auto", ["--filter-eps", "auto"])):
        run_dir = tmp_path / name
        args = [*common(corpus_and_cache), "--run-dir", str(run_dir), "--steps", "6",
                "--tp", "2", "--dtype", "bfloat16", "--log-every", "3", *extra]  # fmt: skip
        torchrun(2, args)
        runs[name] = json.loads((run_dir / "summary.json").read_text())
    filtered = runs["auto"]["history"]["filtered"]
    assert len(filtered) == 6 and all(0.0 <= f <= 1.0 for f in filtered), filtered
    assert "filtered" not in runs["exact"]["history"]
    assert runs["auto"]["history"]["loss"][0] == runs["exact"]["history"]["loss"][0]
    log = (tmp_path / "auto" / "train.log").read_text()
    assert "of G's tiles" in log
