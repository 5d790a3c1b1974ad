"""Checks of the loss's inputs beyond dtypes and shapes: target ids and group membership.

A target id outside the vocabulary (a tokenizer whose vocabulary is larger than the
head's, a ``uint8`` 255 pad) does not crash the fused loss: no shard owns it, so its
loss is the log-sum-exp alone and its gradient pushes every logit down. ``F.cross_entropy``
raises for it, and so do we. The targets are identical on every rank of the group, so
every rank raises alike, without communicating.

On CPU the check is exact and names the first bad id. On CUDA reading a value back would
stall the stream at every call, so a device-side assertion stands in (it stops the
process with the message below); ``check_inputs=False`` on the loss skips both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Device types whose value checks run on the device (``torch._assert_async``: no host
# sync, the error surfaces at the next sync); elsewhere a check reads its result on the
# host and raises a ValueError that says where. (The launch counter,
# ``benchmarks/launches.py``, adds "meta" to model a GPU.)
ASYNC_CHECKS = {"cuda"}


def check_targets(target: torch.Tensor, ignore_index: int, global_size: int) -> None:
    """Raise ``ValueError`` naming ``target`` unless every id is ``ignore_index`` or in
    ``[0, global_size)`` (without a group of several ranks the one shard holds all of them:
    ``vocab_parallel.parallel.layout`` refuses any other layout)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= global_size))
    message = (
        f"target: ids must be in [0, {global_size}) (the global vocabulary) or "
        f"ignore_index={ignore_index}"
    )
    if target.device.type in ASYNC_CHECKS:
        torch._assert_async(~bad.any(), message)
        return
    if bad.any():
        first = int(target[bad][0])
        where = int(bad.nonzero()[0, 0])
        raise ValueError(f"{message}; got {first} at position {where} (of the flattened target)")


def check_member(process_group: dist.ProcessGroup | None) -> None:
    """Raise ``ValueError`` naming ``process_group`` when this process is not one of its ranks."""
    if process_group is None:
        return
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"process_group: this process (global rank {dist.get_rank()}) is not a member of "
            "process_group; pass the tensor-parallel group this rank belongs to"
        )
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            "process_group: expected a torch.distributed.ProcessGroup or None, got "
            f"{type(process_group).__name__}"
        )
    if not dist.is_initialized():
        raise ValueError("process_group: given, but torch.distributed is not initialised")
    if dist.get_rank(process_group) < 0:
        raise ValueError(
            f"process_group: this process (global rank {dist.get_rank()}) is not a member of "
            "process_group; pass the tensor-parallel group this rank belongs to"
        )
