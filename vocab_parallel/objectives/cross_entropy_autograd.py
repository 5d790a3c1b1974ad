"""The cross entropy's autograd Functions, on the engine (``docs/design.md``, "Modes").

:class:`VocabParallelLinearCE` (memory-saving and high-performance modes). Forward: this
rank's statistics (the backend), their all-reduces and the per-token losses
(``vocab_parallel.objectives.cross_entropy``, where the math is); backward: the fused
operator of the backend with this call's
:class:`~vocab_parallel.backends.interface.GradTerms`, then one fp32 SUM all-reduce of
``grad_input``. ``grad_weight`` and ``grad_bias = G.sum(0)`` stay local. Only the
gradients autograd asks for are computed (a frozen weight costs no ``[V, H]`` GEMM; a
hidden that needs no gradient costs no GEMM and no all-reduce), and without a possible
backward (``torch.no_grad()``, nothing requiring grad) high-performance mode keeps no
``[BT, V]`` tensor. High-performance mode keeps the fp32 softmax, or with softcap the fp32
capped logits ``z`` (the cap's derivative needs them; the softmax follows from ``z`` and
the statistics).

:class:`GradInForwardLinearCE` (``mode="grad_in_forward"``): a step on the engine's
token-chunk walker (``vocab_parallel.engine.grad_in_forward``). ``d loss / d loss_i`` is
``g`` (sum) or ``g / count`` (mean, ``count`` the non-ignored tokens, or their targets'
class weights summed: ``vocab_parallel.engine.reduction.mean_denominator``), 0 for ignored
tokens; per chunk of ``R`` token rows:

    z_c          = cap(x_c @ W.T + b) / T           GEMM 1, fp32 [R, V_local], kept
    stats        local max / sum-exp / predicted / logit-sum of z_c
    M, S, P, A   MAX and SUM all-reduces            (they gate the chunk: blocking)
    loss_c, lse_c
    G_c          computed in place of z_c (the backend's fused epilogue)
    grad_input_c = G_c @ W                          GEMM 2, written into its rows
                   SUM all-reduce started asynchronously (does not gate the next chunk)
    grad_weight += G_c.T @ x_c                      GEMM 3, fp32 accumulator

Three GEMMs and no recompute (memory-saving mode does four). Extra memory: the fp32
``[R, V_local]`` chunk, the backend's ``G`` buffer where it has its own (Triton: in the
input dtype), and for half inputs fp32 ``grad_weight``/``grad_input`` accumulators until
the backward. fp16 inputs and class weights form ``G`` with a per-token gradient of 1 and
apply the mean's ``1 / count`` to the fp32 results: fp16's narrow range would flush small
terms, and a weighted mean's denominator is known only after the last chunk
(``mode="auto"`` runs memory-saving mode for fp16, where GradScaler's factor reaches ``G``
before its rounding). A second backward recomputes the gradients memory-saving style.
Where the mode does not apply (``reduction="none"``, or no gradient will be taken)
``vocab_parallel.loss`` runs memory-saving mode instead.
"""

from __future__ import annotations

import dataclasses

import torch

from vocab_parallel.backends.interface import Grads, Outputs
from vocab_parallel.backends.registry import get_backend
from vocab_parallel.engine import precision
from vocab_parallel.engine.autograd import guarded_backward, no_autocast, sum_grad_input
from vocab_parallel.engine.filtering import GradientFilter
from vocab_parallel.engine.grad_in_forward import hand_out, save, walk_token_chunks
from vocab_parallel.engine.objective import Call
from vocab_parallel.engine.reduction import mean_denominator
from vocab_parallel.objectives.cross_entropy import (
    RowStats,
    forward_stats,
    gradient_terms,
    local_targets,
    reduce_statistics,
    with_losses,
)
from vocab_parallel.parallel.collectives import world_size


