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
from helpers import CPU, HAS_TRITON, device_for, moved
from multirank import run_ranks

import vocab_parallel as vp
from vocab_parallel.engine.filtering import DENSE_ABOVE, TILE_COLS, TILE_ROWS, resolve_eps
from vocab_parallel.parallel.layout import shard_bounds

BT, H, V = 389, 48, 700
LIVE = [(0, 256), (384, 512)]  # columns with bias 0; all others -60 (p ~ e^-60)
IGNORED_ROWS = (256, 384)  # a whole row block of ignored tokens
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}
# The interpreted Triton cases take ~20 s each: in the full suite, not the fast loop.
BACKENDS = ["torch"] + ([pytest.param("triton", marks=pytest.mark.slow)] if HAS_TRITON else [])


def clean_problem(dtype, seed=0, reduction="mean"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(BT, H, generator=gen).to(dtype)
    # Live logits spread by 0.1 |x|: each live column's largest entry per row block (even
    # the last block's 5 rows) stays over 4x bf16's threshold.
    w = (torch.randn(V, H, generator=gen) * 0.1).to(dtype)
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
    kept = tmax >= 1
    kept[kept.sum(1) >= DENSE_ABOVE * n_cb] = True  # mostly kept row blocks run whole
    return kept


def masked(G, mask, lo, hi):
    """``G[:, lo:hi]`` with the left-out tiles zeroed."""
    full = mask.repeat_interleave(TILE_ROWS, 0).repeat_interleave(TILE_COLS, 1)
    return G[:, lo:hi] * full[:BT, : hi - lo]


def run(x, w, bias, y, grad, reduction, group=None, lo=0, hi=V, **kw):
    """Loss and gradients, on the CPU, of one call on the backend's device (gloo ranks:
    the CPU)."""
    dev = device_for(kw.get("backend", "torch")) if group is None else CPU
    xx = x.to(dev, copy=True).requires_grad_()
    ww = w[lo:hi].to(dev, copy=True).requires_grad_()
    bb = bias[lo:hi].to(dev, copy=True).requires_grad_()
    y, grad = moved((y, grad), dev)
    loss = vp.vocab_parallel_linear_cross_entropy(
        xx, ww, y, bias=bb, reduction=reduction, process_group=group, **kw
    )
    (loss if grad is None else (loss * grad).sum()).backward()
    return tuple(t.cpu() for t in (loss.detach(), xx.grad, ww.grad, bb.grad))


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
    # Kept: the live columns of the three row blocks that hold targets (one of 5 rows).
    live = sum(hi - lo for lo, hi in LIVE)
    assert stats.skipped_fraction == pytest.approx(1 - 3 * live / (4 * V))
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


# ---------------------------------------------------------------- the chunk loop itself


def _structured_g(bt, v, dtype, seed, held=True):
    """A ``G`` (values the input dtype holds, unless not ``held``: then fp32 values the
    loop must round) whose columns are negligible or not per row
    block in a pattern set by hand: row block 0 keeps every 3rd column, block 1 keeps 80%
    of them (above DENSE_ABOVE: runs whole), block 2 none, block 3 (partial) random."""
    gen = torch.Generator().manual_seed(seed)
    small = torch.rand(bt, v, generator=gen) * 1e-6  # all below eps = 1e-4
    big = (torch.rand(bt, v, generator=gen) + 0.5) * torch.randn(bt, v, generator=gen).sign()
    keep = torch.zeros(bt, v, dtype=torch.bool)
    keep[0:128, ::3] = True
    keep[128:256, torch.randperm(v, generator=gen)[: int(0.8 * v) + 1]] = True
    keep[384:] = torch.rand(bt - 384, v, generator=gen) < 0.3
    # One entry per kept (row block, column) tile is large: the tile is kept.
    tile_keep = torch.zeros(bt, v, dtype=torch.bool)
    for b in range(0, bt, TILE_ROWS):
        rows = keep[b : b + TILE_ROWS].any(0)
        tile_keep[b, rows] = True
    g = torch.where(tile_keep, big, small)
    return (g.to(dtype).float() if held else g), tile_keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("which", ["both", "weight", "input"])
@pytest.mark.parametrize("acc", ["write", "fp32_acc", "dtype_acc"])
def test_chunk_loop_leaves_out_exactly_the_negligible_columns(dtype, which, acc):
    """``gradient_products`` over three chunks (the last one narrower) with a filter, the
    gradients written or added to the caller's accumulators, against float64 products of
    ``G`` with the expected tiles zeroed: per chunk, per row block, the columns with an
    entry at or above eps, and every column of a row block that keeps >= 3/4 of them."""
    from vocab_parallel.backends.interface import Outputs
    from vocab_parallel.engine.chunking import gradient_products
    from vocab_parallel.engine.filtering import GradientFilter

    bt, v, h, cv, eps = 389, 700, 37, 256, 1e-4
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(bt, h, generator=gen).to(dtype)
    w = torch.randn(v, h, generator=gen).to(dtype)
    g, _ = _structured_g(bt, v, dtype, seed=12, held=False)
    row_grad = torch.rand(bt, generator=gen) + 0.5  # G's rows are per unit of it: 1e-6 * 1.5
    row_grad[300] = 0.0  # a row of zero upstream gradient: never keeps anything
    g[300] = 0.0
    expected = torch.zeros(bt, v, dtype=torch.bool)
    for v0 in range(0, v, cv):
        v1 = min(v, v0 + cv)
        for b in range(0, bt, TILE_ROWS):
            ratio = g[b : b + TILE_ROWS, v0:v1].abs() / (eps * row_grad[b : b + TILE_ROWS, None])
            cols = torch.nan_to_num(ratio, nan=0.0).amax(0) >= 1
            if cols.sum() >= DENSE_ABOVE * (v1 - v0):
                cols[:] = True
            expected[b : b + TILE_ROWS, v0:v1] = cols
    g_rounded = g.to(dtype).double()  # what the products must see: G in the input dtype
    gm = g_rounded * expected
    start_w = torch.randn(v, h, generator=gen)
    buffers = {}
    if acc != "write":
        buffers["grad_weight_acc"] = start_w.to(
            torch.float32 if acc == "fp32_acc" else dtype, copy=True
        )
    flt = GradientFilter(
        eps, row_grad, input=which in ("both", "input"), weight=which in ("both", "weight")
    )
    vp.gradient_filter_stats(reset=True)
    out = Outputs(filter=flt, accumulate=acc != "write", grad_input_dtype=torch.float32, **buffers)
    grads = gradient_products(
        x, w, cv, lambda v0, v1, *_: g[:, v0:v1].clone(), out, g_reads_operands=False
    )
    stats = vp.gradient_filter_stats(reset=True)
    n_tiles = sum(-(-bt // TILE_ROWS) * (min(v, v0 + cv) - v0) for v0 in range(0, v, cv))
    left_out = sum(
        int((~expected[b, v0 : v0 + cv]).sum()) for b in range(0, bt, TILE_ROWS)
        for v0 in range(0, v, cv)
    )  # fmt: skip
    assert stats.tiles == n_tiles and left_out > n_tiles // 4
    assert stats.skipped_input == (left_out if flt.input else 0)
    assert stats.skipped_weight == (left_out if flt.weight else 0)
    g_in = gm if flt.input else g_rounded
    g_w = gm if flt.weight else g_rounded
    want_in = g_in @ w.double()
    if acc == "write":
        want_w = g_w.T @ x.double()
    else:  # what the buffer held before
        want_w = g_w.T @ x.double() + start_w.to(buffers["grad_weight_acc"].dtype).double()
    # Summed in fp32: grad_input kept in fp32 (as under tensor parallelism), the weight
    # rows rounded once to the buffer's dtype.
    _close(grads.input, want_in, torch.float32, "grad_input")
    w_dtype = torch.float32 if acc == "fp32_acc" else dtype
    _close(grads.weight.float(), want_w, w_dtype, "grad_weight")
    if acc != "write":
        assert grads.weight is buffers["grad_weight_acc"]  # added in place


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_a_filter_that_leaves_out_nothing_is_bitwise_exact(bias):
    """Every tile kept (eps tiny): the products, G's rounding to bf16 and the bias
    gradient are bitwise those of the unfiltered loop."""
    from vocab_parallel.backends.interface import Outputs
    from vocab_parallel.engine.chunking import gradient_products
    from vocab_parallel.engine.filtering import GradientFilter

    gen = torch.Generator().manual_seed(15)
    x = torch.randn(200, 24, generator=gen).bfloat16()
    w = torch.randn(300, 24, generator=gen).bfloat16()
    g = torch.randn(200, 300, generator=gen)  # fp32 values: the loop rounds them

    def products(flt):
        out = Outputs(need_bias=bias, filter=flt)
        return gradient_products(
            x, w, 128, lambda v0, v1, *_: g[:, v0:v1].clone(), out, g_reads_operands=False
        )

    exact = products(None)
    kept_all = products(GradientFilter(1e-30, torch.ones(200)))
    for a, b in zip(exact, kept_all, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_every_vocabulary_order_leaves_out_the_same_entries():
    """One-column tiles: relabelling the vocabulary (what Cut Cross-Entropy's sort does)
    changes neither what is left out nor, beyond fp32 summation order, the gradients."""
    x, w, bias, y, _ = clean_problem(torch.float32, seed=7)
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(8))
    inv = torch.argsort(perm)
    vp.gradient_filter_stats(reset=True)
    _, gi, gw, _ = run(x, w, bias, y, None, "mean", filter_eps="auto")
    first = vp.gradient_filter_stats(reset=True)
    _, gi_p, gw_p, _ = run(x, w[perm], bias[perm], inv[y.clamp(min=0)].where(y >= 0, y), None,
                           "mean", filter_eps="auto")  # fmt: skip
    second = vp.gradient_filter_stats(reset=True)
    assert first.skipped_input == second.skipped_input > 0
    _close(gi_p, gi.double(), torch.float32, "grad_input")
    _close(gw_p, gw[perm].double(), torch.float32, "grad_weight")


@pytest.mark.parametrize("per_row", [False, True], ids=["uniform_grad", "per_row_grad"])
def test_tile_mask_is_the_same_in_every_dtype_of_g(per_row):
    """The tile test on ``G`` held in bf16 (CUDA's operands) or float64 (gradcheck) picks
    the tiles the fp32 test picks, for one upstream gradient (a mean: ignored rows 0) and
    for one per row; a NaN keeps its tile."""
    from vocab_parallel.engine.filtering import GradientFilter, tile_mask

    g, _ = _structured_g(389, 300, torch.bfloat16, seed=13)
    row_grad = torch.full((389,), 0.5)
    if per_row:
        row_grad = torch.rand(389, generator=torch.Generator().manual_seed(14)) + 0.5
    row_grad[200:210] = 0.0
    g[200:210] = 0.0
    g[5, 7] = float("nan")
    # A column just below the threshold in every row, once each row's gradient scales it
    # (and above it for the largest row scale applied to the largest entry).
    g[0:128, 4] = 0.9e-4 * row_grad[0:128]
    masks = [tile_mask(g.to(dt), GradientFilter(1e-4, row_grad)) for dt in
             (torch.float32, torch.bfloat16, torch.float64)]  # fmt: skip
    ratio = g.double().abs() / (1e-4 * row_grad.double()[:, None])  # 0 / 0: NaN, kept
    ratio[200:210] = torch.where(g[200:210].isnan(), float("nan"), 0.0)
    want = torch.stack([~(ratio[b : b + TILE_ROWS].amax(0) < 1) for b in range(0, 389, TILE_ROWS)])
    want[want.sum(1) >= DENSE_ABOVE * 300] = True
    assert want[0, 7] and not want[0, 4] and 0.3 < want.float().mean() < 0.7
    for mask in masks:
        assert torch.equal(mask, want)
