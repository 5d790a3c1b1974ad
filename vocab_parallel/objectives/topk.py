"""Top-k of the logits without keeping them: per vocabulary chunk, per shard, over ranks.

The token statistics' ``top_k`` (and ``argmax``, the top 1) are found in three steps
(``docs/design.md``, "Token statistics"):

    chunk   the backend writes one ``[BT, CV]`` chunk of logits (its forward statistics
            with ``logits_out``: the same values the statistics see) and the chunk's k
            best join the running k best of the shard, so memory is one chunk, flat in V;
    shard   the chunks' statistics merge as shards do (``LocalStats.rescaled_extras``);
    ranks   each rank brings its k candidates (values and global ids), one all-gather
            of ``[BT, 2k]`` float64, and every rank keeps the same k best.

Order: descending value, ties to the lower global id, on every backend and rank count
(``torch.topk`` promises no order among ties, so ties are settled here explicitly). A
shard of fewer than k columns pads with ``-inf`` and :data:`PAD_ID`, which sort after
every real column.
"""

from __future__ import annotations

import dataclasses

import torch

from vocab_parallel.backends.interface import LocalStats
from vocab_parallel.backends.registry import get_backend
from vocab_parallel.engine import memory_policy as memory
from vocab_parallel.engine import precision
from vocab_parallel.engine.online import merge
from vocab_parallel.parallel.collectives import all_gather

# The id of a padding candidate: above any vocabulary, exact in the float64 exchange.
PAD_ID = 1 << 52


def best_of(values: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best of the candidates ``values`` / ``ids`` (``[BT, n]``, global ids in any
    order): ``(values, ids)`` ``[BT, k]``, descending, ties to the lower id; padded when
    ``n < k``."""
    bt, n = values.shape
    if n < k:
        values = torch.cat([values, values.new_full((bt, k - n), float("-inf"))], dim=1)
        ids = torch.cat([ids, ids.new_full((bt, k - n), PAD_ID)], dim=1)
    order = ids.argsort(dim=1, stable=True)  # by id, then stably by value: ties keep id order
    values, ids = values.gather(1, order), ids.gather(1, order)
    values, pos = values.sort(dim=1, descending=True, stable=True)
    return values[:, :k], ids.gather(1, pos[:, :k])


def chunk_best(z: torch.Tensor, k: int, first_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best columns of a chunk of logits ``z`` ``[BT, n]`` whose column 0 is global
    id ``first_id``: ``(values, ids)`` ``[BT, min(k, n)]``, descending, ties to the lower id.

    One ``topk`` gives the k-th value; every column above it is in, and of the columns
    equal to it the leftmost fill the remaining places (a cumulative count), so the tie
    rule costs a few elementwise passes, not a sort of the chunk. Rows with NaN (no order)
    fall back to a stable sort."""
    bt, n = z.shape
    kk = min(k, n)
    if bt == 0 or kk == 0:
        return z.new_empty((bt, 0)), torch.empty((bt, 0), dtype=torch.int64, device=z.device)
    kth = z.topk(kk, dim=1).values[:, -1:]
    above = z > kth
    tied = z == kth
    need = kk - above.sum(dim=1, keepdim=True)
    take = above | (tied & (tied.cumsum(dim=1) <= need))
    if bool((take.sum(dim=1) != kk).any()):  # NaN: no k-th value to compare with
        values, cols = z.sort(dim=1, descending=True, stable=True)
        return values[:, :kk], cols[:, :kk] + first_id
    cols = take.nonzero()[:, 1].reshape(bt, kk)  # ascending within each row
    values, pos = z.gather(1, cols).sort(dim=1, descending=True, stable=True)
    return values, cols.gather(1, pos) + first_id


def merge_chunks(parts: list[LocalStats]) -> LocalStats:
    """The statistics of consecutive column chunks as those of their union (in order)."""
    if len(parts) == 1:
        return parts[0]
    stacked = torch.stack([p.max for p in parts]), torch.stack([p.sum_exp for p in parts])
    row_max, (total,) = merge(*stacked)  # finite maxima: the running max starts finite
    extras = [p.rescaled_extras(row_max) for p in parts]
    summed = [sum(column) for column in zip(*extras, strict=True)] if extras[0] else []
    return LocalStats(
        row_max,
        total,
        sum(p.predicted for p in parts),
        sum(p.logit_sum for p in parts),
        *summed,
    )


def shard_candidates(
    backend: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    local_target: torch.Tensor,
    logits,
    k: int,
    first_id: int,
    *,
    extra_stats: bool = False,
    logits_out: torch.Tensor | None = None,
) -> tuple[LocalStats, torch.Tensor, torch.Tensor]:
    """This shard's :class:`LocalStats` and its ``k`` best ``(values, global ids)`` in one
    pass over column chunks of the backend (``logits``: the call's
    :class:`~vocab_parallel.backends.interface.Logits`; ``first_id``: the shard's first global id).
    ``logits_out`` (``[BT, V]``): keep every chunk there (high-performance mode) instead of
    one reused chunk buffer."""
    run = get_backend(backend)
    bt, v = hidden.shape[0], weight.shape[0]
    accum = precision.accumulate_dtype(hidden.dtype)
    best = (
        torch.empty((bt, 0), dtype=accum, device=hidden.device),
        torch.empty((bt, 0), dtype=torch.int64, device=hidden.device),
    )
    if v == 0 or bt == 0:
        stats = run.forward_stats(
            hidden, weight, local_target, logits, logits_out=logits_out, extra_stats=extra_stats
        )
        return (stats, *best_of(*best, k))
    cv = memory.columns(bt, v, hidden.device.type, "topk")
    buffer = None
    if logits_out is None:  # one chunk buffer, reused
        buffer = torch.empty((bt, cv), dtype=accum, device=hidden.device)
    parts = []
    for v0 in range(0, v, cv):
        v1 = min(v, v0 + cv)
        out = logits_out[:, v0:v1] if logits_out is not None else buffer[:, : v1 - v0]
        here = (local_target >= v0) & (local_target < v1)
        chunk_target = torch.where(here, local_target - v0, -1)
        bias = None if logits.bias is None else logits.bias[v0:v1]
        chunk_logits = dataclasses.replace(logits, bias=bias)
        parts.append(
            run.forward_stats(
                hidden,
                weight[v0:v1],
                chunk_target,
                chunk_logits,
                logits_out=out,
                extra_stats=extra_stats,
            )
        )
        values, ids = chunk_best(out, k, first_id + v0)
        best = best_of(torch.cat([best[0], values], dim=1), torch.cat([best[1], ids], dim=1), k)
    return (merge_chunks(parts), *best)


def exchange_candidates(
    values: torch.Tensor, ids: torch.Tensor, k: int, process_group
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's ``k`` best from every rank's ``[BT, k]`` candidates: one all-gather of
    ``[BT, 2k]`` float64 (fp32 values and ids below 2^53 are exact there), the same
    result on every rank."""
    packed = torch.cat([values.to(torch.float64), ids.to(torch.float64)], dim=1)
    gathered = all_gather(packed, process_group, "top-k candidates")  # [ranks, BT, 2k]
    bt, n = values.shape[0], gathered.shape[0] * k  # n given: no -1 to infer at BT = 0
    all_values = gathered[:, :, :k].permute(1, 0, 2).reshape(bt, n).to(values.dtype)
    all_ids = gathered[:, :, k:].permute(1, 0, 2).reshape(bt, n).to(torch.int64)
    return best_of(all_values, all_ids, k)
