"""The public backward operator: validation, normalisation of input forms, dispatch.

``fused_linear_cross_entropy_loss_grad`` is the vocabulary-parallel linear + cross
entropy backward (after Ascend's aclnnFusedLinearCrossEntropyLossGrad, with the errata
of SPEC.md). Its math, in one place (the keyword-only options ``bias``, ``softcap`` = c,
``z_loss`` = w, ``lse`` and ``logits`` extend the seed's operator; without them it is
the seed's):

    r = input @ weight.T + bias                      (the raw logits; bias: 0 if None)
    z = c * tanh(r / c)  if softcap, else r          (the logits the softmax sees)
    G = softmax                                      if softmax is given
    G = exp(logits - logits_max) / sum_exp_logits    elif logits (saved z) is given
    G = exp(z - logits_max) / sum_exp_logits         otherwise (recomputed)
    G *= 1 + 2 * z_loss * lse[:, None]               (z-loss; lse = log(sum_exp) + max)
    G -= label_smoothing / global_vocab_size                     (every column)
    G[i, masked_target[i]] -= (1 - label_smoothing) * (1 - target_mask[i])
    G *= grad[:, None]
    G *= 1 - tanh(r / c)^2 = 1 - (z / c)^2           (softcap: through the cap)
    G  = G.to(input.dtype)
    grad_input  = G @ weight        # [BT, H]
    grad_weight = G.T @ input       # [V, H]
    grad_bias   = G.sum(0)          # [V], fp32 sum, in bias dtype (return_bias_grad)

These are the gradients of ``loss_i = CE(z_i, target_i) + z_loss * lse_i^2`` (the loss's
math: ``vocab_parallel.autograd``). A saved softmax cannot carry the softcap's
derivative (it needs ``z``): with ``softcap`` the high-performance form passes the saved
capped ``logits`` and the statistics instead.

Backends implement it tile by tile (``vocab_parallel.kernels.backward``) or chunk by
chunk (``vocab_parallel.torch_backend``); ``vocab_parallel.reference`` has it in float64.
This module validates the operator's input forms (packed or bool mask, int32 or int64
targets, clamping) and converts them to the one interface both backends share (and the
loss calls directly): int64 local targets, -1 where the row's target is not here.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable

import torch

from vocab_parallel import precision, torch_backend
from vocab_parallel.mask import unpack_target_mask

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# float64 inputs: the torch backend only, computed in float64 (gradcheck and the like).
_FLOATS64 = (*_FLOATS, torch.float64)
_BACKENDS = ("auto", "torch", "triton")


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


def _length(name: str, t: torch.Tensor, n: int) -> None:
    if t.shape[0] != n:
        raise ValueError(f"{name}: expected length {n} (rows of input), got {t.shape[0]}")


def _length_v(name: str, t: torch.Tensor, v: int) -> None:
    if t.shape[0] != v:
        raise ValueError(f"{name}: expected length {v} (rows of weight), got {t.shape[0]}")


def check_backend_name(backend: object) -> None:
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")


def resolve_backend(
    backend: str, device: torch.device, dtype: torch.dtype | None = None, name: str = "input"
) -> str:
    """``"auto"`` means Triton on CUDA tensors and the torch backend elsewhere (and for
    float64 inputs, which only the torch backend computes).

    ``"triton"`` needs CUDA tensors, or CPU tensors with Triton's interpreter switched on
    (``TRITON_INTERPRET=1`` before triton is imported); anything else would fail inside
    Triton with "0 active drivers", so it is refused here, naming ``backend``. float64
    inputs (``dtype``) on ``"triton"`` raise a TypeError naming the input ``name``.
    """
    check_backend_name(backend)
    if backend == "auto":
        return "triton" if device.type == "cuda" and dtype != torch.float64 else "torch"
    if backend == "triton" and dtype == torch.float64:
        raise TypeError(
            f"{name}: float64 is not supported by backend='triton' (its kernels compute in "
            "fp32); use backend='torch' (or 'auto'), which computes float64 in float64"
        )
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ValueError(
                "backend: 'triton' needs the triton package (pip install triton); "
                "use backend='torch'"
            )
        interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        if device.type != "cuda" and not interpreted:
            raise ValueError(
                f"backend: 'triton' runs on CUDA tensors (these are on {device}), or under "
                "Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported, for "
                "tests); use backend='torch' or 'auto'"
            )
    return backend


def backend_forward_stats(which: str) -> Callable:
    """``forward_stats`` of the resolved backend ``which`` ("torch" or "triton")."""
    if which == "triton":
        from vocab_parallel.kernels import forward

        return forward.forward_stats
    return torch_backend.forward_stats


def backend_backward(which: str) -> Callable:
    """``fused_backward`` of the resolved backend ``which`` ("torch" or "triton")."""
    if which == "triton":
        from vocab_parallel.kernels import backward

        return backward.fused_backward
    return torch_backend.fused_backward


def check_softcap(softcap: object) -> float | None:
    """``softcap``: None, or a finite number > 0 (the ``c`` of ``c * tanh(z / c)``)."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap: expected None or a float > 0, got {type(softcap).__name__}")
    c = float(softcap)
    if not (0.0 < c < math.inf):
        raise ValueError(f"softcap: expected None or a finite float > 0, got {c}")
    return c


