"""The few collectives the loss needs.

``process_group=None`` (or a group of one rank) means no tensor parallelism: every helper
here then returns without touching torch.distributed, so the loss also works in a
process that never initialised it. All payloads are fp32 or float64 (gloo has no bf16 collectives).

A collective that fails (most often: a peer rank died or stopped and the group's timeout
ran out) raises a :class:`CollectiveError` (a ``RuntimeError``) that says which
collective of the loss it was and over which ranks, instead of the backend's bare
"Timed out waiting for recv".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed: a rank died, stopped or left the group, or the timeout ran out."""


def world_size(process_group: dist.ProcessGroup | None) -> int:
    """Ranks in ``process_group``; 1 for ``None``."""
    return 1 if process_group is None else dist.get_world_size(process_group)


def group_ranks(process_group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``process_group`` (``[0]`` without one)."""
    if process_group is None or not dist.is_initialized():
        return [0]
    return dist.get_process_group_ranks(process_group)


def _failed(op: str, what: str, process_group, exc: Exception) -> CollectiveError:
    kind = "all-gather" if op == "GATHER" else f"{op} all-reduce"
    return CollectiveError(
        f"vocab_parallel: {kind} of {what} over ranks "
        f"{group_ranks(process_group)} of process_group failed (a rank died, stopped "
        f"or left the group, or the group's timeout ran out): {exc}"
    )


def all_reduce(
    tensor: torch.Tensor,
    op: str,
    process_group: dist.ProcessGroup | None,
    what: str = "tensor",
) -> torch.Tensor:
    """In-place ``SUM`` or ``MAX`` all-reduce of ``tensor`` over ``process_group`` (no-op
    alone); ``what`` names the payload in the error a failed collective raises."""
    if world_size(process_group) > 1:
        try:
            dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op), group=process_group)
        except RuntimeError as exc:  # DistBackendError and timeouts derive from it
            raise _failed(op, what, process_group, exc) from exc
    return tensor


def all_gather(
    tensor: torch.Tensor, process_group: dist.ProcessGroup | None, what: str = "tensor"
) -> torch.Tensor:
    """``[ranks, *tensor.shape]``: every rank's ``tensor`` (equal shapes), in group rank
    order; ``tensor[None]`` alone. Errors raise :class:`CollectiveError`."""
    n = world_size(process_group)
    if n == 1:
        return tensor[None]
    parts = [torch.empty_like(tensor) for _ in range(n)]
    try:
        dist.all_gather(parts, tensor.contiguous(), group=process_group)
    except RuntimeError as exc:
        raise _failed("GATHER", what, process_group, exc) from exc
    return torch.stack(parts)


def all_reduce_async(
    tensor: torch.Tensor,
    op: str,
    process_group: dist.ProcessGroup | None,
    what: str = "tensor",
) -> Callable[[], torch.Tensor]:
    """Start the in-place all-reduce of :func:`all_reduce` and return ``wait()``, which
    blocks until it is done (on CUDA: makes the current stream wait) and returns
    ``tensor``. The reduction is the same collective as the blocking one, so its result is
    the same bit for bit; only the caller's work can run meanwhile. Errors raise
    :class:`CollectiveError`, from the start or from ``wait()``."""
    if world_size(process_group) == 1:
        return lambda: tensor
    try:
        work = dist.all_reduce(
            tensor, op=getattr(dist.ReduceOp, op), group=process_group, async_op=True
        )
    except RuntimeError as exc:
        raise _failed(op, what, process_group, exc) from exc

    def wait() -> torch.Tensor:
        try:
            work.wait()
        except RuntimeError as exc:
            raise _failed(op, what, process_group, exc) from exc
        return tensor

    return wait
