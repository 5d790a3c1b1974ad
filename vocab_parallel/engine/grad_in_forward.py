"""``mode="grad_in_forward"``: the gradients computed in the forward pass, three GEMMs.

When the loss is a scalar (``reduction="sum"`` or ``"mean"``) and a backward will follow,
the gradient of each token is known in the forward up to the one upstream scalar ``g``
(``docs/design.md``, "Modes"): ``d loss / d loss_i`` is ``g`` (sum) or ``g / count`` (mean,
``count`` the non-ignored tokens, or their targets' class weights summed:
``vocab_parallel.engine.reduction.mean_denominator``), 0 for ignored tokens. So
the forward walks the tokens in chunks of ``R`` rows, and for each chunk (the math of
``vocab_parallel.objectives.cross_entropy``, per token):

    z_c          = cap(x_c @ W.T + b) / T           GEMM 1, fp32 [R, V_local], kept
    stats        local max / sum-exp / predicted / logit-sum of z_c
    M, S, P, A   MAX and SUM all-reduces            (they gate the chunk: blocking)
    loss_c, lse_c
    G_c          computed in place of z_c (the backend's fused epilogue)
    grad_input_c = G_c @ W                          GEMM 2, written into its rows
                   SUM all-reduce started asynchronously (does not gate the next chunk)
    grad_weight += G_c.T @ x_c                      GEMM 3, fp32 accumulator

and waits for the ``grad_input`` all-reduces at the end. Three GEMMs and no recompute
(memory-saving mode does four). Extra memory: the fp32 ``[R, V_local]`` chunk, the
backend's ``G`` buffer where it has its own (Triton: in the input dtype), and for half
inputs fp32 ``grad_weight``/``grad_input`` accumulators until the backward. The backward
multiplies the saved gradients by ``g`` in place (exact for the usual ``g = 1``) and hands
them to autograd. fp16 inputs and class weights form ``G`` with a per-token gradient of
1 and apply the mean's ``1 / count`` to the fp32 results: fp16's narrow range would flush
small terms, and a weighted mean's denominator is known only after the last chunk
(``mode="auto"`` runs memory-saving mode for fp16, where GradScaler's factor reaches ``G``
before its rounding).

The all-reduces of ``grad_input`` are the same collectives whether they overlap the next
chunk or not (:data:`OVERLAP`), over disjoint rows, so the result is bitwise identical
either way; every other sum runs in a fixed order too.

A second backward through the same graph (``retain_graph=True``) cannot reuse gradients
already handed out: it recomputes them like memory-saving mode, from the saved
per-token statistics. Where the mode does not apply (``reduction="none"``, or no
gradient will be taken) ``vocab_parallel.loss`` runs memory-saving mode instead.

Token chunks are sized from quantities every rank of the group shares (tokens, global
vocabulary, world size: an even share of the vocabulary per rank), so every rank issues
the same collectives in the same order; a rank with a much larger shard than the even
share holds a proportionally larger chunk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from vocab_parallel.backends.interface import Outputs
from vocab_parallel.engine import memory_policy as memory
from vocab_parallel.engine import precision
from vocab_parallel.engine.autograd import (
    guarded_backward,
    no_autocast,
    shard_gradients,
    sum_grad_input,
)
from vocab_parallel.engine.objective import Call
from vocab_parallel.engine.reduction import mean_denominator
from vocab_parallel.objectives.cross_entropy import (
    RowStats,
    forward_stats,
    local_targets,
    reduce_statistics,
)
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
    (``vocab_parallel.engine.memory_policy.token_rows``: the same on every rank). Per chunk,
    ``step``
    does the objective's work (:data:`ChunkStep`): its statistics (the blocking MAX and
    SUM all-reduces are its own), its results, its ``G`` and products into this walker's
    accumulators (written by the first chunk: no zero-fill pass). Then the chunk's
    ``grad_input`` rows start their SUM all-reduce asynchronously (:data:`OVERLAP`: it
    overlaps the next chunk's GEMMs); the walker waits for all of them at the end."""
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


