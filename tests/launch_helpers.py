"""Helpers shared by the tests of the launcher (``test_train.py``, ``test_launch_faults.py``).

Imported as ``launch_helpers`` (pytest puts ``tests/`` on ``sys.path``). Each run starts
``torchrun --standalone`` (a free port every time) on gloo with a tiny model, a 512-token
BPE vocabulary and the first 300 kB of the embedded corpus, so that a run takes seconds.
The corpus and the tokenizer cache live in one folder of the session's temporary
directory, shared by every test module: the tokenizer is trained once per session. Every
subprocess has a timeout and is killed with its whole process group on expiry, so a hung
rank cannot hang the suite.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launch.data import read_text

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "launch" / "train.py"
RUN_TIMEOUT_S = 300
TINY = [
    "--vocab-size", "512", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
    "--context", "32", "--batch-size", "4", "--lr", "1e-2", "--warmup-steps", "2",
    "--val-fraction", "0.05", "--val-batches", "2", "--timeout-s", "120",
]  # fmt: skip


def make_corpus_and_cache(tmp_path_factory) -> tuple[Path, Path]:
    """A small corpus (a prefix of the embedded one) and a tokenizer cache shared by tests:
    the body of each test module's session fixture ``corpus_and_cache``."""
    folder = tmp_path_factory.getbasetemp() / "train_data"
    corpus = folder / "corpus.txt"
    if not corpus.exists():
        folder.mkdir(parents=True, exist_ok=True)
        text = read_text(ROOT / "data" / "kjv.txt.gz")[:300_000]
        tmp = folder / "corpus.txt.tmp"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(corpus)
    return corpus, folder / "cache"


def train_env(extra_env: dict | None = None) -> dict:
    return dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **(extra_env or {}))


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", str(TRAIN), *args]  # fmt: skip


def start_torchrun(nproc: int, args: list[str], *, extra_env: dict | None = None):
    """``launch/train.py`` on ``nproc`` gloo ranks, started (stdout and stderr together,
    in its own process group: killed as a whole with :func:`kill_group`)."""
    return subprocess.Popen(
        torchrun_command(nproc, args),
        cwd=ROOT,
        env=train_env(extra_env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s whole process group (torchrun and its ranks), if still there."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_train(nproc: int, args: list[str], *, extra_env: dict | None = None,
              timeout: float = RUN_TIMEOUT_S) -> tuple[int, str]:  # fmt: skip
    """Run ``launch/train.py`` on ``nproc`` gloo ranks; returns (exit status, stdout+stderr)."""
    proc = start_torchrun(nproc, args, extra_env=extra_env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun timed out after {timeout} s:\n{out[-4000:]}")
    return proc.returncode, out


def torchrun(nproc: int, args: list[str], *, extra_env: dict | None = None) -> str:
    """Run ``launch/train.py`` on ``nproc`` gloo ranks; returns stdout+stderr, fails on error."""
    rc, out = run_train(nproc, args, extra_env=extra_env)
    assert rc == 0, f"torchrun exited with {rc}:\n{out[-6000:]}"
    return out


def common(corpus_and_cache) -> list[str]:
    corpus, cache = corpus_and_cache
    return [*TINY, "--data", str(corpus), "--cache-dir", str(cache)]
