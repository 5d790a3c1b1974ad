"""Train a small GPT whose LM head is vocabulary-parallel, under torchrun (the main job).

    torchrun --nproc-per-node 2 launch/train.py                  # embedded default, 2 CPU ranks
    torchrun --nproc-per-node 2 launch/train.py --check-against-unsharded --steps 100
    torchrun --nproc-per-node 8 launch/train.py --config configs/train_llama3_8b_head_tp8.yaml
    python launch/train.py --config configs/train_two_nodes.yaml --dry-run   # plan only

Options come from a YAML file (``--config``, default ``configs/train_tiny_cpu.yaml``);
every key can be overridden by the flag of the same name (``--steps 50 --tp 1``).

The world of ``torchrun`` ranks is split into tensor-parallel groups of ``tp`` consecutive
ranks (the vocabulary of the head is sharded over each) and ``world / tp`` data-parallel
replicas. NCCL on GPUs, gloo otherwise; every collective has a timeout (``timeout_s``).

Data (default): the embedded public-domain corpus ``data/kjv.txt.gz``, tokenised by a
byte-level BPE tokenizer that rank 0 trains at the first run and caches (``cache_dir``);
the token ids are then sent to the other ranks, so multi-node runs need no shared disk
for the data. Batches are a function of ``(seed, step, dp_rank)`` only, and the last
``val_fraction`` of the corpus is held out for the validation loss.

Engines: ``torch`` (DP gradient averaging in fp32, TP-aware gradient clipping, AdamW; see
``launch/engines.py``) or ``deepspeed`` (``vocab_parallel.integrations.deepspeed``,
ZeRO stage ``zero_stage`` over the DP group).

Outputs, in ``run_dir`` (rank 0): ``train.log``, ``loss_curve.png``, ``summary.json``, and
``checkpoints/`` every ``save_every`` steps. ``--resume`` continues from the latest
checkpoint and reproduces the uninterrupted run's losses exactly (model, optimizer, step
and RNG are restored; data and learning rate are functions of the step; every file is
checked against the SHA-256 recorded at save, ``meta.json`` against its own). A new run
refuses a ``run_dir`` that holds checkpoints, unless ``--overwrite`` (delete them first) or
``--resume`` is given, and any run refuses a ``run_dir`` that another run is using (rank 0
holds ``run_dir/train.lock`` while the run lasts; see ``launch/run_lock.py``).

Before the first step: every package the run imports later (the progress bar, the
tokenizer, the plot) is imported, on the ranks that use it, so that a missing one stops
the run at once, not after its last step. A run refused before it trains (a run_dir in
use, a checkpoint that cannot be resumed, a missing package, ...) stops every rank alike
and says why once; under ``scripts/main.sh`` that reason is also the last thing printed,
after torchrun's report of the failed ranks.

Failures end the job rather than hang it or go unnoticed: a rank that dies or stops makes
the others exit within ``timeout_s``, naming the collective and the group that failed; a
non-finite loss, or TP replicas that no longer agree at the end, exit non-zero.

``--check-against-unsharded`` trains, in lockstep on the same batches, the same model
with an ordinary full head and ``F.cross_entropy`` (same init, same optimizer), and
prints both loss curves side by side with their largest difference.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys
import time
from pathlib import Path

# Run as a script (``torchrun ... launch/train.py``), Python puts launch/ itself first on
# sys.path; the repository root must be there for ``launch`` to import as a package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from launch.checkpoints import (  # noqa: E402
    check_run_dir,
    checkpoint_root,
    load_checkpoint,
    new_run_id,
    open_checkpoint,
    overwrite_run_dir,
)
from launch.config import filter_eps, parse_args  # noqa: E402
from launch.data import load_data  # noqa: E402
from launch.dist_env import (  # noqa: E402
    CollectiveError,
    RunRefused,
    agree,
    collective,
    init_distributed,
    init_groups,
)
from launch.engines import local, make_runner, replicas_in_sync  # noqa: E402
from launch.loop import train  # noqa: E402
from launch.model import build_model  # noqa: E402
from launch.plan import dry_run  # noqa: E402
from launch.report import (  # noqa: E402
    finish,
    import_pyplot,
    log,
    peak_memory_bytes,
    record_error,
    report_error,
    setup_logging,
)
from launch.run_lock import RunLock, acquire  # noqa: E402

# What the run imports only where it first uses it (module, pip package, the ranks that
# use it and what for, whether rank 0 alone does), imported before the first step instead.
# All are in the ``train`` extra.
RUN_IMPORTS = (
    ("tqdm", "tqdm", "the progress bar, on every rank", False),
    ("tokenizers", "tokenizers", "the BPE tokenizer, on rank 0", True),
    ("matplotlib.pyplot", "matplotlib", "the loss-curve plot, on rank 0", True),
)


def main(argv: list[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", "0"))  # torchrun's; the process group is not up yet
    o = parse_options(argv, rank)
    if o["dry_run"]:
        return dry_run(o)
    wall0 = time.perf_counter()
    lock = None
    try:
        backend, device = init_distributed(o)
        rank = dist.get_rank()
        check_imports(rank)
        lock = take_run_dir(o, rank)
        return run(o, backend, device, wall0, lock)
    except RunRefused as exc:  # every rank has it: said once
        report_error(str(exc), rank, alike=True)
        return 1
    except CollectiveError as exc:  # a rank died, stopped or hung: say which collective
        report_error(str(exc), rank, alike=False)
        return 1
    finally:
        if lock is not None:
            lock.release()


def parse_options(argv: list[str] | None, rank: int) -> dict:
    """The options (:func:`launch.config.parse_args`); a usage error is printed by rank 0
    alone (every rank parses the same argv, so every rank has it) and recorded for the
    wrapper (``report.record_error``)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return parse_args(argv, description=__doc__.split("\n\n")[0])
    except SystemExit as exc:
        lines = captured.getvalue().strip().splitlines()
        if exc.code and rank == 0 and lines:
            record_error(lines[-1])
        raise
    finally:
        if rank == 0:
            sys.stderr.write(captured.getvalue())


