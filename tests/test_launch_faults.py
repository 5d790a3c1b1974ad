"""The launcher against faults and bad input: no silent wrong loss, no hang, no lost checkpoint.

- a rank stopped mid-training (SIGSTOP) makes the others exit within ``--timeout-s``,
  naming the collective and the group (its ranks) that failed;
- a new run refuses a run directory that holds checkpoints (``--resume`` or
  ``--overwrite``), pruning deletes only the current run's checkpoints, and resuming past
  ``--steps`` is refused;
- a checkpoint file changed on disk after its save is an error naming it, for both
  engines, and TP replicas that diverge make the run exit non-zero;
- ``meta.json`` edited by hand (its checksum, its step against its folder's) is refused
  at --resume on every rank; a missing package stops the run before its first step, and
  summary.json is written before the plot; a second run on a run directory in use is
  refused, naming the holder, and a dead holder's lock is taken over; a refused run says
  why once, and ``scripts/main.sh`` prints the reason last, after torchrun's report;
- the data rank 0 cannot prepare stops every rank with the reason;
- every option's value is checked when the options are parsed (the flags and the YAML),
  with argparse's usage error (exit status 2) naming the option, for ``train.py`` and
  ``verify.py`` alike, and a YAML file that cannot be read is such an error too.

The end-to-end tests run ``launch/train.py`` under torchrun on gloo with the tiny model of
``launch_helpers``; each takes seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

import torch  # noqa: E402
from launch_helpers import (  # noqa: E402
    common,
    kill_group,
    make_corpus_and_cache,
    run_train,
    start_torchrun,
)

from launch import checkpoints, config, verify  # noqa: E402
from launch.data import prepare_tokens  # noqa: E402

pytestmark = pytest.mark.slow
DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.fixture(scope="session")
def corpus_and_cache(tmp_path_factory):
    return make_corpus_and_cache(tmp_path_factory)


@pytest.fixture(scope="session")
def warm_cache(corpus_and_cache):
    """The tokenizer trained and cached before a run with a short timeout starts (rank 0
    training it would otherwise keep the others waiting in the broadcast for seconds)."""
    corpus, cache = corpus_and_cache
    prepare_tokens(corpus, 512, cache)
    return corpus_and_cache


# ---------------------------------------------------------------- a rank stops: no hang


def _children(ppid: int) -> list[int]:
    """The processes whose parent is ``ppid`` (from /proc: no psutil)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == ppid:
            found.append(int(entry.name))
    return found


def _rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _wait_for(condition, timeout: float, what: str, output: list[str]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n{''.join(output)[-4000:]}")
        time.sleep(0.1)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_stopped_rank_fails_the_others_within_the_timeout(warm_cache, tmp_path):
    """TP 1 x DP 2: rank 1 is SIGSTOPped mid-training; rank 0 waits in a collective of the
    DP group (a group the launcher created) and must exit within about ``--timeout-s``,
    non-zero, saying which collective over which ranks of which group failed. (Torch's
    default for new groups is 30 minutes, whatever the default group's timeout is.)"""
    timeout_s = 10
    run_dir = tmp_path / "run"
    args = [*common(warm_cache), "--tp", "1", "--steps", "1000000", "--log-every", "1",
            "--run-dir", str(run_dir), "--timeout-s", str(timeout_s)]  # fmt: skip
    proc = start_torchrun(2, args)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    stopped = None
    try:
        log = run_dir / "train.log"
        _wait_for(lambda: log.exists() and "step 2/" in log.read_text(), 120,
                  "the second training step", output)  # fmt: skip
        workers = {pid: _rank_of(pid) for pid in _children(proc.pid)}
        ranks = {rank: pid for pid, rank in workers.items() if rank is not None}
        assert set(ranks) == {0, 1}, workers
        os.kill(ranks[1], signal.SIGSTOP)
        stopped, t0 = ranks[1], time.monotonic()
        limit = 3 * timeout_s
        _wait_for(lambda: not _running(ranks[0]), limit + 15, "rank 0 to exit", output)
        waited = time.monotonic() - t0
        assert waited < limit, f"rank 0 exited {waited:.1f} s after rank 1 stopped"
        os.kill(stopped, signal.SIGKILL)  # torchrun's SIGTERM waits for a stopped process
        proc.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGKILL)
        kill_group(proc)
        proc.wait(timeout=60)
    out = "".join(output)
    assert proc.returncode != 0, out[-4000:]
    message = re.search(
        r"error: all-reduce of the (gradients|loss) over ranks \[0, 1\] of the data-parallel "
        rf"group failed \(timeout_s {timeout_s};",
        out,
    )
    assert message, out[-4000:]


