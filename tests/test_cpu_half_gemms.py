"""fp32 GEMMs of bf16 inputs on a CPU's bf16 units (vocab_parallel.engine.precision.cpu_bf16_math).

The choice (``VOCAB_PARALLEL_CPU_HALF_GEMMS`` / ``set_cpu_half_gemms``), that it never
rounds a product (every choice is exact), and that the process-wide oneDNN setting it
sets for the library's own products is the user's again afterwards, also with nested and
overlapping scopes on several threads. The tests that open the scope need a torch that
has the per-operator setting (>= 2.9) and a CPU with bf16 units; the rest run anywhere.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from vocab_parallel import vocab_parallel_linear_cross_entropy
from vocab_parallel.engine import precision
from vocab_parallel.reference import linear_cross_entropy_reference

needs_bf16_math = pytest.mark.skipif(
    not precision.bf16_math_available(),
    reason="needs torch >= 2.9 (torch.backends.mkldnn.matmul.fp32_precision) and bf16 units",
)


@pytest.fixture
def choice(monkeypatch):
    """Set the choice for one test (the environment is read once per process: re-read)."""

    def set_env(value: str | None):
        if value is None:
            monkeypatch.delenv(precision.CPU_HALF_ENV, raising=False)
        else:
            monkeypatch.setenv(precision.CPU_HALF_ENV, value)
        precision._env_choice.cache_clear()

    yield set_env
    monkeypatch.undo()
    precision._env_choice.cache_clear()
    precision.set_cpu_half_gemms(None)


@pytest.fixture
def user_setting():
    """The user's own mkldnn matmul setting ("ieee", not the default "none"), put back."""
    before = precision._get_math()
    precision._set_math("ieee")
    yield "ieee"
    precision._set_math(before)


def test_cpus_never_hand_half_operands_to_a_gemm():
    """No half GEMM on a CPU (they round each product to half): the exact fp32 upcast."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert precision.operand_dtype(dtype, "cpu") == torch.float32
    assert precision.operand_dtype(torch.float64, "cpu") == torch.float64
    assert precision.operand_dtype(torch.bfloat16, "cuda") == torch.bfloat16
    assert not hasattr(precision, "product_dtype")


def test_the_default_follows_what_onednn_does_here(choice):
    choice(None)
    expect = precision.bf16_math_available() and precision.bf16_math_honoured()
    assert precision._use_bf16_math(torch.bfloat16, "cpu") == expect
    for dtype in (torch.float16, torch.float32, torch.float64):  # values bf16 cannot hold
        assert not precision._use_bf16_math(dtype, "cpu")
    assert not precision._use_bf16_math(torch.bfloat16, "cuda")
    if not precision.bf16_math_available():
        assert not precision.bf16_math_honoured()


# ------------------------------------------------------------------- the probe


def _ieee(a, b):
    """oneDNN's AVX-512 fp32 kernel: the bf16 math setting ignored (AVX512-BF16 CPUs)."""
    return a @ b


def _bf16_math(a, b):
    """bf16 math as the library wants it: operands to bf16, fp32 accumulation and output."""
    return a.bfloat16().float() @ b.bfloat16().float()


def _onednn_amx(a, b):
    """oneDNN v3's fp32 GEMM with bf16 math on an AMX CPU: the AMX kernel (bf16 math)
    except for its "small shapes" (brgemm_matmul_utils.cpp), which go to the AVX-512 fp32
    kernel that ignores the setting."""
    (m, k), n = a.shape, b.shape[1]
    small = (m == 1 and k == 256) or (m <= 32 and m * n <= 256) or k <= 16
    return _ieee(a, b) if small else _bf16_math(a, b)


@pytest.fixture
def probe_with(monkeypatch):
    """``bf16_math_honoured()`` probing with ``mm`` in place of torch.mm (oneDNN's
    behaviour, emulated), on a torch and CPU that would let it ask (mocked too)."""

    def run(mm):
        monkeypatch.setattr(precision, "bf16_math_available", lambda: True)
        monkeypatch.setattr(precision, "_scoped_bf16_math", contextlib.nullcontext)
        monkeypatch.setattr(torch, "mm", mm)
        precision.bf16_math_honoured.cache_clear()
        try:
            return precision.bf16_math_honoured()
        finally:
            precision.bf16_math_honoured.cache_clear()
            monkeypatch.undo()

    return run


def test_the_probe_says_yes_where_onednn_runs_bf16_math_on_amx(probe_with):
    """The probe's product must be large enough for oneDNN's AMX kernel: a 16 x 64 x 16
    one is a "small shape" there, runs in fp32, and made AMX CPUs look like AVX512-BF16."""
    assert probe_with(_onednn_amx)
    m, k, n = precision.PROBE_SHAPE
    assert m > 32 and m * n > 256 and k > 16 and m * k * n > 16**3  # oneDNN's and torch's


def test_the_probe_says_no_to_fp32_math_or_to_rounded_bf16_results(probe_with):
    assert not probe_with(_ieee)  # AVX512-BF16 alone: oneDNN keeps its fp32 kernel
    # Converted but not exact: a bf16 output, or a bf16 accumulator in disguise.
    assert not probe_with(lambda a, b: _bf16_math(a, b).bfloat16().float())
    assert not precision.probe_bf16_math(lambda a, b: _bf16_math(a, b).round())
    assert precision.probe_bf16_math(_bf16_math)


