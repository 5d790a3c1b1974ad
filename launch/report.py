"""What a training run tells its user: the log, the progress bar, the plot and the summary.

Rank 0 logs to ``run_dir/train.log`` and to the console, the other ranks only their
warnings (prefixed with their rank). On a terminal the console lines go above a live
progress bar; elsewhere (CI, ``| tee``) the bar is printed as a line now and then instead
of carriage-return redraws, which would otherwise fill a log file with every refresh.
Whether stdout is a terminal is decided once by the caller and passed in
(``interactive``), so the handler and the bar always agree.

At the end rank 0 writes ``summary.json``, then ``loss_curve.png``, and prints the summary
(:func:`finish`); with ``--check-against-unsharded``, both loss curves side by side. The
plotting library is imported by :func:`import_pyplot`, which ``train.py`` also calls
before the first step: a run without it stops at once instead of after its last step.

An error that ends the run is said by :func:`report_error`: once (by rank 0) where every
rank has the same one, and also appended to the file that ``VOCAB_PARALLEL_ERROR_FILE``
names, if set: ``scripts/main.sh`` prints that file after torchrun has exited, so that
the reason, not torchrun's report of a failed child, is the last thing on the console.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import sys
from pathlib import Path

import torch

log = logging.getLogger("train")
# Where a wrapper of torchrun (scripts/main.sh) wants the reason a run ended with an error.
ERROR_FILE_ENV = "VOCAB_PARALLEL_ERROR_FILE"
# ``log.info(..., **FILE_ONLY)``: to train.log, not to the console.
FILE_ONLY = {"extra": {"file_only": True}}


class ConsoleHandler(logging.Handler):
    """Rank 0's console lines: above the progress bar (through tqdm) on a terminal."""

    def __init__(self, interactive: bool) -> None:
        super().__init__(logging.INFO)
        self.interactive = interactive
        self.setFormatter(logging.Formatter("[train] %(message)s"))
        self.addFilter(lambda record: not getattr(record, "file_only", False))

    def emit(self, record: logging.LogRecord) -> None:
        if self.interactive:  # above the progress bar
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stdout)
        else:
            print(self.format(record), flush=True)


def setup_logging(run_dir: Path, rank: int, resume: bool, interactive: bool) -> None:
    """Rank 0 logs to ``run_dir/train.log`` and, through tqdm, to the console."""
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False
    if rank != 0:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s"))
        log.addHandler(handler)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(run_dir / "train.log", mode="a" if resume else "w")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    log.addHandler(file_handler)
    log.addHandler(ConsoleHandler(interactive))


class _BarLines:
    """Where the progress bar goes when stdout is not a terminal (CI, ``| tee``): each
    refresh as a line of its own instead of carriage-return redraws."""

    def write(self, s: str) -> None:
        s = s.replace("\r", "").strip()
        if s:
            print(s, flush=True)

    def flush(self) -> None:
        sys.stdout.flush()


def progress_bar(total: int, initial: int, rank: int, interactive: bool):
    """Rank 0's tqdm bar of the optimizer steps (disabled on the other ranks)."""
    from tqdm import tqdm

    term = shutil.get_terminal_size((0, 0))
    sized = term.columns > 0 and term.lines > 0
    return tqdm(
        total=total,
        initial=initial,
        desc="train",
        disable=rank != 0,
        file=sys.stdout if interactive else _BarLines(),
        mininterval=0.5 if interactive else 30.0,
        # A terminal of unknown size (0 x 0, e.g. a pty without a window) would hide the bar.
        dynamic_ncols=interactive and sized,
        ncols=None if interactive and sized else 100,
        nrows=None if sized else 20,
    )


def report_error(message: str, rank: int, *, alike: bool) -> None:
    """Say why the run ends: ``error: message`` on stderr (``[rank r]`` first on the ranks
    but 0) and in the wrapper's error file. ``alike``: every rank has this very error, so
    only rank 0 says it."""
    if alike and rank != 0:
        return
    line = f"error: {message}" if rank == 0 else f"[rank {rank}] error: {message}"
    print(line, file=sys.stderr, flush=True)
    if any(isinstance(h, logging.FileHandler) for h in log.handlers):
        log.error(line, **FILE_ONLY)  # train.log too, where this run has opened it
    record_error(line)


def record_error(line: str) -> None:
    """Append ``line`` to the file ``VOCAB_PARALLEL_ERROR_FILE`` names (if set), for the
    wrapper to print last; a file that cannot be written is no reason for another error."""
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(line.rstrip("\n") + "\n")
        except OSError:
            pass


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the most ever allocated by torch. CPU: the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def side_by_side(history: dict, every: int) -> str:
    """The two loss curves as a table, every ``every`` steps and the last one."""
    rows = [" step | vocab-parallel |  unsharded | |difference|"]
    steps = history["step"]
    for i, step in enumerate(steps):
        if step % every == 0 or i == len(steps) - 1 or step == 1:
            a, b = history["loss"][i], history["ref_loss"][i]
            rows.append(f"{step:5d} | {a:14.6f} | {b:10.6f} | {abs(a - b):.2e}")
    return "\n".join(rows)


