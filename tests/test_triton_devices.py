"""The device guard of the Triton tests (``device_guard.py``, applied by ``conftest.py`` to
every test whose id says "triton", as these do): what a GPU would refuse fails here too.

Each mistake below passes silently under the interpreter on a CPU machine and fails on a
GPU; the guard fails it on both, with a message that names it. The last test is the right
way, which the guard lets through.
"""

from __future__ import annotations

import pytest
import torch
from device_guard import is_host_made
from helpers import DEVICE

import vocab_parallel as vp

pytest.importorskip("triton")
GUARD = pytest.fail.Exception  # what the guard raises: the test's failure, with its reason


def _inputs(n=6, h=8, v=13):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g)
    y = torch.randint(0, v, (n,), generator=g)
    return x, w, y


def test_a_triton_launch_on_a_tensor_made_on_the_host_fails():
    from vocab_parallel.backends import triton_backend

    x, w, y = _inputs()
    with pytest.raises(GUARD, match=r"forward_stats_kernel launched on tensors off DEVICE.*"
                       r"target_ptr \((made on the host|on cpu)"):  # fmt: skip
        triton_backend.forward_stats(x.to(DEVICE), w.to(DEVICE), y)


def test_the_loss_on_inputs_made_on_the_host_fails():
    x, w, y = _inputs()
    host = pytest.raises((GUARD, ValueError), match="off DEVICE|runs on CUDA tensors")
    with host:  # a GPU refuses CPU tensors before a launch: the backend's ValueError
        vp.vocab_parallel_linear_cross_entropy(x, w, y, backend="triton")


def test_comparing_a_result_with_a_reference_on_the_host_fails():
    x, w, y = _inputs()
    loss = vp.vocab_parallel_linear_cross_entropy(
        x.to(DEVICE), w.to(DEVICE), y.to(DEVICE), backend="triton", reduction="none"
    )
    reference = vp.vocab_parallel_linear_cross_entropy(x, w, y, backend="torch", reduction="none")
    assert is_host_made(reference) and not is_host_made(loss)
    with pytest.raises(GUARD, match="^sub mixes tensors made on the host with tensors on DEVICE"):
        loss - reference


def test_an_upstream_gradient_made_on_the_host_fails():
    x, w, y = _inputs()
    x = x.to(DEVICE, copy=True).requires_grad_(True)
    loss = vp.vocab_parallel_linear_cross_entropy(
        x, w.to(DEVICE), y.to(DEVICE), backend="triton", reduction="none"
    )
    with pytest.raises(GUARD, match="^backward mixes"):
        loss.backward(torch.ones(loss.shape))


def test_inputs_on_device_and_comparisons_on_the_cpu_pass():
    x, w, y = _inputs()
    xd = x.to(DEVICE, copy=True).requires_grad_(True)
    loss = vp.vocab_parallel_linear_cross_entropy(
        xd, w.to(DEVICE), y.to(DEVICE), backend="triton", reduction="none"
    )
    loss.backward(torch.ones(loss.shape, device=DEVICE))
    xr = x.clone().requires_grad_(True)
    reference = vp.vocab_parallel_linear_cross_entropy(xr, w, y, backend="torch", reduction="none")
    reference.sum().backward()
    torch.testing.assert_close(loss.detach().cpu(), reference.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xd.grad.cpu(), xr.grad, rtol=1e-5, atol=1e-6)
