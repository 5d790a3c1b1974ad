"""The autograd Function of the loss: per-token losses forward, fused gradients backward.

Per rank, per token i (SPEC.md section 2), with this rank's rows ``[start, start + V)``:

    raw logits    r_ij = x_i @ W_j + b_j                    (b: the optional bias rows)
    logits        z_ij = c * tanh(r_ij / c)  with softcap c, else z_ij = r_ij
    local stats   m_i = max_j z_ij,  s_i = sum_j exp(z_ij - m_i),  p_i = z_i[t_i] (if here),
                  a_i = sum_j z_ij
    M_i           = allreduce_MAX(m_i)
    S_i, P_i, A_i = allreduce_SUM(s_i * exp(m_i - M_i), p_i, a_i)      (one collective)
    lse_i         = log(S_i) + M_i
    loss_i        = lse_i - (1 - eps) * P_i - eps * A_i / Vg + w * lse_i^2
                                                 (0 for ignored tokens; w: z_loss)

which is ``F.cross_entropy(z, t, label_smoothing=eps, reduction="none") + w * lse^2``
with ``z`` the softcapped ``F.linear(x, W_full, b_full)``. ``return_lse`` also hands out
``lse`` (0 for ignored tokens; no gradient flows through it). The backward is the
operator of ``fused_linear_cross_entropy_loss_grad`` (the backend called directly with
the forward's int64 local targets and statistics): per token,

    G_ij = (softmax(z_i)_j * (1 + 2 w lse_i) - q_ij) * grad_i * (1 - tanh(r_ij / c)^2)

(``q``: the target distribution, the last factor only with softcap), then a SUM
all-reduce of ``grad_input = G @ W`` in fp32; ``grad_weight = G.T @ x`` and
``grad_bias = G.sum(0)`` stay local. Only the gradients autograd asks for are computed
(a frozen weight costs no ``[V, H]`` GEMM; a hidden that needs no gradient costs no GEMM
and no all-reduce), and without a possible backward (``torch.no_grad()``, nothing
requiring grad) high-performance mode keeps no ``[BT, V]`` tensor. High-performance
mode keeps the fp32 softmax, or with softcap the fp32 capped logits ``z`` (the cap's
derivative needs them; the softmax follows from ``z`` and the statistics).

Autocast is switched off inside (the inputs arrive already cast by the loss, as
``F.linear`` would cast them): every product follows ``vocab_parallel.precision``.
Float64 inputs are computed in float64 throughout (loss, statistics and ``G``).

Inputs arrive validated (``vocab_parallel.loss``); this layer knows nothing of tiling:
the backends do (``vocab_parallel.torch_backend`` and ``vocab_parallel.kernels``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from vocab_parallel import precision
from vocab_parallel.distributed import all_reduce, world_size
from vocab_parallel.ops import backend_backward, backend_forward_stats

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


@dataclass(frozen=True)
class LossOptions:
    """The options of the loss's math, validated: what the Function needs besides tensors."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    mode: str = "memory_saving"
    softcap: float | None = None
    z_loss: float = 0.0


def no_autocast(device_type: str):
    """A context with autocast off for ``device_type`` (a no-op where it is off already)."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except (RuntimeError, ValueError, TypeError):  # a device type without autocast
        enabled = False
    return torch.autocast(device_type, enabled=False) if enabled else contextlib.nullcontext()


def local_targets(
    target: torch.Tensor, layout, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local_target, ignored)``: each token's column in this rank's shard (int64, -1
    where its target is elsewhere or ignored) and whether it is ignored."""
    ignored = target == ignore_index
    local = target - layout.start
    here = (local >= 0) & (local < layout.size) & ~ignored
    return torch.where(here, local, -1), ignored


def stats_options(bias: torch.Tensor | None, opts: LossOptions) -> dict:
    """The keyword arguments of a backend's ``forward_stats`` for these options."""
    extra = {"with_logit_sum": opts.label_smoothing > 0}
    if bias is not None:
        extra["bias"] = bias
    if opts.softcap is not None:
        extra["softcap"] = opts.softcap
    return extra


