"""The vocabulary-parallel linear + cross entropy: the public loss and its module.

``vocab_parallel_linear_cross_entropy`` builds its :class:`~vocab_parallel.options.LossOptions`
(validated once), and :func:`run_loss` does the rest for every entry (the module, the LM
head, the integrations): it casts the tensors as ``F.linear`` would under autocast,
validates them (every message starts with the parameter's name), checks the shard layout
against the other ranks and the target ids against the vocabulary
(``vocab_parallel.layout``, ``vocab_parallel.checks``), runs the autograd Function of the
mode on the flattened tokens and reduces the result (``vocab_parallel.reduction``). The
math is in ``vocab_parallel.stats``; the design in ``docs/design.md``.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from vocab_parallel import precision
from vocab_parallel import sequence_parallel as _sp
from vocab_parallel.agreement import check_agreement, fingerprint
from vocab_parallel.autograd import VocabParallelLinearCE
from vocab_parallel.backend import resolve_backend
from vocab_parallel.checks import check_member, check_targets
from vocab_parallel.distributed import world_size
from vocab_parallel.grad_in_forward import GradInForwardLinearCE
from vocab_parallel.layout import resolve_layout
from vocab_parallel.options import MODES, REDUCTIONS, LossOptions, shown_options
from vocab_parallel.reduction import check_num_items_in_batch, reduce_losses
from vocab_parallel.stats import Call

__all__ = ["MODES", "REDUCTIONS", "LossOutput", "run_loss", "vocab_parallel_linear_cross_entropy"]


class LossOutput(NamedTuple):
    """What the loss returns with ``return_lse=True`` (unpacks as ``loss, lse``)."""

    loss: torch.Tensor
    lse: torch.Tensor


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
    temperature: float | torch.Tensor = 1.0,
    class_weight: torch.Tensor | None = None,
    return_lse: bool = False,
    bias: torch.Tensor | None = None,
    mode: str = "auto",
    backend: str = "auto",
    check_inputs: bool = True,
    sequence_parallel: bool = False,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor | LossOutput:
    """Cross entropy of ``hidden @ weight.T`` where ``weight`` is this rank's vocabulary shard.

    Equals ``F.cross_entropy(F.linear(hidden, W_full, b_full) / temperature, target,
    weight=class_weight_full, ...)`` with ``W_full`` the concatenation of the shards of
    ``process_group``, without ever materialising the full logits (memory-saving mode
    keeps no ``[tokens, V]`` tensor at all).

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
            non-ignored tokens, weighted by the targets' class weights; 0 when all are
            ignored).
        label_smoothing: ``0 <= eps < 1`` over the global vocabulary, as ``F.cross_entropy``.
        softcap: ``c > 0``: the logits are ``c * tanh(logits / c)`` (after the bias) before
            the softmax (Gemma 2/3); None: no cap.
        z_loss: ``w >= 0``: each non-ignored token's loss gets ``+ w * lse^2`` (its
            log-sum-exp over the global vocabulary).
        temperature: ``T > 0``, a float or a tensor shaped like ``target`` (one per token):
            the logits are ``softcap(hidden @ W.T + bias) / T``; no gradient reaches it.
        class_weight: ``[V_local]`` this rank's rows of the class weights (sharded like
            ``weight``): ``F.cross_entropy``'s ``weight``; no gradient reaches it.
        return_lse: also return ``lse`` (of the scaled logits; shape of ``target``, fp32,
            0 where ignored, carrying no gradient): a :class:`LossOutput`.
        bias: ``[V_local]`` this rank's bias rows (dtype of ``weight``): the logits are
            ``hidden @ weight.T + bias``; it gets its gradient.
        mode: ``"auto"`` (default): ``"grad_in_forward"`` when it applies (not for fp16
            or float64 inputs), else ``"memory_saving"``. ``"grad_in_forward"``: for a scalar loss
            that will be differentiated, the forward computes the gradients token chunk by
            token chunk (three GEMMs, no recompute; ``vocab_parallel.grad_in_forward``);
            elsewhere it runs as ``"memory_saving"`` (with a warning for
            ``reduction="none"``). ``"memory_saving"``: keep per-token statistics, recompute
            the logits in the backward (four GEMMs). ``"high_performance"``: keep the fp32
            softmax shard ``[tokens, V_local]``, no recompute.
        backend: ``"triton"``, ``"torch"`` or ``"auto"`` (Triton on CUDA; torch for
            float64).
        check_inputs: check that every target id is ``ignore_index`` or in
            ``[0, global vocabulary)`` (and every temperature positive), and (on CPU) the
            layout and token counts of the group at every call. ``False`` skips these.
        sequence_parallel: ``hidden``, ``target`` (and a per-token ``temperature``) are
            this rank's slice of the group's tokens (uneven slices allowed); the loss is
            over all of them, ``"none"`` gives this rank's tokens.
        num_items_in_batch: the loss is then the SUM divided by it (Hugging Face's
            gradient accumulation); ``reduction`` must be ``"sum"`` then.

    ``weight`` (and ``bias``, ``class_weight``) may be DTensors placed ``Shard(0)`` on a
    1-D mesh, which then gives the group and layout (``vocab_parallel.dtensor``).

    Returns:
        The fp32 loss (a scalar, or per token for ``reduction="none"``; float64 for
        float64 inputs); with ``return_lse``, ``LossOutput(loss, lse)``.

    Raises:
        TypeError, ValueError: naming the parameter, on every rank of the group alike for
            what concerns the group (layout, token counts, target ids).
    """
    opts = LossOptions(
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        softcap=softcap, z_loss=z_loss, temperature=temperature, class_weight=class_weight,
        bias=bias, return_lse=return_lse, mode=mode, backend=backend,
        check_inputs=check_inputs, sequence_parallel=sequence_parallel,
        vocab_start_index=vocab_start_index, global_vocab_size=global_vocab_size,
    )  # fmt: skip
    return run_loss(hidden, weight, target, opts, process_group, num_items_in_batch)


def _check_tensors(hidden, weight, target, opts: LossOptions) -> None:
    """The tensors of a call, against each other (messages name the parameter)."""
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
    bias, cw, temp = opts.bias, opts.class_weight, opts.temperature
    if bias is not None and bias.dtype != weight.dtype:
        raise TypeError(
            f"bias: dtype {bias.dtype} differs from weight dtype {weight.dtype}; they must be equal"
        )
    for name, rows in (("bias", bias), ("class_weight", cw)):
        if rows is not None and tuple(rows.shape) != (weight.shape[0],):
            raise ValueError(
                f"{name}: expected shape [{weight.shape[0]}] (the rows of weight), got "
                f"{tuple(rows.shape)}"
            )
    if cw is not None and not cw.is_floating_point():
        raise TypeError(f"class_weight: expected a floating-point tensor, got {cw.dtype}")
    if isinstance(temp, torch.Tensor) and tuple(temp.shape) != tuple(target.shape):
        raise ValueError(
            f"temperature: expected a float or a tensor of the shape of target "
            f"{tuple(target.shape)}, got shape {tuple(temp.shape)}"
        )
    tensors = (("weight", weight), ("target", target), ("bias", bias), ("class_weight", cw))
    tensors += (("temperature", temp if isinstance(temp, torch.Tensor) else None),)
    for name, t in tensors:
        if t is not None and t.device != hidden.device:
            raise ValueError(
                f"{name}: on device {t.device}, but hidden is on {hidden.device}; "
                "all tensors must be on one device"
            )


def _inverse_temperature(opts: LossOptions, tokens: torch.Tensor, dtype, check: bool):
    """``[N]`` inverse temperature of the call's (gathered) tokens in ``dtype`` (fp32, or
    float64 for float64 inputs), or None for 1."""
    temp = opts.temperature
    if not opts.scaled:
        return None
    if not isinstance(temp, torch.Tensor):
        return torch.full(tokens.shape, 1.0 / temp, dtype=dtype, device=tokens.device)
    temp = temp.detach().reshape(-1).to(dtype)
    if check:
        bad = ~((temp > 0) & torch.isfinite(temp))
        message = "temperature: expected finite values > 0"
        if temp.device.type == "cuda":
            torch._assert_async(~bad.any(), message)
        elif bad.any():
            where = int(bad.nonzero()[0, 0])
            raise ValueError(f"{message}, got {float(temp[where])} at position {where}")
    return temp.reciprocal()


def _not_traceable(fn):
    """``fn`` kept out of ``torch.compile`` graphs, with the reason ``fullgraph=True``
    reports: the agreement of the ranks reads its collective's result on the host."""
    reason = (
        "vocab_parallel: the ranks' agreement check (check_inputs=True under tensor "
        "parallelism) reads its collective's result on the host and cannot be traced; "
        "pass check_inputs=False to compile the loss with fullgraph=True"
    )
    try:
        return torch.compiler.disable(fn, reason=reason)
    except TypeError:  # a torch without the reason argument
        return torch.compiler.disable(fn)


