"""``mode="grad_in_forward"``: the gradients computed in the forward pass, three GEMMs.

When the loss is a scalar (``reduction="sum"`` or ``"mean"``) and a backward will follow,
the gradient of each token is known in the forward up to the one upstream scalar ``g``
(``docs/design.md``, "Modes"): ``d loss / d loss_i`` is ``g`` (sum) or ``g / count`` (mean,
``count`` the non-ignored tokens, or their targets' class weights summed:
``vocab_parallel.reduction.mean_denominator``), 0 for ignored tokens. So
the forward walks the tokens in chunks of ``R`` rows, and for each chunk (the math of
``vocab_parallel.stats``, per token):

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

import torch

from vocab_parallel import memory, precision
from vocab_parallel.autograd import guarded_backward, no_autocast, shard_gradients, sum_grad_input
from vocab_parallel.distributed import all_reduce, all_reduce_async, world_size
from vocab_parallel.reduction import mean_denominator
from vocab_parallel.stats import Call, RowStats, forward_stats, local_targets, reduce_statistics

# Overlap each chunk's grad_input all-reduce with the next chunk (same result either way).
OVERLAP = True


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
        bt, h = hidden.shape
        accum = precision.accumulate_dtype(hidden.dtype)
        device, group = hidden.device, call.process_group
        world = world_size(group)
        # d loss / d loss_i: 1 (sum) or 1 / count (mean), 0 where ignored. Class weights
        # (whose mean's denominator is only known after the chunks) and fp16 (whose narrow
        # range would flush small probabilities / count) form G with 1 and apply the mean's
        # 1 / denominator to the fp32 results.
        token_grad = (~ignored).to(accum)
        mean = call.opts.reduction == "mean"
        post_scale = mean and (call.class_weight is not None or hidden.dtype == torch.float16)
        if mean and not post_scale:
            token_grad = token_grad / mean_denominator(token_grad)

        f = dict(dtype=accum, device=device)
        grad_input = torch.empty((bt, h), **f) if needs[0] else None
        # Written by the first chunk (no zero-fill pass); zeros when there are no tokens.
        fill = torch.zeros if bt == 0 else torch.empty
        grad_weight = fill(weight.shape, **f) if needs[1] else None
        grad_bias = fill(weight.shape[0], **f) if needs[2] else None
        fields = ("loss", "lse", "logits_max", "sum_exp")
        if call.class_weight is not None:
            fields += ("target_weight",)
        per_token = {k: torch.empty(bt, **f) for k in fields}
        weight_sum = None

        rows = memory.token_rows(bt, call.layout.global_size, world, device.type)
        chunk = torch.empty((min(rows, bt), weight.shape[0]), **f)
        waits = []  # the grad_input all-reduces in flight
        for r0 in range(0, bt, rows):
            r1 = min(bt, r0 + rows)
            x_c, t_c, z_c = hidden[r0:r1], local_target[r0:r1], chunk[: r1 - r0]
            c_call = _chunk_call(call, r0, r1)
            stats = forward_stats(c_call, x_c, weight, bias, t_c, z_c)
            token = reduce_statistics(stats, t_c, c_call)
            for k in fields[:4]:
                per_token[k][r0:r1] = getattr(token, k)
            if token.target_weight is not None:
                per_token["target_weight"][r0:r1] = token.target_weight
                weight_sum = token.weight_sum
            if not any(needs):
                continue
            buffers = dict(
                grad_input_dtype=accum,
                grad_input_out=None if grad_input is None else grad_input[r0:r1],
                grad_weight_acc=grad_weight,
                grad_bias_acc=grad_bias,
                accumulate=r0 > 0,  # the first chunk writes the (empty) accumulators
            )
            source = dict(logits=z_c, reuse_logits=True)
            grad = token_grad[r0:r1]
            shard_gradients(
                c_call, grad, x_c, weight, bias, t_c, token, needs, source=source, **buffers
            )
            if world > 1 and needs[0]:
                rows_gi = grad_input[r0:r1]
                if OVERLAP and not torch.compiler.is_compiling():  # dynamo: no async_op
                    waits.append(all_reduce_async(rows_gi, "SUM", group, "grad_input"))
                else:
                    all_reduce(rows_gi, "SUM", group, "grad_input")
        del chunk
        for wait in waits:
            wait()

        if call.class_weight is None:
            per_token["target_weight"] = (~ignored).to(accum)
        weights = per_token["target_weight"].masked_fill_(ignored, 0.0)
        loss = per_token["loss"].masked_fill_(ignored, 0.0).sum()
        if mean:
            denominator = mean_denominator(weights)
            loss = loss / denominator
            if post_scale:
                token_grad = token_grad / denominator
                for g in (grad_input, grad_weight, grad_bias):
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
            weight_sum,
        )
        ctx.grads = [grad_input, grad_weight, grad_bias]  # handed out by the first backward
        ctx.device_type = device.type
        ctx.dtypes = (hidden.dtype, hidden.dtype if bias is None else bias.dtype)
        ctx.call = call
        return loss, lse, weights

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, grad_weights):
        def compute(need):
            if ctx.grads is None:  # handed out already: a second backward of the graph
                return GradInForwardLinearCE._recompute(ctx, grad_loss, need)
            grads, ctx.grads = ctx.grads, None  # ours alone now: scaled in place
            return _scaled(grads, grad_loss, *ctx.dtypes, need)

        grads = guarded_backward(ctx, grad_loss, compute)
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


def _scaled(grads, grad_loss, dtype, bias_dtype, need) -> tuple:
    """The saved gradients times the upstream scalar (in place, in their fp32 or float64
    accumulators), in the inputs' dtype (``bias_dtype`` for the bias); None where no
    gradient is needed."""
    out = []
    for g, dt, wanted in zip(grads, (dtype, dtype, bias_dtype), need, strict=True):
        if g is None or not wanted:
            out.append(None)
            continue
        g.mul_(grad_loss.to(g.dtype))
        out.append(g if g.dtype == dt else g.to(dt))
    return tuple(out)
