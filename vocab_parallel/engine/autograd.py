"""The autograd Function of the loss in memory-saving and high-performance modes.

Forward: this rank's statistics (the backend), their all-reduces and the per-token losses
(``vocab_parallel.objectives.cross_entropy``, where the math is); backward: the fused operator
of the backend
with this call's :class:`~vocab_parallel.backends.interface.GradTerms`, then one fp32 SUM
all-reduce of ``grad_input`` (``docs/design.md``, "Modes"). ``grad_weight`` and
``grad_bias = G.sum(0)`` stay local. Only the gradients autograd asks for are computed (a
frozen weight costs no ``[V, H]`` GEMM; a hidden that needs no gradient costs no GEMM and
no all-reduce), and without a possible backward (``torch.no_grad()``, nothing requiring
grad) high-performance mode keeps no ``[BT, V]`` tensor. High-performance mode keeps the
fp32 softmax, or with softcap the fp32 capped logits ``z`` (the cap's derivative needs
them; the softmax follows from ``z`` and the statistics).

Autocast is switched off inside (the inputs arrive already cast by the loss, as
``F.linear`` would cast them): every product follows ``vocab_parallel.engine.precision``.
Float64 inputs are computed in float64 throughout (loss, statistics and ``G``).

Inputs arrive validated (``vocab_parallel.loss``); this layer knows nothing of tiling:
the backends do (``vocab_parallel.backends.registry``).
"""

from __future__ import annotations

import contextlib

import torch

from vocab_parallel.backends.interface import Grads, Outputs
from vocab_parallel.backends.registry import get_backend
from vocab_parallel.engine import precision
from vocab_parallel.engine.filtering import GradientFilter
from vocab_parallel.engine.objective import Call
from vocab_parallel.objectives.cross_entropy import (
    RowStats,
    forward_stats,
    gradient_terms,
    local_targets,
    reduce_statistics,
)
from vocab_parallel.parallel.collectives import all_reduce, world_size

DOUBLE_BACKWARD_ERROR = (
    "vocab_parallel_linear_cross_entropy: double backward is not supported (its backward "
    "is a fused kernel that is not itself differentiable): the gradients it produced "
    "cannot be differentiated again (create_graph=True, then a gradient of them)"
)


def _refuse_double_backward(grads: tuple, anchors: tuple) -> tuple:
    """``grads`` as tensors whose own backward raises :data:`DOUBLE_BACKWARD_ERROR`.

    Called when the backward runs with ``create_graph=True``: the first backward works,
    differentiating its results raises (like ``once_differentiable``, with our message).
    The error node also hangs off ``anchors`` (the inputs that require grad), so that a
    gradient with respect to them reaches it and raises, instead of autograd finding
    them unused.
    """
    present = [i for i, g in enumerate(grads) if g is not None]
    if not present:
        return grads
    delayed = getattr(torch._C._functions, "DelayedError", None)
    if delayed is None:  # no way to defer the error: refuse create_graph right away
        raise RuntimeError(DOUBLE_BACKWARD_ERROR)
    inputs = [grads[i].detach() for i in present]
    anchors = [t for t in anchors if t is not None and t.requires_grad]
    if not anchors:
        inputs = [t.requires_grad_(True) for t in inputs]
    err = delayed(DOUBLE_BACKWARD_ERROR.encode(), len(inputs) + len(anchors))
    outs = err(*inputs, *anchors)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = list(grads)
    for i, out in zip(present, outs[: len(present)], strict=True):
        grads[i] = out
    return tuple(grads)


def guarded_backward(ctx, grad_loss, compute) -> tuple:
    """``(grad_hidden, grad_weight, grad_bias)`` of a loss Function whose first three inputs
    are hidden, weight, bias: ``compute(need)`` (``need``: which of them want a gradient)
    under no_grad and without autocast (on ``ctx.device_type``), nothing when no gradient
    is wanted, and with ``create_graph=True`` results whose own backward refuses."""
    need = ctx.needs_input_grad[:3]
    grads = (None, None, None)
    if grad_loss is not None and any(need):
        with torch.no_grad(), no_autocast(ctx.device_type):
            grads = compute(need)
        if torch.is_grad_enabled():  # create_graph=True
            grads = _refuse_double_backward(grads, ctx.saved_tensors[:3])
    return grads


def no_autocast(device_type: str):
    """A context with autocast off for ``device_type`` (a no-op where it is off already)."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except (RuntimeError, ValueError, TypeError):  # a device type without autocast
        enabled = False
    return torch.autocast(device_type, enabled=False) if enabled else contextlib.nullcontext()


def sum_grad_input(
    grad_input: torch.Tensor | None, process_group, dtype: torch.dtype
) -> torch.Tensor | None:
    """This rank's partial ``grad_input`` summed over the group (fp32, in place), in
    ``dtype``; None stays None."""
    if grad_input is None:
        return None
    return all_reduce(grad_input, "SUM", process_group, "grad_input").to(dtype)


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