def reduce_statistics(
    m: torch.Tensor,
    s: torch.Tensor,
    p: torch.Tensor,
    a: torch.Tensor,
    process_group,
    opts: LossOptions,
    global_size: int,
) -> tuple[torch.Tensor, ...]:
    """Per-token ``(loss, lse, logits_max, sum_exp)`` from this rank's statistics
    ``(max, sum_exp, predicted, logit_sum)``: the MAX and SUM all-reduces and the formula
    of the module docstring (ignored tokens not yet masked)."""
    eps = opts.label_smoothing
    logits_max = all_reduce(m.clone(), "MAX", process_group, "logits_max")
    sums = torch.stack([s * torch.exp(m - logits_max), p, a])
    all_reduce(sums, "SUM", process_group, "sum_exp_logits and predicted logits")
    sum_exp, predicted, logit_sum = sums
    lse = torch.log(sum_exp) + logits_max
    loss = lse - (1.0 - eps) * predicted
    if eps:
        loss = loss - eps * logit_sum / global_size
    if opts.z_loss:
        loss = loss + opts.z_loss * lse.square()
    return loss, lse, logits_max, sum_exp


def z_loss_scale(lse: torch.Tensor, z_loss: float) -> torch.Tensor | None:
    """The softmax's factor in ``G`` under z-loss, ``1 + 2 w lse`` per token (None
    without z-loss)."""
    return 1.0 + (2.0 * z_loss) * lse if z_loss else None


def sum_grad_input(
    grad_input: torch.Tensor | None, process_group, dtype: torch.dtype
) -> torch.Tensor | None:
    """This rank's partial ``grad_input`` summed over the group (fp32, in place), in
    ``dtype``; None stays None."""
    if grad_input is None:
        return None
    return all_reduce(grad_input, "SUM", process_group, "grad_input").to(dtype)


def fused_gradients(
    backend: str,
    grad: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    local_target: torch.Tensor,
    opts: LossOptions,
    global_size: int,
    *,
    softmax: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    logits_max: torch.Tensor | None = None,
    sum_exp: torch.Tensor | None = None,
    prob_scale: torch.Tensor | None = None,
    need_input: bool = True,
    need_weight: bool = True,
    need_bias: bool = False,
    grad_input_dtype: torch.dtype | None = None,
    **buffers,
) -> tuple[torch.Tensor | None, ...]:
    """The backend's fused backward (the operator) with the options of ``opts``: returns
    ``(grad_input, grad_weight, grad_bias)`` of this rank, before any all-reduce.
    ``buffers``: the accumulate-into arguments of the backends (``mode="grad_in_forward"``)."""
    # The options' arguments only when set: the plain call is the one of the operator.
    extra = {"bias": bias} if bias is not None else {}
    extra |= {"softcap": opts.softcap} if opts.softcap is not None else {}
    extra |= {"logits": logits} if logits is not None else {}
    extra |= {"prob_scale": prob_scale} if prob_scale is not None else {}
    extra |= {"need_bias_grad": True} if need_bias else {}
    grads = backend_backward(backend)(
        grad,
        hidden,
        weight,
        local_target,
        logits_max,
        sum_exp,
        softmax,
        1.0 - opts.label_smoothing,
        opts.label_smoothing / global_size,
        need_input_grad=need_input,
        need_weight_grad=need_weight,
        grad_input_dtype=grad_input_dtype,
        **extra,
        **buffers,
    )
    grad_input, grad_weight, *rest = grads
    return grad_input, grad_weight, (rest[0] if need_bias else None)


