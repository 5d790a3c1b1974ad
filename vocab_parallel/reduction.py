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

from typing import Any

import torch


def check_num_items_in_batch(num_items_in_batch: Any) -> None:
    """``num_items_in_batch``: an int >= 1, or a 0-d / one-element real tensor (its value is
    not read: that would synchronise with the device)."""
    n = num_items_in_batch
    if isinstance(n, torch.Tensor):
        if n.numel() != 1 or n.dim() > 1:
            raise ValueError(
                "num_items_in_batch: expected a 0-d or one-element tensor, got shape "
                f"{tuple(n.shape)}"
            )
        if n.dtype == torch.bool or n.dtype.is_complex:
            raise TypeError(f"num_items_in_batch: expected a real number tensor, got {n.dtype}")
        return
    if isinstance(n, bool) or not isinstance(n, int | float):
        raise TypeError(
            "num_items_in_batch: expected a positive int or a one-element tensor, got "
            f"{type(n).__name__}"
        )
    if not n > 0:
        raise ValueError(f"num_items_in_batch: expected a positive number, got {n!r}")


def divide_by_num_items(total: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor:
    """``total / num_items_in_batch`` (a count of 0 in a tensor gives ``total``, i.e. 0 for an
    all-ignored batch, not NaN)."""
    if isinstance(num_items_in_batch, torch.Tensor):
        n = num_items_in_batch.detach().reshape(()).to(device=total.device)
        n = torch.where(n > 0, n, torch.ones_like(n))
        return total / n
    return total / num_items_in_batch


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
    return torch.where(total != 0, total, torch.ones_like(total))