def test_the_probe_is_not_decided_by_autocast(probe_with):
    """The first bf16 call may come under torch.autocast: the probe's GEMMs must still be
    fp32 ones (autocast's bf16 GEMMs round their results and would decide for the process)."""

    def mm(a, b):  # torch.mm as autocast runs it: a bf16 GEMM, a bf16 result
        if torch.is_autocast_enabled("cpu"):
            return _bf16_math(a, b).bfloat16().float()
        return _onednn_amx(a, b)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert probe_with(mm)


def test_the_probe_on_this_cpu():
    """Here, for real: yes with AMX-BF16, no with AVX512-BF16 alone (oneDNN keeps its fp32
    kernel there, at any size)."""
    if not precision.bf16_math_available():
        pytest.skip("no bf16 units, or a torch without the per-operator setting")
    amx = bool(torch.cpu.get_capabilities().get("amx_bf16", False))
    precision.bf16_math_honoured.cache_clear()
    assert precision.bf16_math_honoured() == amx, f"amx_bf16={amx}"


def test_environment_and_override(choice):
    choice("0")
    assert not precision._use_bf16_math(torch.bfloat16, "cpu")
    choice("1")
    assert precision._use_bf16_math(torch.bfloat16, "cpu") == precision.bf16_math_available()
    choice("auto")
    assert precision._env_choice() is None
    precision.set_cpu_half_gemms(False)
    assert not precision._use_bf16_math(torch.bfloat16, "cpu")
    with pytest.raises(TypeError, match="^enabled"):
        precision.set_cpu_half_gemms("yes")


def test_an_unknown_value_is_a_clear_error(choice):
    choice("fast")
    with pytest.raises(ValueError, match=f"^{precision.CPU_HALF_ENV}: expected auto, 0 or 1"):
        precision._use_bf16_math(torch.bfloat16, "cpu")
    x = torch.randn(8, 16).bfloat16()
    w = torch.randn(32, 16).bfloat16()
    with pytest.raises(ValueError, match=precision.CPU_HALF_ENV):  # on any CPU
        vocab_parallel_linear_cross_entropy(x, w, torch.zeros(8, dtype=torch.long))


@needs_bf16_math
def test_the_scope_sets_and_restores_the_users_setting(choice, user_setting):
    precision.set_cpu_half_gemms(True)
    with precision.cpu_bf16_math(torch.bfloat16, "cpu"):
        assert precision._get_math() == "bf16"
        with precision.cpu_bf16_math(torch.bfloat16, "cpu"):  # nested
            assert precision._get_math() == "bf16"
        assert precision._get_math() == "bf16"
    assert precision._get_math() == user_setting
    scope = precision.cpu_bf16_math(torch.bfloat16, "cpu")
    with pytest.raises(RuntimeError, match="boom"), scope:  # an error inside restores it
        raise RuntimeError("boom")
    assert precision._get_math() == user_setting
    with precision.cpu_bf16_math(torch.float32, "cpu"):  # fp32 inputs: untouched
        assert precision._get_math() == user_setting


@needs_bf16_math
def test_overlapping_scopes_on_threads_restore_the_users_setting(choice, user_setting):
    """Thread B enters while A is inside and leaves after A: B must not save A's "bf16"
    as the user's value, nor A restore it while B still computes."""
    precision.set_cpu_half_gemms(True)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def thread_a():
        with precision.cpu_bf16_math(torch.bfloat16, "cpu"):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def thread_b():
        a_in.wait(10)
        with precision.cpu_bf16_math(torch.bfloat16, "cpu"):
            b_in.set()
            a_out.wait(10)
            seen["inside_after_a"] = precision._get_math()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen["inside_after_a"] == "bf16"
    assert precision._get_math() == user_setting


@needs_bf16_math
@pytest.mark.parametrize("mode", ["grad_in_forward", "memory_saving"])
def test_forced_bf16_math_is_exact_and_scoped_to_our_products(
    choice, user_setting, monkeypatch, mode
):
    """Forced on (what AMX CPUs get by default), every product of bf16 inputs runs with
    oneDNN's bf16 math, the loss is the float64 one at fp32 tolerance, and the user's
    setting is back after the forward and the backward."""
    precision.set_cpu_half_gemms(True)
    settings = []
    mm = torch.mm

    def recording_mm(a, b, *args, **kwargs):
        settings.append(precision._get_math())
        return mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "mm", recording_mm)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96, 128, generator=gen).bfloat16()
    w = (torch.randn(3000, 128, generator=gen) * 0.5).bfloat16()
    y = torch.randint(0, 3000, (96,), generator=gen)
    hidden, weight = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = vocab_parallel_linear_cross_entropy(hidden, weight, y, mode=mode, backend="torch")
    assert precision._get_math() == user_setting
    loss.backward()
    assert precision._get_math() == user_setting
    assert len(settings) >= 3 and set(settings) == {"bf16"}
    ref, _ = linear_cross_entropy_reference(x.double(), w.double(), y)
    assert abs(loss.item() - ref.item()) / ref.item() <= 2e-6
