"""The edges a hostile probe found, each against its float64 (or seed-order) reference:
a ``-inf`` bias on the first vocabulary tile or a whole shard, a target beyond the one shard
without a group, per-row uint8 masks at every length, ``gradcheck``
with the default mode, and the original operator's formula order at overflow."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import device_for, moved
from multirank import run_ranks

import vocab_parallel as vp
from vocab_parallel.backends import torch_backend
from vocab_parallel.backends.interface import Logits
from vocab_parallel.engine import memory_policy as memory

MODES = ("auto", "grad_in_forward", "memory_saving", "high_performance")


def _masked_problem(bt=24, h=16, v=300, masked=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bt, h, generator=g)
    w = torch.randn(v, h, generator=g) / h**0.5
    b = torch.zeros(v)
    b[:masked] = float("-inf")  # masks the first tiles / chunk of the vocabulary
    y = torch.randint(masked, v, (bt,), generator=g)
    return x, w, b, y


@pytest.mark.parametrize("mode", MODES)
def test_minus_inf_bias_on_the_first_tiles_is_finite(backend, mode):
    x, w, b, y = _masked_problem()
    dev = device_for(backend)
    xs, ws = (t.to(dev, copy=True).requires_grad_(True) for t in (x, w))
    loss = vp.vocab_parallel_linear_cross_entropy(
        xs, ws, y.to(dev), bias=b.to(dev), mode=mode, backend=backend
    )
    loss.backward()
    loss, gx, gw = loss.detach().cpu(), xs.grad.cpu(), ws.grad.cpu()
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    ref = F.cross_entropy(F.linear(x64, w64, b.double()), y)
    ref.backward()
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) < 1e-5
    assert torch.isfinite(gx).all() and torch.isfinite(gw).all()
    assert (gx.double() - x64.grad).abs().max() < 1e-5
    assert (gw.double() - w64.grad).abs().max() < 1e-5


def test_torch_backend_minus_inf_first_chunk_of_several(monkeypatch):
    """Several vocabulary chunks (the narrowest: 128 columns each), the first two all -inf."""
    monkeypatch.setitem(memory.WORKSPACE_BYTES, "cpu", 1)
    x, w, b, y = _masked_problem(v=900, masked=300)
    stats = torch_backend.forward_stats(x, w, y, Logits(bias=b))
    z = F.linear(x.double(), w.double(), b.double())
    m = z.max(1).values
    assert torch.isfinite(stats.sum_exp).all()
    assert torch.allclose(stats.max.double(), m, rtol=1e-6)
    assert torch.allclose(stats.sum_exp.double(), torch.exp(z - m[:, None]).sum(1), rtol=1e-6)


def _whole_shard_masked(group):
    rank = group.rank()
    x, w, b, y = _masked_problem(v=300, masked=150)  # rank 0's shard is all -inf
    lo, hi = vp.shard_bounds(300, 2)[rank]
    ws = w[lo:hi].clone().requires_grad_(True)
    loss = vp.vocab_parallel_linear_cross_entropy(
        x, ws, y, bias=b[lo:hi], process_group=group, mode="memory_saving"
    )
    loss.backward()
    return float(loss), bool(torch.isfinite(ws.grad).all())


@pytest.mark.slow
def test_a_whole_minus_inf_shard_under_tensor_parallelism():
    results = run_ranks(_whole_shard_masked, 2)
    x, w, b, y = _masked_problem(v=300, masked=150)
    ref = F.cross_entropy(F.linear(x.double(), w.double(), b.double()), y).item()
    assert all(abs(loss - ref) < 1e-5 and finite for loss, finite in results), results


@pytest.mark.parametrize("start,size", [(None, None), (0, None), (None, 10), (0, 10)])
def test_a_target_on_rows_no_rank_holds_without_a_group(start, size):
    """Without a group the one shard holds the whole vocabulary, rows [0, 10): a target
    beyond it would silently be "owned by no row"; it is refused, naming target. (A
    layout that leaves rows to no rank is refused itself: test_layout_without_group.py.)"""
    x, w, _, y = _masked_problem(v=10, masked=0)
    y[0] = 10  # one target on rows nobody holds
    with pytest.raises(ValueError, match=r"^target: ids must be in \[0, 10\)"):
        vp.vocab_parallel_linear_cross_entropy(
            x, w, y, vocab_start_index=start, global_vocab_size=size
        )


@pytest.mark.parametrize("bt", [2, 3, 5, 8, 9, 16])
def test_per_row_uint8_masks_are_refused_at_every_length(bt):
    g = torch.Generator().manual_seed(bt)
    x, w = torch.randn(bt, 4, generator=g), torch.randn(6, 4, generator=g)
    per_row = torch.tensor([i % 2 for i in range(bt)], dtype=torch.uint8)
    z = x @ w.T
    stats = (z.max(1).values, torch.exp(z - z.max(1).values[:, None]).sum(1))
    with pytest.raises(ValueError, match="^target_mask"):
        vp.fused_linear_cross_entropy_loss_grad(
            torch.ones(bt), x, w, per_row, torch.zeros(bt, dtype=torch.int64), 0.0, *stats
        )
    # The packed form of the same rows gives the bool mask's result.
    packed = vp.pack_target_mask(per_row.bool())
    a = vp.fused_linear_cross_entropy_loss_grad(
        torch.ones(bt), x, w, packed, torch.zeros(bt, dtype=torch.int64), 0.0, *stats
    )
    b = vp.fused_linear_cross_entropy_loss_grad(
        torch.ones(bt), x, w, per_row.bool(), torch.zeros(bt, dtype=torch.int64), 0.0, *stats
    )
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def test_gradcheck_with_the_default_mode():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(9, 4, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 9, (5,), generator=g)
    assert torch.autograd.gradcheck(
        lambda x, w: vp.vocab_parallel_linear_cross_entropy(x, w, y), (x, w)
    )


def test_the_original_formula_order_at_overflow(backend):
    """Statistics smaller than the true ones (the original's system tests): exp(z - max) /
    sum overflows to inf; the non-finite rows of grad_input are those of the original
    order computed with plain fp32 ops."""
    g = torch.Generator().manual_seed(3)
    bt, h, v = 16, 32, 200
    x, w = torch.randn(bt, h, generator=g) * 4, torch.randn(v, h, generator=g) * 4
    target = torch.randint(0, v, (bt,), generator=g)
    z = x @ w.T
    logits_max = z.max(1).values - 100.0  # exp(z - max) overflows near each row's max
    sum_exp = torch.full((bt,), 0.5)
    grad = torch.ones(bt)
    not_here = torch.zeros(bt, dtype=torch.bool)
    args = moved((grad, x, w, not_here, target, 0.0, logits_max, sum_exp), device_for(backend))
    gi, gw = (t.cpu() for t in vp.fused_linear_cross_entropy_loss_grad(*args, backend=backend))
    G = torch.exp(z - logits_max[:, None]) / sum_exp[:, None]  # the original's order
    G[torch.arange(bt), target] -= 1.0
    G = G * grad[:, None]
    want_gi, want_gw = G @ w, G.T @ x
    assert torch.equal(~torch.isfinite(gi).all(1), ~torch.isfinite(want_gi).all(1))
    assert torch.equal(~torch.isfinite(gw).all(1), ~torch.isfinite(want_gw).all(1))
    assert (~torch.isfinite(gi)).any()  # the case overflows at all


def _fullgraph(group, check_inputs):
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    w_full = torch.randn(40, 16)
    y = torch.randint(0, 40, (8,))
    lo, hi = vp.shard_bounds(40, 2)[group.rank()]

    def loss(x, w, y):
        return vp.vocab_parallel_linear_cross_entropy(
            x, w, y, process_group=group, check_inputs=check_inputs,
            vocab_start_index=lo, global_vocab_size=40,
        )  # fmt: skip

    try:
        got = torch.compile(loss, fullgraph=True)(x, w_full[lo:hi], y)
    except Exception as exc:  # what fullgraph reports, compared by the test
        return str(exc)
    want = F.cross_entropy(x.double() @ w_full.double().T, y)
    return abs(float(got) - float(want))


@pytest.mark.slow
def test_fullgraph_compile_under_tensor_parallelism():
    """check_inputs=True: a refusal that says what to do (the agreement reads its result on
    the host); check_inputs=False: the whole loss in one graph, equal to the unsharded."""
    refused = run_ranks(_fullgraph, 2, True, timeout=300)
    assert all(isinstance(m, str) and "check_inputs=False" in m for m in refused), refused
    errors = run_ranks(_fullgraph, 2, False, timeout=300)
    assert all(isinstance(e, float) and e < 1e-5 for e in errors), errors