_agree = _not_traceable(check_agreement)


def _prepare(hidden, weight, target, opts: LossOptions, process_group, num_items_in_batch):
    """The call's tensors unwrapped (DTensors), cast (autocast) and validated, and the
    backend that runs them: ``(hidden, weight, target, bias, opts, process_group, which)``."""
    if num_items_in_batch is not None:
        check_num_items_in_batch(num_items_in_batch)
        if opts.reduction != "sum":
            raise ValueError(
                f"reduction: {opts.reduction!r} cannot be combined with num_items_in_batch "
                "(the loss is then the sum divided by num_items_in_batch); pass 'sum'"
            )
    if "torch.distributed.tensor" in sys.modules:  # DTensor inputs (vocab_parallel.dtensor)
        from vocab_parallel.dtensor import unwrap_inputs

        hidden, weight, target, opts, process_group = unwrap_inputs(
            hidden, weight, target, opts, process_group
        )
        check_member(process_group)
    hidden, weight, bias = autocast_inputs(hidden, weight, opts.bias)
    opts = opts if bias is opts.bias else opts.replace(bias=bias)
    _check_tensors(hidden, weight, target, opts)
    which = resolve_backend(opts.backend, hidden.device, hidden.dtype, "hidden")
    return hidden, weight, target, bias, opts, process_group, which


