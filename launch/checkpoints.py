"""Checkpoints of a training run, and resuming from them.

A checkpoint is a step folder under ``run_dir/checkpoints``::

    checkpoints/latest               the tag of the newest complete checkpoint
    checkpoints/step_000300/         meta.json, rng_rank<r>.pt, and the main model's files
    checkpoints/unsharded/           the unsharded copy's (--check-against-unsharded),
        latest, step_000300/         with the same tags

What the model and optimizer files look like is the engine's business: each runner
writes and reads its own (``runner.save(folder, name)`` / ``runner.load(folder, name)``,
see ``launch.engines``). This module owns what every engine shares: the folder and its
tag, the RNG state of every rank, ``meta.json`` (step, loss history, options, world, the
run's id and the SHA-256 of every file of the checkpoint), writing ``latest`` last (a
checkpoint is complete when ``latest`` names it, so a crash while saving leaves the
previous one in force), pruning old checkpoints, and refusing to resume from a
checkpoint that is damaged or with options that would not reproduce the interrupted run.

``meta.json`` covers itself too: it records the SHA-256 of its own content
(``meta_sha256``, over the canonical JSON of every other key), and its step must be its
folder's and its history's last. A hand edit (``"step": 10`` made 15 would resume at
step 15 from step 10's model, skipping five steps) is an error at ``--resume``, on every
rank, before anything trains.

One run directory holds one run: a new run refuses to start where another run's
checkpoints are (:func:`check_run_dir`) unless told to continue it (``--resume``, which
keeps its run id) or to delete them (``--overwrite``, :func:`overwrite_run_dir`), and
pruning only ever deletes checkpoints of the current run id.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from launch.dist_env import RunRefused, agree, collective

# Keys that must match between a checkpoint and the run resuming it.
RESUME_MUST_MATCH = (
    "engine", "tp", "d_model", "n_layers", "n_heads", "mlp_ratio", "vocab_size", "context",
    "dtype", "seed", "data", "tokenizer", "val_fraction", "batch_size", "check_against_unsharded",
    "zero_stage",
)  # fmt: skip
# Keys a resumed run may change, but whose change makes it differ from the uninterrupted run.
RESUME_NOTE_CHANGES = (
    "steps", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip",
    "label_smoothing", "mode", "backend", "sequence_parallel", "tp_style",
)  # fmt: skip
# Where each model's checkpoints go, under checkpoints/.
SUBDIR = {"main": ".", "unsharded": "unsharded"}
# The outputs of a finished run in run_dir, removed with its checkpoints by --overwrite.
RUN_OUTPUTS = ("summary.json", "loss_curve.png")

log = logging.getLogger("train")


def checkpoint_root(o: dict) -> Path:
    return Path(o["run_dir"]) / "checkpoints"


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def step_of(folder: Path) -> int | None:
    """The step of a ``step_XXXXXX`` folder (None for any other name)."""
    digits = folder.name.removeprefix("step_")
    return int(digits) if folder.name.startswith("step_") and digits.isdigit() else None


def existing_checkpoints(root: Path) -> list[Path]:
    """The step folders and ``latest`` files under ``root`` (every model's)."""
    found = []
    for sub in dict.fromkeys(root / s for s in SUBDIR.values()):
        found += sorted(p for p in sub.glob("step_*") if p.is_dir())
        found += [sub / "latest"] if (sub / "latest").exists() else []
    return found


def check_run_dir(o: dict) -> None:
    """A new run (neither ``--resume`` nor ``--overwrite``) must not start where another
    run's checkpoints are: its own would mix with them (every rank, before anything)."""
    if o["resume"] or o["overwrite"]:
        return
    root = checkpoint_root(o)
    found = existing_checkpoints(root)
    if found:
        names = ", ".join(str(p.relative_to(root)) for p in found[:4])
        more = f" and {len(found) - 4} more" if len(found) > 4 else ""
        raise RunRefused(
            f"run_dir {o['run_dir']} already holds checkpoints of an earlier run in {root} "
            f"({names}{more}): pass --resume to continue that run, or --overwrite to delete "
            "them and start a new one (or choose another --run-dir)"
        )


def overwrite_run_dir(o: dict) -> int:
    """``--overwrite``: rank 0 deletes the checkpoints (and outputs) of an earlier run in
    ``run_dir`` before anything new is written (collective). Returns how many checkpoint
    entries were deleted."""
    root = checkpoint_root(o)
    removed = 0
    if dist.get_rank() == 0:
        removed = len(existing_checkpoints(root))
        if root.exists():
            shutil.rmtree(root)
        for name in RUN_OUTPUTS:
            (Path(o["run_dir"]) / name).unlink(missing_ok=True)
    with collective("barrier after --overwrite", None):
        dist.barrier()
    return removed


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def meta_digest(meta: dict) -> str:
    """SHA-256 of ``meta`` (but its own ``meta_sha256``) as canonical JSON: sorted keys, no
    spaces, so that it does not depend on how the file was formatted."""
    rest = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(
        json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def write_meta(folder: Path, meta: dict) -> None:
    """Write ``folder/meta.json`` (atomically) with the SHA-256 of its content in it. The
    digest is of the content as it reads back (tuples as lists), so a reader recomputes it
    from what it loads."""
    loaded = json.loads(json.dumps({k: v for k, v in meta.items() if k != "meta_sha256"}))
    _write_atomic(folder / "meta.json", json.dumps({**loaded, "meta_sha256": meta_digest(loaded)}))


def checkpoint_files(root: Path, tag: str, names) -> list[str]:
    """Every file of checkpoint ``tag`` (of the models ``names``), relative to ``root``,
    but ``meta.json``, which lists them."""
    files = []
    for folder in dict.fromkeys(root / SUBDIR[name] / tag for name in names):
        for path in sorted(folder.rglob("*")):
            if path.is_file() and path != root / tag / "meta.json":
                files.append(path.relative_to(root).as_posix())
    return files


def checksums(root: Path, tag: str, names) -> dict[str, str]:
    """SHA-256 of every file of checkpoint ``tag`` (collective: rank 0 lists the files, every
    rank hashes its share, rank 0 gets them all; other ranks get ``{}``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    listing = [checkpoint_files(root, tag, names) if rank == 0 else None]
    with collective("broadcast of the checkpoint's file list", None):
        dist.broadcast_object_list(listing, src=0)
    mine = {f: sha256_of(root / f) for f in listing[0][rank::world]}
    gathered = [None] * world
    with collective("all-gather of the checkpoint's checksums", None):
        dist.all_gather_object(gathered, mine)
    return dict(sorted(kv for part in gathered for kv in part.items())) if rank == 0 else {}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(o: dict, runners: dict, step: int, history: dict, run_id: str) -> str:
    """Write ``checkpoints/step_XXXXXX`` (collective) and point ``latest`` at it.

    Rank 0 first removes what a save of the same step that crashed may have left. Each
    runner writes its model's files into its folder (``SUBDIR``); then every rank its RNG
    state; then the ranks hash the files and rank 0 writes ``meta.json`` (with the
    checksums and ``run_id``), the ``latest`` files and prunes.
    """
    root, tag, rank = checkpoint_root(o), f"step_{step:06d}", dist.get_rank()
    folder = root / tag
    if rank == 0:
        for stale in dict.fromkeys(root / SUBDIR[name] / tag for name in runners):
            if stale.exists():
                shutil.rmtree(stale)
    with collective("barrier before writing a checkpoint", None):
        dist.barrier()
    for name, runner in runners.items():
        runner.save(root / SUBDIR[name] / tag, name)
    # Training draws no random numbers (no dropout; batches have their own generators), but
    # a model that does would need its RNG back to resume exactly.
    folder.mkdir(parents=True, exist_ok=True)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, folder / f"rng_rank{rank}.pt")
    with collective("barrier after writing a checkpoint", None):
        dist.barrier()
    files = checksums(root, tag, runners)
    if rank == 0:
        meta = {"step": step, "history": history, "options": o, "world": dist.get_world_size(),
                "run_id": run_id, "files": files}  # fmt: skip
        write_meta(folder, meta)
        for name in runners:
            _write_atomic(root / SUBDIR[name] / "latest", tag)
        prune_checkpoints(root, o["keep_checkpoints"], run_id)
    with collective("barrier after a checkpoint's meta.json", None):
        dist.barrier()
    return tag


def run_id_of(folder: Path) -> str | None:
    """The run id in ``folder/meta.json`` (None: none, no readable meta.json, or one that
    does not match its own checksum: pruning never deletes what it cannot vouch for)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        if "meta_sha256" in meta and meta["meta_sha256"] != meta_digest(meta):
            return None
        return meta.get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def prune_checkpoints(root: Path, keep: int, run_id: str) -> None:
    """Delete all but the ``keep`` newest checkpoints of the run ``run_id`` (0: keep all),
    every model's folder of each; never another run's, nor the one ``latest`` names."""
    if keep <= 0:
        return
    latest = (root / "latest").read_text().strip() if (root / "latest").exists() else None
    mine = [p for p in root.glob("step_*") if p.is_dir() and step_of(p) is not None]
    mine = sorted((p for p in mine if run_id_of(p) == run_id), key=step_of)
    for old in mine[:-keep]:
        if old.name == latest:
            continue
        for sub in dict.fromkeys(root / s for s in SUBDIR.values()):
            shutil.rmtree(sub / old.name, ignore_errors=True)


def read_meta(root: Path) -> tuple[str, dict]:
    """The tag ``latest`` names and its ``meta.json`` (without its ``meta_sha256``); a
    clear exit (:class:`RunRefused`) where either is missing, unreadable, not as saved
    (its checksum), or inconsistent with its folder (the step)."""
    latest = root / "latest"
    if not latest.exists():
        raise RunRefused(f"--resume: no checkpoint in {root}")
    tag = latest.read_text().strip()
    path = root / tag / "meta.json"
    if not tag or not (root / tag).is_dir():
        raise RunRefused(f"--resume: {latest} names {tag!r}, which is not a folder of {root}")
    try:
        meta = json.loads(path.read_text())
        if not isinstance(meta, dict) or not {"step", "history", "options", "world"} <= set(meta):
            raise ValueError("not a checkpoint's meta.json")
    except (OSError, ValueError) as exc:
        raise RunRefused(f"--resume: {path} is missing or damaged: {exc}") from None
    problems = []
    step, history = meta["step"], meta["history"]
    steps = history.get("step") if isinstance(history, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step != step_of(root / tag):
        problems.append(f"says step {step!r}, but its folder is {tag}")
    if not isinstance(steps, list) or not steps or steps[-1] != step:
        last = steps[-1] if isinstance(steps, list) and steps else None
        problems.append(f"its history ends at step {last!r}, not at step {step!r}")
    if "meta_sha256" not in meta:
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning(f"--resume: {path} records no checksum of its own (written by an "
                        "older launcher): its content is not verified")  # fmt: skip
    elif meta["meta_sha256"] != meta_digest(meta):
        problems.append("its content does not match the SHA-256 recorded in it (edited or "
                        "damaged since it was saved)")  # fmt: skip
    if problems:
        raise RunRefused(
            f"--resume: {path} {problems[0]}"
            + "".join(f"; {p}" for p in problems[1:])
            + ": not resuming from a checkpoint whose record is not the one its save wrote "
            "(restore the file, or start anew with --overwrite)"
        )
    return tag, {k: v for k, v in meta.items() if k != "meta_sha256"}


def verify_files(root: Path, meta: dict) -> None:
    """Compare every file of the checkpoint with the SHA-256 in ``meta.json`` (collective:
    each rank checks its share; every rank exits, naming the files, on any mismatch)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    files = meta.get("files")
    errors = []
    if files is not None and not isinstance(files, dict):
        raise RunRefused(f"--resume: {root} meta.json: damaged list of files")
    if files is None:
        if rank == 0:
            log.warning("--resume: this checkpoint records no checksums (written by an older "
                        "launcher): its files are not verified")  # fmt: skip
    else:
        for f in sorted(files)[rank::world]:
            path = root / f
            if not path.is_file():
                errors.append(f"{path}: missing")
                continue
            digest = sha256_of(path)
            if digest != files[f]:
                errors.append(f"{path}: corrupted (SHA-256 {digest[:16]}..., recorded at save "
                              f"{files[f][:16]}...)")  # fmt: skip
    gathered = [None] * world
    with collective("all-gather of the checkpoint verification", None):
        dist.all_gather_object(gathered, errors)
    errors = [e for part in gathered for e in part]
    if errors:
        raise RunRefused(
            "--resume: the checkpoint's files do not match the checksums in its meta.json "
            "(damaged or modified since they were saved):\n  " + "\n  ".join(errors)
        )


def open_checkpoint(o: dict) -> tuple[str, dict]:
    """The latest checkpoint's tag and ``meta.json``, once it is known to be resumable
    (collective): options and world as the checkpoint's, its step not beyond ``steps``,
    every file as saved. Called before the data and the models are made, so that a
    checkpoint that cannot be resumed stops the run at once. Each rank reads the files;
    what any rank finds wrong stops every rank alike (:func:`agree`)."""
    root = checkpoint_root(o)
    try:
        tag, meta = read_meta(root)
        _check_resumable(o, meta)
        problem = None
    except RunRefused as exc:
        problem = str(exc)
    agree(problem, "the checkpoint's meta.json")
    verify_files(root, meta)
    return tag, meta


def _check_resumable(o: dict, meta: dict) -> None:
    """Refuse a checkpoint whose options or world would not continue the run it saved."""
    saved = meta["options"]
    if not isinstance(saved, dict):
        raise RunRefused(f"--resume: the checkpoint's options are damaged: {saved!r:.80}")
    different = {k: (saved.get(k), o[k]) for k in RESUME_MUST_MATCH if saved.get(k) != o[k]}
    if different:
        raise RunRefused(f"--resume: options differ from the checkpoint's: {different}")
    if meta["world"] != dist.get_world_size():
        raise RunRefused(f"--resume: checkpoint has {meta['world']} ranks, this run has "
                         f"{dist.get_world_size()}")  # fmt: skip
    if meta["step"] > o["steps"]:
        raise RunRefused(f"--resume: the checkpoint is at step {meta['step']}, beyond --steps "
                         f"{o['steps']}")  # fmt: skip


def load_checkpoint(o: dict, runners: dict, tag: str, meta: dict) -> tuple[int, dict, str]:
    """Restore checkpoint ``tag`` (from :func:`open_checkpoint`) into the runners and the
    RNG (collective); returns ``(step, history, run_id)``: the run id of the checkpoint,
    whose run this one continues."""
    root = checkpoint_root(o)
    for name, runner in runners.items():
        runner.load(root / SUBDIR[name] / tag, name)
    rng = torch.load(root / tag / f"rng_rank{dist.get_rank()}.pt", weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    saved = meta["options"]
    for key in RESUME_NOTE_CHANGES:
        if key in saved and saved[key] != o[key]:
            what = " (the LR schedule changes)" if key == "steps" else ""
            log.info(f"resume: {key} {saved[key]} -> {o[key]}{what}")
    return meta["step"], meta["history"], meta.get("run_id") or new_run_id()
