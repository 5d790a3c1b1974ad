"""Native half-precision GEMMs on CPUs with bf16/fp16 matrix units (vocab_parallel.precision).

The suite pins the exact fp32 upcast (conftest.py); here the native path is forced on,
which works on any CPU (slowly where there are no matrix units: tiny shapes only), and
the decision itself is checked against what torch reports about this CPU.
"""

from __future__ import annotations

import pytest
import torch
from helpers import HAS_TRITON

from vocab_parallel import precision
from vocab_parallel.testing import Case, check_case, grid

CPU = torch.device("cpu")


@pytest.fixture
def native(monkeypatch):
    """Half GEMMs on, for this test (restored afterwards)."""
    precision.set_cpu_half_gemms(True)
    yield
    precision.set_cpu_half_gemms(None)


@pytest.fixture
def fresh_env(monkeypatch):
    """The environment variable is read once per process: re-read it in this test."""
    precision._env_choice.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    precision._env_choice.cache_clear()


def test_decision_follows_what_torch_reports(fresh_env):
    fresh_env.delenv(precision.CPU_HALF_ENV, raising=False)
    precision._env_choice.cache_clear()
    caps = torch.cpu.get_capabilities()
    has_bf16 = bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    onednn = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert precision.cpu_half_gemms(torch.bfloat16) == (has_bf16 and onednn)
    expect = torch.bfloat16 if has_bf16 and onednn else torch.float32
    assert precision.operand_dtype(torch.bfloat16, "cpu") == expect
    assert precision.operand_dtype(torch.float32, "cpu") == torch.float32
    assert precision.operand_dtype(torch.float64, "cpu") == torch.float64
    assert not precision.cpu_has_half_units(torch.float32)


def test_environment_and_override(fresh_env):
    fresh_env.setenv(precision.CPU_HALF_ENV, "0")
    precision._env_choice.cache_clear()
    assert precision.operand_dtype(torch.bfloat16, "cpu") == torch.float32
    fresh_env.setenv(precision.CPU_HALF_ENV, "1")
    precision._env_choice.cache_clear()
    assert precision.operand_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    assert precision.operand_dtype(torch.float16, "cpu") == torch.float16
    precision.set_cpu_half_gemms(False)
    try:
        assert precision.operand_dtype(torch.bfloat16, "cpu") == torch.float32
    finally:
        precision.set_cpu_half_gemms(None)
    with pytest.raises(TypeError, match="enabled"):
        precision.set_cpu_half_gemms("yes")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_mm_is_a_half_gemm_accumulated_in_fp32(native, dtype):
    """The product is oneDNN's half GEMM (fp32 accumulation, one rounding of the result),
    returned in fp32: within one half ulp of the exact fp32 product."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(33, 300, generator=gen).to(dtype)
    b = torch.randn(300, 17, generator=gen).to(dtype)
    out = precision.mm_fp32(a, b)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.mm(a, b).float())
    exact = a.float() @ b.float()
    ulp = torch.finfo(dtype).eps
    assert ((out - exact).abs() <= exact.abs() * ulp + 1e-6).all()
    buf = torch.full((33, 40), float("nan"))[:, 3:20]
    assert precision.mm_fp32(a, b, out=buf) is buf and torch.equal(buf, out)
    acc = torch.ones(33, 17)
    precision.addmm_fp32_(acc, a, b, scratch=torch.empty(33, 17))
    assert torch.equal(acc, 1.0 + out)


def _cases(backend: str) -> list[Case]:
    modes = ("grad_in_forward", "memory_saving", "high_performance")
    cases = grid(
        dtypes=("bfloat16",),
        modes=modes,
        reductions=("none", "mean"),
        backends=(backend,),
    )
    return cases + [
        Case(dtype="bfloat16", mode=m, backend=backend, softcap=3.0, z_loss=1e-3, bias=True)
        for m in modes
    ]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_loss_and_gradients_within_bf16_tolerance(native, backend):
    """Every mode against the float64 reference: bf16-rounded logits keep the loss within
    bf16 tolerance (HALF_LOGITS_LOSS_TOLERANCE), the gradients within the usual one."""
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    results = [check_case(c, None, CPU) for c in _cases(backend)]
    bad = [r for r in results if not r["ok"]]
    assert not bad, bad[:5]
    if backend == "torch":  # (the Triton forward kernel's logits stay fp32)
        worst = max(r["loss"] for r in results)
        assert worst > 1e-6, "the logits were not rounded to bf16: the native path did not run"


def test_the_gemms_see_half_operands(native, monkeypatch):
    """All three products of grad_in_forward run on bf16 operands (no fp32 upcast)."""
    from vocab_parallel import vocab_parallel_linear_cross_entropy

    seen = []
    mm = torch.mm

    def recording_mm(a, b, *args, **kwargs):
        seen.append((a.dtype, b.dtype))
        return mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "mm", recording_mm)
    x = torch.randn(16, 8).bfloat16().requires_grad_(True)
    w = torch.randn(24, 8).bfloat16().requires_grad_(True)
    y = torch.randint(0, 24, (16,))
    vocab_parallel_linear_cross_entropy(x, w, y, mode="grad_in_forward", backend="torch").backward()
    assert len(seen) == 3 and set(seen) == {(torch.bfloat16, torch.bfloat16)}
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16


def test_grad_in_forward_keeps_half_logits_and_forms_g_in_place(native, monkeypatch):
    """On the native path the grad-in-forward chunk is kept in bf16 (the GEMM's own output)
    and G is formed over it block by block: several token chunks and row blocks, every
    option but softcap (which keeps fp32 logits), against the float64 reference."""
    from vocab_parallel import grad_in_forward, torch_backend

    monkeypatch.setitem(grad_in_forward.CHUNK_BYTES, "cpu", 6 * 4 * 389)
    monkeypatch.setattr(torch_backend, "HALF_G_BLOCK", 700)  # blocks of 1-2 rows
    kept = []
    half_g = torch_backend._half_g_in_place

    def recording(z, *args):
        kept.append(z.dtype)
        return half_g(z, *args)

    monkeypatch.setattr(torch_backend, "_half_g_in_place", recording)
    cases = [
        Case(dtype="bfloat16", mode="grad_in_forward", backend="torch", reduction=r, **opts)
        for r in ("mean", "sum")
        for opts in (
            {},
            {"label_smoothing": 0.1},
            {"bias": True, "z_loss": 1e-3, "return_lse": True},
            {"all_ignored": True},
        )
    ]
    results = [check_case(c, None, CPU) for c in cases]
    bad = [r for r in results if not r["ok"]]
    assert not bad, bad[:5]
    assert kept and set(kept) == {torch.bfloat16}
