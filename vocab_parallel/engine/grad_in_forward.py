"""The token-chunk walker of ``mode="grad_in_forward"``, for every objective.

When an objective's loss is a scalar and a backward will follow, the gradient of each
token is known in the forward up to the one upstream scalar ``g`` (``docs/design.md``,
"Modes"), so the forward walks the tokens in chunks and computes the gradients as it goes
(:func:`walk_token_chunks`: the objective's step per chunk, its logits in the walker's
kept fp32 blocks, its ``G`` and the two gradient products into the walker's fp32
accumulators); the backward (:func:`hand_out`) multiplies the saved gradients by ``g`` in
place (exact for the usual ``g = 1``) and hands them to autograd.

The all-reduces of ``grad_input`` are the same collectives whether they overlap the next
chunk or not (:data:`OVERLAP`), over disjoint rows, so the result is bitwise identical
either way; every other sum runs in a fixed order too.

A second backward through the same graph (``retain_graph=True``) cannot reuse gradients
already handed out: the objective recomputes them (``hand_out``'s ``recompute``).

Token chunks are sized from quantities every rank of the group shares (tokens, global
vocabulary, world size: an even share of the vocabulary per rank;
``vocab_parallel.engine.memory_policy.token_rows``), so every rank issues the same
collectives in the same order; a rank with a much larger shard than the even share holds
a proportionally larger chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vocab_parallel.backends.interface import Outputs
from vocab_parallel.engine import memory_policy as memory
from vocab_parallel.engine import precision
from vocab_parallel.engine.autograd import (
    guarded_backward,
)
from vocab_parallel.engine.objective import Call
from vocab_parallel.parallel.collectives import all_reduce, all_reduce_async, world_size

# Overlap each chunk's grad_input all-reduce with the next chunk (same result either way).
OVERLAP = True


# ---------------------------------------------------------------------------------------
# The one token-chunk walker (every objective's grad_in_forward)
# ---------------------------------------------------------------------------------------

# step(r0, r1, blocks, buffers): an objective's work on the token rows [r0, r1): its
# statistics of the chunk (``blocks``: the walker's fp32 [r1 - r0, V_local] logits
# buffers, one per head), its per-token results, and, when ``buffers`` is not None, its
# G and the two gradient products into them (the accumulate-into fields of Outputs).
ChunkStep = Callable[[int, int, list, "dict | None"], None]


def walk_token_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    call: Call,
    needs: tuple[bool, bool, bool],
    step: ChunkStep,
    heads: int = 1,
) -> list[torch.Tensor | None]:
    """The token-chunk walker of ``mode="grad_in_forward"``, written once for every
    objective: ``[grad_input, grad_weight, grad_bias]`` in the statistics' dtype (None
    where not needed), ``grad_input`` summed over the group.

    Token chunks are as tall as the memory policy allows for ``heads`` kept fp32 blocks
    (``vocab_parallel.engine.memory_policy.token_rows``: the same on every rank). Per
    chunk, ``step`` does the objective's work (:data:`ChunkStep`): its statistics (the
    blocking MAX and SUM all-reduces are its own), its results, its ``G`` and products
    into this walker's accumulators (written by the first chunk: no zero-fill pass).
    Then the chunk's ``grad_input`` rows start their SUM all-reduce asynchronously
    (:data:`OVERLAP`: it overlaps the next chunk's GEMMs); the walker waits for all of
    them at the end."""
    bt, h = hidden.shape
    v = weight.shape[0]
    accum = precision.accumulate_dtype(hidden.dtype)
    f = dict(dtype=accum, device=hidden.device)
    group = call.process_group
    world = world_size(group)
    grad_input = torch.empty((bt, h), **f) if needs[0] else None
    fill = torch.zeros if bt == 0 else torch.empty  # zeros when there are no tokens
    grad_weight = fill(weight.shape, **f) if needs[1] else None
    grad_bias = fill(v, **f) if needs[2] else None
    rows = memory.token_rows(bt, call.layout.global_size, world, hidden.device.type, heads)
    blocks = [torch.empty((min(rows, bt), v), **f) for _ in range(heads)]
    waits = []  # the grad_input all-reduces in flight
    for r0 in range(0, bt, rows):
        r1 = min(bt, r0 + rows)
        buffers = None
        if any(needs):
            buffers = dict(
                grad_input_dtype=accum,
                grad_input_out=None if grad_input is None else grad_input[r0:r1],
                grad_weight_acc=grad_weight,
                grad_bias_acc=grad_bias,
                accumulate=r0 > 0,  # the first chunk writes the (empty) accumulators
            )
        step(r0, r1, [b[: r1 - r0] for b in blocks], buffers)
        if buffers is not None and world > 1 and needs[0]:
            rows_gi = grad_input[r0:r1]
            if OVERLAP and not torch.compiler.is_compiling():  # dynamo: no async_op
                waits.append(all_reduce_async(rows_gi, "SUM", group, "grad_input"))
            else:
                all_reduce(rows_gi, "SUM", group, "grad_input")
    del blocks
    for wait in waits:
        wait()
    return [grad_input, grad_weight, grad_bias]


def outputs(needs: tuple[bool, bool, bool], buffers: dict, **extra) -> Outputs:
    """The :class:`~vocab_parallel.backends.interface.Outputs` of a chunk step's products."""
    return Outputs(
        need_input=needs[0], need_weight=needs[1], need_bias=needs[2], **buffers, **extra
    )


def hand_out(ctx, grad_loss, recompute: Callable) -> tuple:
    """The backward of a grad_in_forward Function whose first inputs are hidden, weight,
    bias: the gradients saved in ``ctx.grads`` times the upstream scalar (in place, in
    their fp32 or float64 accumulators), in ``ctx.dtypes`` (hidden's, bias'); a second
    backward of the graph (``retain_graph=True``: they were handed out already) calls
    ``recompute(ctx, grad_loss, need)``."""

    def compute(need):
        if ctx.grads is None:
            return recompute(ctx, grad_loss, need)
        grads, ctx.grads = ctx.grads, None  # ours alone now: scaled in place
        dtype, bias_dtype = ctx.dtypes
        out = []
        for g, dt, wanted in zip(grads, (dtype, dtype, bias_dtype), need, strict=True):
            if g is None or not wanted:
                out.append(None)
                continue
            g.mul_(grad_loss.to(g.dtype))
            out.append(g if g.dtype == dt else g.to(dt))
        return tuple(out)

    return guarded_backward(ctx, grad_loss, compute)