# ---------------------------------------------------------------- checkpoints


def _checkpoint_steps(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


def _latest(run_dir: Path) -> Path:
    root = run_dir / "checkpoints"
    return root / (root / "latest").read_text().strip()


def test_new_run_refuses_a_run_dir_with_checkpoints(corpus_and_cache, tmp_path):
    """A run of 8 steps left checkpoints 4 and 8. A new 4-step run in the same directory
    would have pruned its own step 2 (the old steps sort after it) and left ``latest`` on a
    deleted folder: it must refuse, naming the directory and the way out, and leave the
    checkpoints alone; with ``--overwrite`` it deletes them first and starts anew."""
    run_dir = tmp_path / "run"
    base = [*common(corpus_and_cache), "--tp", "1", "--run-dir", str(run_dir)]
    rc, out = run_train(1, [*base, "--steps", "8", "--save-every", "4"])
    assert rc == 0, out[-4000:]
    assert _checkpoint_steps(run_dir) == ["step_000004", "step_000008"]
    old_meta = (run_dir / "checkpoints" / "step_000008" / "meta.json").read_text()

    rc, out = run_train(1, [*base, "--steps", "4", "--save-every", "2"])
    assert rc != 0, out[-4000:]
    assert f"run_dir {run_dir} already holds checkpoints" in out, out[-4000:]
    assert "--resume" in out and "--overwrite" in out
    assert _checkpoint_steps(run_dir) == ["step_000004", "step_000008"]
    assert (run_dir / "checkpoints" / "step_000008" / "meta.json").read_text() == old_meta

    rc, out = run_train(1, [*base, "--steps", "4", "--save-every", "2", "--overwrite"])
    assert rc == 0, out[-4000:]
    assert _checkpoint_steps(run_dir) == ["step_000002", "step_000004"]  # keep_checkpoints 2
    assert _latest(run_dir).name == "step_000004" and _latest(run_dir).is_dir()
    metas = [json.loads((run_dir / "checkpoints" / s / "meta.json").read_text())
             for s in _checkpoint_steps(run_dir)]  # fmt: skip
    assert metas[0]["run_id"] == metas[1]["run_id"]
    assert len(metas[1]["history"]["step"]) == 4


def test_pruning_spares_other_runs_and_resume_past_steps_is_refused(corpus_and_cache, tmp_path):
    """Another run's checkpoint (a higher step) sits beside this run's: resuming and
    pruning to one checkpoint must delete only this run's older ones (by the run id in
    meta.json), and ``latest`` must name a folder that exists. Resuming a checkpoint of
    step 8 with ``--steps 6`` is refused (it would report step 8's model as step 6's)."""
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    base = [*common(corpus_and_cache), "--tp", "1", "--run-dir", str(run_dir),
            "--save-every", "2", "--keep-checkpoints", "1"]  # fmt: skip
    rc, out = run_train(1, [*base, "--steps", "4"])
    assert rc == 0, out[-4000:]
    assert _checkpoint_steps(run_dir) == ["step_000004"]
    foreign = root / "step_000100"
    shutil.copytree(root / "step_000004", foreign)
    meta = json.loads((foreign / "meta.json").read_text())
    meta["run_id"] = "another-run"
    (foreign / "meta.json").write_text(json.dumps(meta))

    rc, out = run_train(1, [*base, "--steps", "8", "--resume"])
    assert rc == 0, out[-4000:]
    assert "resumed from step 4" in out
    assert _checkpoint_steps(run_dir) == ["step_000008", "step_000100"]
    assert _latest(run_dir).name == "step_000008" and _latest(run_dir).is_dir()

    rc, out = run_train(1, [*base, "--steps", "6", "--resume"])
    assert rc != 0, out[-4000:]
    assert "the checkpoint is at step 8, beyond --steps 6" in out, out[-4000:]


def test_resume_from_a_broken_latest_is_a_clear_error(tmp_path):
    """``latest`` naming a folder that is gone, or a damaged ``meta.json``: an exit that
    says so (before: a FileNotFoundError or JSONDecodeError traceback on every rank)."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    with pytest.raises(SystemExit, match="no checkpoint in"):
        checkpoints.read_meta(root)
    (root / "latest").write_text("step_000009")
    with pytest.raises(SystemExit, match="names 'step_000009', which is not a folder"):
        checkpoints.read_meta(root)
    (root / "step_000009").mkdir()
    with pytest.raises(SystemExit, match="meta.json is missing or damaged"):
        checkpoints.read_meta(root)
    (root / "step_000009" / "meta.json").write_text('{"step": 9, "hist')
    with pytest.raises(SystemExit, match="meta.json is missing or damaged"):
        checkpoints.read_meta(root)


def test_prune_deletes_only_the_current_runs_older_checkpoints(tmp_path):
    """Every model's folder of a pruned step goes; another run's steps, folders without a
    readable meta.json and the step ``latest`` names stay; steps sort as numbers."""
    root = tmp_path / "checkpoints"
    for step, run in [(2, "a"), (4, "a"), (1_000_000, "a"), (999_999, "a"), (6, "b"), (8, None)]:
        folder = root / f"step_{step:06d}"
        (root / "unsharded" / folder.name).mkdir(parents=True)
        folder.mkdir()
        if run is not None:
            (folder / "meta.json").write_text(json.dumps({"run_id": run}))
    (root / "latest").write_text("step_000004")
    checkpoints.prune_checkpoints(root, 1, "a")
    kept = ["step_000004", "step_000006", "step_000008", "step_1000000"]
    assert _checkpoint_steps(tmp_path) == kept
    assert sorted(p.name for p in (root / "unsharded").glob("step_*")) == kept


@pytest.fixture(scope="module")
def tp2_checkpoint(corpus_and_cache, tmp_path_factory) -> Path:
    """A run directory with the checkpoint of step 3 of a TP 2 run (torch engine)."""
    run_dir = tmp_path_factory.mktemp("tp2") / "run"
    args = [*common(corpus_and_cache), "--tp", "2", "--steps", "3", "--save-every", "3",
            "--run-dir", str(run_dir)]  # fmt: skip
    rc, out = run_train(2, args)
    assert rc == 0, out[-4000:]
    return run_dir


def _copy_run(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy


def _corrupt(path: Path) -> None:
    """Overwrite 1 KiB in the middle of ``path`` (with 0x7f bytes: floats of 3.4e38)."""
    size = path.stat().st_size
    assert size > 4096, path
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\x7f" * 1024)


def _resume_args(run_dir: Path, corpus_and_cache, extra: list[str]) -> list[str]:
    return [*common(corpus_and_cache), "--steps", "5", "--run-dir", str(run_dir), "--resume",
            *extra]  # fmt: skip


def test_corrupted_checkpoint_file_is_an_error(tp2_checkpoint, corpus_and_cache, tmp_path):
    """1 KiB overwritten inside ``model_tp1.pt`` loads without complaint (huge values in
    the weights) and trains on; the SHA-256 recorded at save must catch it and name it."""
    run_dir = _copy_run(tp2_checkpoint, tmp_path)
    bad = run_dir / "checkpoints" / "step_000003" / "model_tp1.pt"
    _corrupt(bad)
    rc, out = run_train(2, _resume_args(run_dir, corpus_and_cache, ["--tp", "2"]))
    assert rc != 0, out[-4000:]
    assert f"{bad}: corrupted" in out, out[-4000:]
    assert "resumed from step" not in out


def test_diverged_tp_replicas_exit_non_zero(tp2_checkpoint, corpus_and_cache, tmp_path):
    """TP rank 1's copy of a replicated parameter made to differ (and its checksum made to
    match, as a bug rather than damage would): the run trains two different bodies, and
    must end non-zero saying so instead of printing "NO" and exiting 0."""
    run_dir = _copy_run(tp2_checkpoint, tmp_path)
    root = run_dir / "checkpoints"
    path = root / "step_000003" / "model_tp1.pt"
    state = torch.load(path, weights_only=True)
    state["main"]["model"]["ln_f.weight"] += 1e-3
    torch.save(state, path)
    meta_path = root / "step_000003" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["files"]["step_000003/model_tp1.pt"] = hashlib.sha256(path.read_bytes()).hexdigest()
    checkpoints.write_meta(meta_path.parent, meta)
    rc, out = run_train(2, _resume_args(run_dir, corpus_and_cache, ["--tp", "2"]))
    assert "resumed from step 3" in out, out[-4000:]
    assert rc != 0, out[-4000:]
    # The loss's agreement check (vocab_parallel.parallel.agreement) sees the TP ranks pass
    # different hidden states at the first step and stops every rank; without it, the launcher's
    # end-of-run check reports the divergence.
    stopped = "hidden: the ranks of process_group pass different values (checksum)" in out
    if not stopped:
        assert "error: the tensor-parallel replicas diverged" in out, out[-4000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["tp_replicas_in_sync"] is False


@pytest.mark.skipif(not DEEPSPEED, reason="needs deepspeed")
def test_corrupted_deepspeed_checkpoint_file_is_an_error(corpus_and_cache, tmp_path):
    """The same for the DeepSpeed engine: every file DeepSpeed writes into the step folder
    is checksummed; the largest one, damaged, must be named at --resume."""
    env = {"DS_ACCELERATOR": "cpu"}
    run_dir = tmp_path / "run"
    extra = ["--tp", "2", "--engine", "deepspeed", "--zero-stage", "1"]
    args = [*common(corpus_and_cache), *extra, "--steps", "2", "--save-every", "2",
            "--run-dir", str(run_dir)]  # fmt: skip
    rc, out = run_train(2, args, extra_env=env)
    assert rc == 0, out[-4000:]
    folder = run_dir / "checkpoints" / "step_000002"
    meta = json.loads((folder / "meta.json").read_text())
    written = {p.relative_to(folder.parent).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert set(meta["files"]) == written - {"step_000002/meta.json"}
    bad = max((p for p in folder.rglob("*.pt")), key=lambda p: p.stat().st_size)
    assert not bad.name.startswith("rng_rank"), bad
    _corrupt(bad)
    rc, out = run_train(2, _resume_args(run_dir, corpus_and_cache, extra), extra_env=env)
    assert rc != 0, out[-4000:]
    assert f"{bad}: corrupted" in out, out[-4000:]


# ---------------------------------------------------------------- data rank 0 cannot read


def test_missing_corpus_stops_every_rank_with_the_reason(corpus_and_cache, tmp_path):
    """Rank 0 cannot read the corpus: it sends the reason, and every rank exits with it
    (before, rank 0 died with a traceback and the others waited in the broadcast)."""
    missing = tmp_path / "no_such_corpus.txt"
    args = [*common(corpus_and_cache), "--tp", "2", "--data", str(missing),
            "--run-dir", str(tmp_path / "run")]  # fmt: skip
    rc, out = run_train(2, args, timeout=120)
    assert rc != 0
    assert f"data: cannot prepare the tokens of data {str(missing)!r}" in out, out[-4000:]
    assert "FileNotFoundError" in out


def test_validation_slice_too_short_is_a_clear_error(corpus_and_cache, tmp_path):
    """A validation tail too short for one batch per DP rank: every rank exits saying how
    to fix it (before: a ValueError traceback from inside the training loop)."""
    args = [*common(corpus_and_cache), "--tp", "1", "--val-fraction", "0.001",
            "--run-dir", str(tmp_path / "run")]  # fmt: skip
    rc, out = run_train(1, args, timeout=120)
    assert rc != 0
    assert "data: validation slice (121 tokens) too short" in out, out[-4000:]
    assert "raise val_fraction" in out


# ---------------------------------------------------------------- options, at parse time


def _usage_error(parse, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--log-every", "0"], "log_every (--log-every)"),
        (["--filter-eps", "fast"], "filter_eps (--filter-eps)"),
        (["--filter-eps=-1"], "filter_eps (--filter-eps)"),
        (["--timeout-s", "0"], "timeout_s (--timeout-s)"),
        (["--timeout-s=-5"], "timeout_s (--timeout-s)"),
        (["--lr", "nan"], "lr (--lr)"),
        (["--lr", "inf"], "lr (--lr)"),
        (["--lr=-1e-3"], "lr (--lr)"),
        (["--save-every=-1"], "save_every (--save-every)"),
        (["--keep-checkpoints=-1"], "keep_checkpoints (--keep-checkpoints)"),
        (["--grad-clip=-1"], "grad_clip (--grad-clip)"),
        (["--grad-clip", "nan"], "grad_clip (--grad-clip)"),
        (["--warmup-steps=-1"], "warmup_steps (--warmup-steps)"),
        (["--eval-every=-1"], "eval_every (--eval-every)"),
        (["--stop-at=-1"], "stop_at (--stop-at)"),
        (["--mlp-ratio", "0"], "mlp_ratio (--mlp-ratio)"),
        (["--val-fraction", "0"], "val_fraction (--val-fraction)"),
        (["--val-fraction", "1"], "val_fraction (--val-fraction)"),
        (["--val-batches", "0"], "val_batches (--val-batches)"),
        (["--min-lr-ratio=-0.1"], "min_lr_ratio (--min-lr-ratio)"),
        (["--min-lr-ratio", "1.5"], "min_lr_ratio (--min-lr-ratio)"),
        (["--beta1", "1"], "beta1 (--beta1)"),
        (["--beta2=-0.5"], "beta2 (--beta2)"),
        (["--weight-decay=-0.1"], "weight_decay (--weight-decay)"),
        (["--label-smoothing", "1"], "label_smoothing (--label-smoothing)"),
        (["--vocab-size", "0"], "vocab_size (--vocab-size)"),
        (["--vocab-size", "200"], "vocab_size (--vocab-size)"),  # below the BPE's 257
        (["--seed=-1"], "seed (--seed)"),
        (["--world-size", "0"], "world_size (--world-size)"),
        (["--zero-stage", "3"], "zero_stage (--zero-stage)"),
        (["--mode", "fast"], "mode (--mode)"),
        (["--backend", "cuda"], "backend (--backend)"),
        (["--run-dir", ""], "run_dir (--run-dir)"),
        (["--resume", "--overwrite"], "--resume and --overwrite"),
        (["--dry-run", "--world-size", "6", "--tp", "4"], "does not divide world_size 6"),
    ],
)
def test_train_options_out_of_range_are_usage_errors(argv, named, capsys):
    err = _usage_error(config.parse_args, argv, capsys)
    assert named in err, err


def test_train_options_in_range_are_accepted():
    o = config.parse_args(["--lr", "1e-4", "--beta2", "0", "--min-lr-ratio", "1",
                           "--grad-clip", "0", "--vocab-size", "257", "--overwrite"])  # fmt: skip
    assert (o["lr"], o["beta2"], o["min_lr_ratio"], o["grad_clip"]) == (1e-4, 0.0, 1.0, 0.0)
    assert o["overwrite"] is True and o["resume"] is False


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "options.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('resume: "no"\n', False),  # a non-empty string: true before
        ('resume: "Yes"\n', True),
        ("resume: off\n", False),  # YAML 1.1 reads it as false
        ("resume: true\n", True),
    ],
)
def test_yaml_booleans(tmp_path, text, expected):
    assert config.parse_args(["--config", _yaml(tmp_path, text)])["resume"] is expected


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('resume: "maybe"\n', "resume: expected a boolean"),
        ("check_against_unsharded: 1\n", "check_against_unsharded: expected a boolean"),
        ("steps: [1, 2]\n", "steps: expected an int"),
        ("steps: 1.5\n", "steps: expected an int"),
        ("steps: true\n", "steps: expected an int"),
        ("zero_stage: yes\n", "zero_stage: expected an int"),  # YAML's yes is not 1
        ("lr: fast\n", "lr: expected a number"),
        ("lr: .nan\n", "lr (--lr): expected a finite number > 0.0"),
        ("data: 12\n", "data: expected a string"),
        ("deepspeed: [1]\n", "deepspeed: expected a mapping"),
        ("tp: null\n", "tp: expected an int, got null"),
        ("log_every: 0\n", "log_every (--log-every)"),
        ("stepz: 3\n", "unknown keys ['stepz']"),
    ],
)
def test_yaml_wrong_types_are_usage_errors(tmp_path, text, named, capsys):
    err = _usage_error(config.parse_args, ["--config", _yaml(tmp_path, text)], capsys)
    assert named in err, err


def test_yaml_numbers_as_strings_still_read(tmp_path):
    """YAML 1.1 reads ``3e-4`` and ``1e3`` as strings: they are taken as numbers."""
    o = config.parse_args(["--config", _yaml(tmp_path, "lr: 3e-4\nsteps: 1e3\n")])
    assert (o["lr"], o["steps"]) == (3e-4, 1000)


@pytest.mark.parametrize(
    ("setup", "named"),
    [
        (lambda d: d / "missing.yaml", "no such file"),
        (lambda d: d, "is a directory"),
        (lambda d: _write(d / "bad.yaml", "steps: [1,\n"), "malformed YAML"),
        (lambda d: _write(d / "list.yaml", "- steps\n- 3\n"), "expected a mapping"),
        (lambda d: _write(d / "scalar.yaml", "just text\n"), "expected a mapping"),
        (lambda d: _write(d / "keys.yaml", "1: 2\n"), "option names must be strings"),
        (lambda d: _write(d / "binary.yaml", b"steps: \xff\xfe\n"), "not a UTF-8 text file"),
    ],
)
@pytest.mark.parametrize("job", ["train", "verify"])
def test_unreadable_config_is_a_usage_error_naming_it(tmp_path, setup, named, job, capsys):
    path = setup(tmp_path)
    parse = config.parse_args if job == "train" else verify.parse_args
    err = _usage_error(parse, ["--config", str(path)], capsys)
    assert f"--config {path}: {named}" in err, err


def _write(path: Path, content) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def test_one_yaml_loader_for_both_jobs():
    assert verify.load_yaml_config is config.load_yaml_config


@pytest.mark.parametrize(
    ("argv", "text", "named"),
    [
        (["--timeout-s", "0"], None, "timeout_s (--timeout-s)"),
        (["--dtypes", "float64"], None, "dtypes (--dtypes): expected one of"),
        (["--modes", "fast"], None, "modes (--modes): expected one of"),
        (["--reductions", "avg"], None, "reductions (--reductions): expected one of"),
        (["--backends", "cuda"], None, "backends (--backends): expected one of"),
        (["--tokens", "0"], None, "tokens (--tokens): expected an int >= 1"),
        (["--label-smoothing", "1.0"], None, "label_smoothing (--label-smoothing)"),
        ([], "dtypes: []\n", "dtypes (--dtypes): expected a non-empty list"),
        ([], "modes: memory_saving\n", "modes: expected a list"),
        ([], "timeout_s: -1\n", "timeout_s (--timeout-s)"),
        ([], "timeout_s: [1]\n", "timeout_s: expected an int"),
        ([], "vocab: [10, x]\n", "vocab: expected an int"),
        ([], "label_smoothing: [.nan]\n", "label_smoothing (--label-smoothing)"),
        ([], "grids: 3\n", "unknown keys in config: ['grids']"),
    ],
)
def test_verify_options_are_checked(tmp_path, argv, text, named, capsys):
    if text is not None:
        argv = ["--config", _yaml(tmp_path, text), *argv]
    err = _usage_error(verify.parse_args, argv, capsys)
    assert named in err, err


@pytest.mark.parametrize("name", ["verify.yaml", "verify_gpu.yaml"])
def test_verify_configs_still_valid(name):
    opts = verify.parse_args(["--config", str(config.ROOT / "configs" / name)])
    assert opts["timeout_s"] > 0 and opts["dtypes"]


# ---------------------------------------------------------------- meta.json, imports, lock


def _edit_meta(folder: Path, **changes) -> None:
    """Edit ``folder/meta.json`` by hand, as a user would (its checksum left as it was)."""
    path = folder / "meta.json"
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta))


def test_resume_refuses_a_meta_json_edited_to_another_step(
    tp2_checkpoint, corpus_and_cache, tmp_path
):
    """``"step": 3`` edited to 5 in the checkpoint of step 3: --resume would continue at
    step 5 from step 3's model (skipping steps 4 and 5, "resumed from step 5" naming a
    folder that does not exist). It must stop every rank before training, once, naming
    the file and the two steps."""
    run_dir = _copy_run(tp2_checkpoint, tmp_path)
    folder = run_dir / "checkpoints" / "step_000003"
    _edit_meta(folder, step=5)
    rc, out = run_train(2, _resume_args(run_dir, corpus_and_cache, ["--tp", "2"]))
    assert rc != 0, out[-4000:]
    assert "resumed from step" not in out and "step 4/" not in out, out[-4000:]
    expected = f"--resume: {folder / 'meta.json'} says step 5, but its folder is step_000003"
    assert out.count(expected) == 1, out[-4000:]
    assert "does not match the SHA-256 recorded in it" in out, out[-4000:]


def _saved_meta(tmp_path: Path, step: int = 4) -> Path:
    """A checkpoint folder whose meta.json is written as a save writes it."""
    root = tmp_path / "checkpoints"
    folder = root / f"step_{step:06d}"
    folder.mkdir(parents=True)
    history = {"step": list(range(1, step + 1)), "loss": [1.0] * step, "grad_norm": [0.5] * step,
               "lr": [1e-3] * step, "val": []}  # fmt: skip
    meta = {"step": step, "history": history, "options": {}, "world": 1, "run_id": "r",
            "files": {}}  # fmt: skip
    checkpoints.write_meta(folder, meta)
    (root / "latest").write_text(folder.name)
    return root


def test_meta_json_is_checked_against_its_checksum_and_folder(tmp_path, caplog):
    """A meta.json as saved reads back; any hand edit (even one that keeps the step
    consistent) breaks its checksum; a checksum recomputed after the edit still cannot
    hide a step that differs from its folder's or from the history's last step."""
    root = _saved_meta(tmp_path)
    tag, meta = checkpoints.read_meta(root)
    assert (tag, meta["step"]) == ("step_000004", 4)

    _edit_meta(root / tag, history={**meta["history"], "loss": [2.0] * 4})
    with pytest.raises(SystemExit, match="does not match the SHA-256 recorded in it"):
        checkpoints.read_meta(root)

    checkpoints.write_meta(root / tag, {**meta, "step": 7})  # a consistent checksum
    with pytest.raises(SystemExit, match=r"says step 7, but its folder is step_000004") as exc:
        checkpoints.read_meta(root)
    assert "its history ends at step 4" in str(exc.value)

    legacy = {k: v for k, v in meta.items() if k != "meta_sha256"}  # an older launcher's
    (root / tag / "meta.json").write_text(json.dumps(legacy))
    with caplog.at_level("WARNING", logger="train"):
        assert checkpoints.read_meta(root)[1]["step"] == 4
    assert "records no checksum of its own" in caplog.text
    (root / tag / "meta.json").write_text(json.dumps({**legacy, "step": 5}))
    with pytest.raises(SystemExit, match="says step 5, but its folder is step_000004"):
        checkpoints.read_meta(root)


def _blocked_module(tmp_path: Path, name: str) -> dict:
    """An environment in which ``import name`` fails as if it were not installed: a
    package of that name first on the path, whose import raises ModuleNotFoundError."""
    folder = tmp_path / "blocked" / name
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n"
    )
    return {"PYTHONPATH": str(folder.parent)}


def test_missing_matplotlib_stops_the_run_before_training(warm_cache, tmp_path):
    """Without matplotlib the run used to train to the end, then exit 1 with a traceback
    from the plot and no summary.json. Every import the run needs happens before the
    first step: it must stop at once, naming the package and the extra that provides it."""
    run_dir = tmp_path / "run"
    args = [*common(warm_cache), "--tp", "2", "--steps", "3", "--run-dir", str(run_dir)]
    rc, out = run_train(2, args, extra_env=_blocked_module(tmp_path, "matplotlib"), timeout=120)
    assert rc != 0, out[-4000:]
    assert "step 1/" not in out and "train:" not in out, out[-4000:]
    message = "the run needs matplotlib (the loss-curve plot, on rank 0), which does not import"
    assert out.count(message) == 1, out[-4000:]
    assert "pip install -e '.[train]'" in out, out[-4000:]
    assert not (run_dir / "train.log").exists()


def test_the_plot_comes_after_summary_json(tmp_path, monkeypatch):
    """finish() writes summary.json before the plot: a plot that fails at the end of a
    long run (a full disk, a broken font cache) loses the picture, not the numbers."""
    from launch import report

    def broken_plot(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(report, "plot", broken_plot)
    history = {"step": [1, 2], "loss": [3.0, 2.0], "grad_norm": [1.0, 1.0], "lr": [1e-3, 1e-3],
               "val": [[2, 2.5]]}  # fmt: skip
    run = type("Run", (), {"history": history, "tokens_per_step": 8, "timed_steps": 1,
                           "timed_seconds": 0.5})()  # fmt: skip
    groups = type("Groups", (), {"tp_size": 1, "dp_size": 1})()
    o = {"run_dir": str(tmp_path), "steps": 2, "engine": "torch", "sequence_parallel": False,
         "tp_style": "shards", "d_model": 8, "n_layers": 1, "vocab_size": 300,
         "dtype": "float32"}  # fmt: skip
    with pytest.raises(OSError, match="no space left"):
        report.finish(o, run, {}, groups, world=1, backend="gloo", device=torch.device("cpu"),
                      peak=1.0, in_sync=True, wall=1.0)  # fmt: skip
    assert json.loads((tmp_path / "summary.json").read_text())["final_train_loss"] == 2.0


def test_second_run_on_a_run_dir_in_use_is_refused(warm_cache, tmp_path):
    """Run A trains in run_dir; run B (2 ranks, --overwrite) is started on the same
    run_dir. B used to start, truncate A's train.log and delete A's checkpoints. It must
    stop on both of its ranks alike, saying once which run (pid, host) holds the
    directory, and leave A's files alone."""
    import socket

    run_dir = tmp_path / "run"
    base = [*common(warm_cache), "--tp", "1", "--run-dir", str(run_dir)]
    proc = start_torchrun(1, [*base, "--steps", "1000000", "--log-every", "1", "--save-every",
                              "2", "--keep-checkpoints", "0"])  # fmt: skip
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        log = run_dir / "train.log"
        _wait_for(lambda: (run_dir / "checkpoints" / "latest").exists(), 120,
                  "run A's first checkpoint", output)  # fmt: skip
        holder = [pid for pid in _children(proc.pid) if _rank_of(pid) == 0]
        assert len(holder) == 1, holder
        rc, out = run_train(2, [*base, "--steps", "2", "--overwrite"], timeout=120)
        assert rc != 0, out[-4000:]
        expected = (f"run_dir {run_dir} is in use by another run (pid {holder[0]} on host "
                    f"{socket.gethostname()}")  # fmt: skip
        assert out.count(expected) == 1, out[-4000:]
        assert "step 1/" not in out, out[-4000:]
        assert (run_dir / "checkpoints" / "step_000002").is_dir()
        assert "step 1/" in log.read_text()  # not truncated by B
        assert proc.poll() is None, "".join(output)[-4000:]
    finally:
        kill_group(proc)
        proc.wait(timeout=60)


