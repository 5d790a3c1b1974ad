"""The public backward operator: validation, normalisation of input forms, dispatch.

``fused_linear_cross_entropy_loss_grad`` is the vocabulary-parallel linear + cross
entropy backward (after Ascend's aclnnFusedLinearCrossEntropyLossGrad, with the errata
of the original document: ``docs/design.md``, "The operator"). Its math, in one place
(the keyword-only options ``bias``, ``softcap`` = c, ``z_loss`` = w, ``lse``, ``logits``,
``class_weight`` and ``temperature`` extend the seed's operator; without them it is the
seed's):

    r = input @ weight.T + bias                      (the raw logits; bias: 0 if None)
    z = c * tanh(r / c)  if softcap, else r
    z = z / temperature                              (the logits the softmax sees)
    G = softmax                                      if softmax is given
    G = exp(logits - logits_max) / sum_exp_logits    elif logits (saved z) is given
    G = exp(z - logits_max) / sum_exp_logits         otherwise (recomputed)
    G *= 1 + 2 * z_loss * lse[:, None]               (z-loss; lse = log(sum_exp) + max)
    G -= label_smoothing / global_vocab_size                     (every column)
    G[i, masked_target[i]] -= (1 - label_smoothing) * (1 - target_mask[i])
                                   (class weights: the docstring of the operator)
    G *= grad[:, None] / temperature[:, None]
    G *= 1 - tanh(r / c)^2                           (softcap: through the cap)
    G  = G.to(input.dtype)
    grad_input  = G @ weight        # [BT, H]
    grad_weight = G.T @ input       # [V, H]
    grad_bias   = G.sum(0)          # [V], fp32 sum, in bias dtype (return_bias_grad)

These are the gradients of ``loss_i = CE(z_i, target_i) + z_loss * lse_i^2`` (the loss's
math: ``vocab_parallel.engine.autograd``). A saved softmax cannot carry the softcap's
derivative (it needs ``z``): with ``softcap`` the high-performance form passes the saved
capped ``logits`` and the statistics instead.

This module holds the operator alone: it validates the operator's input forms (packed or
bool mask, int32 or int64 targets, clamping) and translates them to the one backend
interface (``vocab_parallel.backends.registry``: int64 local targets, -1 where the row's target is
not here, and the terms of ``G``); ``vocab_parallel.reference`` has it in float64.

Its keyword-only options:

- ``bias``: ``[V]`` this shard's bias rows (dtype of ``input``): the recomputed logits are
  ``input @ weight.T + bias``; also the dtype of ``grad_bias``.
- ``softcap``: ``c > 0``: the logits are ``c * tanh(r / c)`` of the raw ones ``r``, and
  ``G`` gets the factor ``1 - tanh(r / c)^2``. Not with ``softmax``: pass ``logits``.
- ``logits``: fp32 ``[BT, V]`` the saved logits after bias, softcap and temperature (the
  high-performance form with ``softcap``); needs ``logits_max`` and ``sum_exp_logits``;
  never modified.
- ``z_loss``: ``w >= 0``: the loss has ``+ w * lse^2``, so the softmax in ``G`` is scaled
  by ``1 + 2 * w * lse``; ``lse``: fp32 ``[BT]`` the rows' global log-sum-exp (default
  ``log(sum_exp_logits) + logits_max``; required with ``softmax``).
- ``return_bias_grad``: also return ``grad_bias = G.sum(0)`` ``[V]`` (fp32 sum of the
  rounded ``G``, in the dtype of ``bias``, or of ``input`` without one).
- ``class_weight``: ``[V]`` this shard's class weights (``F.cross_entropy``'s ``weight``):
  with ``u_i`` the weight of row i's target and ``W`` the sum of all class weights,
  ``G = p ((1-eps) u + eps W / Vg) - (1-eps) u onehot - eps/Vg w_j``. ``target_weight``:
  fp32 ``[BT]`` the ``u_i`` (default: ``class_weight`` at the row's target where it is on
  this shard; pass it under tensor parallelism, where rows whose target is elsewhere need
  it too); ``class_weight_sum``: ``W`` (default ``class_weight.sum()``: right without
  tensor parallelism).
- ``temperature``: ``T > 0``, a float or ``[BT]``: the logits are ``z / T`` (statistics and
  saved tensors are of those), and ``G`` gets the factor ``1 / T``.
"""