def run_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    opts: LossOptions,
    process_group: dist.ProcessGroup | None = None,
    num_items_in_batch: Any = None,
) -> torch.Tensor | LossOutput:
    """The loss of ``vocab_parallel_linear_cross_entropy`` for options already made.

    With ``check_inputs`` the ranks of the group first compare what must agree
    (``vocab_parallel.agreement``): a difference, or arguments refused on one rank, raise
    on every rank alike before any collective whose size depends on the inputs."""
    check_member(process_group)
    try:
        hidden, weight, target, bias, opts, process_group, which = _prepare(
            hidden, weight, target, opts, process_group, num_items_in_batch
        )
    except (TypeError, ValueError) as err:
        if opts.check_inputs and world_size(process_group) > 1:  # the others must not wait
            device = hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")
            _agree(None, process_group, device, own_error=err)
        raise
    t1 = target.reshape(-1).to(torch.int64)
    h2 = hidden.reshape(t1.shape[0], hidden.shape[-1])  # not (-1, H): H may be 0
    if opts.check_inputs and world_size(process_group) > 1:
        _agree(fingerprint(opts, h2, weight, t1), process_group, hidden.device)
    temp, accum = opts.temperature, precision.accumulate_dtype(hidden.dtype)
    slices = None  # sequence_parallel: all tokens of the group, gathered
    if opts.sequence_parallel:
        extra = temp.reshape(-1).to(accum) if isinstance(temp, torch.Tensor) else None
        h2, t1, slices, extra = _sp.gather_tokens(h2, t1, process_group, extra=extra)
        if extra is not None:
            opts = opts.replace(temperature=extra)
    layout = resolve_layout(
        weight.shape[0],
        process_group,
        opts.vocab_start_index,
        opts.global_vocab_size,
        t1.shape[0],
        hidden.device,
        recheck=opts.check_inputs and hidden.device.type == "cpu",
        trust=not opts.check_inputs,
    )
    if opts.check_inputs:
        alone = world_size(process_group) == 1
        rows = (layout.start, layout.start + layout.size) if alone else None
        check_targets(t1, opts.ignore_index, layout.global_size, rows)
    inputs = (h2, weight) if bias is None else (h2, weight, bias)
    track = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    mode = resolve_mode(opts.mode, opts.reduction, track, h2.dtype)
    cw = opts.class_weight
    call = Call(
        opts=opts,
        process_group=process_group,
        layout=layout,
        backend=which,
        mode=mode,
        track=track,
        class_weight=None if cw is None else cw.detach().to(accum),
        inv_temperature=_inverse_temperature(opts, t1, accum, opts.check_inputs),
    )
    if mode == "grad_in_forward":
        needs = tuple(t is not None and t.requires_grad for t in (h2, weight, bias))
        losses, lse, weights = GradInForwardLinearCE.apply(h2, weight, bias, t1, call, needs)
    else:
        losses, lse, weights = VocabParallelLinearCE.apply(h2, weight, bias, t1, call)
    if opts.reduction == "none":
        losses = _sp.own_tokens(losses, slices).reshape(target.shape)
    if mode == "grad_in_forward" and opts.reduction == "mean":
        out = losses  # the mean already (vocab_parallel.grad_in_forward)
    else:
        out = reduce_losses(losses, weights, opts.reduction, num_items_in_batch)
    if opts.return_lse:
        return LossOutput(out, _sp.own_tokens(lse, slices).reshape(target.shape))
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
    if mode == "auto" and dtype in (torch.float16, torch.float64):
        # fp16: GradScaler's factor must reach G before its rounding. float64 (checks such
        # as gradcheck): a second backward must equal the first bit for bit.
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

    Holds the options (``self.options``, a :class:`~vocab_parallel.options.LossOptions`,
    and ``self.process_group``); ``forward(hidden, weight, target, bias=None,
    class_weight=None)`` takes this rank's weight shard (and bias / class-weight rows),
    like ``nn.CrossEntropyLoss`` takes logits.
    """

    def __init__(self, *, process_group: dist.ProcessGroup | None = None, **options: Any):
        super().__init__()
        from vocab_parallel.options import loss_options

        self.process_group = process_group
        self.options = loss_options(**options)

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
        class_weight: torch.Tensor | None = None,
    ) -> torch.Tensor | LossOutput:
        opts = self.options
        if bias is not None or class_weight is not None:
            opts = opts.replace(
                bias=bias if bias is not None else opts.bias,
                class_weight=class_weight if class_weight is not None else opts.class_weight,
            )
        return run_loss(hidden, weight, target, opts, self.process_group)

    def extra_repr(self) -> str:
        return shown_options(self.options)
