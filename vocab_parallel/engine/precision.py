"""The precision policy of every matrix product in the library (docs/design.md, "Precision").

On every device, by default: logits and both gradient products accumulate in fp32 and
come out in fp32 (nothing is rounded to half on the way), and ``G`` is rounded to the
input dtype once, before the gradient products. How a device gets there is decided here,
:func:`operand_dtype` and :func:`cpu_bf16_math`:

- fp32 inputs: plain fp32 GEMMs.
- half inputs on CUDA: the operands stay in the input dtype and cuBLAS writes fp32
  (``torch.mm(a, b, out_dtype=torch.float32)``): tensor cores, fp32 accumulation, no
  rounding of the result to half (and no reduced-precision split-K reduction).
- half inputs on CPUs: the operands are upcast to fp32, one chunk at a time, and the
  GEMMs are fp32 GEMMs. Products of half values are exact in fp32, so the result is that
  of a half GEMM with fp32 output, which torch does not have on CPUs (its half GEMMs
  round every product to half: a loss off by ~1e-4 and, with large logits, gradients
  off by 20%, which is why the library does not use them).
- bf16 inputs on a CPU where oneDNN runs fp32 GEMMs on bf16 units (AMX): those fp32
  GEMMs are run with oneDNN's bf16 math mode (``torch.backends.mkldnn.matmul
  .fp32_precision = "bf16"``, torch >= 2.9), scoped to the library's own products by
  :func:`cpu_bf16_math`. It converts the fp32 operands to bf16 and accumulates in fp32
  with fp32 output: for operands that hold bf16 values (bf16 inputs, the bf16-rounded
  ``G``) the conversion is exact, so the result is still the exact fp32 product, at the
  bf16 units' rate. Never for fp16 or fp32 inputs, whose values bf16 cannot hold.
- float64 inputs (the torch backend only; for checks such as ``gradcheck``): everything
  is float64 instead of fp32, :func:`accumulate_dtype`: products, statistics, ``G`` and
  the loss.

``VOCAB_PARALLEL_CPU_HALF_GEMMS`` (or :func:`set_cpu_half_gemms`) chooses the bf16 math
mode: ``auto`` (unset: where oneDNN honours it), ``0`` (never: IEEE fp32 GEMMs), ``1``
(always for bf16 inputs on CPUs; oneDNN falls back to fp32 math where it has no bf16
kernel). Every choice is exact; none rounds products to half.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch

_HALF = (torch.float16, torch.bfloat16)


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype products, statistics, ``G`` and the loss are accumulated and held in, for
    inputs of ``dtype``: fp32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# Device types whose GEMMs take half operands and return fp32 (cuBLAS); elsewhere half
# operands are upcast exactly to fp32. (The launch counter, ``benchmarks/launches.py``,
# adds "meta" to model a GPU.)
CUDA_GEMMS = {"cuda"}


def operand_dtype(dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype the operands of a product are handed to the GEMM in, for inputs of
    ``dtype`` on a device of type ``device_type`` ("cuda", "cpu", ...): the policy."""
    if dtype in _HALF and device_type in CUDA_GEMMS:
        return dtype  # cuBLAS: half operands, fp32 accumulation and output
    return accumulate_dtype(dtype)  # elsewhere the exact upcast: fp32 GEMMs


# ---------------------------------------------------------------------------------------
# fp32 GEMMs on a CPU's bf16 units, for operands that hold bf16 values
# ---------------------------------------------------------------------------------------

CPU_HALF_ENV = "VOCAB_PARALLEL_CPU_HALF_GEMMS"
_CHOICES = {
    "": None, "auto": None,
    "0": False, "false": False, "no": False, "off": False,
    "1": True, "true": True, "yes": True, "on": True,
}  # fmt: skip
# Set by set_cpu_half_gemms (None: decide from the environment and the CPU).
_OVERRIDE: bool | None = None


