"""The precision policy of every matrix product in the library (SPEC.md section 5).

On every device: logits and both gradient products accumulate in fp32 and come out in
fp32; the only roundings are ``G``'s (to the input dtype, once, before the gradient
products) and the final outputs'. How a device gets there is decided in one place,
:func:`operand_dtype`:

- fp32 inputs: plain fp32 GEMMs.
- half inputs on CUDA: the operands stay in the input dtype and cuBLAS writes fp32
  (``torch.mm(a, b, out_dtype=torch.float32)``): tensor cores, fp32 accumulation, no
  rounding of the result to half (and no reduced-precision split-K reduction).
- half inputs elsewhere (CPUs): the operands are upcast to fp32, one chunk at a time.
  Most CPUs have no bf16/fp16 matrix units; half GEMMs there are hundreds of times
  slower, and products of half values are exact in fp32, so the result is the same.
- float64 inputs (the torch backend only; for checks such as ``gradcheck``): everything
  is float64 instead of fp32, :func:`accumulate_dtype`: products, statistics, ``G`` and
  the loss.

Hook: a CPU with bf16/fp16 matrix units (AMX, SME...) would answer ``dtype`` in
:func:`operand_dtype` for it; :func:`mm_fp32` then needs a CPU GEMM with fp32 output
(it falls back to an exact fp32 upcast while torch has none).
"""

from __future__ import annotations

import functools

import torch

_HALF = (torch.float16, torch.bfloat16)


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype products, statistics, ``G`` and the loss are accumulated and held in, for
    inputs of ``dtype``: fp32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def operand_dtype(dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype the operands of a product are handed to the GEMM in, for inputs of
    ``dtype`` on a device of type ``device_type`` ("cuda", "cpu", ...): the policy."""
    if dtype in _HALF and device_type == "cuda":
        return dtype  # cuBLAS: half operands, fp32 accumulation and output
    return accumulate_dtype(dtype)


@functools.cache
def mm_out_dtype_supported(device_type: str) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` runs on half operands here
    (recent torch, CUDA only; the CPU kernel raises "Could not run 'aten::mm.dtype'")."""
    if device_type != "cuda" or not hasattr(torch.ops.aten.mm, "dtype"):
        return False
    try:
        a = torch.ones((2, 2), dtype=torch.bfloat16, device=device_type)
        out = torch.mm(a, a, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return out.dtype == torch.float32


def mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` accumulated in fp32 and returned in fp32 (into ``out`` when given).

    ``a`` and ``b`` share a dtype, fp32 or half (float64 operands: a float64 product).
    Half operands go to a GEMM with fp32 output where the device has one; elsewhere they
    are upcast (exactly) to fp32.
    """
    if a.dtype in _HALF:
        if mm_out_dtype_supported(a.device.type):
            if out is None or out.is_contiguous():
                return torch.mm(a, b, out_dtype=torch.float32, out=out)
            return out.copy_(torch.mm(a, b, out_dtype=torch.float32))
        a, b = a.float(), b.float()
    return torch.mm(a, b, out=out)


def addmm_fp32_(
    acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """``acc += a @ b`` for an fp32 ``acc``, the product accumulated in fp32 (float64
    ``acc`` and operands: in float64).

    Half operands go through :func:`mm_fp32` into ``scratch`` (an fp32 buffer shaped like
    ``acc``, reused across calls) and are added: torch's in-place addmm needs operands of
    ``acc``'s dtype.
    """
    if a.dtype == acc.dtype:
        return acc.addmm_(a, b)
    return acc.add_(mm_fp32(a, b, out=scratch))


def round_to(g: torch.Tensor, dtype: torch.dtype, operand: torch.dtype) -> torch.Tensor:
    """``g`` (fp32, or already ``dtype``) with its values rounded to ``dtype``, held in the
    ``operand`` dtype of the products that follow (reusing ``g``'s fp32 buffer if it can)."""
    if g.dtype != dtype:
        rounded = g.to(dtype)
        if operand == g.dtype:
            return g.copy_(rounded)
        g = rounded
    return g.to(operand)
