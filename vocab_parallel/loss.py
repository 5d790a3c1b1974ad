"""The vocabulary-parallel linear + cross entropy: the public loss and its module.

``vocab_parallel_linear_cross_entropy`` validates its arguments (every message starts
with the parameter's name), casts them as ``F.linear`` would under autocast, checks the
shard layout against the other ranks and the target ids against the vocabulary
(``vocab_parallel.layout``, ``vocab_parallel.checks``), then runs the autograd Function of
``vocab_parallel.autograd`` (its docstring has the math, options included) on the
flattened tokens and reduces the per-token losses with ordinary torch ops, so any
upstream gradient reaches the fused backward exactly.

The options LLM trainers use, per token ``i`` (``r = hidden @ weight.T + bias``):

    softcap=c       z = c * tanh(r / c) replaces r before the softmax (Gemma 2/3)
    z_loss=w        loss_i += w * lse_i^2 (non-ignored tokens), lse_i = logsumexp_j z_ij
    return_lse      returns (loss, lse): lse shaped like target, 0 where ignored, no grad
    bias            this rank's [V_local] bias rows; its gradient is G.sum(0)
    autocast        hidden, weight, bias cast to the autocast dtype, as F.linear does
    float64         computed in float64 throughout (torch backend), e.g. for gradcheck
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

from vocab_parallel import sequence_parallel as _sp
from vocab_parallel.autograd import LossOptions, VocabParallelLinearCE
from vocab_parallel.checks import check_member, check_targets
from vocab_parallel.grad_in_forward import GradInForwardLinearCE
from vocab_parallel.layout import resolve_layout
from vocab_parallel.ops import (
    check_backend_name,
    check_flag,
    check_label_smoothing,
    check_softcap,
    check_z_loss,
    resolve_backend,
)

MODES = ("auto", "grad_in_forward", "memory_saving", "high_performance")
REDUCTIONS = ("none", "sum", "mean")


def check_options(
    ignore_index,
    reduction,
    label_smoothing,
    mode,
    backend,
    vocab_start_index,
    global_vocab_size=None,
    check_inputs=True,
    softcap=None,
    z_loss=0.0,
    return_lse=False,
):
    """Validate the loss's options (before any tensor is looked at); returns the smoothing."""
    check_softcap(softcap)
    check_z_loss(z_loss)
    check_flag("return_lse", return_lse)
    if not isinstance(check_inputs, bool):
        raise TypeError(f"check_inputs: expected a bool, got {type(check_inputs).__name__}")
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
    check_backend_name(backend)
    return check_label_smoothing(label_smoothing)