def check_z_loss(z_loss: object) -> float:
    """``z_loss``: a finite number >= 0 (the coefficient of ``lse^2``)."""
    if isinstance(z_loss, bool) or not isinstance(z_loss, (int, float)):
        raise TypeError(f"z_loss: expected a float >= 0, got {type(z_loss).__name__}")
    w = float(z_loss)
    if not (0.0 <= w < math.inf):
        raise ValueError(f"z_loss: expected a finite float >= 0, got {w}")
    return w


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


def check_label_smoothing(label_smoothing: object) -> float:
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"label_smoothing: expected a float, got {type(label_smoothing).__name__}")
    eps = float(label_smoothing)
    if not (0.0 <= eps < 1.0):
        raise ValueError(f"label_smoothing: expected 0 <= label_smoothing < 1, got {eps}")
    return eps


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
        logits_max, sum_exp_logits: fp32 ``[BT]`` global statistics of the forward;
            required in memory-saving mode (``softmax`` None), ignored otherwise.
        softmax: fp32 ``[BT, V]`` saved probabilities (high-performance mode); never
            modified.
        global_vocab_size: vocabulary size over all shards, for label smoothing
            (default ``V``: right without tensor parallelism).
        backend: ``"triton"``, ``"torch"`` or ``"auto"`` (Triton for CUDA tensors).
        grad_input_dtype: dtype of ``grad_input`` (default ``input.dtype``). Pass
            ``torch.float32`` to get the fp32 accumulator itself, e.g. to sum ``grad_input``
            over tensor-parallel ranks before rounding it once.
        bias: ``[V]`` this shard's bias rows (dtype of ``input``): the recomputed logits
            are ``input @ weight.T + bias``; also the dtype of ``grad_bias``.
        softcap: ``c > 0``: the logits are ``c * tanh(r / c)`` of the raw ones ``r``, and
            ``G`` gets the factor ``1 - tanh(r / c)^2``. Not with ``softmax``: pass
            ``logits``.
        logits: fp32 ``[BT, V]`` the saved logits after bias and softcap (the
            high-performance form with ``softcap``); needs ``logits_max`` and
            ``sum_exp_logits``; never modified.
        z_loss: ``w >= 0``: the loss has ``+ w * lse^2``, so the softmax in ``G`` is
            scaled by ``1 + 2 * w * lse``.
        lse: fp32 ``[BT]`` the rows' global log-sum-exp, for ``z_loss``; default
            ``log(sum_exp_logits) + logits_max`` (required with ``softmax``).
        return_bias_grad: also return ``grad_bias = G.sum(0)`` ``[V]`` (fp32 sum of the
            rounded ``G``, in the dtype of ``bias``, or of ``input`` without one).

    float64 ``input`` and ``weight`` (torch backend only) are computed in float64; their
    statistics and ``grad`` may be float64 too.

    Returns:
        ``(grad_input [BT, H], grad_weight [V, H])`` in ``input.dtype``, accumulated in fp32,
        bitwise deterministic; ``(grad_input, grad_weight, grad_bias)`` with
        ``return_bias_grad``.

    Raises:
        TypeError, ValueError: naming the offending parameter.
    """
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
    # fp32 vectors and saved tensors; float64 ones too for float64 inputs.
    f32 = (torch.float32, torch.float64) if input.dtype == torch.float64 else (torch.float32,)
    _tensor("grad", grad, f32, (0, 1))
    grad = grad.reshape(-1)
    if grad.shape[0] not in (bt, 1):
        raise ValueError(f"grad: expected shape [{bt}] or [1], got {tuple(grad.shape)}")
    _tensor("target_mask", target_mask, (torch.uint8, torch.bool), (1,))
    packed = target_mask.dtype == torch.uint8
    if packed and target_mask.shape[0] * 8 < bt:
        raise ValueError(
            f"target_mask: bit-packed uint8 mask too short: {target_mask.shape[0]} bytes hold "
            f"{target_mask.shape[0] * 8} rows, need at least {math.ceil(bt / 8)} bytes for {bt}"
        )
    if not packed:
        _length("target_mask", target_mask, bt)
    elif bt > 8 and target_mask.shape[0] == bt and bool((target_mask <= 1).all()):
        # One 0/1 byte per row read as bits would silently give the wrong rows.
        raise ValueError(
            f"target_mask: a uint8 mask of {bt} bytes holding only 0 and 1 looks like one "
            f"byte per row, but uint8 masks are bit-packed ({math.ceil(bt / 8)} bytes for "
            f"{bt} rows); pass target_mask.bool(), or pack_target_mask(target_mask.bool())"
        )
    _tensor("masked_target", masked_target, (torch.int32, torch.int64), (1,))
    _length("masked_target", masked_target, bt)
    eps = check_label_smoothing(label_smoothing)
    if global_vocab_size is None:
        global_vocab_size = v
    if isinstance(global_vocab_size, bool) or not isinstance(global_vocab_size, int):
        raise TypeError(
            f"global_vocab_size: expected an int, got {type(global_vocab_size).__name__}"
        )
    if global_vocab_size < max(v, 1):
        raise ValueError(
            f"global_vocab_size: expected an int >= V={max(v, 1)}, got {global_vocab_size}"
        )
    softcap = check_softcap(softcap)
    z_loss = check_z_loss(z_loss)
    check_flag("return_bias_grad", return_bias_grad)
    if bias is not None:
        _tensor("bias", bias, _FLOATS64, (1,))
        if bias.dtype != input.dtype:
            raise TypeError(
                f"bias: dtype {bias.dtype} differs from input dtype {input.dtype}; "
                "they must be equal"
            )
        _length_v("bias", bias, v)
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
        stats = {}
    else:
        if logits is not None:
            _tensor("logits", logits, f32, (2,))
            if tuple(logits.shape) != (bt, v):
                raise ValueError(f"logits: expected shape [{bt}, {v}], got {tuple(logits.shape)}")
        stats = {"logits_max": logits_max, "sum_exp_logits": sum_exp_logits}
        for name, t in stats.items():
            if t is None:
                raise ValueError(
                    f"{name}: required when softmax is None (memory-saving mode); "
                    "pass logits_max and sum_exp_logits, or softmax"
                )
            _tensor(name, t, f32, (1,))
            _length(name, t, bt)
    if lse is not None:
        _tensor("lse", lse, f32, (1,))
        _length("lse", lse, bt)
    elif z_loss and softmax is not None:
        raise ValueError(
            "lse: required with z_loss and softmax (the softmax's factor is "
            "1 + 2 * z_loss * lse); pass the rows' log-sum-exp"
        )
    named = {"grad": grad, "weight": weight, "target_mask": target_mask}
    named |= {"masked_target": masked_target, "softmax": softmax, **stats}
    named |= {"bias": bias, "logits": logits, "lse": lse}
    for name, t in named.items():
        if t is not None and t.device != input.device:
            raise ValueError(
                f"{name}: on device {t.device}, but input is on {input.device}; "
                "all tensors must be on one device"
            )
    if grad_input_dtype is None:
        grad_input_dtype = input.dtype
    allowed = _FLOATS64 if input.dtype == torch.float64 else _FLOATS
    if grad_input_dtype not in allowed:
        raise TypeError(f"grad_input_dtype: expected one of {allowed}, got {grad_input_dtype}")
    which = resolve_backend(backend, input.device, input.dtype, "input")

    # This operator computes gradients; it is not itself differentiated. Tensors that
    # require grad (e.g. a head's own nn.Parameter) are read as plain values.
    with torch.no_grad():
        # The one backend interface: int64 local targets, -1 where no one-hot is here.
        not_here = unpack_target_mask(target_mask, bt) if packed else target_mask
        target = masked_target.to(torch.int64).clamp(0, max(v - 1, 0))
        local_target = target.masked_fill(not_here, -1)
        if softmax is not None:  # the statistics are ignored in high-performance mode
            logits_max = sum_exp_logits = None
        # The options' arguments only when set: without them the call is the seed's.
        extra = {"bias": bias} if bias is not None else {}
        extra |= {"softcap": softcap} if softcap is not None else {}
        extra |= {"logits": logits} if logits is not None else {}
        extra |= {"need_bias_grad": True} if return_bias_grad else {}
        if z_loss:
            accum = precision.accumulate_dtype(input.dtype)
            if lse is None:
                lse = torch.log(sum_exp_logits.to(accum)) + logits_max.to(accum)
            extra["prob_scale"] = 1.0 + (2.0 * z_loss) * lse.to(accum)
        return backend_backward(which)(
            grad,
            input,
            weight,
            local_target,
            logits_max,
            sum_exp_logits,
            softmax,
            1.0 - eps,
            eps / global_vocab_size,
            grad_input_dtype=grad_input_dtype,
            **extra,
        )
