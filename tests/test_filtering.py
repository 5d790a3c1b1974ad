"""Gradient filtering (``filter_eps``): what it leaves out, against float64 references.

Two problems. The *clean* one has whole tiles of ``G`` far below or far above the
threshold (dead vocabulary columns with a bias of -60, a row block of ignored tokens), so
which tiles are left out is known exactly: the gradients must equal the float64 gradients
of ``G`` with those tiles zeroed, and the counter must count them. The *peaked* one uses a
large ``eps`` on random logits, so the left-out entries matter: the gradients must stay
within the documented bound of the exact ones (and differ from them). ``None`` and
``eps = 0`` must be bitwise the exact results; everything bitwise deterministic; 1-4 gloo
ranks with uneven shards; both backends; every mode.
"""

from __future__ import annotations

import pytest
import torch
from helpers import HAS_TRITON
from multirank import run_ranks

import vocab_parallel as vp
from vocab_parallel.filtering import TILE_COLS, TILE_ROWS, resolve_eps
from vocab_parallel.layout import shard_bounds

BT, H, V = 389, 48, 700
LIVE = [(0, 256), (384, 512)]  # columns with bias 0; all others -60 (p ~ e^-60)
IGNORED_ROWS = (256, 384)  # a whole row block of ignored tokens
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}
# The interpreted Triton cases take ~20 s each: in the full suite, not the fast loop.
BACKENDS = ["torch"] + ([pytest.param("triton", marks=pytest.mark.slow)] if HAS_TRITON else [])


