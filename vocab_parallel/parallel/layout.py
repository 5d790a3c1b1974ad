"""Where each rank's vocabulary rows sit, and the check that the ranks agree about it.

The head's ``[Vg, H]`` weight is cut into contiguous row ranges, one per rank of the
tensor-parallel group. :func:`shard_bounds` is the default cut (the only shard formula of
the project): uneven shards in rank order, the first ``Vg % world`` ranks one row larger.

A wrong layout does not crash: overlapping shards count some logits twice, a gap leaves
target ids that no rank owns, a wrong ``global_vocab_size`` skews label smoothing, and
ranks passing different numbers of tokens enter collectives of different sizes. So
:func:`resolve_layout` exchanges one small row per rank (start, size, global size, tokens)
and every rank checks the same table: a bad layout raises the same ``ValueError`` on every
rank of the group, never on one rank while the others wait in a collective. A layout that
passed is remembered, so an LM head that states its layout pays the exchange once per
group, layout and token count. Without tensor parallelism (no group, or a group of one) the
one shard must hold the whole vocabulary, checked without a collective.

``check_inputs=False`` trusts a stated layout (``vocab_start_index`` and
``global_vocab_size`` both given), on one rank as on several: no exchange, no check of
coverage (e.g. one shard of a larger vocabulary, computed alone on purpose).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from vocab_parallel.parallel.collectives import all_reduce, group_ranks, world_size


def shard_bounds(vocab: int, world: int) -> list[tuple[int, int]]:
    """Uneven contiguous shards in rank order: the first ``vocab % world`` get one more row.

    ``shard_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]``.
    """
    for name, value, least in (("vocab", vocab, 0), ("world", world, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")
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

    def columns(self, ids: torch.Tensor) -> torch.Tensor:
        """Global token ids as this shard's columns (int64; -1 where on another shard)."""
        local = ids - self.start
        return torch.where((local >= 0) & (local < self.size), local, -1)


# Layouts already exchanged and checked: (group id, start, size, global size, tokens).
_CHECKED: set[tuple] = set()


def resolve_layout(
    v_local: int,
    process_group: dist.ProcessGroup | None,
    vocab_start_index: int | None,
    global_vocab_size: int | None,
    tokens: int,
    device: torch.device,
    *,
    recheck: bool = False,
    trust: bool = False,
) -> ShardLayout:
    """This rank's :class:`ShardLayout`, checked against the other ranks of the group.

    Without ``vocab_start_index`` the shards are contiguous in rank order (sizes may be
    uneven). Without ``global_vocab_size`` it is the sum of the shard sizes. Both are
    then found by one small collective at every call; when both are given (an LM head
    knows them) the collective runs once per layout and token count, or at every call
    with ``recheck`` (cheap on CPU, where every collective waits anyway).

    ``trust``: a stated layout (both given) is taken as it is, without any collective
    (``check_inputs=False``: what ``torch.compile(fullgraph=True)`` under tensor
    parallelism needs, since the exchange reads its result on the host).

    Raises ``ValueError`` on every rank alike when shards overlap, leave a gap, do not add
    up to ``global_vocab_size``, or ranks pass different numbers of tokens. Without a
    group (or in a group of one) the one shard must hold the whole vocabulary
    (:func:`_one_shard`): ``vocab_start_index`` 0 and ``global_vocab_size`` its rows.
    """
    n = world_size(process_group)
    if n == 1:
        return _one_shard(v_local, vocab_start_index, global_vocab_size, trust)

    known = vocab_start_index is not None and global_vocab_size is not None
    key = (id(process_group), vocab_start_index, v_local, global_vocab_size, tokens)
    if known and ((not recheck and key in _CHECKED) or trust):
        return ShardLayout(vocab_start_index, v_local, global_vocab_size)

    # One row per rank: (start given, start, size, global size given, global size, tokens).
    rank = dist.get_rank(process_group)
    table = torch.zeros((n, 6), dtype=torch.int64, device=device)
    table[rank] = torch.tensor(
        [
            vocab_start_index is not None,
            vocab_start_index or 0,
            v_local,
            global_vocab_size is not None,
            global_vocab_size or 0,
            tokens,
        ],
        dtype=torch.int64,
    )
    rows = all_reduce(table, "SUM", process_group, "shard layout").tolist()
    layout = _check_table(rows, rank, group_ranks(process_group))
    if known:
        _CHECKED.add(key)
    return layout


