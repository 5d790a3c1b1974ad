"""The vocabulary-parallel linear + cross entropy: the public loss and its module.

``vocab_parallel_linear_cross_entropy`` builds its :class:`~vocab_parallel.options.LossOptions`
(validated once, in the guarded step of ``prepare_call``, so that a value refused on one
rank raises on every rank), and :func:`run_loss` does the rest for every entry (the module, the LM
head, the integrations): the call prepared as every entry prepares it
(``vocab_parallel.engine.entry``: autocast, validation, agreement, layout, target checks), the
autograd Function of the mode run on the flattened tokens and the result reduced
(``vocab_parallel.engine.reduction``). The math is in
``vocab_parallel.objectives.cross_entropy``; the design in
``docs/design.md``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from vocab_parallel.engine.entry import prepare_call
from vocab_parallel.engine.objective import Objective, resolve_mode  # noqa: F401 (its old home)
from vocab_parallel.engine.reduction import reduce_losses
from vocab_parallel.objectives.cross_entropy_autograd import (
    GradInForwardLinearCE,
    VocabParallelLinearCE,
)
from vocab_parallel.options import (
    MODES,
    REDUCTIONS,
    LossOptions,
    PendingOptions,
    documented,
    shown_options,
)
from vocab_parallel.parallel import sequence_parallel as _sp

__all__ = ["MODES", "REDUCTIONS", "LossOutput", "run_loss", "vocab_parallel_linear_cross_entropy"]


class LossOutput(NamedTuple):
    """What the loss returns with ``return_lse=True`` (unpacks as ``loss, lse``)."""

    loss: torch.Tensor
    lse: torch.Tensor


@documented
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
    filter_eps: float | str | None = None,
    filter_grads: str = "both",
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
        {shared: process_group, vocab_start_index, global_vocab_size, ignore_index}
        reduction: ``"none"`` (per-token, shape of ``target``), ``"sum"`` or ``"mean"`` (over
            non-ignored tokens, weighted by the targets' class weights; 0 when all are
            ignored).
        label_smoothing: ``0 <= eps < 1`` over the global vocabulary, as ``F.cross_entropy``.
        z_loss: ``w >= 0``: each non-ignored token's loss gets ``+ w * lse^2`` (its
            log-sum-exp over the global vocabulary).
        class_weight: ``[V_local]`` this rank's rows of the class weights (sharded like
            ``weight``): ``F.cross_entropy``'s ``weight``; no gradient reaches it.
        return_lse: also return ``lse`` (of the scaled logits; shape of ``target``, fp32,
            0 where ignored, carrying no gradient): a :class:`LossOutput`.
        mode: ``"auto"`` (default): ``"grad_in_forward"`` when it applies (not for fp16
            or float64 inputs), else ``"memory_saving"``. ``"grad_in_forward"``: for a
            scalar loss that will be differentiated, the forward computes the gradients
            token chunk by token chunk (three GEMMs, no recompute;
            ``vocab_parallel.engine.grad_in_forward``);
            elsewhere it runs as ``"memory_saving"`` (with a warning for
            ``reduction="none"``). ``"memory_saving"``: keep per-token statistics, recompute
            the logits in the backward (four GEMMs). ``"high_performance"``: keep the fp32
            softmax shard ``[tokens, V_local]``, no recompute.
        {shared: softcap, temperature, bias, backend, check_inputs, sequence_parallel}
        num_items_in_batch: the loss is then the SUM divided by it (Hugging Face's
            gradient accumulation); ``reduction`` must be ``"sum"`` then. A finite count
            > 0 (an int, a float or a one-element tensor, the same on every rank); 0 only
            for a batch whose tokens are all ignored (the loss is then 0).
        filter_eps: gradient filtering, which changes the gradients (not the loss):
            ``None`` (default): exact. ``"auto"`` (``eps(input dtype) / 32``: 2^-12 for
            bf16, 2^-28 for fp32) or a float ``eps >= 0``: each vocabulary column of a
            block of 128 tokens of the gradient of the logits whose every entry is below
            ``eps`` per unit of upstream gradient is left out of the gradient GEMMs
            (``vocab_parallel.engine.filtering``: the bound on what that changes;
            ``gradient_filter_stats()`` counts the tiles left out).
        filter_grads: which products ``filter_eps`` applies to: ``"both"`` (default),
            ``"weight"`` or ``"input"``. ``"weight"`` keeps ``grad_input`` exact: its
            error is the one that adds up over a row's many small probabilities.

    ``weight`` (and ``bias``, ``class_weight``) may be DTensors placed ``Shard(0)`` on a
    1-D mesh, which then gives the group and layout (``vocab_parallel.parallel.dtensor``).

    Returns:
        The fp32 loss (a scalar, or per token for ``reduction="none"``; float64 for
        float64 inputs); with ``return_lse``, ``LossOutput(loss, lse)``.

    Raises:
        TypeError, ValueError: naming the parameter, on every rank of the group alike for
            what concerns the group (layout, token counts, target ids).
    """
    opts = PendingOptions(  # made in the guarded step of prepare_call
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        softcap=softcap, z_loss=z_loss, temperature=temperature, class_weight=class_weight,
        bias=bias, return_lse=return_lse, mode=mode, backend=backend,
        check_inputs=check_inputs, sequence_parallel=sequence_parallel,
        vocab_start_index=vocab_start_index, global_vocab_size=global_vocab_size,
        filter_eps=filter_eps, filter_grads=filter_grads,
    )  # fmt: skip
    return run_loss(hidden, weight, target, opts, process_group, num_items_in_batch)