def _hold_lock_in_subprocess(run_dir: Path):
    """A process that takes ``run_dir``'s lock and waits (killed by the caller)."""
    import subprocess
    import sys

    code = ("import sys, time; from launch.run_lock import acquire; "
            "acquire(sys.argv[1]); print('held', flush=True); time.sleep(600)")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], cwd=config.ROOT,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_run_lock_names_its_holder_and_is_taken_over_when_it_is_gone(tmp_path):
    """A held lock is an error naming the directory, the holder's pid and host; once the
    holder is killed (no chance to clean up) the next run takes the lock and says whose
    it was; a lock released normally leaves no file behind."""
    import socket

    from launch import run_lock

    run_dir = tmp_path / "run"
    holder = _hold_lock_in_subprocess(run_dir)
    try:
        with pytest.raises(SystemExit) as exc:
            run_lock.acquire(run_dir)
        message = str(exc.value)
        assert message.startswith(f"run_dir {run_dir} is in use by another run (pid "
                                  f"{holder.pid} on host {socket.gethostname()}")  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    lock = run_lock.acquire(run_dir)
    assert lock.stale is not None and f"pid {holder.pid}" in lock.stale
    with pytest.raises(SystemExit, match=f"pid {os.getpid()}"):
        run_lock.acquire(run_dir)  # another open file description, same process
    lock.release()
    assert not (run_dir / run_lock.LOCK_NAME).exists()
    again = run_lock.acquire(run_dir)
    assert again.stale is None
    again.release()