class VocabParallelLinearCE(torch.autograd.Function):
    """Per-token ``(losses, lse)`` ``[BT]`` (fp32; float64 for float64 inputs) of
    ``hidden [BT, H]`` against this rank's shard (and its ``bias`` rows, or None).

    ``track`` says whether a backward can follow (grad mode on and an input requiring
    grad); without one, nothing is saved and high-performance mode keeps no softmax.
    ``lse`` (0 for ignored tokens) is not differentiable.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, process_group, layout, opts, backend, track):
        with no_autocast(hidden.device.type):
            return VocabParallelLinearCE._forward(
                ctx, hidden, weight, bias, target, process_group, layout, opts, backend, track
            )

    @staticmethod
    def _forward(ctx, hidden, weight, bias, target, process_group, layout, opts, backend, track):
        local_target, ignored = local_targets(target, layout, opts.ignore_index)
        bt, v = hidden.shape[0], weight.shape[0]
        accum = precision.accumulate_dtype(hidden.dtype)
        keep_saved = track and opts.mode == "high_performance"
        saved = None  # receives the (capped) logits; normalised in place below w/o softcap
        if keep_saved:
            saved = torch.empty((bt, v), dtype=accum, device=hidden.device)
        stats = backend_forward_stats(backend)(
            hidden, weight, local_target, saved, **stats_options(bias, opts)
        )
        loss, lse, logits_max, sum_exp = reduce_statistics(
            *stats, process_group, opts, layout.global_size
        )
        loss = loss.masked_fill(ignored, 0.0)
        lse_out = lse.masked_fill(ignored, 0.0)
        ctx.mark_non_differentiable(lse_out)
        ctx.set_materialize_grads(False)
        softcap, z_loss = opts.softcap, opts.z_loss

        if track:
            softmax = logits = stats_max = stats_sum = None
            if keep_saved and softcap is None:
                softmax = saved.sub_(logits_max[:, None]).exp_().div_(sum_exp[:, None])
            else:  # recompute (memory-saving), or exp of the saved capped logits
                logits, stats_max, stats_sum = saved, logits_max, sum_exp
            # z-loss: the softmax's factor in G, 1 + 2 w lse (ignored rows get grad 0).
            prob_scale = z_loss_scale(lse, z_loss)
            ctx.save_for_backward(
                hidden,
                weight,
                bias,
                local_target,
                ignored,
                softmax,
                logits,
                stats_max,
                stats_sum,
                prob_scale,
            )
        ctx.process_group, ctx.opts, ctx.backend = process_group, opts, backend
        ctx.global_size, ctx.device_type = layout.global_size, hidden.device.type
        return loss, lse_out

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        grads = guarded_backward(
            ctx, grad_loss, lambda need: VocabParallelLinearCE._gradients(ctx, grad_loss, *need)
        )
        return (*grads, None, None, None, None, None, None)

    @staticmethod
    def _gradients(ctx, grad_loss, need_input: bool, need_weight: bool, need_bias: bool):
        """``(grad_hidden, grad_weight, grad_bias)``; a gradient nobody needs costs no GEMM,
        no memory and (``grad_hidden``) no all-reduce, and is None."""
        hidden, weight, bias, local_target, ignored, *stats = ctx.saved_tensors
        softmax, logits, logits_max, sum_exp, prob_scale = stats
        opts, accum = ctx.opts, precision.accumulate_dtype(hidden.dtype)
        grad = grad_loss.to(accum).masked_fill(ignored, 0.0)
        tp = world_size(ctx.process_group) > 1
        grad_input, grad_weight, grad_bias = fused_gradients(
            ctx.backend,
            grad,
            hidden,
            weight,
            bias,
            local_target,
            opts,
            ctx.global_size,
            softmax=softmax,
            logits=logits,
            logits_max=logits_max,
            sum_exp=sum_exp,
            prob_scale=prob_scale,
            need_input=need_input,
            need_weight=need_weight,
            need_bias=need_bias,
            grad_input_dtype=accum if tp else None,
        )
        return sum_grad_input(grad_input, ctx.process_group, hidden.dtype), grad_weight, grad_bias
