"""Checkpoints of a training run, and resuming from them.

A checkpoint is a step folder under ``run_dir/checkpoints``::

    checkpoints/latest               the tag of the newest complete checkpoint
    checkpoints/step_000300/         meta.json, rng_rank<r>.pt, and the main model's files
    checkpoints/unsharded/           the unsharded copy's (--check-against-unsharded),
        latest, step_000300/         with the same tags

What the model and optimizer files look like is the engine's business: each runner
writes and reads its own (``runner.save(folder, name)`` / ``runner.load(folder, name)``,
see ``launch.engines``). This module owns what every engine shares: the folder and its
tag, the RNG state of every rank, ``meta.json`` (step, loss history, options, world),
writing ``latest`` last (a checkpoint is complete when ``latest`` names it, so a crash
while saving leaves the previous one in force), pruning old checkpoints, and refusing to
resume with options that would not reproduce the interrupted run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

# Keys that must match between a checkpoint and the run resuming it.
RESUME_MUST_MATCH = (
    "engine", "tp", "d_model", "n_layers", "n_heads", "mlp_ratio", "vocab_size", "context",
    "dtype", "seed", "data", "tokenizer", "val_fraction", "batch_size", "check_against_unsharded",
    "zero_stage",
)  # fmt: skip
# Where each model's checkpoints go, under checkpoints/.
SUBDIR = {"main": ".", "unsharded": "unsharded"}

log = logging.getLogger("train")


def checkpoint_root(o: dict) -> Path:
    return Path(o["run_dir"]) / "checkpoints"


def save_checkpoint(o: dict, runners: dict, step: int, history: dict) -> str:
    """Write ``checkpoints/step_XXXXXX`` (collective) and point ``latest`` at it.

    Each runner writes its model's files into its folder (``SUBDIR``); then every rank
    its RNG state and rank 0 ``meta.json``, the ``latest`` files and the pruning.
    """
    root, tag, rank = checkpoint_root(o), f"step_{step:06d}", dist.get_rank()
    folder = root / tag
    for name, runner in runners.items():
        runner.save(root / SUBDIR[name] / tag, name)
    # Training draws no random numbers (no dropout; batches have their own generators), but
    # a model that does would need its RNG back to resume exactly.
    folder.mkdir(parents=True, exist_ok=True)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, folder / f"rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        meta = {"step": step, "history": history, "options": o, "world": dist.get_world_size()}
        (folder / "meta.json").write_text(json.dumps(meta))
        for name in runners:
            tmp = root / SUBDIR[name] / "latest.tmp"
            tmp.write_text(tag)
            os.replace(tmp, root / SUBDIR[name] / "latest")
        prune_checkpoints(root, o["keep_checkpoints"])
    dist.barrier()
    return tag


def prune_checkpoints(root: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest step folders of every model (0: keep all)."""
    if keep <= 0:
        return
    for sub in dict.fromkeys(root / s for s in SUBDIR.values()):
        tags = sorted(p for p in sub.glob("step_*") if p.is_dir())
        for old in tags[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(o: dict, runners: dict) -> tuple[int, dict]:
    """Restore the latest checkpoint (collective); returns ``(step, history)``."""
    root = checkpoint_root(o)
    latest = root / "latest"
    if not latest.exists():
        raise SystemExit(f"--resume: no checkpoint in {root}")
    tag = latest.read_text().strip()
    meta = json.loads((root / tag / "meta.json").read_text())
    saved = meta["options"]
    different = {k: (saved.get(k), o[k]) for k in RESUME_MUST_MATCH if saved.get(k) != o[k]}
    if different:
        raise SystemExit(f"--resume: options differ from the checkpoint's: {different}")
    if meta["world"] != dist.get_world_size():
        raise SystemExit(f"--resume: checkpoint has {meta['world']} ranks, this run has "
                         f"{dist.get_world_size()}")  # fmt: skip
    for name, runner in runners.items():
        runner.load(root / SUBDIR[name] / tag, name)
    rng = torch.load(root / tag / f"rng_rank{dist.get_rank()}.pt", weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    if saved.get("steps") != o["steps"]:
        log.info(f"resume: steps {saved.get('steps')} -> {o['steps']} (the LR schedule changes)")
    return meta["step"], meta["history"]