def import_pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(history: dict, path: Path, title: str) -> None:
    plt = import_pyplot()

    check = "ref_loss" in history
    fig, axes = plt.subplots(
        2 if check else 1, 1, figsize=(8, 6.5 if check else 4.5), squeeze=False,
        gridspec_kw={"height_ratios": [3, 1]} if check else None, sharex=True,
    )  # fmt: skip
    ax = axes[0][0]
    ax.plot(history["step"], history["loss"], lw=1.2, label="train, vocab-parallel head")
    if check:
        ax.plot(history["step"], history["ref_loss"], lw=1.0, ls="--",
                label="train, unsharded head (F.cross_entropy)")  # fmt: skip
    if history["val"]:
        vs = [v[0] for v in history["val"]]
        ax.plot(vs, [v[1] for v in history["val"]], "o-", ms=4, label="validation, vocab-parallel")
        if check:
            ax.plot(vs, [v[2] for v in history["val"]], "x--", ms=6, label="validation, unsharded")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    if check:
        diff = [abs(a - b) for a, b in zip(history["loss"], history["ref_loss"], strict=True)]
        axes[1][0].plot(history["step"], diff, lw=1.0, color="tab:red")
        axes[1][0].ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        axes[1][0].set_ylabel("|difference|")
        axes[1][0].grid(alpha=0.3)
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finish(o: dict, run, info: dict, groups, *, world: int, backend: str,
           device: torch.device, peak: float, in_sync: bool, wall: float) -> None:  # fmt: skip
    """Rank 0: the loss-curve PNG, ``summary.json`` and the summary on the console.

    ``run``: the training loop's result (``history``, ``timed_steps``, ``timed_seconds``,
    ``tokens_per_step``); ``peak``: the largest peak memory of any rank, in bytes.
    """
    run_dir, history = Path(o["run_dir"]), run.history
    tok_s = run.tokens_per_step * run.timed_steps / run.timed_seconds if run.timed_seconds else None
    val = history["val"][-1]
    summary = {
        "steps": o["steps"],
        "final_train_loss": history["loss"][-1],
        "final_val_loss": val[1],
        "tokens_per_s": tok_s,
        "tokens_per_step": run.tokens_per_step,
        "peak_memory_mib": peak / 2**20,
        "peak_memory_kind": "cuda_max_allocated" if device.type == "cuda" else "cpu_max_rss",
        "wall_time_s": wall,
        "world": world,
        "tp": groups.tp_size,
        "dp": groups.dp_size,
        "backend": backend,
        "device": device.type,
        "engine": o["engine"],
        "sequence_parallel": o["sequence_parallel"],
        "tp_style": o["tp_style"],
        "tp_replicas_in_sync": in_sync,
        "data": info,
        "options": o,
        "history": history,
    }
    check = "ref_loss" in history
    title = (
        f"GPT d{o['d_model']} L{o['n_layers']} V{o['vocab_size']}, TP {groups.tp_size} x "
        f"DP {groups.dp_size}, {o['engine']} engine, {o['dtype']}"
        + (", sequence parallel" if o["sequence_parallel"] else "")
        + (", DTensor head" if o["tp_style"] == "dtensor" else "")
    )
    if check:
        diffs = [abs(a - b) for a, b in zip(history["loss"], history["ref_loss"], strict=True)]
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        summary.update(
            final_train_loss_unsharded=history["ref_loss"][-1],
            final_val_loss_unsharded=val[2],
            max_abs_loss_difference=diffs[worst],
            max_abs_loss_difference_step=history["step"][worst],
        )
    # The numbers first: a plot that fails (a full disk, a broken font cache) loses the
    # picture, not the summary of the run.
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(history, run_dir / "loss_curve.png", title)
    lines = [
        f"done: {o['steps']} steps in {wall:.1f} s wall (this run), {tok_s or 0:,.0f} tokens/s, "
        f"peak memory {mib(peak)} per rank"
        + (" (max RSS)" if device.type == "cpu" else " (CUDA max allocated)"),
        f"loss: train {history['loss'][0]:.4f} -> {history['loss'][-1]:.4f}, "
        f"validation {val[1]:.4f}",
    ]
    if check:
        lines.append(
            f"unsharded head: train {history['ref_loss'][-1]:.4f}, validation {val[2]:.4f}; "
            f"largest |difference| of the train losses {summary['max_abs_loss_difference']:.2e} "
            f"(step {summary['max_abs_loss_difference_step']}) over {len(diffs)} steps"
        )
        lines.append("side by side:\n" + side_by_side(history, max(1, o["steps"] // 10)))
    lines.append(f"replicated body bitwise equal on the TP ranks: {'yes' if in_sync else 'NO'}")
    lines.append(f"wrote {run_dir / 'loss_curve.png'}, {run_dir / 'summary.json'}, "
                 f"{run_dir / 'train.log'}")  # fmt: skip
    for line in lines:
        log.info(line)