from __future__ import annotations

import math

import torch

from vocab_parallel.backends.interface import GradTerms, Logits, Outputs
from vocab_parallel.backends.registry import get_backend, resolve_backend
from vocab_parallel.engine import precision
from vocab_parallel.mask import unpack_target_mask
from vocab_parallel.options import (
    check_flag,
    check_label_smoothing,
    check_softcap,
    check_temperature,
    check_z_loss,
)

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# float64 inputs: the torch backend only, computed in float64 (gradcheck and the like).
_FLOATS64 = (*_FLOATS, torch.float64)


def _tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...], dims: tuple[int, ...]):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want}, got {t.dtype}")
    if t.dim() not in dims:
        want = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{name}: expected a {want} tensor, got shape {tuple(t.shape)}")
    return t


def _length(name: str, t: torch.Tensor, n: int, of: str = "rows of input") -> None:
    if t.shape[0] != n:
        raise ValueError(f"{name}: expected length {n} ({of}), got {t.shape[0]}")


def _check_operands(grad, input, weight) -> tuple[int, int, int, torch.Tensor]:
    """``input``, ``weight`` and ``grad``; returns ``(BT, H, V, grad as [BT] or [1])``."""
    _tensor("input", input, _FLOATS64, (2,))
    _tensor("weight", weight, _FLOATS64, (2,))
    if input.dtype == torch.float64 and weight.dtype != input.dtype:
        raise TypeError(
            f"input: float64 input needs a float64 weight (the float64 path computes in "
            f"float64 throughout), got weight dtype {weight.dtype}"
        )
    if weight.dtype != input.dtype:
        raise TypeError(
            f"weight: dtype {weight.dtype} differs from input dtype {input.dtype}; "
            "they must be equal"
        )
    bt, h = input.shape
    v = weight.shape[0]
    if weight.shape[1] != h:
        raise ValueError(f"weight: expected shape [V, {h}] (H of input), got {tuple(weight.shape)}")
    if v == 0:
        raise ValueError("weight: has 0 rows; the operator needs V >= 1 rows of this shard")
    _tensor("grad", grad, _vectors(input), (0, 1))
    grad = grad.reshape(-1)
    if grad.shape[0] not in (bt, 1):
        raise ValueError(f"grad: expected shape [{bt}] or [1], got {tuple(grad.shape)}")
    return bt, h, v, grad


def _vectors(input: torch.Tensor) -> tuple[torch.dtype, ...]:
    """Dtypes of the fp32 vectors and saved tensors (float64 too for float64 inputs)."""
    return (torch.float32, torch.float64) if input.dtype == torch.float64 else (torch.float32,)


def _not_here(target_mask, masked_target, bt: int) -> torch.Tensor:
    """The bool ``[BT]`` "target not on this shard" of a packed or bool ``target_mask``."""
    _tensor("target_mask", target_mask, (torch.uint8, torch.bool), (1,))
    _tensor("masked_target", masked_target, (torch.int32, torch.int64), (1,))
    _length("masked_target", masked_target, bt)
    if target_mask.dtype == torch.bool:
        _length("target_mask", target_mask, bt)
        return target_mask
    if target_mask.shape[0] * 8 < bt:
        raise ValueError(
            f"target_mask: bit-packed uint8 mask too short: {target_mask.shape[0]} bytes hold "
            f"{target_mask.shape[0] * 8} rows, need at least {math.ceil(bt / 8)} bytes for {bt}"
        )
    if bt > 1 and target_mask.shape[0] == bt and bool((target_mask <= 1).all()):
        # One 0/1 byte per row read as bits would silently give the wrong rows.
        raise ValueError(
            f"target_mask: a uint8 mask of {bt} bytes holding only 0 and 1 looks like one "
            f"byte per row, but uint8 masks are bit-packed ({math.ceil(bt / 8)} bytes for "
            f"{bt} rows); pass target_mask.bool(), or pack_target_mask(target_mask.bool())"
        )
    return unpack_target_mask(target_mask, bt)


