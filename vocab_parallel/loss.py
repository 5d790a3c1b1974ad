"""The vocabulary-parallel linear + cross entropy: forward statistics, loss, autograd.

Per rank, per token i (SPEC.md section 2), with this rank's rows ``[start, start + V)``:

    local stats   m_i = max_j z_ij,  s_i = sum_j exp(z_ij - m_i),  p_i = z_i[t_i] (if here),
                  a_i = sum_j z_ij                                     (z = x @ W_local.T)
    M_i           = allreduce_MAX(m_i)
    S_i, P_i, A_i = allreduce_SUM(s_i * exp(m_i - M_i), p_i, a_i)      (one collective)
    lse_i         = log(S_i) + M_i
    loss_i        = lse_i - (1 - eps) * P_i - eps * A_i / Vg           (0 for ignored tokens)

which is ``F.cross_entropy(x @ W_full.T, t, label_smoothing=eps, reduction="none")``.
The backward is ``fused_linear_cross_entropy_loss_grad`` followed by a SUM all-reduce of
``grad_input`` in fp32; ``grad_weight`` stays local. Reductions are ordinary torch ops on
the per-token losses, so any upstream gradient reaches the operator exactly.

This layer knows nothing of tiling: the backends do (``vocab_parallel.torch_backend``
and ``vocab_parallel.kernels``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from vocab_parallel import torch_backend
from vocab_parallel.distributed import ShardLayout, all_reduce, shard_layout, world_size
from vocab_parallel.mask import pack_target_mask
from vocab_parallel.ops import (
    check_label_smoothing,
    fused_linear_cross_entropy_loss_grad,
    resolve_backend,
)

MODES = ("memory_saving", "high_performance")
REDUCTIONS = ("none", "sum", "mean")


def _forward_stats(backend: str):
    if backend == "triton":
        from vocab_parallel.kernels.forward import forward_stats

        return forward_stats
    return torch_backend.forward_stats


class _VocabParallelLinearCE(torch.autograd.Function):
    """Per-token losses ``[BT]`` (fp32) of ``hidden [BT, H]`` against this rank's shard."""

    @staticmethod
    def forward(ctx, hidden, weight, target, group, layout, ignore_index, eps, mode, backend):
        ignored = target == ignore_index
        local = target - layout.start
        here = (local >= 0) & (local < layout.size) & ~ignored
        local_target = torch.where(here, local, -1)

        bt, v = hidden.shape[0], weight.shape[0]
        keep_softmax = mode == "high_performance"
        softmax = None
        if keep_softmax:  # receives the raw logits, normalised in place below
            softmax = torch.empty((bt, v), dtype=torch.float32, device=hidden.device)
        m, s, p, a = _forward_stats(backend)(
            hidden, weight, local_target, softmax, with_logit_sum=eps > 0
        )

        logits_max = all_reduce(m.clone(), "MAX", group)
        sums = torch.stack([s * torch.exp(m - logits_max), p, a])
        all_reduce(sums, "SUM", group)
        sum_exp, predicted, logit_sum = sums
        lse = torch.log(sum_exp) + logits_max
        loss = lse - (1.0 - eps) * predicted
        if eps:
            loss = loss - eps * logit_sum / layout.global_size
        loss = loss.masked_fill(ignored, 0.0)

        if keep_softmax:
            softmax.sub_(logits_max[:, None]).exp_().div_(sum_exp[:, None])
            stats = (softmax,)
        else:
            stats = (logits_max, sum_exp)
        target_mask = pack_target_mask(~here)
        ctx.save_for_backward(hidden, weight, target_mask, local_target, ignored, *stats)
        ctx.group, ctx.eps, ctx.backend = group, eps, backend
        ctx.global_size, ctx.keep_softmax = layout.global_size, keep_softmax
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, target_mask, local_target, ignored, *stats = ctx.saved_tensors
        if ctx.keep_softmax:
            stat_kwargs = {"softmax": stats[0]}
        else:
            stat_kwargs = {"logits_max": stats[0], "sum_exp_logits": stats[1]}
        grad = grad_loss.float().masked_fill(ignored, 0.0)
        tp = world_size(ctx.group) > 1
        grad_input, grad_weight = fused_linear_cross_entropy_loss_grad(
            grad,
            hidden,
            weight,
            target_mask,
            local_target.clamp(min=0),
            ctx.eps,
            global_vocab_size=ctx.global_size,
            backend=ctx.backend,
            grad_input_dtype=torch.float32 if tp else None,
            **stat_kwargs,
        )
        if tp:
            grad_input = all_reduce(grad_input, "SUM", ctx.group).to(hidden.dtype)
        return grad_input, grad_weight, None, None, None, None, None, None, None