def clean_problem(dtype, seed=0, reduction="mean"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(BT, H, generator=gen).to(dtype)
    w = (torch.randn(V, H, generator=gen) * 0.3).to(dtype)
    bias = torch.full((V,), -60.0)
    for lo, hi in LIVE:
        bias[lo:hi] = 0.0
    live = torch.cat([torch.arange(lo, hi) for lo, hi in LIVE])
    y = live[torch.randint(0, live.numel(), (BT,), generator=gen)]
    y[IGNORED_ROWS[0] : IGNORED_ROWS[1]] = -100
    y[7] = -100
    grad = torch.randn(BT, generator=gen) if reduction == "none" else None
    return x, w, bias.to(dtype), y, grad


def reference_g(x, w, bias, y, grad, reduction):
    """float64 ``G = d loss / d z`` and each row's upstream gradient ``g_i``."""
    z = x.double() @ w.double().T + bias.double()
    keep = y != -100
    p = torch.softmax(z, dim=1)
    onehot = torch.zeros_like(p)
    onehot[keep.nonzero().squeeze(1), y[keep]] = 1.0
    if reduction == "mean":
        g = keep.double() / keep.sum()
    elif reduction == "sum":
        g = keep.double()
    else:
        g = grad.double() * keep
    return (p - onehot) * g[:, None], g


def expected_mask(G, g, eps, lo, hi):
    """Kept tiles of the shard ``[lo, hi)`` (its tile grid starts at ``lo``), asserting
    that no tile is near the threshold (so rounding cannot move one)."""
    ratio = G[:, lo:hi].abs() / (eps * g.abs()[:, None])
    ratio = torch.nan_to_num(ratio, nan=0.0)  # rows of g = 0 have G = 0
    n_rb, n_cb = -(-BT // TILE_ROWS), -(-(hi - lo) // TILE_COLS)
    tmax = torch.zeros(n_rb, n_cb, dtype=torch.float64)
    for a in range(n_rb):
        for b in range(n_cb):
            block = ratio[a * TILE_ROWS : (a + 1) * TILE_ROWS, b * TILE_COLS : (b + 1) * TILE_COLS]
            tmax[a, b] = block.max()
    assert ((tmax > 4) | (tmax < 0.25)).all(), "problem not clean: a tile near the threshold"
    return tmax >= 1


def masked(G, mask, lo, hi):
    """``G[:, lo:hi]`` with the left-out tiles zeroed."""
    full = mask.repeat_interleave(TILE_ROWS, 0).repeat_interleave(TILE_COLS, 1)
    return G[:, lo:hi] * full[:BT, : hi - lo]


def run(x, w, bias, y, grad, reduction, group=None, lo=0, hi=V, **kw):
    xx = x.clone().requires_grad_()
    ww = w[lo:hi].clone().requires_grad_()
    bb = bias[lo:hi].clone().requires_grad_()
    loss = vp.vocab_parallel_linear_cross_entropy(
        xx, ww, y, bias=bb, reduction=reduction, process_group=group, **kw
    )
    (loss if grad is None else (loss * grad).sum()).backward()
    return loss.detach(), xx.grad, ww.grad, bb.grad


def _close(actual, expected, dtype, what):
    a, e = actual.double(), expected.double()
    err, scale = (a - e).abs().max().item(), e.abs().max().item()
    assert err <= TOL[dtype] * scale + 1e-7, f"{what}: {err:.3e} (max |ref| {scale:.3e})"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "mode,reduction",
    [("auto", "mean"), ("memory_saving", "none"), ("high_performance", "sum")],
)
def test_left_out_tiles_are_exactly_the_negligible_ones(backend, dtype, mode, reduction):
    x, w, bias, y, grad = clean_problem(dtype, reduction=reduction)
    G, g = reference_g(x, w, bias, y, grad, reduction)
    eps = resolve_eps("auto", dtype)
    mask = expected_mask(G, g, eps, 0, V)
    vp.gradient_filter_stats(reset=True)
    loss, gi, gw, gb = run(
        x, w, bias, y, grad, reduction, mode=mode, backend=backend, filter_eps="auto"
    )
    stats = vp.gradient_filter_stats(reset=True)
    assert stats.tiles == mask.numel() and stats.skipped_input == int((~mask).sum())
    assert stats.skipped_weight == stats.skipped_input
    assert stats.skipped_fraction == pytest.approx(15 / 24)  # 3 dead blocks + 1 ignored
    Gm = masked(G, mask, 0, V)
    _close(gi, Gm @ w.double(), dtype, "grad_input")
    _close(gw, Gm.T @ x.double(), dtype, "grad_weight")
    _close(gb, G.sum(0), dtype, "grad_bias")  # never filtered
    exact = run(x, w, bias, y, grad, reduction, mode=mode, backend=backend)
    assert torch.equal(loss, exact[0])  # the loss is never filtered
    assert torch.equal(gb, exact[3])


@pytest.mark.parametrize("mode", ["auto", "memory_saving"])
def test_none_and_zero_are_bitwise_exact_and_filtering_is_deterministic(mode):
    x, w, bias, y, grad = clean_problem(torch.float32, seed=1)
    exact = run(x, w, bias, y, None, "mean", mode=mode)
    for eps in (None, 0.0):
        again = run(x, w, bias, y, None, "mean", mode=mode, filter_eps=eps)
        for a, b in zip(exact, again, strict=True):
            assert torch.equal(a, b)
    first = run(x, w, bias, y, None, "mean", mode=mode, filter_eps="auto")
    second = run(x, w, bias, y, None, "mean", mode=mode, filter_eps="auto")
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(first[2], exact[2]) or not torch.equal(first[1], exact[1])


@pytest.mark.parametrize("which", ["weight", "input"])
def test_filter_grads_leaves_the_other_gradient_exact(which):
    x, w, bias, y, grad = clean_problem(torch.float32, seed=2)
    exact = run(x, w, bias, y, None, "mean")
    vp.gradient_filter_stats(reset=True)
    got = run(x, w, bias, y, None, "mean", filter_eps="auto", filter_grads=which)
    stats = vp.gradient_filter_stats()
    untouched = 1 if which == "weight" else 2  # grad_input / grad_weight
    assert torch.equal(got[untouched], exact[untouched])
    if which == "weight":
        assert stats.skipped_weight > 0 and stats.skipped_input == 0
    else:
        assert stats.skipped_input > 0 and stats.skipped_weight == 0


def peaked_problem(seed=3):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(257, 32, generator=gen) * 2.0
    w = torch.randn(389, 32, generator=gen)
    y = torch.randint(0, 389, (257,), generator=gen)
    return x, w, y


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_stay_within_the_documented_bound(backend):
    """|grad_input_i - exact| <= eps |g_i| n_i max|W| and |grad_weight_j - exact| <=
    eps sum_i |g_i| |x_i| (over rows whose entry j is below the threshold), with an eps
    large enough that the left-out entries change the result."""
    x, w, y = peaked_problem()
    eps = 2e-3
    zero = torch.zeros(389)
    exact = run(x, w, zero, y, None, "mean", backend=backend, mode="memory_saving")
    vp.gradient_filter_stats(reset=True)
    got = run(x, w, zero, y, None, "mean", backend=backend, mode="memory_saving", filter_eps=eps)
    assert vp.gradient_filter_stats().skipped_fraction >= 0.15
    G, g = reference_g(x, w, zero, y, None, "mean")
    small = G.abs() < eps * g.abs()[:, None] * 1.001  # every entry that may be left out
    slack = 1e-6  # fp32 summation order of the exact products
    bound_in = eps * g.abs() * small.sum(1) * w.abs().max() + slack
    err_in = (got[1] - exact[1]).double().abs().amax(1)
    assert (err_in <= bound_in).all(), f"grad_input over bound by {(err_in - bound_in).max()}"
    bound_w = eps * (small.double().T @ (g.abs()[:, None] * x.double().abs())) + slack
    err_w = (got[2] - exact[2]).double().abs()
    assert (err_w <= bound_w).all(), f"grad_weight over bound by {(err_w - bound_w).max()}"
    assert err_in.max() > 1e-6 and err_w.max() > 1e-6  # something was left out
    assert torch.equal(got[0], exact[0])


def test_nan_gradients_are_never_hidden():
    x, w, bias, y, grad = clean_problem(torch.float32, seed=4)
    w = w.clone()
    w[600, 0] = float("nan")  # a dead column: its tile would be left out
    got = run(x, w, bias, y, None, "mean", filter_eps="auto")
    assert torch.isnan(got[1]).any() and torch.isnan(got[2][600]).any()


@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(filter_eps="fast"), ValueError),
        (dict(filter_eps=-1.0), ValueError),
        (dict(filter_eps=float("inf")), ValueError),
        (dict(filter_eps=True), TypeError),
        (dict(filter_eps=[1e-3]), TypeError),
        (dict(filter_grads="bias"), ValueError),
    ],
)
def test_errors_name_the_parameter(kwargs, error):
    x, w, bias, y, _ = clean_problem(torch.float32)
    with pytest.raises(error, match=f"^{next(iter(kwargs))}:"):
        vp.vocab_parallel_linear_cross_entropy(x, w, y, **kwargs)