def run_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    opts: LossOptions | PendingOptions,
    process_group: dist.ProcessGroup | None = None,
    num_items_in_batch: Any = None,
) -> torch.Tensor | LossOutput:
    """The loss of ``vocab_parallel_linear_cross_entropy`` for options already made (or
    pending: made where a refused value raises on every rank alike).

    With ``check_inputs`` the ranks of the group first compare what must agree
    (``vocab_parallel.parallel.agreement``): a difference, or arguments refused on one rank, raise
    on every rank alike before any collective whose size depends on the inputs."""
    prep = prepare_call(
        hidden, weight, target, opts, process_group, CrossEntropy(),
        num_items_in_batch=num_items_in_batch,
    )  # fmt: skip
    call, h2, weight, bias, t1, slices, shape = prep
    opts, mode = call.opts, call.mode
    if mode == "grad_in_forward":
        needs = tuple(t is not None and t.requires_grad for t in (h2, weight, bias))
        losses, lse, weights = GradInForwardLinearCE.apply(h2, weight, bias, t1, call, needs)
    else:
        losses, lse, weights = VocabParallelLinearCE.apply(h2, weight, bias, t1, call)
    if opts.reduction == "none":
        losses = _sp.own_tokens(losses, slices).reshape(shape)
    if mode == "grad_in_forward" and opts.reduction == "mean":
        out = losses  # the mean already (vocab_parallel.engine.grad_in_forward)
    else:
        out = reduce_losses(losses, weights, opts.reduction, num_items_in_batch)
    if opts.return_lse:
        return LossOutput(out, _sp.own_tokens(lse, slices).reshape(shape))
    return out


class CrossEntropy(Objective):
    """The cross entropy, as the engine's entry sees it: its options are the
    :class:`~vocab_parallel.options.LossOptions` (compared with the general entries)."""

    name = "cross entropy"


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
        given = {"bias": bias, "class_weight": class_weight}
        given = {name: value for name, value in given.items() if value is not None}
        opts = PendingOptions(self.options, **given) if given else self.options
        return run_loss(hidden, weight, target, opts, self.process_group)

    def extra_repr(self) -> str:
        return shown_options(self.options)