def check_options(
    ignore_index,
    reduction,
    label_smoothing,
    mode,
    backend,
    vocab_start_index,
    global_vocab_size=None,
):
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if vocab_start_index is not None and (
        isinstance(vocab_start_index, bool)
        or not isinstance(vocab_start_index, int)
        or vocab_start_index < 0
    ):
        raise ValueError(f"vocab_start_index: expected an int >= 0, got {vocab_start_index!r}")
    if global_vocab_size is not None and (
        isinstance(global_vocab_size, bool)
        or not isinstance(global_vocab_size, int)
        or global_vocab_size < 1
    ):
        raise ValueError(f"global_vocab_size: expected an int >= 1, got {global_vocab_size!r}")
    resolve_backend(backend, torch.device("cpu"))  # validates the name
    return check_label_smoothing(label_smoothing)


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    process_group: dist.ProcessGroup | None = None,
    vocab_start_index: int | None = None,
    global_vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    mode: str = "memory_saving",
    backend: str = "auto",
) -> torch.Tensor:
    """Cross entropy of ``hidden @ weight.T`` where ``weight`` is this rank's vocabulary shard.

    Equals ``F.cross_entropy(F.linear(hidden, W_full), target, ...)`` with ``W_full`` the
    concatenation of the shards of ``process_group``, without ever materialising the full
    logits (memory-saving mode keeps no ``[tokens, V]`` tensor at all).

    Args:
        hidden: ``[..., H]`` fp32/fp16/bf16, identical on every rank of the group.
        weight: ``[V_local, H]`` this rank's rows, same dtype as ``hidden``.
        target: ``[...]`` integer global token ids (``ignore_index`` for none).
        process_group: the tensor-parallel group; ``None`` (or one rank): no collectives.
        vocab_start_index: first global id of this shard; default: contiguous shards in
            rank order (uneven sizes allowed).
        global_vocab_size: rows over all shards. With ``vocab_start_index`` it makes the
            layout known without the small collective (and device sync) that otherwise
            finds the shard sizes at every call.
        ignore_index: target value that contributes no loss and no gradient.
        reduction: ``"none"`` (per-token, shape of ``target``), ``"sum"`` or ``"mean"`` (over
            non-ignored tokens; 0 when all are ignored).
        label_smoothing: ``0 <= eps < 1`` over the global vocabulary, as ``F.cross_entropy``.
        mode: ``"memory_saving"`` (recompute logits in backward) or ``"high_performance"``
            (keep the fp32 softmax shard ``[tokens, V_local]``, no recompute).
        backend: ``"triton"``, ``"torch"`` or ``"auto"`` (Triton on CUDA).

    Returns:
        The fp32 loss (a scalar, or per token for ``reduction="none"``).
    """
    eps = check_options(
        ignore_index,
        reduction,
        label_smoothing,
        mode,
        backend,
        vocab_start_index,
        global_vocab_size,
    )
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden: expected a torch.Tensor, got {type(hidden).__name__}")
    if hidden.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"hidden: expected dtype float16, bfloat16 or float32, got {hidden.dtype}")
    if hidden.dim() < 1:
        raise ValueError("hidden: expected a tensor of shape [..., H], got a 0-d tensor")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError("weight: expected a 2-D torch.Tensor [V_local, H]")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target: expected a torch.Tensor, got {type(target).__name__}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target: expected an integer dtype, got {target.dtype}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"target: expected shape {tuple(hidden.shape[:-1])} (hidden without its last "
            f"dim), got {tuple(target.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"weight: dtype {weight.dtype} differs from hidden dtype {hidden.dtype}; "
            "they must be equal"
        )
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight: expected shape [V_local, {hidden.shape[-1]}], got {tuple(weight.shape)}"
        )
    layout: ShardLayout = shard_layout(
        weight.shape[0], process_group, vocab_start_index, hidden.device, global_vocab_size
    )
    which = resolve_backend(backend, hidden.device)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = target.reshape(-1).to(torch.int64)
    losses = _VocabParallelLinearCE.apply(
        h2, weight, t1, process_group, layout, ignore_index, eps, mode, which
    )
    if reduction == "none":
        return losses.reshape(target.shape)
    total = losses.sum()
    if reduction == "sum":
        return total
    count = (t1 != ignore_index).sum()
    return total / count.clamp(min=1)


class VocabParallelLinearCrossEntropy(nn.Module):
    """``nn.Module`` form of :func:`vocab_parallel_linear_cross_entropy`.

    Holds the options; ``forward(hidden, weight, target)`` takes this rank's weight shard,
    like ``nn.CrossEntropyLoss`` takes logits. (An LM head that owns its shard is built on
    top of this.)
    """

    def __init__(
        self,
        *,
        process_group: dist.ProcessGroup | None = None,
        vocab_start_index: int | None = None,
        global_vocab_size: int | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        mode: str = "memory_saving",
        backend: str = "auto",
    ) -> None:
        super().__init__()
        check_options(
            ignore_index,
            reduction,
            label_smoothing,
            mode,
            backend,
            vocab_start_index,
            global_vocab_size,
        )
        self.options = dict(
            process_group=process_group,
            vocab_start_index=vocab_start_index,
            global_vocab_size=global_vocab_size,
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
            mode=mode,
            backend=backend,
        )

    def forward(
        self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        return vocab_parallel_linear_cross_entropy(hidden, weight, target, **self.options)

    def extra_repr(self) -> str:
        shown = {k: v for k, v in self.options.items() if k != "process_group"}
        return ", ".join(f"{k}={v!r}" for k, v in shown.items())
