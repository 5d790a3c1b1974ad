"""The engine's objective interface (``vocab_parallel.engine.epilogue``): an objective that
is nothing but its math runs in every mode, on both backends and over ranks.

The objective here is written for this test alone: the cross entropy with a z-loss, as
an :class:`~vocab_parallel.engine.epilogue.Epilogue` (one online sum, two plain rows, its
``G``), about 40 lines. Every mode, the column walker's chunks (a narrow workspace), uneven
shards over 2 gloo ranks and a second backward are checked against float64 on
materialised logits.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from helpers import HAS_TRITON, device_for
from multirank import run_ranks

from vocab_parallel.engine import memory_policy as memory
from vocab_parallel.engine.epilogue import Epilogue, Local, add_at, pick
from vocab_parallel.engine.functions import ChunkedLoss, GradInForwardLoss
from vocab_parallel.engine.objective import Call, Objective
from vocab_parallel.engine.online import Online
from vocab_parallel.engine.reduction import reduce_losses
from vocab_parallel.options import LossOptions
from vocab_parallel.parallel.layout import ShardLayout

Z_LOSS = 0.01


class _Terms(NamedTuple):
    lse: torch.Tensor
    predicted: torch.Tensor


class ZLossCE(Epilogue):
    """``lse - z_t + Z_LOSS lse^2`` per token (``target``: local columns, -1 elsewhere)."""

    sums_name = "z-loss sums"

    def __init__(self, target, ignored):
        self.target, self.ignored = target, ignored

    def operands(self, x, weight, bias):
        return [(x, weight, bias)]

    def rows(self, r0, r1):
        return ZLossCE(self.target[r0:r1], self.ignored[r0:r1])

    def local(self, chunks):
        n = self.target.shape[0]
        online, predicted = None, None
        for v0, v1, (z,) in chunks:
            if online is None:
                online = Online(n, 0, z.dtype, z.device)
                predicted = torch.zeros(n, dtype=z.dtype, device=z.device)
            predicted += pick(z, self.target, v0, v1)
            online.add(z)
        if online is None:  # no columns here
            device = self.target.device
            online = Online(n, 0, torch.float32, device)
            predicted = torch.zeros(n, device=device)
        return Local([online], [predicted])

    def terms(self, maxima, sums):
        return _Terms(maxima[0] + torch.log(sums[0]), sums[1])

    def losses(self, terms):
        return terms.lse - terms.predicted + Z_LOSS * terms.lse.square()

    def gradient(self, terms, v0, v1, logits, grad):
        scale = grad * (1.0 + 2.0 * Z_LOSS * terms.lse)
        g = torch.exp(logits[0] - terms.lse[:, None]).mul_(scale[:, None])
        return add_at(g, self.target, -grad, v0, v1)


class _Objective(Objective):
    """What the engine asks for the math (the epilogue of this test's call)."""

    name = "z-loss cross entropy"

    def __init__(self, ep):
        self.ep = ep

    def epilogue(self, call, target, dtype):
        return self.ep


def _reference(x, w, b, y, softcap=None):
    z = (x.double() @ w.double().T) + b.double()
    z = z if softcap is None else softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, dim=1)
    per = F.cross_entropy(z, y, reduction="none", ignore_index=-100) + Z_LOSS * lse.square()
    return (per * (y != -100)).sum() / (y != -100).sum()


def _run(x, w, b, y, mode, backend="torch", group=None, start=0, vg=None, softcap=None):
    vg = vg or w.shape[0]
    opts = LossOptions(mode=mode, backend=backend, softcap=softcap)
    call = Call(opts, group, ShardLayout(start, w.shape[0], vg), backend, mode, track=True)
    local = y - start
    ignored = y == -100
    target = torch.where((local >= 0) & (local < w.shape[0]) & ~ignored, local, -1)
    objective = _Objective(ZLossCE(target, ignored))
    if mode == "grad_in_forward":
        return GradInForwardLoss.apply(x, w, b, call, objective, y, (True, True, True))
    losses, weights = ChunkedLoss.apply(x, w, b, call, objective, y)
    return reduce_losses(losses, weights, "mean")


def _problem(n=37, v=389, h=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g), torch.randn(v)
    y = torch.randint(0, v, (n,), generator=g)
    y[::5] = -100
    return x, w, b, y


def _grads(loss, *inputs):
    return torch.autograd.grad(loss, inputs)


BACKENDS = ["torch"] + (["triton"] if HAS_TRITON else [])


@pytest.mark.parametrize("softcap", [None, 4.0])  # the engine's chain rule through the cap
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["memory_saving", "high_performance", "grad_in_forward"])
def test_an_objective_of_math_alone_runs_every_mode(mode, backend, softcap, monkeypatch):
    dev = device_for(backend)
    monkeypatch.setitem(memory.WORKSPACE_BYTES, dev.type, 1)  # 128-column chunks: 4 of them
    x, w, b, y = _problem()
    x64, w64, b64 = (t.double().requires_grad_(True) for t in (x, w, b))
    want = _reference(x64, w64, b64, y, softcap)
    want_grads = _grads(want, x64, w64, b64)
    inputs = [t.to(dev, copy=True).requires_grad_(True) for t in (x, w, b)]
    loss = _run(*inputs, y.to(dev), mode, backend, softcap=softcap)
    torch.testing.assert_close(loss.detach().cpu().double(), want, rtol=1e-5, atol=1e-6)
    got = [torch.autograd.grad(loss, inputs, retain_graph=True)]
    got.append(torch.autograd.grad(loss, inputs))  # a second backward: recomputed
    for grads in got:
        for a, e in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(a.cpu().double(), e, rtol=1e-4, atol=1e-6)


def _two_ranks(group):
    rank = torch.distributed.get_rank(group)
    x, w, b, y = _problem(seed=1)
    lo, hi = (0, 150) if rank == 0 else (150, w.shape[0])  # uneven shards
    x64, w64, b64 = (t.double().requires_grad_(True) for t in (x, w, b))
    want = _reference(x64, w64, b64, y)
    want_grads = _grads(want, x64, w64, b64)
    errors = []
    for mode in ("memory_saving", "grad_in_forward"):
        inputs = [x.clone().requires_grad_(True), w[lo:hi].clone().requires_grad_(True)]
        inputs.append(b[lo:hi].clone().requires_grad_(True))
        loss = _run(*inputs, y, mode, group=group, start=lo, vg=w.shape[0])
        got = _grads(loss, *inputs)
        pairs = [(loss, want), (got[0], want_grads[0])]
        pairs += [(got[1], want_grads[1][lo:hi]), (got[2], want_grads[2][lo:hi])]
        for i, (a, e) in enumerate(pairs):
            if not torch.allclose(a.double(), e, rtol=1e-4, atol=1e-6):
                errors.append(f"rank {rank} {mode} output {i}")
    return errors


@pytest.mark.slow
def test_an_objective_of_math_alone_on_two_ranks():
    assert [e for rank in run_ranks(_two_ranks, 2) for e in rank] == []