def _check_source(input, bt, v, softmax, logits, logits_max, sum_exp_logits, softcap) -> None:
    """The softmax source: a saved softmax, or the statistics (with saved ``logits``)."""
    f32 = _vectors(input)
    if softmax is not None and logits is not None:
        raise ValueError(
            "logits: given together with softmax; pass one of them (softmax, or the saved "
            "capped logits with logits_max and sum_exp_logits)"
        )
    if softmax is not None:
        _tensor("softmax", softmax, f32, (2,))
        if tuple(softmax.shape) != (bt, v):
            raise ValueError(f"softmax: expected shape [{bt}, {v}], got {tuple(softmax.shape)}")
        if softcap is not None:
            raise ValueError(
                "softmax: cannot be combined with softcap (the gradient through the cap "
                "needs the logits); pass logits= (after bias and softcap) with logits_max "
                "and sum_exp_logits instead"
            )
        return
    if logits is not None:
        _tensor("logits", logits, f32, (2,))
        if tuple(logits.shape) != (bt, v):
            raise ValueError(f"logits: expected shape [{bt}, {v}], got {tuple(logits.shape)}")
    for name, t in (("logits_max", logits_max), ("sum_exp_logits", sum_exp_logits)):
        if t is None:
            raise ValueError(
                f"{name}: required when softmax is None (memory-saving mode); "
                "pass logits_max and sum_exp_logits, or softmax"
            )
        _tensor(name, t, f32, (1,))
        _length(name, t, bt)


def _check_rows(input, bt, v, bias, class_weight, target_weight, temperature, lse) -> None:
    """The per-column (``bias``, ``class_weight``) and per-row tensor options."""
    if bias is not None:
        _tensor("bias", bias, _FLOATS64, (1,))
        if bias.dtype != input.dtype:
            raise TypeError(
                f"bias: dtype {bias.dtype} differs from input dtype {input.dtype}; "
                "they must be equal"
            )
        _length("bias", bias, v, "rows of weight")
    if class_weight is not None:
        _tensor("class_weight", class_weight, _FLOATS64, (1,))
        _length("class_weight", class_weight, v, "rows of weight")
    elif target_weight is not None:
        raise ValueError("target_weight: given without class_weight")
    for name, t in (("target_weight", target_weight), ("lse", lse)):
        if t is not None:
            _tensor(name, t, _vectors(input), (1,))
            _length(name, t, bt)
    if isinstance(temperature, torch.Tensor):
        _tensor("temperature", temperature, _FLOATS64, (0, 1))
        if temperature.numel() not in (1, bt):
            raise ValueError(
                f"temperature: expected a float or a tensor of {bt} (rows of input) or 1 "
                f"values, got shape {tuple(temperature.shape)}"
            )


def _check_devices(input, **tensors) -> None:
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device != input.device:
            raise ValueError(
                f"{name}: on device {t.device}, but input is on {input.device}; "
                "all tensors must be on one device"
            )


def _check_vocab(global_vocab_size, v: int) -> int:
    if global_vocab_size is None:
        return v
    if isinstance(global_vocab_size, bool) or not isinstance(global_vocab_size, int):
        raise TypeError(
            f"global_vocab_size: expected an int, got {type(global_vocab_size).__name__}"
        )
    if global_vocab_size < max(v, 1):
        raise ValueError(
            f"global_vocab_size: expected an int >= V={max(v, 1)}, got {global_vocab_size}"
        )
    return global_vocab_size


