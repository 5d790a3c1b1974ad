"""One run at a time in a run directory: the lock file ``run_dir/train.lock``.

Two runs started on one run directory would write into each other's files: the second
truncates the first's ``train.log``, and its ``--overwrite`` or the save of a step the
first also saves deletes the first's checkpoints. So rank 0 of a run holds an exclusive
``flock`` on ``train.lock`` for the run's lifetime (``train.py`` tells the other ranks
whether it got it, so that every rank of a refused run stops alike), and a run that
cannot take it stops with an error naming the directory and the holder.

The file records its holder (pid, host, start time) for that message. The kernel
releases a ``flock`` when its holder's process ends, however it ends: a lock whose holder
was killed is free, and the next run takes it over (saying whose it was) without anyone
deleting a stale file by hand; a run that ends normally removes the file. (``flock`` is
advisory and, on network file systems, only as good as the file system's support for it.)
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from launch.dist_env import RunRefused

LOCK_NAME = "train.lock"


@dataclass
class RunLock:
    """A held lock: ``stale`` describes the earlier holder whose process ended without
    releasing it (``None``: the lock was free)."""

    path: Path
    fd: int
    stale: str | None

    def release(self) -> None:
        """Remove the file (while still holding it, and only if it is still ours), then
        let go of the lock."""
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        os.close(self.fd)
        self.fd = -1


def _holder(fd: int) -> str | None:
    """Who the lock file says holds it ("pid P on host H, since T"), or None if it says
    nothing readable."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode())
        return f"pid {info['pid']} on host {info['host']}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return None


def acquire(run_dir: str | os.PathLike) -> RunLock:
    """Take ``run_dir``'s lock (creating the directory), or :class:`RunRefused` naming
    the run that holds it."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK_NAME
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunRefused(f"run_dir {run_dir}: cannot create it: {exc.strerror or exc}") from None
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise RunRefused(f"run_dir {run_dir}: cannot open its lock file {path}: "
                             f"{exc.strerror or exc}") from None  # fmt: skip
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd) or "its pid and host not yet written"
            os.close(fd)
            raise RunRefused(
                f"run_dir {run_dir} is in use by another run ({holder}; lock file {path}): "
                "wait for that run to end, stop it, or choose another --run-dir"
            ) from None
        except OSError as exc:
            os.close(fd)
            reason = exc.strerror or exc
            raise RunRefused(f"run_dir {run_dir}: cannot lock {path} ({reason}; a file system "
                             "without flock?): choose another --run-dir") from None  # fmt: skip
        # The holder may have removed the file between our open and our flock (its normal
        # release): then we hold a lock on a file no other run can see; open it again.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        stale = _holder(fd)
        since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since})
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode() + b"\n", 0)
        return RunLock(path, fd, stale)
