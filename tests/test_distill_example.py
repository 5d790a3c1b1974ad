"""``launch/distill.py`` under torchrun on 2 gloo ranks: a few steps of the teacher and of
the student, whose vocabulary-parallel curve must match the run from full logits."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from launch_helpers import ROOT, RUN_TIMEOUT_S, make_corpus_and_cache, train_env

pytestmark = pytest.mark.slow


def test_two_ranks_match_the_full_logits_run(tmp_path_factory, tmp_path):
    corpus, cache = make_corpus_and_cache(tmp_path_factory)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "launch" / "distill.py"), "--data", str(corpus), "--cache-dir", str(cache),
           "--vocab-size", "512", "--teacher-steps", "4", "--steps", "4",
           "--out", str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=train_env(), capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    gap = float(re.search(r"max \|gap\| (\S+);", out.stdout).group(1))
    summary = json.loads((tmp_path / "curve.json").read_text())
    ours, full = summary["curves"]["vocab_parallel"], summary["curves"]["full_logits"]
    assert len(ours) == len(full) == 4 and ours[-1] < ours[0]  # it learns
    assert abs(gap - summary["max_abs_gap"]) <= 1e-2 * gap and gap < 1e-4  # printed 3 digits
    assert (tmp_path / "curve.png").stat().st_size > 0