def fused_linear_cross_entropy_loss_grad(
    grad: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    target_mask: torch.Tensor,
    masked_target: torch.Tensor,
    label_smoothing: float = 0.0,
    logits_max: torch.Tensor | None = None,
    sum_exp_logits: torch.Tensor | None = None,
    softmax: torch.Tensor | None = None,
    *,
    global_vocab_size: int | None = None,
    backend: str = "auto",
    grad_input_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    logits: torch.Tensor | None = None,
    z_loss: float = 0.0,
    lse: torch.Tensor | None = None,
    return_bias_grad: bool = False,
    class_weight: torch.Tensor | None = None,
    target_weight: torch.Tensor | None = None,
    class_weight_sum: float | None = None,
    temperature: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, ...]:
    """Gradients of the vocabulary-parallel linear + cross entropy for one shard.

    Args:
        grad: fp32 ``[BT]`` upstream gradient of each token's loss; ``[1]`` or 0-d
            broadcasts to every row.
        input: ``[BT, H]`` hidden states, fp16, bf16 or fp32.
        weight: ``[V, H]`` this shard's rows of the LM head, same dtype as ``input``.
        target_mask: bit-packed uint8 of at least ``ceil(BT/8)`` bytes (LSB first) or bool
            ``[BT]``; 1/True means the row's target is not on this shard (or is ignored).
        masked_target: int32/int64 ``[BT]`` local target column; clamped into ``[0, V-1]``.
        label_smoothing: ``0 <= eps < 1``; the target distribution is
            ``(1-eps) * onehot + eps / global_vocab_size``.
        logits_max, sum_exp_logits: fp32 ``[BT]`` global statistics of the forward (of the
            logits after softcap and temperature); required in memory-saving mode
            (``softmax`` None), ignored otherwise.
        softmax: fp32 ``[BT, V]`` saved probabilities (high-performance mode); never
            modified.
        global_vocab_size: vocabulary size over all shards, for label smoothing
            (default ``V``: right without tensor parallelism).
        backend: ``"triton"``, ``"torch"`` or ``"auto"`` (Triton for CUDA tensors).
        grad_input_dtype: dtype of ``grad_input`` (default ``input.dtype``). Pass
            ``torch.float32`` to get the fp32 accumulator itself, e.g. to sum ``grad_input``
            over tensor-parallel ranks before rounding it once.
        bias, softcap, logits, z_loss, lse, return_bias_grad, class_weight,
        target_weight, class_weight_sum, temperature: the options of the module
            docstring.

    float64 ``input`` and ``weight`` (torch backend only) are computed in float64; their
    statistics and ``grad`` may be float64 too.

    Returns:
        ``(grad_input [BT, H], grad_weight [V, H])`` in ``input.dtype``, accumulated in fp32,
        bitwise deterministic; ``(grad_input, grad_weight, grad_bias)`` with
        ``return_bias_grad``.

    Raises:
        TypeError, ValueError: naming the offending parameter.
    """
    bt, h, v, grad = _check_operands(grad, input, weight)
    not_here = _not_here(target_mask, masked_target, bt)
    eps = check_label_smoothing(label_smoothing)
    vg = _check_vocab(global_vocab_size, v)
    softcap, z_loss = check_softcap(softcap), check_z_loss(z_loss)
    temperature = check_temperature(temperature)
    check_flag("return_bias_grad", return_bias_grad)
    _check_rows(input, bt, v, bias, class_weight, target_weight, temperature, lse)
    _check_source(input, bt, v, softmax, logits, logits_max, sum_exp_logits, softcap)
    if lse is None and z_loss and softmax is not None:
        raise ValueError(
            "lse: required with z_loss and softmax (the softmax's factor is "
            "1 + 2 * z_loss * lse); pass the rows' log-sum-exp"
        )
    _check_devices(
        input, grad=grad, weight=weight, target_mask=target_mask, masked_target=masked_target,
        softmax=softmax, logits_max=logits_max, sum_exp_logits=sum_exp_logits, bias=bias,
        logits=logits, lse=lse, class_weight=class_weight, target_weight=target_weight,
        temperature=temperature,
    )  # fmt: skip
    if grad_input_dtype is None:
        grad_input_dtype = input.dtype
    allowed = _FLOATS64 if input.dtype == torch.float64 else _FLOATS
    if grad_input_dtype not in allowed:
        raise TypeError(f"grad_input_dtype: expected one of {allowed}, got {grad_input_dtype}")
    which = resolve_backend(backend, input.device, input.dtype, "input")
    terms = dict(
        label_smoothing=eps, global_vocab_size=vg, z_loss=z_loss, lse=lse,
        logits_max=logits_max, sum_exp=sum_exp_logits, softmax=softmax, logits=logits,
        class_weight=class_weight, target_weight=target_weight,
        class_weight_sum=class_weight_sum,
    )  # fmt: skip
    out = Outputs(need_bias=return_bias_grad, grad_input_dtype=grad_input_dtype)
    grads = _dispatch(which, grad, input, weight, not_here, masked_target, bias, softcap,
                      temperature, terms, out)  # fmt: skip
    return tuple(grads) if return_bias_grad else (grads.input, grads.weight)


