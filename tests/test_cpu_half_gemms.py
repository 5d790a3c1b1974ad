"""fp32 GEMMs of bf16 inputs on a CPU's bf16 units (vocab_parallel.engine.precision.cpu_bf16_math).

The choice (``VOCAB_PARALLEL_CPU_HALF_GEMMS`` / ``set_cpu_half_gemms``), that it never
rounds a product (every choice is exact), and that the process-wide oneDNN setting it
sets for the library's own products is the user's again afterwards, also with nested and
overlapping scopes on several threads. The tests that open the scope need a torch that
has the per-operator setting (>= 2.9) and a CPU with bf16 units; the rest run anywhere.
"""

from __future__ import annotations

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
