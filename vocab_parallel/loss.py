"""The vocabulary-parallel linear + cross entropy: the public loss and its module.

``vocab_parallel_linear_cross_entropy`` validates its arguments (every message starts
with the parameter's name), checks the shard layout against the other ranks and the
target ids against the vocabulary (``vocab_parallel.layout``, ``vocab_parallel.checks``),
then runs the autograd Function of ``vocab_parallel.autograd`` on the flattened tokens and
reduces the per-token losses with ordinary torch ops, so any upstream gradient reaches
the fused backward exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from vocab_parallel.autograd import VocabParallelLinearCE
from vocab_parallel.checks import check_member, check_targets
from vocab_parallel.layout import resolve_layout
from vocab_parallel.ops import check_backend_name, check_label_smoothing, resolve_backend

MODES = ("memory_saving", "high_performance")
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
):
    """Validate the loss's options (before any tensor is looked at); returns the smoothing."""
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
    check_inputs: bool = True,
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
        check_inputs: check that every target id is ``ignore_index`` or in
            ``[0, global vocabulary)``, and (on CPU) the layout and token counts of the
            group at every call. ``False`` skips both for the last microseconds on GPUs
            (the layout is still checked once per layout and token count).

    Returns:
        The fp32 loss (a scalar, or per token for ``reduction="none"``).

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
    for name, t in (("weight", weight), ("target", target)):
        if t.device != hidden.device:
            raise ValueError(
                f"{name}: on device {t.device}, but hidden is on {hidden.device}; "
                "all tensors must be on one device"
            )
    which = resolve_backend(backend, hidden.device)
    check_member(process_group)
    t1 = target.reshape(-1).to(torch.int64)
    h2 = hidden.reshape(t1.shape[0], hidden.shape[-1])  # not (-1, H): H may be 0
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
    track = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    losses = VocabParallelLinearCE.apply(
        h2, weight, t1, process_group, layout, ignore_index, eps, mode, which, track
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
        check_inputs: bool = True,
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
            check_inputs=check_inputs,
        )

    def forward(
        self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        return vocab_parallel_linear_cross_entropy(hidden, weight, target, **self.options)

    def extra_repr(self) -> str:
        shown = {k: v for k, v in self.options.items() if k != "process_group"}
        return ", ".join(f"{k}={v!r}" for k, v in shown.items())
