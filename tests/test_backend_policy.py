"""Backend policy: fp32 products everywhere, only the gradients asked for, no double backward.

- ``vocab_parallel.engine.precision``: the CUDA branch (half operands, fp32 GEMM output) run on
  CPU tensors gives the fp32-accumulated result, which the former bf16-output path of the
  torch backend on CUDA did not.
- The loss's backward honours ``ctx.needs_input_grad``: no GEMM, allocation or all-reduce
  for a gradient nobody needs; without a possible backward, high-performance mode keeps
  no ``[BT, V]`` softmax.
- The public operator accepts tensors that require grad (it is not differentiated), and
  double backward through the loss raises a clear error.
- Both backends share one interface: int64 local targets (-1 where not here), the
  statistics, the flags of the gradients wanted, and chunks of logits.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, assert_matches_reference, dtype_id, make_case
from torch.utils._python_dispatch import TorchDispatchMode

import vocab_parallel as vp
from vocab_parallel.backends import torch_backend
from vocab_parallel.backends.interface import PLAIN, GradTerms, Logits, Outputs
from vocab_parallel.backends.registry import get_backend
from vocab_parallel.engine import autograd as engine_autograd  # the shared all-reduce
from vocab_parallel.engine import memory_policy as memory
from vocab_parallel.engine import precision
from vocab_parallel.objectives import cross_entropy_autograd as loss_module  # the loss's Function

BT, H, V = 24, 20, 50  # distinct, so the shape of a product tells which product it is


def _problem(dtype=torch.float32, bt=BT, h=H, v=V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(bt, h, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(v, h, generator=gen) * 0.5).to(dtype).to(DEVICE)
    y = torch.randint(0, v, (bt,), generator=gen).to(DEVICE)
    y[::5] = -100
    return x, w, y


class OpLog(TorchDispatchMode):
    """Records ``(op name, output shape)`` of every op that produces a new tensor."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        if not func.is_view and not name.endswith("_") and isinstance(out, torch.Tensor):
            self.ops.append((name, tuple(out.shape)))
        return out

    def shapes(self, *names: str) -> list[tuple[int, ...]]:
        return [shape for name, shape in self.ops if name in names]


# ---------------------------------------------------------------------------------------
# One precision policy
# ---------------------------------------------------------------------------------------


