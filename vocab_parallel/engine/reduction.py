"""The one home of the loss's reduction: per-token losses or their sum, normalised once.

The memory-saving / high-performance Function hands back the per-token losses, with each
token's target class weight (1 without class weights, 0 where ignored); the reduction is
applied here with ordinary torch ops, so any upstream gradient reaches the Function
exactly. The gradients-in-forward Function returns its scalar already reduced: it must
know the mean's denominator to form ``G`` (:func:`mean_denominator`, the same one)
(``docs/design.md``, "Reduction"):

    "none"               the per-token losses
    "sum"                their sum
    "mean"               the sum divided by the sum of the target weights (the count of
                         non-ignored tokens without class weights: torch's weighted mean);
                         a zero denominator (every token ignored) gives 0, not NaN
    num_items_in_batch   the sum divided by it (Hugging Face's gradient accumulation)
"""

from __future__ import annotations

import math
from typing import Any

import torch

NUM_ITEMS_RULE = (
    "num_items_in_batch: expected a finite count > 0 (0 only for a batch whose tokens are "
    "all ignored)"
)


def check_num_items_in_batch(num_items_in_batch: Any, read: bool = True) -> None:
    """``num_items_in_batch``: an int, a float or a 0-d / one-element real tensor, the same
    rule for each: a finite count >= 0 (0 only for a batch whose tokens are all ignored:
    :func:`check_items_counted`). A tensor's value is read here only on the CPU (and with
    ``read``): on a GPU that would wait for the device, so :func:`check_items_counted`
    checks it there. A bool or a non-number is a ``TypeError``; every message starts with
    ``num_items_in_batch``."""
    n = num_items_in_batch
    if isinstance(n, torch.Tensor):
        if n.numel() != 1 or n.dim() > 1:
            raise ValueError(
                "num_items_in_batch: expected a 0-d or one-element tensor, got shape "
                f"{tuple(n.shape)}"
            )
        if n.dtype == torch.bool or n.dtype.is_complex:
            raise TypeError(f"num_items_in_batch: expected a real number tensor, got {n.dtype}")
        if not read or n.device.type != "cpu":
            return
        n = n.item()
    elif isinstance(n, bool) or not isinstance(n, int | float):
        raise TypeError(
            "num_items_in_batch: expected an int, a float or a one-element tensor, got "
            f"{type(n).__name__}"
        )
    if not (0 <= n < math.inf):
        raise ValueError(f"{NUM_ITEMS_RULE}, got {n!r}")


def check_items_counted(num_items_in_batch: Any, target: torch.Tensor, ignore_index: int):
    """Raise ``ValueError`` naming ``num_items_in_batch`` for a count of 0 where ``target``
    (the call's flattened targets, the group's under sequence parallelism) has tokens that
    count. A tensor on a GPU (or targets there) is checked on the device, with a
    device-side assertion (as the target ids are: ``vocab_parallel.parallel.checks``), its whole
    rule (:func:`check_num_items_in_batch`) at once: no wait for the device."""
    n = num_items_in_batch
    on_device = isinstance(n, torch.Tensor) and n.device.type != "cpu"
    if not on_device and float(n) != 0:  # a number or a CPU tensor, its rule checked already
        return
    counted = (target != ignore_index).any()
    message = f"{NUM_ITEMS_RULE}; got 0 with tokens that are not ignored"
    if on_device:
        v = n.detach().reshape(()).to(torch.float64)
        ok = ((v > 0) & torch.isfinite(v)) | ((v == 0) & ~counted.to(v.device))
        torch._assert_async(ok, f"{NUM_ITEMS_RULE} (a tensor checked on its device)")
        return
    if target.device.type != "cpu":
        torch._assert_async(~counted, message)
    elif counted:
        raise ValueError(message)


def divide_by_num_items(total: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor:
    """``total / num_items_in_batch``; a count of 0 (an all-ignored batch: ``total`` is 0)
    gives ``total``, not NaN."""
    n = num_items_in_batch
    if isinstance(n, torch.Tensor):
        n = n.detach().reshape(()).to(device=total.device)
        return total / torch.where(n != 0, n, torch.ones_like(n))
    return total if n == 0 else total / n


def reduce_losses(
    losses: torch.Tensor,
    target_weight: torch.Tensor,
    reduction: str,
    num_items_in_batch: Any = None,
) -> torch.Tensor:
    """The ``reduction`` of ``losses`` (``[N]`` per token, or a 0-d sum: then not
    ``"none"``), the mean over ``target_weight`` (``[N]``, not differentiable), or the sum
    divided by ``num_items_in_batch``."""
    if reduction == "none":
        return losses
    total = losses if losses.dim() == 0 else losses.sum()
    if num_items_in_batch is not None:
        return divide_by_num_items(total, num_items_in_batch)
    if reduction == "sum":
        return total
    return total / mean_denominator(target_weight)


def mean_denominator(target_weight: torch.Tensor) -> torch.Tensor:
    """What a mean divides by: the targets' weights summed (the count of non-ignored
    tokens without class weights), 1 where that is 0 (an all-ignored batch gives 0)."""
    total = target_weight.sum()
    return torch.where(total != 0, total, 1.0)