def test_module_and_head_take_the_options():
    x, w, bias, y, _ = clean_problem(torch.float32, seed=5)
    ref = run(x, w, bias, y, None, "mean", filter_eps="auto")
    mod = vp.VocabParallelLinearCrossEntropy(filter_eps="auto")
    assert "filter_eps='auto'" in repr(mod)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    mod(xx, ww, y, bias=bias).backward()
    assert torch.equal(ww.grad, ref[2])
    head = vp.VocabParallelLMHead(H, V, bias=True, filter_eps="auto")
    with torch.no_grad():
        head.weight.copy_(w)
        head.bias.copy_(bias)
    xx = x.clone().requires_grad_()
    head(xx, y).backward()
    assert torch.equal(head.weight.grad, ref[2]) and torch.equal(xx.grad, ref[1])


# ---------------------------------------------------------------- ranks


def _ranks(group, dtype, backend):
    rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    lo, hi = shard_bounds(V, world)[rank]
    x, w, bias, y, _ = clean_problem(dtype, seed=6)
    G, g = reference_g(x, w, bias, y, None, "mean")
    eps = resolve_eps("auto", dtype)
    vp.gradient_filter_stats(reset=True)
    loss, gi, gw, gb = run(
        x, w, bias, y, None, "mean", group, lo, hi, backend=backend, filter_eps="auto"
    )
    skipped = vp.gradient_filter_stats().skipped_fraction
    gi_ref = torch.zeros(BT, H, dtype=torch.float64)
    for lo_r, hi_r in shard_bounds(V, world):
        Gm = masked(G, expected_mask(G, g, eps, lo_r, hi_r), lo_r, hi_r)
        gi_ref += Gm @ w[lo_r:hi_r].double()
        if lo_r == lo:
            gw_ref = Gm.T @ x.double()
    _close(gi, gi_ref, dtype, f"rank {rank} grad_input")
    _close(gw, gw_ref, dtype, f"rank {rank} grad_weight")
    return skipped


def _disagree(group):
    rank = torch.distributed.get_rank(group)
    x, w, bias, y, _ = clean_problem(torch.float32)
    lo, hi = shard_bounds(V, 2)[rank]
    try:
        vp.vocab_parallel_linear_cross_entropy(
            x, w[lo:hi], y, process_group=group, filter_eps=None if rank else "auto"
        )
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,dtype,backend",
    [(2, torch.float32, "torch"), (3, torch.bfloat16, "torch"), (4, torch.float32, "torch")]
    + ([(2, torch.bfloat16, "triton")] if HAS_TRITON else []),
)
def test_every_rank_matches_the_masked_reference(world, dtype, backend):
    skipped = run_ranks(_ranks, world, dtype, backend)
    assert all(s >= 0.25 for s in skipped), skipped  # the ignored row block at least


@pytest.mark.slow
def test_ranks_that_disagree_on_filter_eps_fail_alike():
    messages = run_ranks(_disagree, 2)
    assert all(m is not None and m.startswith("filter_eps:") for m in messages), messages
    assert messages[0] == messages[1]