def _refused_run_dir(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_000004").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step_000004")
    return run_dir


def test_refused_run_says_why_once(corpus_and_cache, tmp_path):
    """A run refused on 2 ranks (a run_dir with checkpoints) prints its reason once, not
    once per rank."""
    run_dir = _refused_run_dir(tmp_path)
    args = [*common(corpus_and_cache), "--tp", "2", "--run-dir", str(run_dir)]
    rc, out = run_train(2, args, timeout=120)
    assert rc != 0
    assert out.count(f"run_dir {run_dir} already holds checkpoints") == 1, out[-4000:]


@pytest.mark.skipif(not (config.ROOT / ".venv" / "bin" / "python").exists(),
                    reason="scripts/main.sh runs the repository's .venv")  # fmt: skip
def test_main_sh_ends_a_refused_run_with_its_reason(tmp_path):
    """scripts/main.sh: whatever torchrun prints after a refused rank exits (its
    ChildFailedError report), the last thing the user reads is the reason."""
    import subprocess

    from launch_helpers import ROOT, train_env

    run_dir = _refused_run_dir(tmp_path)
    proc = subprocess.run(["bash", "scripts/main.sh", "--run-dir", str(run_dir)], cwd=ROOT,
                          env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=180)  # fmt: skip
    assert proc.returncode != 0
    out = proc.stdout
    lines = [line for line in out.splitlines() if line.strip()]
    assert "ChildFailedError" in out, out[-4000:]  # torchrun's report is there, but before
    assert out.count(f"run_dir {run_dir} already holds checkpoints") == 2, out[-4000:]
    assert f"error: run_dir {run_dir} already holds checkpoints" in lines[-1], out[-4000:]