def check_imports(rank: int) -> None:
    """Import now, on the ranks that use them, what the run imports later (collective):
    a missing package stops every rank, naming it and the extra that provides it."""
    missing = []
    for module, package, used_for, rank0_only in RUN_IMPORTS:
        if rank0_only and rank != 0:
            continue
        try:
            import_pyplot() if module == "matplotlib.pyplot" else importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{package} ({used_for}), which does not import ({exc})")
    problem = None
    if missing:
        problem = (f"the run needs {'; and '.join(missing)}: install the launcher's "
                   "requirements, pip install -e '.[train]'")  # fmt: skip
    agree(problem, "the packages the run imports")


def take_run_dir(o: dict, rank: int) -> RunLock | None:
    """Rank 0 takes ``run_dir``'s lock and then, holding it, checks that a new run does not
    start where another run's checkpoints are (collective: every rank refuses alike).
    Returns rank 0's lock (``None`` on the other ranks)."""
    lock, problem = None, None
    if rank == 0:
        try:
            lock = acquire(o["run_dir"])
            check_run_dir(o)
        except RunRefused as exc:
            problem = str(exc)
    try:
        agree(problem, f"run_dir {o['run_dir']}", rank0_only=True)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock


def run(o: dict, backend: str, device: torch.device, wall0: float, lock: RunLock | None) -> int:
    """The training job, once the default process group is up and rank 0 holds the run
    directory's lock (collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir, interactive = Path(o["run_dir"]), sys.stdout.isatty()
    removed = overwrite_run_dir(o) if o["overwrite"] else 0
    setup_logging(run_dir, rank, o["resume"], interactive)
    if lock is not None and lock.stale:
        log.info(f"{lock.path}: taken over from a run that ended without releasing it "
                 f"({lock.stale})")  # fmt: skip
    if removed:
        log.info(f"--overwrite: deleted {removed} checkpoint entries of an earlier run in "
                 f"{checkpoint_root(o)}")  # fmt: skip
    groups = init_groups(o)
    if o["world_size"] and o["world_size"] != world:
        log.info(f"note: {o['config']} is written for {o['world_size']} ranks; running on {world}")
    log.info(
        f"world {world} = TP {groups.tp_size} x DP {groups.dp_size}, {backend} on {device.type}, "
        f"engine {o['engine']}, {o['dtype']}, run dir {run_dir}"
    )
    # A checkpoint that cannot be resumed (damaged, other options) stops the run before the
    # data and the models are made.
    checkpoint = open_checkpoint(o) if o["resume"] else None
    data, info = load_data(o, rank, device)
    log.info(
        f"data: {info['corpus']}, {info['tokens']:,} tokens ({len(data.train):,} train, "
        f"{len(data.val):,} validation), BPE vocabulary {info['tokenizer_vocab_size']:,} "
        f"({'cached' if info['cache_hit'] else 'trained'}: {info['tokenizer']}, "
        f"{info['seconds']} s)"
    )

    heads = {"main": "vocab_parallel"}
    if o["check_against_unsharded"]:
        heads["unsharded"] = "unsharded"
    runners = {name: make_runner(build_model(o, h, groups, device), groups, o)
               for name, h in heads.items()}  # fmt: skip
    model = runners["main"].module
    n_head = local(model.head.weight).numel()  # this rank's shard (DTensor: to_local())
    n_body = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("head."))
    layout = ""
    if o["tp_style"] == "dtensor" and o["engine"] == "torch":
        layout += ", head weight a ColwiseParallel DTensor (Shard(0))"
    if o["sequence_parallel"] and o["engine"] == "torch":
        layout += ", sequence parallel (the head takes this TP rank's tokens)"
    log.info(
        f"model: d_model {o['d_model']}, {o['n_layers']} layers, context {o['context']}, "
        f"vocab {o['vocab_size']:,}; rank 0 holds head rows {model.head.vocab_start_index:,}.."
        f"{model.head.vocab_end_index:,} ({n_head:,} parameters) and the body "
        f"({n_body:,} parameters, replicated over TP); {o['mode']} loss{layout}"
    )

    history = {"step": [], "loss": [], "grad_norm": [], "lr": [], "val": []}
    if filter_eps(o) is not None:
        history["filtered"] = []  # share of G's tiles the step's products left out
    if o["check_against_unsharded"]:
        history["ref_loss"] = []
    start, run_id = 0, new_run_id()
    if checkpoint is not None:
        start, history, run_id = load_checkpoint(o, runners, *checkpoint)
        log.info(f"resumed from step {start} ({checkpoint_root(o) / f'step_{start:06d}'})")
    result = train(o, runners, data, groups, device, start=start, history=history,
                   interactive=interactive, run_id=run_id)  # fmt: skip
    if result.status == "diverged":
        return 1
    if result.status == "stopped":
        dist.destroy_process_group()
        return 0

    in_sync = all(replicas_in_sync(r.module, groups.tp_group) for r in runners.values())
    # The largest peak memory, and whether the replicas of any TP group differ, over all ranks.
    flags = torch.tensor([peak_memory_bytes(device), 0.0 if in_sync else 1.0],
                         dtype=torch.float64, device=device)  # fmt: skip
    with collective("all-reduce of the peak memory", None):
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    peak, in_sync = flags[0].item(), flags[1].item() == 0.0
    if rank == 0:
        finish(o, result, info, groups, world=world, backend=backend, device=device,
               peak=peak, in_sync=in_sync, wall=time.perf_counter() - wall0)  # fmt: skip
    dist.destroy_process_group()
    if not in_sync:  # every rank exits non-zero; rank 0 says why
        if rank == 0:
            message = (
                "error: the tensor-parallel replicas diverged: the replicated parameters "
                "(the body) are no longer bitwise equal on the ranks of a TP group, so the "
                "ranks trained different models and the losses above are not those of one "
                "model (summary.json: tp_replicas_in_sync false)"
            )
            log.error(message)
            record_error(message)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
