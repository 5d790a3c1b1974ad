"""Starting torch.distributed for the launch jobs, from torchrun's environment.

These are process-wide decisions that belong to an application, not to the library:
defaults for the launcher's variables (so that ``python launch/verify.py`` is a world of
one), the backend and device of the rank, a timeout on every collective, and the number
of CPU threads each rank may use (``torch.set_num_threads`` affects the whole process).
Both ``train.py`` and ``verify.py`` start this way.

The DeepSpeed engine also needs DeepSpeed's own communication layer on top of the same
process group; :func:`init_distributed` sets it up when the options ask for DeepSpeed.

Every group the launcher creates (:func:`init_groups`: the TP and DP groups) takes the
same timeout as the default group, and every collective the launcher itself calls runs
inside :func:`collective`, so that a rank that died or stopped makes the others fail
within ``timeout_s`` with a :class:`CollectiveError` that names the collective and the
group (its ranks), rather than hang or print a bare transport error.

A run refused before it trains (a run directory in use, a checkpoint that cannot be
resumed, a missing package) raises :class:`RunRefused` on every rank alike: either the
reason depends only on what every rank shares (the options, the world size, what rank 0
broadcast), or the ranks' own findings went through :func:`agree` first. So the reason
is printed once (by rank 0) and no rank is left waiting in a collective that the others
will never reach.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from vocab_parallel.parallel import collectives as distributed
from vocab_parallel.parallel.groups import ParallelGroups, init_parallel_groups

# The collective timeout of this process (seconds), for the messages of CollectiveError.
_timeout_s: float | None = None


# The library's: a failed collective of the loss and one of the launcher end the same way.
CollectiveError = distributed.CollectiveError


class RunRefused(SystemExit):
    """The run stops before training, for a reason every rank raises alike (see the module
    docstring): ``str()`` is the reason. A ``SystemExit`` (exit status 1, the reason on
    stderr) wherever it is not caught; ``train.py`` prints it once, on rank 0."""

    def __str__(self) -> str:
        return str(self.code)


def agree(problem: str | None, what: str, *, rank0_only: bool = False) -> None:
    """Every rank's finding about ``what`` (``None``: fine), gathered (collective): where
    any rank found a problem, :class:`RunRefused` on every rank, with each distinct reason
    once (and the ranks that found it, where not all did). ``rank0_only``: rank 0 checked
    for every rank (the others pass ``None``), and its reason is everyone's."""
    world = dist.get_world_size()
    found: list[str | None] = [None] * world
    if rank0_only:
        head = [problem]
        with collective(f"broadcast of rank 0's check of {what}", None):
            dist.broadcast_object_list(head, src=0)
        found = head * world
    else:
        with collective(f"all-gather of the ranks' checks of {what}", None):
            dist.all_gather_object(found, problem)
    reasons: dict[str, list[int]] = {}
    for rank, reason in enumerate(found):
        if reason is not None:
            reasons.setdefault(reason, []).append(rank)
    if not reasons:
        return
    if len(reasons) == 1 and len(next(iter(reasons.values()))) == world:
        raise RunRefused(next(iter(reasons)))
    raise RunRefused("\n".join(
        reason if len(ranks) == world else f"rank{'s' * (len(ranks) > 1)} "
        f"{', '.join(map(str, ranks))}: {reason}" for reason, ranks in reasons.items()
    ))  # fmt: skip


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` (``None``: the default group)."""
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


@contextlib.contextmanager
def collective(what: str, group: dist.ProcessGroup | None = None,
               group_name: str = "the default group") -> Iterator[None]:  # fmt: skip
    """Run the launcher's collective ``what`` over ``group`` (called ``group_name``); a
    failure of the transport (a timeout, a peer gone) becomes a :class:`CollectiveError`
    that says which collective over which ranks of which group failed, and why."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:  # DistBackendError, gloo/NCCL timeouts, a closed connection
        try:
            ranks = group_ranks(group)
        except Exception:  # the group itself is broken: say so rather than mask the cause
            ranks = "?"
        limit = f"timeout_s {_timeout_s:g}; " if _timeout_s is not None else ""
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CollectiveError(
            f"{what} over ranks {ranks} of {group_name} failed ({limit}a rank may have died, "
            f"stopped or be stuck): {cause}"
        ) from exc


def init_from_env(timeout_s: float, default_port: int = 29511) -> tuple[str, torch.device]:
    """Start the default process group from torchrun's environment (collective).

    NCCL on the local GPU when every local rank has a GPU of its own, gloo on CPUs
    otherwise (with the CPU threads split between the local ranks, which would otherwise
    oversubscribe the cores): two ranks on a one-GPU machine run on CPUs rather than ask
    for a ``cuda:1`` that does not exist. Without torchrun's variables it is a world of
    one process. ``timeout_s`` bounds every collective, so a rank never waits forever
    for a failed one.
    Returns ``(backend, device)``.
    """
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(default_port))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    global _timeout_s
    _timeout_s = timeout_s
    dist.init_process_group(
        backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if backend == "nccl" else None,
    )
    return backend, device


def init_distributed(o: dict) -> tuple[str, torch.device]:
    """Process group from torchrun's environment: NCCL with GPUs, gloo otherwise."""
    backend, device = init_from_env(o["timeout_s"], default_port=29512)
    if o["engine"] == "deepspeed":
        # DeepSpeed adopts the process group above (and its timeout) rather than making one.
        deepspeed_integration().init_distributed(backend, timeout=o["timeout_s"])
    return backend, device


def init_groups(o: dict) -> ParallelGroups:
    """The TP and DP groups of the launcher's options (collective), with ``timeout_s``
    (not torch's 30 minutes for new groups) on every one of them."""
    world = dist.get_world_size()
    if world % o["tp"]:
        raise RunRefused(
            f"tp {o['tp']} does not divide the world size {world}: start a multiple of "
            f"{o['tp']} ranks (torchrun --nproc-per-node) or change --tp"
        )
    return init_parallel_groups(o["tp"], timeout=datetime.timedelta(seconds=o["timeout_s"]))


def deepspeed_integration():
    """``vocab_parallel.integrations.deepspeed``, or a clear exit where it cannot load."""
    try:
        from vocab_parallel.integrations import deepspeed as integration
    except ImportError as exc:
        raise RunRefused(f"--engine deepspeed needs DeepSpeed and our integration: {exc}") from exc
    return integration
