"""``mode="grad_in_forward"``: the gradients computed in the forward pass, three GEMMs.

When the loss is a scalar (``reduction="sum"`` or ``"mean"``) and a backward will follow,
the gradient of each token is known in the forward up to the one upstream scalar ``g``:
``d loss / d loss_i`` is ``g`` (sum) or ``g / count`` (mean, ``count`` the non-ignored
tokens), 0 for ignored tokens. So the forward walks the tokens in chunks of ``R`` rows,
and for each chunk (the math of ``vocab_parallel.autograd``, per token):

    z_c          = cap(x_c @ W.T + b)              GEMM 1, fp32 [R, V_local], kept
    stats        local max / sum-exp / predicted / logit-sum of z_c
    M, S, P, A   MAX and SUM all-reduces            (they gate the chunk: blocking)
    loss_c, lse_c
    G_c          = (softmax(z_c) * (1 + 2 w lse_c) - q) * (1 or 1/count) * cap'
                   computed in place of z_c (the backend's fused epilogue)
    grad_input_c = G_c @ W                          GEMM 2, written into its rows
                   SUM all-reduce started asynchronously (does not gate the next chunk)
    grad_weight += G_c.T @ x_c                      GEMM 3, fp32 accumulator

and waits for the ``grad_input`` all-reduces at the end. Three GEMMs and no recompute
(memory-saving mode does four). Extra memory: the ``[R, V_local]`` fp32 chunk (G
overwrites it), the backend's ``G`` buffer where it has its
own (Triton: in the input dtype; torch with half operands: a half copy per vocabulary
chunk), and for half inputs fp32 ``grad_weight``/``grad_input`` accumulators until the
backward. The backward multiplies the saved gradients by ``g`` in place (exact for the
usual ``g = 1``) and hands them to autograd. fp16 inputs form ``G`` with a per-token
gradient of 1 and apply a mean's ``1/count`` to the fp32 results, so that fp16's narrow
range does not flush small terms (``mode="auto"`` runs memory-saving mode for fp16, where
GradScaler's factor reaches ``G`` before its rounding).

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

import torch

from vocab_parallel import precision
from vocab_parallel.autograd import (
    fused_gradients,
    guarded_backward,
    local_targets,
    no_autocast,
    reduce_statistics,
    stats_options,
    sum_grad_input,
    z_loss_scale,
)
from vocab_parallel.distributed import all_reduce, all_reduce_async, world_size
from vocab_parallel.ops import backend_forward_stats

# Bytes of the fp32 [R, V_local] logits chunk, per device type: 128 MiB keeps CPU GEMMs
# near their best rate (256 rows at V_local = 131072: 14% faster than 128 rows) with less
# extra memory than DeepSpeed's chunked loss; GPUs need taller chunks for the
# grad_weight GEMM (K = R) to run at tensor-core speed.
CHUNK_BYTES = {"cpu": 128 * 1024 * 1024}
DEFAULT_CHUNK_BYTES = 512 * 1024 * 1024
# At most this many rows per chunk: on CPUs GEMMs of 512 rows already run near their best
# rate, and taller chunks only cost memory (the chunk is sized for V_local, which shrinks
# with more ranks).
MAX_ROWS = {"cpu": 512}

# Overlap each chunk's grad_input all-reduce with the next chunk (same result either way).
OVERLAP = True


def chunk_rows(
    tokens: int, global_size: int, world: int, device_type: str, chunk_bytes: int | None = None
) -> int:
    """Token rows per chunk: an fp32 ``[rows, ceil(global_size / world)]`` chunk (an even
    share of the vocabulary) fits
    ``chunk_bytes`` (the device's default), at most the device's :data:`MAX_ROWS`; at
    least one row, at most ``tokens``, a multiple of 64 when above 64. The same on every
    rank of the group."""
    budget = chunk_bytes or CHUNK_BYTES.get(device_type, DEFAULT_CHUNK_BYTES)
    per_row = 4 * max(1, -(-global_size // max(1, world)))
    rows = max(1, min(budget // per_row, MAX_ROWS.get(device_type, tokens)))
    if rows > 64:
        rows = rows // 64 * 64
    return max(1, min(tokens, rows))


class GradInForwardLinearCE(torch.autograd.Function):
    """``(loss, lse)``: the ``reduction`` (``"sum"`` or ``"mean"``) of the per-token
    losses (a 0-d fp32 tensor; float64 for float64 inputs) and the per-token ``lse``
    ``[BT]`` (0 for ignored tokens, not differentiable), gradients computed on the way.

    ``needs``: whether ``hidden``, ``weight``, ``bias`` need a gradient (the others cost
    no GEMM and no memory).
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, target, process_group, layout, opts, backend, reduction, needs
    ):
        with no_autocast(hidden.device.type), torch.no_grad():
            return GradInForwardLinearCE._forward(
                ctx, hidden, weight, bias, target, process_group, layout, opts, backend,
                reduction, needs,
            )  # fmt: skip

    @staticmethod
    def _forward(
        ctx, hidden, weight, bias, target, process_group, layout, opts, backend, reduction, needs
    ):
        need_input, need_weight, need_bias = needs  # need_bias: False without a bias
        local_target, ignored = local_targets(target, layout, opts.ignore_index)
        bt, h = hidden.shape
        v = weight.shape[0]
        accum = precision.accumulate_dtype(hidden.dtype)
        device = hidden.device
        world = world_size(process_group)
        tp = world > 1

        # d loss / d loss_i for an upstream gradient of 1: 0 for ignored tokens.
        count = (~ignored).sum()
        per_token = torch.ones((), dtype=accum, device=device)
        if reduction == "mean":
            per_token = per_token / count.clamp(min=1).to(accum)
        token_grad = per_token.expand(bt).masked_fill(ignored, 0.0)
        # fp16 G is rounded with a per-token gradient of 1, not 1/count: fp16's narrow
        # range would flush small probabilities / count to zero (GradScaler's factor only
        # arrives in the backward). The 1/count goes into the fp32 results instead.
        post_scale = None
        chunk_grad = token_grad
        if hidden.dtype == torch.float16 and reduction == "mean":
            post_scale, chunk_grad = per_token, (~ignored).to(accum)

        f = dict(dtype=accum, device=device)
        grad_input = torch.empty((bt, h), **f) if need_input else None
        # Written by the first chunk (no zero-fill pass); zeros when there are no tokens.
        fill = torch.zeros if bt == 0 else torch.empty
        grad_weight = fill((v, h), **f) if need_weight else None
        grad_bias = fill(v, **f) if need_bias else None
        losses, lse = torch.empty(bt, **f), torch.empty(bt, **f)
        logits_max, sum_exp = torch.empty(bt, **f), torch.empty(bt, **f)

        rows = chunk_rows(bt, layout.global_size, world, device.type)
        # The logits chunk is fp32 (the GEMM's exact output; float64 for float64 inputs).
        chunk = torch.empty((min(rows, bt), v), dtype=accum, device=device)
        forward_stats = backend_forward_stats(backend)
        waits = []  # the grad_input all-reduces in flight
        for r0 in range(0, bt, rows):
            r1 = min(bt, r0 + rows)
            x_c, t_c, z_c = hidden[r0:r1], local_target[r0:r1], chunk[: r1 - r0]
            stats = forward_stats(x_c, weight, t_c, z_c, **stats_options(bias, opts))
            loss_c, lse_c, max_c, sum_c = reduce_statistics(
                *stats, process_group, opts, layout.global_size
            )
            losses[r0:r1], lse[r0:r1] = loss_c, lse_c
            logits_max[r0:r1], sum_exp[r0:r1] = max_c, sum_c
            if not (need_input or need_weight or need_bias):
                continue
            fused_gradients(
                backend,
                chunk_grad[r0:r1],
                x_c,
                weight,
                bias,
                t_c,
                opts,
                layout.global_size,
                logits=z_c,
                logits_max=max_c,
                sum_exp=sum_c,
                prob_scale=z_loss_scale(lse_c, opts.z_loss),
                need_input=need_input,
                need_weight=need_weight,
                need_bias=need_bias,
                grad_input_dtype=accum,
                reuse_logits=True,
                grad_input_out=None if grad_input is None else grad_input[r0:r1],
                grad_weight_acc=grad_weight,
                grad_bias_acc=grad_bias,
                accumulate=r0 > 0,  # the first chunk writes the (empty) accumulators
            )
            if tp and need_input:
                rows_gi = grad_input[r0:r1]
                if OVERLAP:
                    waits.append(all_reduce_async(rows_gi, "SUM", process_group, "grad_input"))
                else:
                    all_reduce(rows_gi, "SUM", process_group, "grad_input")
        del chunk
        for wait in waits:
            wait()

        losses.masked_fill_(ignored, 0.0)
        lse.masked_fill_(ignored, 0.0)
        loss = losses.sum()
        if reduction == "mean":
            loss = loss / count.clamp(min=1)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        # What a second backward (retain_graph=True) needs to recompute the gradients.
        prob_scale = z_loss_scale(lse, opts.z_loss)
        ctx.save_for_backward(
            hidden, weight, bias, local_target, token_grad, logits_max, sum_exp, prob_scale
        )
        ctx.grads = [grad_input, grad_weight, grad_bias]  # handed out by the first backward
        ctx.post_scale = post_scale
        ctx.device_type = device.type
        ctx.dtypes = (hidden.dtype, hidden.dtype if bias is None else bias.dtype)
        ctx.process_group, ctx.opts, ctx.backend = process_group, opts, backend
        ctx.global_size = layout.global_size
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        def compute(need):
            if ctx.grads is None:  # handed out already: a second backward of the graph
                return GradInForwardLinearCE._recompute(ctx, grad_loss, need)
            grads, ctx.grads = ctx.grads, None  # ours alone now: scaled in place
            scale = grad_loss if ctx.post_scale is None else grad_loss * ctx.post_scale
            return _scaled(grads, scale, *ctx.dtypes, need)

        grads = guarded_backward(ctx, grad_loss, compute)
        return (*grads, None, None, None, None, None, None, None)

    @staticmethod
    def _recompute(ctx, grad_loss, need):
        """The gradients again, memory-saving style (a second backward of the graph)."""
        hidden, weight, bias, local_target, token_grad, logits_max, sum_exp, prob_scale = (
            ctx.saved_tensors
        )
        accum = precision.accumulate_dtype(hidden.dtype)
        tp = world_size(ctx.process_group) > 1
        grad_input, grad_weight, grad_bias = fused_gradients(
            ctx.backend,
            token_grad * grad_loss.to(accum),
            hidden,
            weight,
            bias,
            local_target,
            ctx.opts,
            ctx.global_size,
            logits_max=logits_max,
            sum_exp=sum_exp,
            prob_scale=prob_scale,
            need_input=need[0],
            need_weight=need[1],
            need_bias=need[2],
            grad_input_dtype=accum if tp else None,
        )
        grad_input = sum_grad_input(grad_input, ctx.process_group, hidden.dtype)
        return grad_input, grad_weight, grad_bias


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
