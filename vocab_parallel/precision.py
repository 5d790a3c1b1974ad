"""The precision policy of every matrix product in the library (docs/design.md, "Precision").

On every device: logits and both gradient products accumulate in fp32, and ``G`` is
rounded to the input dtype once, before the gradient products. How a device gets there
is decided in one place, :func:`operand_dtype`:

- fp32 inputs: plain fp32 GEMMs.
- half inputs on CUDA: the operands stay in the input dtype and cuBLAS writes fp32
  (``torch.mm(a, b, out_dtype=torch.float32)``): tensor cores, fp32 accumulation, no
  rounding of the result to half (and no reduced-precision split-K reduction).
- half inputs on a CPU with matrix units for that dtype (AVX512-BF16 or AMX for bf16;
  AVX512-FP16 or AMX-FP16 for fp16, as ``torch.cpu`` and oneDNN report them; decided once
  per process, never by timing, :func:`cpu_half_gemms`): the operands stay in the input
  dtype, oneDNN accumulates in fp32 and rounds each product to the input dtype (torch has
  no CPU GEMM with fp32 output). bf16 GEMMs run 2-3x faster than fp32 there; the logits
  are then rounded to bf16 as ``F.linear`` rounds them, so the loss is within bf16
  tolerance of float64 rather than fp32 tolerance. ``VOCAB_PARALLEL_CPU_HALF_GEMMS=0``
  (or :func:`set_cpu_half_gemms`) keeps the exact fp32 upcast below.
- half inputs on other CPUs: the operands are upcast to fp32, one chunk at a time. Half
  GEMMs there are hundreds of times slower, and products of half values are exact in
  fp32, so the result is that of an fp32-output GEMM.
- float64 inputs (the torch backend only; for checks such as ``gradcheck``): everything
  is float64 instead of fp32, :func:`accumulate_dtype`: products, statistics, ``G`` and
  the loss.
"""

from __future__ import annotations

import functools
import os

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
    if dtype in _HALF and device_type == "cpu" and cpu_half_gemms(dtype):
        return dtype  # oneDNN on bf16/fp16 matrix units: fp32 accumulation, half output
    return accumulate_dtype(dtype)


# Set by set_cpu_half_gemms (None: decide from the environment and the CPU).
_CPU_HALF_OVERRIDE: bool | None = None
CPU_HALF_ENV = "VOCAB_PARALLEL_CPU_HALF_GEMMS"


def set_cpu_half_gemms(enabled: bool | None) -> None:
    """Force half-precision CPU GEMMs on (``True``: also on CPUs without matrix units,
    where they are very slow; for tests), off (``False``: the exact fp32 upcast), or
    back to the CPU's own answer (``None``)."""
    global _CPU_HALF_OVERRIDE
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool or None, got {type(enabled).__name__}")
    _CPU_HALF_OVERRIDE = enabled


def cpu_half_gemms(dtype: torch.dtype) -> bool:
    """Whether products of ``dtype`` (bf16/fp16) operands run natively on this CPU: the
    override, else ``VOCAB_PARALLEL_CPU_HALF_GEMMS`` ("0"/"1", read once per process),
    else what the CPU has. Called for every product: nothing here is recomputed."""
    if _CPU_HALF_OVERRIDE is not None:
        return _CPU_HALF_OVERRIDE
    forced = _env_choice()
    return cpu_has_half_units(dtype) if forced is None else forced


@functools.cache
def _env_choice() -> bool | None:
    """``VOCAB_PARALLEL_CPU_HALF_GEMMS`` as read once per process (None: unset)."""
    env = os.environ.get(CPU_HALF_ENV, "").strip().lower()
    if env in ("0", "false", "no", "off"):
        return False
    if env in ("1", "true", "yes", "on"):
        return True
    return None


@functools.cache
def cpu_has_half_units(dtype: torch.dtype) -> bool:
    """Whether this CPU has matrix units for ``dtype`` that oneDNN uses, from what torch
    reports (``torch.cpu`` capabilities and oneDNN's own bf16/fp16 support check), once
    per process. bf16: AVX512-BF16 or AMX-BF16; fp16: AVX512-FP16 or AMX-FP16."""
    if dtype not in _HALF or not torch.backends.mkldnn.is_available():
        return False
    flags = ("avx512_bf16", "amx_bf16") if dtype == torch.bfloat16 else ("avx512_fp16", "amx_fp16")
    try:
        caps = torch.cpu.get_capabilities()
        has_units = any(caps.get(flag, False) for flag in flags)
        mkldnn = torch.ops.mkldnn
        if dtype == torch.bfloat16:
            onednn = mkldnn._is_mkldnn_bf16_supported()
        else:
            onednn = mkldnn._is_mkldnn_fp16_supported()
    except (AttributeError, RuntimeError):  # an older torch: keep the exact upcast
        return False
    return bool(has_units and onednn)


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


def product_dtype(dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype a product of inputs of ``dtype`` comes out of the GEMM in: the input
    dtype on a CPU running half GEMMs natively (oneDNN rounds each product to it), else
    the accumulation dtype. Logits kept in it lose nothing more."""
    operand = operand_dtype(dtype, device_type)
    if operand in _HALF and device_type == "cpu" and not mm_out_dtype_supported(device_type):
        return operand
    return accumulate_dtype(dtype)


def mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` accumulated in fp32 and returned in fp32 (into ``out`` when given).

    ``a`` and ``b`` share a dtype, fp32 or half (float64 operands: a float64 product).
    Half operands go to a GEMM with fp32 output where the device has one; on a CPU with
    half matrix units to a half GEMM (fp32 accumulation, the product rounded to half);
    elsewhere they are upcast (exactly) to fp32.
    """
    if a.dtype in _HALF:
        if mm_out_dtype_supported(a.device.type):
            if out is None or out.is_contiguous():
                return torch.mm(a, b, out_dtype=torch.float32, out=out)
            return out.copy_(torch.mm(a, b, out_dtype=torch.float32))
        if a.device.type == "cpu" and cpu_half_gemms(a.dtype):
            if out is not None and out.dtype == a.dtype and out.is_contiguous():
                return torch.mm(a, b, out=out)  # kept in half: product_dtype
            product = torch.mm(a, b)
            return product.float() if out is None else out.copy_(product)
        a, b = a.float(), b.float()
    return torch.mm(a, b, out=out)


def addmm_fp32_(
    acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """``acc += a @ b`` for an fp32 ``acc``, the product accumulated in fp32 (float64
    ``acc`` and operands: in float64). On a CPU with half GEMMs the product of half
    operands is rounded to half once before it is added (oneDNN has no fp32 output):
    a sum over several calls then carries one half rounding per call.

    Half operands go through :func:`mm_fp32` into ``scratch`` (an fp32 buffer shaped like
    ``acc``, reused across calls) and are added: torch's in-place addmm needs operands of
    ``acc``'s dtype.
    """
    if a.dtype == acc.dtype:
        return acc.addmm_(a, b)
    if a.device.type == "cpu" and a.dtype in _HALF and cpu_half_gemms(a.dtype):
        return acc.add_(torch.mm(a, b))  # the half product added in fp32: no fp32 copy of it
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