class GradInForwardLinearCE(torch.autograd.Function):
    """``(loss, lse, target_weight)``: the sum of the per-token losses, or with
    ``reduction="mean"`` their mean (a 0-d fp32 tensor;
    float64 for float64 inputs), the per-token ``lse`` ``[BT]`` (0 for ignored tokens) and
    each token's target class weight (1 without class weights, 0 where ignored),
    gradients computed on the way. ``lse`` and
    ``target_weight`` are not differentiable. ``needs``: whether ``hidden``, ``weight``,
    ``bias`` need a gradient (the others cost no GEMM and no memory).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, call: Call, needs):
        with no_autocast(hidden.device.type), torch.no_grad():
            return GradInForwardLinearCE._forward(ctx, hidden, weight, bias, target, call, needs)

    @staticmethod
    def _forward(ctx, hidden, weight, bias, target, call: Call, needs):
        local_target, ignored = local_targets(target, call.layout, call.opts.ignore_index)
        bt = hidden.shape[0]
        accum = precision.accumulate_dtype(hidden.dtype)
        # d loss / d loss_i: 1 (sum) or 1 / count (mean), 0 where ignored. Class weights
        # (whose mean's denominator is only known after the chunks) and fp16 (whose narrow
        # range would flush small probabilities / count) form G with 1 and apply the mean's
        # 1 / denominator to the fp32 results.
        token_grad = (~ignored).to(accum)
        mean = call.opts.reduction == "mean"
        post_scale = mean and (call.class_weight is not None or hidden.dtype == torch.float16)
        if mean and not post_scale:
            token_grad = token_grad / mean_denominator(token_grad)

        fields = ("loss", "lse", "logits_max", "sum_exp")
        if call.class_weight is not None:
            fields += ("target_weight",)
        per_token = {k: torch.empty(bt, dtype=accum, device=hidden.device) for k in fields}
        weight_sum = []

        def step(r0, r1, blocks, buffers):
            x_c, t_c = hidden[r0:r1], local_target[r0:r1]
            c_call = _chunk_call(call, r0, r1)
            stats = forward_stats(c_call, x_c, weight, bias, t_c, blocks[0])
            token = reduce_statistics(stats, t_c, c_call)
            for k in fields:
                per_token[k][r0:r1] = getattr(token, k)
            if token.weight_sum is not None:
                weight_sum[:] = [token.weight_sum]
            if buffers is not None:
                source = dict(logits=blocks[0], reuse_logits=True)
                grad = token_grad[r0:r1]
                shard_gradients(
                    c_call, grad, x_c, weight, bias, t_c, token, needs, source=source, **buffers
                )

        grads = walk_token_chunks(hidden, weight, call, needs, step)
        if call.class_weight is None:
            per_token["target_weight"] = (~ignored).to(accum)
        weights = per_token["target_weight"].masked_fill_(ignored, 0.0)
        loss = per_token["loss"].masked_fill_(ignored, 0.0).sum()
        if mean:
            denominator = mean_denominator(weights)
            loss = loss / denominator
            if post_scale:
                token_grad = token_grad / denominator
                for g in grads:
                    if g is not None:
                        g.div_(denominator)
        lse = per_token["lse"].masked_fill_(ignored, 0.0)
        ctx.mark_non_differentiable(lse, weights)
        ctx.set_materialize_grads(False)
        # What a second backward (retain_graph=True) needs to recompute the gradients.
        ctx.save_for_backward(
            hidden,
            weight,
            bias,
            local_target,
            token_grad,
            lse,
            per_token["logits_max"],
            per_token["sum_exp"],
            None if call.class_weight is None else weights,
            weight_sum[0] if weight_sum else None,
        )
        ctx.grads = grads  # handed out by the first backward
        ctx.device_type = hidden.device.type
        ctx.dtypes = (hidden.dtype, hidden.dtype if bias is None else bias.dtype)
        ctx.call = call
        return loss, lse, weights

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, grad_weights):
        grads = hand_out(ctx, grad_loss, GradInForwardLinearCE._recompute)
        return (*grads, None, None, None)

    @staticmethod
    def _recompute(ctx, grad_loss, need):
        """The gradients again, memory-saving style (a second backward of the graph)."""
        hidden, weight, bias, local_target, token_grad, *stats = ctx.saved_tensors
        token = RowStats(None, *stats)
        accum = precision.accumulate_dtype(hidden.dtype)
        grad = token_grad * grad_loss.to(accum)
        grads = shard_gradients(ctx.call, grad, hidden, weight, bias, local_target, token, need)
        grad_input = sum_grad_input(grads.input, ctx.call.process_group, hidden.dtype)
        return grad_input, grads.weight, grads.bias


def _chunk_call(call: Call, r0: int, r1: int) -> Call:
    """``call`` for the token rows ``[r0, r1)`` (their per-row inverse temperatures)."""
    if call.inv_temperature is None:
        return call
    return dataclasses.replace(call, inv_temperature=call.inv_temperature[r0:r1])
