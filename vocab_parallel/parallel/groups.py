"""Tensor-parallel x data-parallel process groups, and the ``mpu`` object DeepSpeed asks for.

The world of ``tp * dp`` ranks is laid out Megatron-style: tensor-parallel groups are
blocks of consecutive ranks (they talk most, so they share a node), data-parallel groups
take one rank of each block. With world 4 and tp 2:

    TP groups: [0, 1], [2, 3]        DP groups: [0, 2], [1, 3]

The vocabulary of the LM head is sharded over the TP group; everything else is
replicated over it, and gradients are averaged over the DP group.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's groups and coordinates."""

    tp_group: dist.ProcessGroup | None  # None when tp_size == 1: no collectives
    dp_group: dist.ProcessGroup | None  # None when dp_size == 1
    tp_size: int
    dp_size: int
    tp_rank: int
    dp_rank: int
    timeout: datetime.timedelta | None = None  # of every group created for these groups


def world_timeout() -> datetime.timedelta | None:
    """The collective timeout of the default process group (None where it cannot be read)."""
    try:
        return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        try:
            return dist.group.WORLD._get_backend(torch.device("cuda")).options._timeout
        except (AttributeError, RuntimeError):
            return None


def init_parallel_groups(
    tp_size: int, *, timeout: datetime.timedelta | float | None = None
) -> ParallelGroups:
    """Create the TP and DP groups of the initialised default group (collective: all ranks).

    ``timeout`` (a timedelta or seconds) bounds every collective of the new groups;
    default: the default group's timeout (``init_process_group(timeout=...)``), not
    torch's 30 minutes for new groups, so that a stopped rank makes the others fail
    within the time the launcher chose. Without torch.distributed initialised, returns the
    single-process layout.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size: expected an int >= 1, got {tp_size!r}")
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout: expected a timedelta or seconds > 0, got {timeout!r}")
        timeout = datetime.timedelta(seconds=timeout)
    if not (dist.is_available() and dist.is_initialized()):
        if tp_size != 1:
            raise ValueError(f"tp_size: {tp_size} needs torch.distributed to be initialised")
        return ParallelGroups(None, None, 1, 1, 0, 0)
    world, rank = dist.get_world_size(), dist.get_rank()
    if timeout is None:
        timeout = world_timeout()
    if world % tp_size:
        raise ValueError(f"tp_size: {tp_size} does not divide the world size {world}")
    dp_size = world // tp_size
    tp_group = dp_group = None
    # Every rank must create every group, in the same order.
    for block in range(dp_size):
        ranks = list(range(block * tp_size, (block + 1) * tp_size))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            tp_group = group
    for offset in range(tp_size):
        ranks = list(range(offset, world, tp_size))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            dp_group = group
    return ParallelGroups(
        tp_group=tp_group if tp_size > 1 else None,
        dp_group=dp_group if dp_size > 1 else None,
        tp_size=tp_size,
        dp_size=dp_size,
        tp_rank=rank % tp_size,
        dp_rank=rank // tp_size,
        timeout=timeout,
    )


class ModelParallelUnit:
    """The ``mpu`` interface DeepSpeed (and Megatron-style code) queries for groups.

    ``deepspeed.initialize(..., mpu=ModelParallelUnit(groups))`` makes ZeRO partition over
    the DP group only and gradient clipping reduce norms over the TP group.
    """

    def __init__(self, groups: ParallelGroups) -> None:
        self.groups = groups
        # DeepSpeed wants real groups, also of size one.
        self._tp = groups.tp_group or _own_group(groups, "tp")
        self._dp = groups.dp_group or _own_group(groups, "dp")

    # Model (tensor) parallel
    def get_model_parallel_group(self):
        return self._tp

    def get_model_parallel_rank(self) -> int:
        return self.groups.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.groups.tp_size

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    # Data parallel
    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_rank(self) -> int:
        return self.groups.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.groups.dp_size


def _own_group(groups: ParallelGroups, kind: str):
    """The group of size one (or the whole world) standing for an absent TP/DP group."""
    if not dist.is_initialized():
        return None
    world = dist.get_world_size()
    if kind == "tp" and groups.tp_size == world or kind == "dp" and groups.dp_size == world:
        return dist.group.WORLD
    # Groups of one rank each: every rank must take part in creating all of them.
    mine = None
    for r in range(world):
        g = dist.new_group([r], timeout=groups.timeout)
        if r == dist.get_rank():
            mine = g
    return mine
