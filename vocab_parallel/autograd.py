"""The autograd Function of the loss: per-token losses forward, fused gradients backward.

Per rank, per token i (SPEC.md section 2), with this rank's rows ``[start, start + V)``:

    local stats   m_i = max_j z_ij,  s_i = sum_j exp(z_ij - m_i),  p_i = z_i[t_i] (if here),
                  a_i = sum_j z_ij                                     (z = x @ W_local.T)
    M_i           = allreduce_MAX(m_i)
    S_i, P_i, A_i = allreduce_SUM(s_i * exp(m_i - M_i), p_i, a_i)      (one collective)
    lse_i         = log(S_i) + M_i
    loss_i        = lse_i - (1 - eps) * P_i - eps * A_i / Vg           (0 for ignored tokens)

which is ``F.cross_entropy(x @ W_full.T, t, label_smoothing=eps, reduction="none")``.
The backward is the operator of ``fused_linear_cross_entropy_loss_grad`` (the backend
called directly with the forward's int64 local targets and statistics) followed by a SUM
all-reduce of ``grad_input`` in fp32; ``grad_weight`` stays local. Only the gradients
autograd asks for are computed (a frozen weight costs no ``[V, H]`` GEMM; a hidden that
needs no gradient costs no GEMM and no all-reduce), and without a possible backward
(``torch.no_grad()``, nothing requiring grad) high-performance mode keeps no softmax.

Inputs arrive validated (``vocab_parallel.loss``); this layer knows nothing of tiling:
the backends do (``vocab_parallel.torch_backend`` and ``vocab_parallel.kernels``).
"""

from __future__ import annotations

import torch

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
    anchors = [t for t in anchors if t.requires_grad]
    if not anchors:
        inputs = [t.requires_grad_(True) for t in inputs]
    err = delayed(DOUBLE_BACKWARD_ERROR.encode(), len(inputs) + len(anchors))
    outs = err(*inputs, *anchors)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = list(grads)
    for i, out in zip(present, outs[: len(present)], strict=True):
        grads[i] = out
    return tuple(grads)


class VocabParallelLinearCE(torch.autograd.Function):
    """Per-token losses ``[BT]`` (fp32) of ``hidden [BT, H]`` against this rank's shard.

    ``track`` says whether a backward can follow (grad mode on and an input requiring
    grad); without one, nothing is saved and high-performance mode keeps no softmax.
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, target, process_group, layout, ignore_index, eps, mode, backend, track
    ):
        ignored = target == ignore_index
        local = target - layout.start
        here = (local >= 0) & (local < layout.size) & ~ignored
        local_target = torch.where(here, local, -1)

        bt, v = hidden.shape[0], weight.shape[0]
        keep_softmax = track and mode == "high_performance"
        softmax = None
        if keep_softmax:  # receives the raw logits, normalised in place below
            softmax = torch.empty((bt, v), dtype=torch.float32, device=hidden.device)
        m, s, p, a = backend_forward_stats(backend)(
            hidden, weight, local_target, softmax, with_logit_sum=eps > 0
        )

        logits_max = all_reduce(m.clone(), "MAX", process_group, "logits_max")
        sums = torch.stack([s * torch.exp(m - logits_max), p, a])
        all_reduce(sums, "SUM", process_group, "sum_exp_logits and predicted logits")
        sum_exp, predicted, logit_sum = sums
        lse = torch.log(sum_exp) + logits_max
        loss = lse - (1.0 - eps) * predicted
        if eps:
            loss = loss - eps * logit_sum / layout.global_size
        loss = loss.masked_fill(ignored, 0.0)

        if track:
            if keep_softmax:
                softmax.sub_(logits_max[:, None]).exp_().div_(sum_exp[:, None])
                stats = (softmax,)
            else:
                stats = (logits_max, sum_exp)
            ctx.save_for_backward(hidden, weight, local_target, ignored, *stats)
        ctx.process_group, ctx.eps, ctx.backend = process_group, eps, backend
        ctx.global_size, ctx.keep_softmax = layout.global_size, keep_softmax
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        need_input, need_weight = ctx.needs_input_grad[:2]
        with torch.no_grad():
            grads = VocabParallelLinearCE._gradients(ctx, grad_loss, need_input, need_weight)
        if torch.is_grad_enabled():  # create_graph=True
            grads = _refuse_double_backward(grads, ctx.saved_tensors[:2])
        return (*grads, None, None, None, None, None, None, None, None)

    @staticmethod
    def _gradients(ctx, grad_loss, need_input: bool, need_weight: bool):
        """``(grad_hidden, grad_weight)``; a gradient nobody needs costs no GEMM, no
        memory and (``grad_hidden``) no all-reduce, and is None."""
        if not (need_input or need_weight):
            return None, None
        hidden, weight, local_target, ignored, *stats = ctx.saved_tensors
        if ctx.keep_softmax:
            logits_max, sum_exp, softmax = None, None, stats[0]
        else:
            (logits_max, sum_exp), softmax = stats, None
        grad = grad_loss.float().masked_fill(ignored, 0.0)
        tp = world_size(ctx.process_group) > 1
        grad_input, grad_weight = backend_backward(ctx.backend)(
            grad,
            hidden,
            weight,
            local_target,
            logits_max,
            sum_exp,
            softmax,
            1.0 - ctx.eps,
            ctx.eps / ctx.global_size,
            need_input_grad=need_input,
            need_weight_grad=need_weight,
            grad_input_dtype=torch.float32 if tp else None,
        )
        if tp and grad_input is not None:
            grad_input = all_reduce(grad_input, "SUM", ctx.process_group, "grad_input")
            grad_input = grad_input.to(hidden.dtype)
        return grad_input, grad_weight