def set_cpu_half_gemms(enabled: bool | None) -> None:
    """Whether fp32 GEMMs of bf16 inputs on CPUs ask oneDNN for bf16 math: ``True``
    always, ``False`` never (IEEE fp32 GEMMs), overriding ``VOCAB_PARALLEL_CPU_HALF_GEMMS``;
    ``None``: back to the environment's choice (unset: where oneDNN honours it). Every
    choice is exact."""
    global _OVERRIDE
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool or None, got {type(enabled).__name__}")
    _OVERRIDE = enabled


@functools.cache
def _env_choice() -> bool | None:
    """``VOCAB_PARALLEL_CPU_HALF_GEMMS`` as read once per process (None: unset or auto);
    a value it does not know is an error, not a silent default."""
    raw = os.environ.get(CPU_HALF_ENV, "")
    try:
        return _CHOICES[raw.strip().lower()]
    except KeyError:
        raise ValueError(
            f"{CPU_HALF_ENV}: expected auto, 0 or 1 (fp32 GEMMs of bf16 inputs on bf16 "
            f"units where oneDNN has them, never, always; all exact), got {raw!r}"
        ) from None


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
    except (AttributeError, RuntimeError):  # an older torch: no half units known
        return False
    return bool(has_units and onednn)


def _get_math() -> str:
    return torch._C._get_fp32_precision_getter("mkldnn", "matmul")


def _set_math(value: str) -> None:
    torch._C._set_fp32_precision_setter("mkldnn", "matmul", value)


@functools.cache
def bf16_math_available() -> bool:
    """Whether this torch can ask oneDNN for bf16 math in fp32 GEMMs, per operator
    (``torch.backends.mkldnn.matmul.fp32_precision``, torch >= 2.9) and the CPU has bf16
    units (:func:`cpu_has_half_units`). Older torch: IEEE fp32 GEMMs, as exact."""
    if not cpu_has_half_units(torch.bfloat16):
        return False
    try:
        _get_math()
    except (AttributeError, RuntimeError, TypeError):
        return False
    return True


# The probe's product: [M, K] x [K, N]. oneDNN (v3.x, brgemm_matmul_utils.cpp) keeps fp32
# GEMMs of "small shapes" off its AMX kernel, and so off bf16 math, when M <= 32 and
# M * N <= 256, or K <= 16 (or M == 1 and K == 256): its kernel for those is the
# AVX-512 fp32 one, which ignores the setting. torch hands a product to oneDNN when
# M * K * N > 16^3. 128 rows, columns and depth are well past both, and cheap.
PROBE_SHAPE = (128, 128, 128)


@functools.cache
def bf16_math_honoured() -> bool:
    """Whether oneDNN really runs this CPU's fp32 GEMMs in bf16 math when asked (it does
    on AMX; on AVX512-BF16 alone it keeps its fp32 kernel), and exactly, probed once per
    process at :data:`PROBE_SHAPE` (:func:`probe_bf16_math`). A behaviour, not a timing.
    Autocast is off for it: the first bf16 call may come under ``torch.autocast``, whose
    bf16 GEMMs would decide for the whole process."""
    if not bf16_math_available():
        return False
    with torch.autocast("cpu", enabled=False), torch.no_grad(), _scoped_bf16_math():
        return probe_bf16_math(torch.mm)


def probe_bf16_math(mm) -> bool:
    """Whether ``mm`` (fp32 ``[M, K] x [K, N] -> [M, N]``, :data:`PROBE_SHAPE`) is what the
    library wants of bf16 math: it converts its operands to bf16 (``1 + 2^-10``, which bf16
    cannot hold, summed ``K`` times gives ``K``, not fp32's ``K + K 2^-10``), and is
    exact for operands that hold bf16 values (small integers times 2^-4, whose products
    sum exactly in fp32 in any order, mostly to values bf16 cannot hold: an fp32 accumulator
    and an fp32 output, nothing rounded to bf16). Deterministic operands, no RNG."""
    m, k, n = PROBE_SHAPE
    ones = torch.ones(k, n)
    converted = mm(torch.full((m, k), 1.0 + 2.0**-10), ones)
    if not bool((converted == float(k)).all()):
        return False
    a = (torch.arange(m)[:, None] * 7 + torch.arange(k)[None, :] * 3) % 15 + 1.0
    b = ((torch.arange(k)[:, None] * 5 + torch.arange(n)[None, :] * 11) % 15 + 1.0) / 16
    exact = (a.double() @ b.double()).float()  # sums < 2^11 in steps of 2^-4: exact
    return torch.equal(mm(a, b), exact)


