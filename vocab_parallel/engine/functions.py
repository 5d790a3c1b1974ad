"""The autograd Functions of every :class:`~vocab_parallel.engine.epilogue.Epilogue`
objective, written once (``docs/design.md``, "The engine"): the objective brings its math
(:meth:`~vocab_parallel.engine.objective.Objective.epilogue`, asked for in the forward),
these bring the modes.

    memory_saving      forward: the statistics over recomputed chunks (nothing
                       ``[tokens, V_local]``); backward: the chunks again, ``G`` and the
                       products                                      (:class:`ChunkedLoss`)
    high_performance   the same, every head's fp32 logits kept from the forward
                                                                     (:class:`ChunkedLoss`)
    grad_in_forward    the engine's token-chunk walker: each chunk's heads' logits made
                       once into the walker's blocks, its statistics, losses and ``G``'s
                       products in the forward; the backward scales the saved gradients
                       (:class:`GradInForwardLoss`)

Only ``hidden``, ``weight`` and ``bias`` (the student's) get gradients.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from vocab_parallel.backends.interface import Outputs
from vocab_parallel.engine import precision
from vocab_parallel.engine.autograd import guarded_backward, no_autocast, sum_grad_input
from vocab_parallel.engine.chunking import gradient_products
from vocab_parallel.engine.epilogue import Epilogue, HeadChunks, cat_terms, statistics
from vocab_parallel.engine.grad_in_forward import hand_out, outputs, save, walk_token_chunks
from vocab_parallel.engine.objective import Call, Objective
from vocab_parallel.engine.reduction import mean_denominator
from vocab_parallel.parallel.collectives import world_size


def _chunks(call: Call, ep: Epilogue, hidden, weight, bias, kept=None) -> HeadChunks:
    accum = precision.accumulate_dtype(hidden.dtype)
    heads = ep.operands(hidden, weight, bias)
    untempered = replace(call.logits(None), inv_temperature=None)
    return HeadChunks(call.backend, heads, untempered, accum, kept)


def _products(ep: Epilogue, terms, chunks: HeadChunks, hidden, weight, bias, grad, out):
    """The student's gradients of these tokens: the epilogue's ``G`` (through the cap),
    chunk by chunk (the walker's widths), through the engine's two products (and the
    bias' sum)."""

    def make_g(v0, v1, x_op, w_op):
        logits = chunks.chunk(v0, v1)
        if out.g_out is None:
            g = ep.gradient(terms, v0, v1, logits, grad)
        else:  # the epilogue may write G into the kept G's columns
            g = ep.gradient_into(terms, v0, v1, logits, grad, out.g_out[:, v0:v1])
        return chunks.logits.through_cap(g, logits[0])

    bias_dtype = hidden.dtype if bias is None else bias.dtype
    with precision.cpu_bf16_math(hidden.dtype, hidden.device.type):
        return gradient_products(
            hidden, weight, ep.gradient_width(chunks), make_g, out,
            g_reads_operands=False, bias_grad_dtype=bias_dtype,
        )  # fmt: skip


def _rows(ignored: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``ignored`` ``[N]`` shaped to mask ``like`` (``[N]`` or ``[N, m]``)."""
    return ignored.reshape(-1, *([1] * (like.dim() - 1)))


def _backward(call: Call, ep: Epilogue, terms, hidden, weight, bias, grad, need, kept=None):
    """The student's gradients of every token (``grad``: per token), ``grad_input``
    summed over the group."""
    chunks = _chunks(call, ep, hidden, weight, bias, kept)
    chunks.filled = kept is not None
    accum = precision.accumulate_dtype(hidden.dtype)
    tp = world_size(call.process_group) > 1
    out = Outputs(need[0], need[1], need[2], grad_input_dtype=accum if tp else None)
    grad = grad.masked_fill(_rows(ep.ignored, grad), 0.0)
    grads = _products(ep, terms, chunks, hidden, weight, bias, grad, out)
    return sum_grad_input(grads.input, call.process_group, hidden.dtype), *grads[1:]


class ChunkedLoss(torch.autograd.Function):
    """``(losses, weights)`` ``[N]`` of memory-saving and high-performance modes: each
    token's loss (0 where ignored) and whether it counts (what a mean divides by; not
    differentiable)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, call: Call, objective: Objective, target):
        with no_autocast(hidden.device.type):
            ep = objective.epilogue(call, target, hidden.dtype)
            keep = call.track and call.mode == "high_performance"
            n, v = hidden.shape[0], weight.shape[0]
            accum = precision.accumulate_dtype(hidden.dtype)
            f = dict(dtype=accum, device=hidden.device)
            kept = [torch.empty((n, v), **f) for _ in range(ep.heads)] if keep else None
            terms = statistics(
                ep, _chunks(call, ep, hidden, weight, bias, kept), call.process_group
            )
            losses = ep.losses(terms)
            losses = losses.masked_fill(_rows(ep.ignored, losses), 0.0)
        weights = (~ep.ignored).to(accum)
        ctx.mark_non_differentiable(weights)
        ctx.set_materialize_grads(False)
        if call.track:
            ctx.save_for_backward(hidden, weight, bias, *(kept or []))
            ctx.terms = terms
        ctx.call, ctx.ep, ctx.device_type = call, ep, hidden.device.type
        return losses, weights

    @staticmethod
    def backward(ctx, grad_loss, grad_weights):
        def compute(need):
            hidden, weight, bias, *kept = ctx.saved_tensors
            grad = grad_loss.to(precision.accumulate_dtype(hidden.dtype))
            args = (ctx.call, ctx.ep, ctx.terms, hidden, weight, bias, grad, need)
            return _backward(*args, kept or None)

        return (*guarded_backward(ctx, grad_loss, compute), None, None, None)


class GradInForwardLoss(torch.autograd.Function):
    """The loss (a 0-d sum or mean), the student's gradients computed on the way by the
    engine's token-chunk walker (``vocab_parallel.engine.grad_in_forward``): each chunk's
    heads' logits made once into its kept blocks, read by the statistics, a second walk
    and ``G``. The backward scales the saved gradients by the upstream scalar."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, call: Call, objective: Objective, target, needs):
        with no_autocast(hidden.device.type):
            ep = objective.epilogue(call, target, hidden.dtype)
            accum = precision.accumulate_dtype(hidden.dtype)
            weights = (~ep.ignored).to(accum)
            token_grad = weights.clone()
            if call.opts.reduction == "mean":
                token_grad = token_grad / mean_denominator(weights)
            losses = torch.zeros(hidden.shape[0], dtype=accum, device=hidden.device)
            parts = []

            def step(r0, r1, blocks, buffers):
                part = ep.rows(r0, r1)
                x = hidden[r0:r1]
                chunks = _chunks(call, part, x, weight, bias, blocks)
                terms = statistics(part, chunks, call.process_group)
                losses[r0:r1] = part.losses(terms).masked_fill(part.ignored, 0.0)
                parts.append(terms)
                if buffers is not None:
                    grad = token_grad[r0:r1]
                    _products(part, terms, chunks, x, weight, bias, grad, outputs(needs, buffers))

            grads = walk_token_chunks(hidden, weight, call, needs, step, ep.heads)
            loss = losses.sum()
            if call.opts.reduction == "mean":
                loss = loss / mean_denominator(weights)
        ctx.set_materialize_grads(False)
        ctx.dtypes = (hidden.dtype, hidden.dtype if bias is None else bias.dtype)
        ctx.device_type = hidden.device.type
        # What a second backward (retain_graph=True) recomputes the gradients from.
        save(ctx, grads, hidden, weight, bias, token_grad)
        ctx.call, ctx.ep = call, ep
        ctx.terms = cat_terms(parts, None) if parts else None
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        def recompute(ctx, grad_loss, need):
            hidden, weight, bias, token_grad = ctx.saved_tensors[:-1]
            grad = token_grad * grad_loss.to(token_grad.dtype)
            return _backward(ctx.call, ctx.ep, ctx.terms, hidden, weight, bias, grad, need)

        return (*hand_out(ctx, grad_loss, recompute), None, None, None, None)