def _one_shard(
    v_local: int, start: int | None, global_size: int | None, trust: bool
) -> ShardLayout:
    """The layout without tensor parallelism (no group, or a group of one): the weight is
    the whole vocabulary, rows ``[0, global_vocab_size)`` in one shard. A layout that
    leaves rows to no rank raises, as it does over several ranks (:func:`_check_table`):
    their logits would be missing from every softmax, silently. ``trust``
    (``check_inputs=False``) takes a stated layout (both given) as it is, as over several
    ranks: e.g. one shard of a larger vocabulary computed alone, on purpose."""
    stated = start is not None and global_size is not None
    start = 0 if start is None else start
    end = start + v_local
    if global_size is not None and end > global_size:
        raise ValueError(
            f"global_vocab_size: {global_size} is smaller than vocab_start_index "
            f"{start} + {v_local} local rows"
        )
    if trust and stated:
        return ShardLayout(start, v_local, global_size)
    global_size = end if global_size is None else global_size
    alone = (
        f"the weight's {v_local} rows are [{start}, {end}) of {global_size}; without a "
        "process_group of several ranks the weight is the whole vocabulary "
        "(check_inputs=False takes a stated layout as it is)"
    )
    if start > 0:
        raise ValueError(
            f"vocab_start_index: {start}, but rows [0, {start}) belong to no rank; {alone}"
        )
    if end < global_size:
        raise ValueError(
            f"global_vocab_size: {global_size}, but rows [{end}, {global_size}) belong to no "
            f"rank; {alone}"
        )
    if v_local == 0:
        raise ValueError(
            "weight: has 0 rows; without tensor parallelism the weight is the whole "
            "vocabulary and needs at least one row"
        )
    return ShardLayout(0, v_local, v_local)


def _check_table(rows: list[list[int]], rank: int, ranks: list[int]) -> ShardLayout:
    """The layout of ``rank`` from every rank's row; the same verdict on every rank."""
    names = [f"rank {r}" for r in ranks]
    tokens = [row[5] for row in rows]
    if len(set(tokens)) > 1:
        per_rank = ", ".join(f"{name}: {t}" for name, t in zip(names, tokens, strict=True))
        raise ValueError(
            f"hidden: the ranks of process_group pass different numbers of tokens ({per_rank}); "
            "every rank of the tensor-parallel group must pass the same tokens"
        )
    sizes = [row[2] for row in rows]
    total = sum(sizes)
    stated = {row[4] for row in rows if row[3]}
    if len(stated) > 1:
        raise ValueError(
            f"global_vocab_size: the ranks of process_group state different values {sorted(stated)}"
        )
    global_size = stated.pop() if stated else total
    starts, prefix = [], 0
    for row in rows:
        starts.append(row[1] if row[0] else prefix)
        prefix += row[2]
    if global_size != total:
        raise ValueError(
            f"global_vocab_size: {global_size}, but the shards of process_group hold {total} "
            f"rows in all ({_describe(names, starts, sizes)})"
        )
    end = 0
    for start, size, name in sorted(zip(starts, sizes, names, strict=True)):
        if size == 0:
            continue
        if start < end:
            raise ValueError(
                f"vocab_start_index: shards overlap at row {start} ({name}); "
                f"{_describe(names, starts, sizes)}"
            )
        if start > end:
            raise ValueError(
                f"vocab_start_index: rows [{end}, {start}) belong to no rank; "
                f"{_describe(names, starts, sizes)}"
            )
        end = start + size
    if global_size == 0:
        raise ValueError("weight: every rank of process_group has 0 rows; the vocabulary is empty")
    return ShardLayout(starts[rank], sizes[rank], global_size)


def _describe(names: list[str], starts: list[int], sizes: list[int]) -> str:
    shards = zip(names, starts, sizes, strict=True)
    return "shards " + ", ".join(f"{n}: [{s}, {s + z})" for n, s, z in shards)
