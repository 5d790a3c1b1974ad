"""The few collectives the loss needs, and the vocabulary shard layout.

``process_group=None`` (or a group of one rank) means no tensor parallelism: every helper
here then returns without touching torch.distributed, so the loss also works in a
process that never initialised it. All payloads are fp32 (gloo has no bf16 collectives).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def world_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group``; 1 for ``None``."""
    return 1 if group is None else dist.get_world_size(group)


def all_reduce(tensor: torch.Tensor, op: str, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place ``SUM`` or ``MAX`` all-reduce of ``tensor`` over ``group`` (no-op alone)."""
    if world_size(group) > 1:
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op), group=group)
    return tensor


def shard_bounds(vocab: int, world: int) -> list[tuple[int, int]]:
    """Uneven contiguous shards in rank order: the first ``vocab % world`` get one more row."""
    base, extra = divmod(vocab, world)
    bounds, start = [], 0
    for r in range(world):
        size = base + (1 if r < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


@dataclass(frozen=True)
class ShardLayout:
    """Where this rank's rows sit in the global vocabulary."""

    start: int  # first global token id of this shard
    size: int  # rows of this shard
    global_size: int  # rows over all shards of the group


def shard_layout(
    v_local: int,
    group: dist.ProcessGroup | None,
    vocab_start_index: int | None,
    device: torch.device,
    global_vocab_size: int | None = None,
) -> ShardLayout:
    """Layout of this rank's shard: contiguous rank-ordered shards unless overridden.

    Shards may be uneven. Given both ``vocab_start_index`` and ``global_vocab_size`` (an
    LM head knows them), the layout is known without communication. Otherwise, with more
    than one rank, one small collective (each rank puts its size into its slot, then a
    SUM; it synchronises with the device) gives all shard sizes: the global vocabulary
    size and the default start (the sum of the sizes of the lower ranks).
    """
    n = world_size(group)
    if global_vocab_size is not None and (vocab_start_index is not None or n == 1):
        start = 0 if vocab_start_index is None else vocab_start_index
        if start + v_local > global_vocab_size:
            raise ValueError(
                f"global_vocab_size: {global_vocab_size} is smaller than vocab_start_index "
                f"{start} + {v_local} local rows"
            )
        return ShardLayout(start, v_local, global_vocab_size)
    if n == 1:
        start = 0 if vocab_start_index is None else vocab_start_index
        return ShardLayout(start, v_local, v_local)
    sizes = torch.zeros(n, dtype=torch.int64, device=device)
    sizes[dist.get_rank(group)] = v_local
    all_reduce(sizes, "SUM", group)
    sizes = sizes.tolist()
    global_size = sum(sizes)
    if vocab_start_index is None:
        vocab_start_index = sum(sizes[: dist.get_rank(group)])
    if vocab_start_index + v_local > global_size:
        raise ValueError(
            f"vocab_start_index: {vocab_start_index} + {v_local} local rows exceeds the "
            f"global vocabulary of {global_size} rows (sum of the shards of the group)"
        )
    return ShardLayout(vocab_start_index, v_local, global_size)