def _use_bf16_math(dtype: torch.dtype, device_type: str) -> bool:
    """The choice for the products of inputs of ``dtype`` on ``device_type``."""
    if dtype != torch.bfloat16 or device_type != "cpu":
        return False
    choice = _env_choice() if _OVERRIDE is None else _OVERRIDE  # (an unknown value raises)
    if not bf16_math_available():
        return False
    return bf16_math_honoured() if choice is None else choice


# The mkldnn matmul setting is process-wide: the first thread in sets it, the last one out
# restores the user's value, so that overlapping scopes never leave "bf16" behind.
_LOCK = threading.Lock()
_DEPTH = 0
_SAVED = "none"


@contextlib.contextmanager
def _scoped_bf16_math():
    global _DEPTH, _SAVED
    with _LOCK:
        if _DEPTH == 0:
            _SAVED = _get_math()
            _set_math("bf16")
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                _set_math(_SAVED)


def cpu_bf16_math(dtype: torch.dtype, device_type: str) -> contextlib.AbstractContextManager:
    """A context for the products of inputs of ``dtype`` on ``device_type``: with bf16
    inputs on a CPU whose fp32 GEMMs can run on bf16 units (:func:`_use_bf16_math`),
    oneDNN's bf16 math for fp32 GEMMs while it is open, the user's own setting restored
    when the last such context closes; else nothing. The operands must hold bf16 values
    (bf16 inputs upcast, ``G`` rounded to bf16): then the products are exact in fp32.

    The setting is process-wide while open: another thread's fp32 GEMMs get bf16 math
    too in that time. Not while ``torch.compile`` traces (the setting is not traceable;
    the IEEE fp32 GEMMs give the same exact products)."""
    if not _use_bf16_math(dtype, device_type) or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _scoped_bf16_math()


# ---------------------------------------------------------------------------------------
# The products
# ---------------------------------------------------------------------------------------


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
    Half operands go to a GEMM with fp32 output where the device has one (CUDA), else
    they are upcast (exactly) to fp32.
    """
    if a.dtype in _HALF:
        if mm_out_dtype_supported(a.device.type):
            if out is None or out.is_contiguous():
                return torch.mm(a, b, out_dtype=torch.float32, out=out)
            return out.copy_(torch.mm(a, b, out_dtype=torch.float32))
        a, b = a.float(), b.float()
    return torch.mm(a, b, out=out)


@functools.cache
def addmm_out_dtype_supported(device_type: str) -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` adds the
    product of half operands to an fp32 ``acc`` inside the GEMM (recent torch, CUDA only:
    the CPU build has no such kernel). Probed once per process and device type, by value:
    ``1 + 1 * 1 + 1 * 1`` must give 3 in ``acc`` itself."""
    if device_type != "cuda" or not hasattr(torch.ops.aten.addmm, "dtype_out"):
        return False
    try:
        acc = torch.ones((2, 2), dtype=torch.float32, device=device_type)
        a = torch.ones((2, 2), dtype=torch.bfloat16, device=device_type)
        out = torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return out.data_ptr() == acc.data_ptr() and bool((acc == 3.0).all())


def addmm_fp32_(
    acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """``acc += a @ b`` for an fp32 ``acc``, the product accumulated in fp32 (float64
    ``acc`` and operands: in float64).

    Half operands: where the device has it (:func:`addmm_out_dtype_supported`, CUDA), one
    GEMM that adds into ``acc`` (no fp32 product in memory, no second pass); else through
    :func:`mm_fp32` into ``scratch`` (an fp32 buffer shaped like ``acc``, reused across
    calls), then added.
    """
    if a.dtype == acc.dtype:
        return acc.addmm_(a, b)
    if addmm_out_dtype_supported(acc.device.type) and acc.is_contiguous():
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
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