def shard_gradients(
    call: Call,
    grad: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    local_target: torch.Tensor,
    token: RowStats,
    need: tuple[bool, bool, bool],
    *,
    source: dict | None = None,
    **buffers,
) -> Grads:
    """This rank's gradients of these tokens, before any all-reduce: the backend's fused
    backward with this call's terms. ``need``: of hidden, weight, bias; ``source``: where
    the softmax comes from (``softmax=``, ``logits=``, ``reuse_logits=``); ``buffers``: the
    accumulate-into fields of :class:`~vocab_parallel.backends.interface.Outputs`."""
    tp = world_size(call.process_group) > 1
    accum = precision.accumulate_dtype(hidden.dtype)
    buffers.setdefault("grad_input_dtype", accum if tp else None)
    opts = call.opts
    flt = GradientFilter.of(opts.filter_eps, opts.filter_grads, hidden.dtype, grad)
    out = Outputs(need_input=need[0], need_weight=need[1], need_bias=need[2], filter=flt, **buffers)
    terms = gradient_terms(call, grad, token, **(source or {}))
    backend = get_backend(call.backend)
    return backend.fused_backward(hidden, weight, local_target, call.logits(bias), terms, out)


class VocabParallelLinearCE(torch.autograd.Function):
    """``(losses, lse, target_weight)``, each ``[BT]`` (fp32; float64 for float64 inputs),
    of ``hidden [BT, H]`` against this rank's shard (and its ``bias`` rows, or None).

    ``target_weight``: each token's class weight of its target (1 without class weights,
    0 where ignored): what a mean divides by. ``lse`` (0 where ignored) and
    ``target_weight`` are not differentiable. Whether a backward can follow is
    ``call.track``; without one nothing is saved and high-performance mode keeps no softmax.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, call: Call):
        with no_autocast(hidden.device.type):
            return VocabParallelLinearCE._forward(ctx, hidden, weight, bias, target, call)

    @staticmethod
    def _forward(ctx, hidden, weight, bias, target, call: Call):
        local_target, ignored = local_targets(target, call.layout, call.opts.ignore_index)
        bt, v = hidden.shape[0], weight.shape[0]
        accum = precision.accumulate_dtype(hidden.dtype)
        keep_saved = call.track and call.mode == "high_performance"
        saved = None  # receives the (capped) logits; normalised in place below w/o softcap
        if keep_saved:
            saved = torch.empty((bt, v), dtype=accum, device=hidden.device)
        stats = forward_stats(call, hidden, weight, bias, local_target, saved)
        token = reduce_statistics(stats, local_target, call)
        loss = token.loss.masked_fill(ignored, 0.0)
        lse_out = token.lse.masked_fill(ignored, 0.0)
        weights = (~ignored).to(accum) if token.target_weight is None else token.target_weight
        weights = weights.masked_fill(ignored, 0.0)
        ctx.mark_non_differentiable(lse_out, weights)
        ctx.set_materialize_grads(False)
        if call.track:
            softmax = logits = None
            if keep_saved and call.opts.softcap is None:
                softmax = saved.sub_(token.logits_max[:, None]).exp_()
                softmax.div_(token.sum_exp[:, None])
            else:  # recompute (memory-saving), or exp of the saved capped logits
                logits = saved
            ctx.save_for_backward(
                hidden,
                weight,
                bias,
                local_target,
                ignored,
                softmax,
                logits,
                token.lse,
                token.logits_max,
                token.sum_exp,
                token.target_weight,
                token.weight_sum,
            )
        ctx.call, ctx.device_type = call, hidden.device.type
        return loss, lse_out, weights

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, grad_weights):
        grads = guarded_backward(
            ctx, grad_loss, lambda need: VocabParallelLinearCE._gradients(ctx, grad_loss, need)
        )
        return (*grads, None, None)

    @staticmethod
    def _gradients(ctx, grad_loss, need):
        """``(grad_hidden, grad_weight, grad_bias)``; a gradient nobody needs costs no GEMM,
        no memory and (``grad_hidden``) no all-reduce, and is None."""
        hidden, weight, bias, local_target, ignored, softmax, logits, *stats = ctx.saved_tensors
        token = RowStats(None, *stats)
        accum = precision.accumulate_dtype(hidden.dtype)
        grad = grad_loss.to(accum).masked_fill(ignored, 0.0)
        source = {"softmax": softmax, "logits": logits}
        grads = shard_gradients(
            ctx.call, grad, hidden, weight, bias, local_target, token, need, source=source
        )
        grad_input = sum_grad_input(grads.input, ctx.call.process_group, hidden.dtype)
        return grad_input, grads.weight, grads.bias


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
        counted = (~ignored).to(accum)  # 1 where a token counts, 0 where ignored
        token_grad = counted
        mean = call.opts.reduction == "mean"
        post_scale = mean and (call.class_weight is not None or hidden.dtype == torch.float16)
        denominator = None
        if mean and not post_scale:  # (without class weights: the weights' own, below)
            denominator = mean_denominator(counted)
            token_grad = token_grad / denominator

        # Each chunk's reduced sums, joined after the walk, where the loss formula runs
        # once for every token: per chunk a GEMM and three kernels. Where G reads lse
        # (z-loss, class weights) each chunk runs the formula and keeps loss and lse.
        lse_in_g = bool(call.opts.z_loss) or call.class_weight is not None
        fields = ("logits_max", "sum_exp")
        if lse_in_g:
            fields += ("loss", "lse")
        else:
            fields += ("predicted", "logit_sum") if call.opts.label_smoothing else ("predicted",)
        if call.class_weight is not None:
            fields += ("target_weight",)
        parts = {k: [] for k in fields}
        weight_sum = []

        def step(r0, r1, blocks, buffers):
            x_c, t_c = hidden[r0:r1], local_target[r0:r1]
            c_call = _chunk_call(call, r0, r1)
            stats = forward_stats(c_call, x_c, weight, bias, t_c, blocks[0])
            token = reduce_statistics(stats, t_c, c_call, losses=lse_in_g)
            for k in fields:
                parts[k].append(getattr(token, k))
            if token.weight_sum is not None:
                weight_sum[:] = [token.weight_sum]
            if buffers is not None:
                source = dict(logits=blocks[0], reuse_logits=True)
                grad = token_grad[r0:r1]
                shard_gradients(
                    c_call, grad, x_c, weight, bias, t_c, token, needs, source=source, **buffers
                )

        opts = call.opts  # a kept G's products filter over every token (the rows' grads)
        flt = GradientFilter.of(opts.filter_eps, opts.filter_grads, hidden.dtype, token_grad)
        grads = walk_token_chunks(hidden, weight, call, needs, step, g_filter=flt)
        per_token = {
            k: torch.cat(p) if p else torch.empty(bt, dtype=accum, device=hidden.device)
            for k, p in parts.items()
        }
        if not lse_in_g:  # the loss formula, once for every token
            token = RowStats(
                None, None, per_token["logits_max"], per_token["sum_exp"],
                per_token.get("target_weight"), weight_sum[0] if weight_sum else None,
                predicted=per_token["predicted"], logit_sum=per_token.get("logit_sum"),
            )  # fmt: skip
            token = with_losses(token, call)
            per_token["loss"], per_token["lse"] = token.loss, token.lse
        if call.class_weight is None:  # (its own tensor: returned, token_grad saved)
            weights = counted.clone() if token_grad is counted else counted
        else:
            weights = per_token["target_weight"].masked_fill_(ignored, 0.0)
        loss = per_token["loss"].masked_fill_(ignored, 0.0).sum()
        if mean:
            if denominator is None:
                denominator = mean_denominator(weights)
            loss = loss / denominator
            if post_scale:
                token_grad = token_grad / denominator
                grads.divide_(denominator)
        lse = per_token["lse"].masked_fill_(ignored, 0.0)
        ctx.mark_non_differentiable(lse, weights)
        ctx.set_materialize_grads(False)
        # What a second backward (retain_graph=True) needs to recompute the gradients.
        save(
            ctx,
            grads,  # handed out by the first backward
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
        hidden, weight, bias, local_target, token_grad, *stats = ctx.saved_tensors[:-1]
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