def test_policy_decides_operands_in_one_place():
    assert precision.operand_dtype(torch.bfloat16, "cuda") == torch.bfloat16
    assert precision.operand_dtype(torch.float16, "cuda") == torch.float16
    assert precision.operand_dtype(torch.bfloat16, "cpu") == torch.float32
    assert precision.operand_dtype(torch.float32, "cuda") == torch.float32
    assert not precision.mm_out_dtype_supported("cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_mm_fp32_returns_the_exact_fp32_accumulation(dtype):
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(33, 300, generator=gen).to(dtype)
    b = torch.randn(300, 17, generator=gen).to(dtype)
    out = precision.mm_fp32(a, b)
    assert out.dtype == torch.float32
    assert torch.equal(out, a.float() @ b.float())  # products of halves are exact in fp32
    buf = torch.full((33, 40), float("nan"))[:, 3:20]  # a non-contiguous out
    assert precision.mm_fp32(a, b, out=buf) is buf and torch.equal(buf, out)
    acc = torch.ones(33, 17)
    precision.addmm_fp32_(acc, a, b, scratch=torch.empty(33, 17))
    assert torch.equal(acc, 1.0 + out)


def test_the_cuda_gemm_call_is_well_formed(monkeypatch):
    """The branch CUDA takes (``torch.mm(..., out_dtype=torch.float32)``), on meta tensors."""
    monkeypatch.setattr(precision, "mm_out_dtype_supported", lambda device_type: True)
    a = torch.empty(8, 16, dtype=torch.bfloat16, device="meta")
    b = torch.empty(16, 4, dtype=torch.bfloat16, device="meta")
    assert precision.mm_fp32(a, b).dtype == torch.float32
    out = torch.empty(8, 4, device="meta")
    assert precision.mm_fp32(a, b, out=out).dtype == torch.float32
    acc = torch.zeros(8, 4, device="meta")
    assert precision.addmm_fp32_(acc, a, b, scratch=torch.empty_like(acc)) is acc


def test_grad_weight_accumulates_inside_the_gemm_where_torch_can(monkeypatch):
    """The CUDA branch of ``addmm_fp32_`` (``torch.addmm(acc, a, b, out_dtype=fp32,
    out=acc)``: the product added inside the GEMM, no fp32 product in memory and no
    second pass), on meta tensors; the probe says no on CPU, and where it says no the
    product goes through a scratch buffer (the CPU test above)."""
    assert not precision.addmm_out_dtype_supported("cpu")
    calls = []
    real_addmm = torch.addmm

    def addmm(*args, **kwargs):
        calls.append(kwargs.get("out_dtype"))
        return real_addmm(*args, **kwargs)

    monkeypatch.setattr(precision, "addmm_out_dtype_supported", lambda device_type: True)
    monkeypatch.setattr(torch, "addmm", addmm)
    a = torch.empty(8, 16, dtype=torch.bfloat16, device="meta")
    b = torch.empty(16, 4, dtype=torch.bfloat16, device="meta")
    acc = torch.zeros(8, 4, device="meta")
    assert precision.addmm_fp32_(acc, a, b, scratch=None) is acc
    assert calls == [torch.float32]


def _cuda_policy(monkeypatch):
    """Make CPU tensors take the CUDA branch: half operands into a GEMM with fp32 output
    (emulated on CPU by the exact fp32 upcast, as ``mm_fp32`` does without ``out_dtype``)."""
    cpu_policy = precision.operand_dtype
    monkeypatch.setattr(precision, "operand_dtype", lambda dtype, dev: cpu_policy(dtype, "cuda"))
    assert precision.operand_dtype(torch.bfloat16, "cpu") == torch.bfloat16


@pytest.mark.skipif(DEVICE.type != "cpu", reason="emulates the CUDA branch on CPU tensors")
def test_cuda_branch_accumulates_logits_and_products_in_fp32(monkeypatch):
    bt, h, v = 64, 256, 1000
    x, w, y = _problem(torch.bfloat16, bt, h, v, seed=3)
    w = w * 4  # logits of tens: bf16 rounding of them shows in the loss
    target = torch.where(y >= 0, y, -1)
    logits64 = x.double() @ w.double().T
    lse64 = torch.logsumexp(logits64, dim=1)

    cpu = torch_backend.forward_stats(x, w, target)
    _cuda_policy(monkeypatch)
    operands = []
    mm_fp32 = precision.mm_fp32

    def recording_mm_fp32(a, b, out=None):
        operands.append((a.dtype, b.dtype))
        return mm_fp32(a, b, out=out)

    monkeypatch.setattr(precision, "mm_fp32", recording_mm_fp32)
    cuda = torch_backend.forward_stats(x, w, target)
    assert operands and set(operands) == {(torch.bfloat16, torch.bfloat16)}  # the CUDA branch
    for a, b in zip(cuda, cpu, strict=True):  # the same fp32 accumulation: bitwise equal
        assert (a is None and b is None) or torch.equal(a, b)
    lse = torch.log(cuda[1]) + cuda[0]
    err_new = ((lse.double() - lse64).abs() / lse64.abs()).max().item()

    # The former CUDA path: compute_dtype = bf16, so the GEMM rounded the logits to bf16.
    old_logits = torch.mm(x, w.t()).float()
    lse_old = torch.logsumexp(old_logits, dim=1)
    err_old = ((lse_old.double() - lse64).abs() / lse64.abs()).max().item()
    assert err_new < 1e-6 < 1e-4 < err_old, (err_new, err_old)

    # The backward on the CUDA branch equals the CPU policy's fp32 path bit for bit.
    case = make_case(bt, h, v, dtype=torch.bfloat16, seed=4, label_smoothing=0.1)
    cuda_grads = case.run("torch")
    monkeypatch.undo()
    assert precision.operand_dtype(torch.bfloat16, "cpu") == torch.float32
    cpu_grads = case.run("torch")
    for a, b in zip(cuda_grads, cpu_grads, strict=True):
        assert torch.equal(a, b)
    assert_matches_reference(cuda_grads, case.reference(), torch.bfloat16)


# ---------------------------------------------------------------------------------------
# Only the gradients autograd asks for
# ---------------------------------------------------------------------------------------


def _backward_log(backend, mode, hidden_grad, weight_grad, monkeypatch, world=1):
    reduced = []

    def all_reduce(tensor, op, group, what=None):
        reduced.append(tuple(tensor.shape))
        return tensor

    if world > 1:  # pretend to be one rank of a tensor-parallel group (no real collective)
        monkeypatch.setattr(loss_module, "world_size", lambda group: world)
        monkeypatch.setattr(engine_autograd, "all_reduce", all_reduce)
    x, w, y = _problem()
    x.requires_grad_(hidden_grad)
    w.requires_grad_(weight_grad)
    loss = vp.vocab_parallel_linear_cross_entropy(x, w, y, mode=mode, backend=backend)
    reduced.clear()
    with OpLog() as log:
        loss.backward()
    return log, reduced, x, w


def test_frozen_weight_costs_no_weight_gemm_nor_allocation(backend, mode, monkeypatch):
    log, _, x, w = _backward_log(backend, mode, True, False, monkeypatch)
    assert w.grad is None and x.grad is not None
    assert (V, H) not in log.shapes(*(name for name, _ in log.ops))  # no [V, H] at all
    assert (BT, H) in log.shapes("mm", "addmm")  # the grad_input product ran
    # The check can fail: with a trainable weight the [V, H] product is there.
    log, _, _, w = _backward_log(backend, mode, True, True, monkeypatch)
    assert w.grad is not None and (V, H) in log.shapes("mm", "addmm")


def test_frozen_hidden_costs_no_input_gemm_nor_all_reduce(backend, mode, monkeypatch):
    log, reduced, x, w = _backward_log(backend, mode, False, True, monkeypatch, world=2)
    assert x.grad is None and w.grad is not None
    assert (BT, H) not in log.shapes("mm", "addmm")
    assert (BT, H) not in log.shapes(*(name for name, _ in log.ops))  # no accumulator either
    assert reduced == []  # no all-reduce of grad_input
    log, reduced, x, _ = _backward_log(backend, mode, True, True, monkeypatch, world=2)
    assert x.grad is not None and (BT, H) in log.shapes("mm", "addmm") and reduced == [(BT, H)]


def _allocations_of_logits_shape(x, w, y, backend):
    with OpLog() as log:
        loss = vp.vocab_parallel_linear_cross_entropy(
            x, w, y, mode="high_performance", backend=backend
        )
    # A [BT, V] product chunk of the torch backend is the forward's own work, not a softmax.
    return loss, [name for name, shape in log.ops if shape == (BT, V) and name != "mm"]


def test_no_softmax_without_a_possible_backward(backend):
    x, w, y = _problem()
    with torch.no_grad():
        loss, kept = _allocations_of_logits_shape(
            x.requires_grad_(True), w.requires_grad_(True), y, backend
        )
    assert kept == [] and not loss.requires_grad
    loss2, kept2 = _allocations_of_logits_shape(x.detach(), w.detach(), y, backend)
    assert kept2 == [] and torch.equal(loss, loss2)
    # With a backward possible the softmax is kept: the check can fail.
    loss3, kept3 = _allocations_of_logits_shape(x, w, y, backend)
    assert kept3 != [] and loss3.requires_grad
    assert torch.allclose(loss3.detach(), loss, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------
# Not differentiable itself
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_operator_on_tensors_that_require_grad(backend, mode, dtype):
    case = make_case(37, 16, 129, dtype=dtype, mode=mode, seed=5)
    plain = case.run(backend)
    head = torch.nn.Linear(16, 129, bias=False, dtype=dtype, device=DEVICE)
    with torch.no_grad():
        head.weight.copy_(case.weight)
    hidden = case.input.clone().requires_grad_(True)
    out = case.with_(input=hidden, weight=head.weight).run(backend)
    for a, b in zip(out, plain, strict=True):
        assert not a.requires_grad and a.grad_fn is None
        assert torch.equal(a, b)


def test_double_backward_raises_a_clear_error(backend, mode):
    x, w, y = _problem(seed=6)
    x.requires_grad_(True)
    w.requires_grad_(True)
    loss = vp.vocab_parallel_linear_cross_entropy(x, w, y, mode=mode, backend=backend)
    gx, gw = torch.autograd.grad(loss, (x, w), create_graph=True)
    ref = torch.autograd.grad(
        vp.vocab_parallel_linear_cross_entropy(x, w, y, mode=mode, backend=backend), (x, w)
    )
    assert torch.equal(gx.detach(), ref[0]) and torch.equal(gw.detach(), ref[1])
    with pytest.raises(RuntimeError, match="double backward is not supported") as info:
        torch.autograd.grad((gx * gx).sum() + gw.sum(), (x, w))
    assert "vocab_parallel_linear_cross_entropy" in str(info.value)


# ---------------------------------------------------------------------------------------
# One backend interface
# ---------------------------------------------------------------------------------------


def test_loss_hands_local_targets_to_the_backend_without_mask_round_trips(
    backend, mode, monkeypatch
):
    def forbidden(*args, **kwargs):
        raise AssertionError("the loss must not pack, unpack or re-validate per backward")

    import vocab_parallel.ops as ops

    for module in (vp.mask, ops, loss_module):
        for name in ("pack_target_mask", "unpack_target_mask"):
            monkeypatch.setattr(module, name, forbidden, raising=False)
    for module in (ops, loss_module):
        monkeypatch.setattr(
            module, "fused_linear_cross_entropy_loss_grad", forbidden, raising=False
        )
    x, w, y = _problem(seed=7)
    x.requires_grad_(True)
    w.requires_grad_(True)
    vp.vocab_parallel_linear_cross_entropy(x, w, y, mode=mode, backend=backend).backward()
    assert x.grad is not None and w.grad is not None


def _backend_module(name):
    if name == "triton":
        from vocab_parallel.backends import triton_backend

        return triton_backend
    return torch_backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_backends_share_one_interface_and_chunking_is_invisible(backend, mode, dtype, monkeypatch):
    bt, h, v = 37, 20, 700
    case = make_case(bt, h, v, dtype=dtype, mode=mode, seed=8, label_smoothing=0.1)
    # Targets spread over every chunk, including the last, short one; some rows elsewhere.
    target = torch.arange(bt, device=DEVICE) * 19 % v
    case = case.with_(masked_target=target)
    local = target.masked_fill(case.not_here, -1)
    module = _backend_module(backend)

    def run(workspace, **flags):
        monkeypatch.setitem(memory.WORKSPACE_BYTES, DEVICE.type, workspace)
        terms = GradTerms(
            case.grad, 0.9, 0.1 / v, None, None,
            case.logits_max, case.sum_exp_logits, case.softmax,
        )  # fmt: skip
        out = Outputs(**flags)
        return module.fused_backward(case.input, case.weight, local, PLAIN, terms, out)[:2]

    chunked, whole = run(1), run(1 << 30)
    assert_matches_reference(chunked, case.reference(), dtype)
    assert_matches_reference(whole, case.reference(), dtype)
    only_input = run(1, need_weight=False)
    only_weight = run(1, need_input=False)
    assert only_input[1] is None and torch.equal(only_input[0], chunked[0])
    assert only_weight[0] is None and torch.equal(only_weight[1], chunked[1])
    assert run(1, need_input=False, need_weight=False) == (None, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_backends_make_the_same_chunks_of_logits(backend, dtype):
    """``chunk_logits``: ``z = cap(x @ W.T + b) * inv_t`` of any column range, returned or
    written into ``out``, as the float64 formula gives; ``distill`` is the Triton
    backend's fused distillation launchers, None on the torch backend."""
    v = 77
    x, w, _ = _problem(dtype, v=v)
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(v, generator=gen).to(dtype).to(DEVICE)
    inv_t = (torch.rand(BT, generator=gen) + 0.5).to(DEVICE)
    r = x.double() @ w.double().T + bias.double()
    want = 2.5 * torch.tanh(r / 2.5) * inv_t.double()[:, None]
    run = get_backend(backend)
    tol = dict(rtol=1e-5, atol=1e-5)  # fp32 accumulation of the products
    make = run.chunk_logits(x, w, Logits(bias, 2.5, inv_t))
    for v0, v1 in ((0, v), (5, 40), (40, v)):
        z = make(v0, v1)
        assert z.dtype == torch.float32 and z.shape == (BT, v1 - v0)
        torch.testing.assert_close(z.double(), want[:, v0:v1], **tol)
    out = torch.full((BT, 30), float("nan"), device=DEVICE)
    assert make(10, 40, out).data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.double(), want[:, 10:40], **tol)
    plain = run.chunk_logits(x, w, dtype=torch.float32)(3, 9)
    torch.testing.assert_close(plain.double(), (x.double() @ w.double().T)[:, 3:9], **tol)
    if backend == "torch":
        wide = run.chunk_logits(x, w, dtype=torch.float64)(0, v)
        assert wide.dtype == torch.float64
    else:
        with pytest.raises(TypeError, match="^dtype:"):
            run.chunk_logits(x, w, dtype=torch.float64)