def autocast_inputs(*tensors):
    """``tensors`` cast as ``F.linear`` casts its inputs under autocast: when autocast is on
    for their device type, floating tensors on that device (not float64 ones) go to
    ``torch.get_autocast_dtype``. The casts are ordinary autograd ops, so gradients
    reach fp32 master weights in their dtype. Anything else is returned as it is."""
    first = tensors[0]
    if not isinstance(first, torch.Tensor):
        return tensors
    device_type = first.device.type
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except (RuntimeError, ValueError, TypeError):  # a device type without autocast
        return tensors
    if not enabled:
        return tensors
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t):
        eligible = (
            isinstance(t, torch.Tensor)
            and t.is_floating_point()
            and t.dtype != torch.float64
            and t.device.type == device_type
        )
        return t.to(dtype) if eligible else t

    return tuple(cast(t) for t in tensors)


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
    softcap: float | None = None,
    z_loss: float = 0.0,
    return_lse: bool = False,
    bias: torch.Tensor | None = None,
    mode: str = "auto",
    backend: str = "auto",
    check_inputs: bool = True,
    sequence_parallel: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
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
        softcap: ``c > 0``: the logits are ``c * tanh(logits / c)`` (after the bias) before
            the softmax (Gemma 2/3); None: no cap.
        z_loss: ``w >= 0``: each non-ignored token's loss gets ``+ w * lse^2`` (its
            log-sum-exp over the global vocabulary).
        return_lse: also return ``lse`` (shape of ``target``, fp32, 0 where ignored,
            carrying no gradient): ``(loss, lse)``.
        bias: ``[V_local]`` this rank's bias rows (dtype of ``weight``): the logits are
            ``hidden @ weight.T + bias``; it gets its gradient.
        mode: ``"auto"`` (default): ``"grad_in_forward"`` when it applies (not for fp16
            inputs), else ``"memory_saving"``. ``"grad_in_forward"``: for a scalar loss (``"sum"``,
            ``"mean"``) that will be differentiated, the forward computes the gradients
            token chunk by token chunk (three GEMMs, no recompute); the backward scales
            them by the upstream scalar (``vocab_parallel.grad_in_forward``); elsewhere it
            runs as ``"memory_saving"`` (with a warning for ``reduction="none"``).
            ``"memory_saving"``: keep per-token statistics, recompute the logits in the
            backward (four GEMMs). ``"high_performance"``: keep the fp32 softmax shard
            ``[tokens, V_local]``, no recompute (with ``softcap``, the fp32 capped logits
            of that shape instead).
        backend: ``"triton"``, ``"torch"`` or ``"auto"`` (Triton on CUDA; torch for
            float64).
        check_inputs: check that every target id is ``ignore_index`` or in
            ``[0, global vocabulary)``, and (on CPU) the layout and token counts of the
            group at every call. ``False`` skips both for the last microseconds on GPUs
            (the layout is still checked once per layout and token count).
        sequence_parallel: ``hidden`` and ``target`` are this rank's slice of the group's
            tokens (uneven slices allowed); the loss is over all of them, ``"none"``
            gives this rank's tokens (``vocab_parallel.sequence_parallel``).

    ``weight`` may be a DTensor placed ``Shard(0)`` on a 1-D mesh, which then gives the
    group and layout (``vocab_parallel.dtensor``).

    Under ``torch.autocast`` for the device of ``hidden``, ``hidden``, ``weight`` and
    ``bias`` are used in the autocast dtype, as ``F.linear`` would use them (gradients
    reach fp32 master weights in fp32); outside it their dtypes must be equal. float64
    inputs are computed in float64 (torch backend; the loss is then float64).

    Returns:
        The fp32 loss (a scalar, or per token for ``reduction="none"``); with
        ``return_lse``, ``(loss, lse)``.

    Raises:
        TypeError, ValueError: naming the parameter, on every rank of the group alike for
            what concerns the group (layout, token counts, target ids).
    """
    eps = check_options(
        ignore_index,
        reduction,
        label_smoothing,
        mode,
        backend,
        vocab_start_index,
        global_vocab_size,
        check_inputs,
        softcap,
        z_loss,
        return_lse,
    )
    sequence_parallel = _sp.check_flag(sequence_parallel)
    if "torch.distributed.tensor" in sys.modules:  # DTensor inputs (vocab_parallel.dtensor)
        from vocab_parallel.dtensor import unwrap_inputs

        layout_args = (process_group, vocab_start_index, global_vocab_size)
        hidden, weight, target, bias, *layout_args = unwrap_inputs(
            hidden, weight, target, bias, *layout_args, sequence_parallel
        )
        process_group, vocab_start_index, global_vocab_size = layout_args
    hidden, weight, bias = autocast_inputs(hidden, weight, bias)
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden: expected a torch.Tensor, got {type(hidden).__name__}")
    if hidden.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(
            f"hidden: expected dtype float16, bfloat16, float32 or float64, got {hidden.dtype}"
        )
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
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias: expected None or a torch.Tensor, got {type(bias).__name__}")
        if bias.dtype != weight.dtype:
            raise TypeError(
                f"bias: dtype {bias.dtype} differs from weight dtype {weight.dtype}; "
                "they must be equal"
            )
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"bias: expected shape [{weight.shape[0]}] (the rows of weight), got "
                f"{tuple(bias.shape)}"
            )
    for name, t in (("weight", weight), ("target", target), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(
                f"{name}: on device {t.device}, but hidden is on {hidden.device}; "
                "all tensors must be on one device"
            )
    which = resolve_backend(backend, hidden.device, hidden.dtype, "hidden")
    check_member(process_group)
    t1 = target.reshape(-1).to(torch.int64)
    h2 = hidden.reshape(t1.shape[0], hidden.shape[-1])  # not (-1, H): H may be 0
    slices = None  # sequence_parallel: all tokens of the group, gathered
    if sequence_parallel:
        h2, t1, slices = _sp.gather_tokens(h2, t1, process_group)
    layout = resolve_layout(
        weight.shape[0],
        process_group,
        vocab_start_index,
        global_vocab_size,
        t1.shape[0],
        hidden.device,
        recheck=check_inputs and hidden.device.type == "cpu",
    )
    if check_inputs:
        check_targets(t1, ignore_index, layout.global_size)
    # Whether a backward can follow: else high-performance mode keeps no softmax.
    inputs = (h2, weight) if bias is None else (h2, weight, bias)
    track = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    mode = resolve_mode(mode, reduction, track, h2.dtype)
    opts = LossOptions(ignore_index, eps, mode, check_softcap(softcap), check_z_loss(z_loss))
    if mode == "grad_in_forward":
        needs = tuple(t is not None and t.requires_grad for t in (h2, weight, bias))
        out, lse = GradInForwardLinearCE.apply(
            h2, weight, bias, t1, process_group, layout, opts, which, reduction, needs
        )
        if return_lse:
            return out, _sp.own_tokens(lse, slices).reshape(target.shape)
        return out
    losses, lse = VocabParallelLinearCE.apply(
        h2, weight, bias, t1, process_group, layout, opts, which, track
    )
    if reduction == "none":
        out = _sp.own_tokens(losses, slices).reshape(target.shape)
    elif reduction == "sum":
        out = losses.sum()
    else:
        count = (t1 != ignore_index).sum()
        out = losses.sum() / count.clamp(min=1)
    if return_lse:
        return out, _sp.own_tokens(lse, slices).reshape(target.shape)
    return out


def resolve_mode(mode: str, reduction: str, track: bool, dtype: torch.dtype | None = None) -> str:
    """The mode that runs: ``"auto"`` and ``"grad_in_forward"`` become
    ``"grad_in_forward"`` for a scalar loss that will be differentiated, else
    ``"memory_saving"`` (per-token upstream gradients are not known in the forward; without
    a backward there is nothing to compute early). ``"auto"`` also keeps fp16 inputs in
    memory-saving mode, where GradScaler's factor reaches ``G`` before its fp16 rounding.
    Asking for ``"grad_in_forward"`` with ``reduction="none"`` warns."""
    if mode not in ("auto", "grad_in_forward"):
        return mode
    if mode == "auto" and dtype == torch.float16:
        return "memory_saving"
    if reduction != "none" and track:
        return "grad_in_forward"
    if mode == "grad_in_forward" and reduction == "none":
        warnings.warn(
            'mode="grad_in_forward" needs reduction "sum" or "mean" (per-token upstream '
            'gradients are only known in the backward): running mode="memory_saving"',
            stacklevel=3,
        )
    return "memory_saving"


class VocabParallelLinearCrossEntropy(nn.Module):
    """``nn.Module`` form of :func:`vocab_parallel_linear_cross_entropy`.

    Holds the options; ``forward(hidden, weight, target, bias=None)`` takes this rank's
    weight shard (and bias rows), like ``nn.CrossEntropyLoss`` takes logits. (An LM head
    that owns its shard is built on top of this.)
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
        softcap: float | None = None,
        z_loss: float = 0.0,
        return_lse: bool = False,
        mode: str = "auto",
        backend: str = "auto",
        check_inputs: bool = True,
        sequence_parallel: bool = False,
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
            check_inputs,
            softcap,
            z_loss,
            return_lse,
        )
        self.options = dict(
            process_group=process_group,
            vocab_start_index=vocab_start_index,
            global_vocab_size=global_vocab_size,
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
            softcap=softcap,
            z_loss=z_loss,
            return_lse=return_lse,
            mode=mode,
            backend=backend,
            check_inputs=check_inputs,
            sequence_parallel=_sp.check_flag(sequence_parallel),
        )

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return vocab_parallel_linear_cross_entropy(
            hidden, weight, target, bias=bias, **self.options
        )

    def extra_repr(self) -> str:
        shown = {k: v for k, v in self.options.items() if k != "process_group"}
        return ", ".join(f"{k}={v!r}" for k, v in shown.items())