@torch.no_grad()
def _dispatch(
    which, grad, input, weight, not_here, masked_target, bias, softcap, temperature, terms, out
):
    """The validated operator on the backend ``which`` (the one interface). Not itself
    differentiated: tensors that require grad (a head's own parameter) are read as values."""
    v = weight.shape[0]
    target = masked_target.to(torch.int64).clamp(0, max(v - 1, 0))
    local_target = target.masked_fill(not_here, -1)
    accum = precision.accumulate_dtype(input.dtype)
    inv_t = None
    if isinstance(temperature, torch.Tensor) or temperature != 1.0:
        inv_t = 1.0 / torch.as_tensor(temperature, dtype=accum, device=input.device)
        inv_t = inv_t.reshape(-1).expand(input.shape[0])
    grad_terms = _terms(grad, local_target, accum=accum, **terms)
    logits = Logits(bias, softcap, inv_t)
    return get_backend(which).fused_backward(input, weight, local_target, logits, grad_terms, out)


def _terms(
    grad, local_target, *, label_smoothing, global_vocab_size, z_loss, lse, logits_max,
    sum_exp, softmax, logits, class_weight, target_weight, class_weight_sum, accum,
) -> GradTerms:  # fmt: skip
    """The operator's inputs as the backend interface's :class:`GradTerms`."""
    eps, vg = label_smoothing, global_vocab_size
    if softmax is not None:  # the statistics are ignored in high-performance mode
        logits_max = sum_exp = None
    prob_scale, on_target = None, 1.0 - eps
    cw = None
    if class_weight is not None:
        cw = class_weight.to(accum)
        if target_weight is None:
            here = local_target >= 0
            target_weight = torch.where(here, cw[local_target.clamp(min=0)], 0.0)
        total = cw.sum() if class_weight_sum is None else float(class_weight_sum)
        on_target = (1.0 - eps) * target_weight.to(accum)
        prob_scale = on_target + eps * total / vg
    if z_loss:
        if lse is None:
            lse = torch.log(sum_exp.to(accum)) + logits_max.to(accum)
        z_term = (2.0 * z_loss) * lse.to(accum)
        prob_scale = 1.0 + z_term if prob_scale is None else prob_scale + z_term
    return GradTerms(
        grad=grad,
        on_target=on_target,
        smooth=eps / vg,
        prob_scale=prob_scale,
        class_weight=cw if eps else None,
        logits_max=logits_max,
        sum_exp=sum_exp,
        softmax=softmax,
        logits=logits,
    )
