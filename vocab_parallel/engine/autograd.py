"""What every objective's autograd Functions share: the guarded backward (only the
gradients autograd asks for, no autocast, a double backward refused with our message),
autocast switched off, and the one fp32 SUM all-reduce of ``grad_input``.

Autocast is switched off inside the Functions (the inputs arrive already cast by the
entry, as ``F.linear`` would cast them): every product follows
``vocab_parallel.engine.precision``. Float64 inputs are computed in float64 throughout.
"""

from __future__ import annotations

import contextlib

import torch

from vocab_parallel.parallel.collectives import all_reduce

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
