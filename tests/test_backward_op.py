"""The backward operator (docs/design.md, "The operator") on both backends, against the
float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    ALL_DTYPES,
    DEVICE,
    HAS_TRITON,
    assert_bitwise_equal,
    assert_matches_reference,
    close_to_reference,
    dtype_id,
    first_named_parameter,
    make_case,
)

from vocab_parallel import (
    fused_linear_cross_entropy_loss_grad,
    pack_target_mask,
    shard_bounds,
)
from vocab_parallel.backends import torch_backend
from vocab_parallel.backends.interface import PLAIN, GradTerms, Outputs
from vocab_parallel.engine import memory_policy as memory
from vocab_parallel.reference import global_statistics

SHAPES = [(37, 33, 129), (1, 1, 1), (64, 16, 260), (9, 70, 3)]


def shape_id(s):
    return "x".join(map(str, s))


# ---------------------------------------------------------------------------------------
# Against the reference
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_matches_reference(backend, mode, dtype, shape):
    bt, h, v = shape
    # With one row, test both sides of the mask; V = 1 and target here would make G = 0.
    not_here = torch.tensor([True]) if bt == 1 else 0.3
    case = make_case(bt, h, v, dtype=dtype, mode=mode, seed=bt + v, not_here=not_here)
    ref = case.reference()
    assert ref[0].abs().max() > 0 and ref[1].abs().max() > 0  # a meaningful comparison
    assert_matches_reference(case.run(backend), ref, dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_single_row_single_column_target_here(backend, mode, dtype):
    # softmax over one column is 1 and the one-hot removes it: G = 0 exactly.
    case = make_case(1, 1, 1, dtype=dtype, mode=mode, not_here=torch.tensor([False]))
    gi, gw = case.run(backend)
    assert gi.shape == (1, 1) and gw.shape == (1, 1)
    assert gi.dtype == dtype and gw.dtype == dtype
    assert gi.item() == 0.0 and gw.item() == 0.0


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_g_is_rounded_to_nearest_input_dtype_before_the_products(backend, dtype):
    """With one row, grad_weight[j] = round(G[0, j]) * x[0] is a single exact product.

    A saved softmax, no one-hot and a power-of-two grad make G exact in fp32, so the
    result must equal the reference bit for bit: G not rounded to the input dtype, or
    rounded by truncation, or a product not accumulated in fp32, all show here.
    """
    case = make_case(1, 16, 129, dtype=dtype, mode="high_performance", seed=37, not_here=1.0)
    case = case.with_(grad=torch.tensor([-0.5], device=DEVICE))
    gi, gw = case.run(backend)
    ref_gi, ref_gw = case.reference()
    assert gw.dtype == dtype
    assert torch.equal(gw.cpu(), ref_gw)
    close_to_reference(gi, ref_gi, dtype, "grad_input")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_mask_forms_and_target_dtypes_agree(backend, mode, dtype):
    """Packed uint8 and bool masks, int32 and int64 targets: bitwise the same result."""
    results = {}
    for mask_form in ("packed", "bool"):
        for target_dtype in (torch.int32, torch.int64):
            case = make_case(
                37,
                20,
                129,
                dtype=dtype,
                mode=mode,
                seed=3,
                mask_form=mask_form,
                target_dtype=target_dtype,
                not_here=0.5,
            )
            assert case.target_mask.dtype == (torch.uint8 if mask_form == "packed" else torch.bool)
            assert case.masked_target.dtype == target_dtype
            results[mask_form, target_dtype] = case.run(backend)
    assert_matches_reference(results["packed", torch.int64], case.reference(), dtype)
    first = results["packed", torch.int64]
    for key, out in results.items():
        assert_bitwise_equal(out, first, str(key))


def test_mask_actually_controls_the_one_hot(backend, mode):
    """Flipping the mask of one row changes exactly that row of grad_input."""
    case = make_case(20, 12, 40, mode=mode, seed=5, not_here=torch.zeros(20, dtype=torch.bool))
    flipped = case.not_here.clone()
    flipped[7] = True
    other = case.with_(not_here=flipped, target_mask=pack_target_mask(flipped))
    gi0, _ = case.run(backend)
    gi1, _ = other.run(backend)
    changed = (gi0 != gi1).any(dim=1)
    assert changed.nonzero().flatten().tolist() == [7]
    assert_matches_reference(other.run(backend), other.reference(), torch.float32)


@pytest.mark.parametrize("grad_form", ["shape1", "0d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
def test_grad_broadcasts(backend, mode, grad_form, dtype):
    case = make_case(37, 17, 129, dtype=dtype, mode=mode, seed=11)
    value = -1.75  # not 1: a scale that is ignored must show
    g = torch.full((1,), value) if grad_form == "shape1" else torch.tensor(value)
    g = g.to(DEVICE)
    bcast = case.with_(grad=g)
    expanded = case.with_(grad=torch.full((37,), value, device=DEVICE))
    out = bcast.run(backend)
    assert_matches_reference(out, expanded.reference(), dtype)
    assert_bitwise_equal(out, expanded.run(backend))
    # A stride-0 grad of full length is the same thing again.
    assert_bitwise_equal(out, case.with_(grad=g.reshape(1).expand(37)).run(backend))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("global_vocab_size", [None, 1000])
def test_label_smoothing(backend, mode, dtype, global_vocab_size):
    kw = dict(dtype=dtype, mode=mode, seed=21, not_here=0.4)
    case = make_case(37, 24, 129, label_smoothing=0.1, global_vocab_size=global_vocab_size, **kw)
    out = case.run(backend)
    assert_matches_reference(out, case.reference(), dtype)
    # And it is not a no-op: the result differs from the unsmoothed gradient.
    plain = make_case(37, 24, 129, **kw).run(backend)
    diff = (out[0].double() - plain[0].double()).abs().max()
    assert diff > 1e-3


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_sharded_gradients_equal_unsharded_cross_entropy(backend, mode, label_smoothing):
    """Uneven vocabulary shards with global statistics give autograd's gradients."""
    bt, h, v, world = 29, 19, 150, 4  # shards of 38, 38, 37 and 37 rows
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(bt, h, generator=gen, dtype=torch.float64)
    w = torch.randn(v, h, generator=gen, dtype=torch.float64) * 0.3
    y = torch.randint(0, v, (bt,), generator=gen)
    up = torch.randn(bt, generator=gen, dtype=torch.float64)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = F.cross_entropy(xr @ wr.T, y, reduction="none", label_smoothing=label_smoothing)
    (loss * up).sum().backward()

    lmax, sumexp, soft = (s.float().to(DEVICE) for s in global_statistics(x, w))
    x32, w32 = x.float().to(DEVICE), w.float().to(DEVICE)
    grad_input = torch.zeros(bt, h, dtype=torch.float64)
    grad_weight = []
    for start, end in shard_bounds(v, world):
        here = (y >= start) & (y < end)
        stats = (
            dict(logits_max=lmax, sum_exp_logits=sumexp)
            if mode == "memory_saving"
            else dict(softmax=soft[:, start:end])
        )
        gi, gw = fused_linear_cross_entropy_loss_grad(
            up.float().to(DEVICE),
            x32,
            w32[start:end],
            pack_target_mask(~here).to(DEVICE),
            torch.where(here, y - start, 0).to(DEVICE),
            label_smoothing,
            global_vocab_size=v,
            backend=backend,
            **stats,
        )
        grad_input += gi.double().cpu()
        grad_weight.append(gw.double().cpu())
    close_to_reference(grad_input.float(), xr.grad, torch.float32, "grad_input")
    close_to_reference(torch.cat(grad_weight).float(), wr.grad, torch.float32, "grad_weight")


def test_out_of_range_targets_are_clamped(backend, mode):
    v = 40
    case = make_case(8, 12, v, mode=mode, seed=2, not_here=torch.zeros(8, dtype=torch.bool))
    for target_dtype, huge in ((torch.int64, 2**40), (torch.int32, 2**31 - 1)):
        raw = torch.tensor([-1, -7, v, v + 5, huge, -huge, 0, v - 1], dtype=target_dtype)
        clamped = raw.long().clamp(0, v - 1)
        wild = case.with_(masked_target=raw.to(DEVICE))
        out = wild.run(backend)
        assert_matches_reference(out, wild.reference(), torch.float32)
        tame = case.with_(masked_target=clamped.to(DEVICE))
        assert_bitwise_equal(out, tame.run(backend))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_non_contiguous_arguments(backend, mode, dtype):
    bt, h, v = 37, 21, 129
    case = make_case(bt, h, v, dtype=dtype, mode=mode, seed=9, mask_form="bool", not_here=0.5)

    def transposed(t):  # same values, column-major storage
        return t.t().contiguous().t()

    def strided(t):  # same values, every other element of a bigger buffer
        buf = torch.zeros((2 * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        buf[::2] = t
        return buf[::2]

    def strided_cols(t):
        buf = torch.zeros((t.shape[0], 2 * t.shape[1]), dtype=t.dtype, device=t.device)
        buf[:, 1::2] = t
        return buf[:, 1::2]

    changes = dict(
        input=transposed(case.input),
        weight=strided_cols(case.weight),
        grad=strided(case.grad),
        target_mask=strided(case.target_mask),
        masked_target=strided(case.masked_target),
    )
    if mode == "memory_saving":
        changes |= dict(
            logits_max=strided(case.logits_max), sum_exp_logits=strided(case.sum_exp_logits)
        )
    else:
        changes["softmax"] = transposed(case.softmax)
    for name, t in changes.items():
        assert not t.is_contiguous(), name
        assert torch.equal(t, getattr(case, name)), name
    odd = case.with_(**changes)
    out = odd.run(backend)
    assert_matches_reference(out, case.reference(), dtype)
    contiguous = case.run(backend)
    for a, b in zip(out, contiguous, strict=True):
        close_to_reference(a, b.double(), dtype)


def test_packed_mask_longer_than_needed_with_garbage_tail(backend, mode):
    bt = 37  # 5 bytes: rows 37..39 of the last byte are unused
    case = make_case(bt, 16, 129, mode=mode, seed=4, not_here=0.5)
    clean = pack_target_mask(case.not_here.cpu())
    assert clean.shape == (5,)
    dirty = torch.cat([clean, torch.tensor([0xFF, 0xA5, 0xFF], dtype=torch.uint8)])
    dirty[4] |= 0b11100000  # set every unused bit of the last used byte
    out = case.with_(target_mask=dirty.to(DEVICE)).run(backend)
    assert_bitwise_equal(out, case.with_(target_mask=clean.to(DEVICE)).run(backend))
    assert_matches_reference(out, case.reference(), torch.float32)


def test_auto_backend_picks_a_backend(mode):
    case = make_case(9, 8, 20, mode=mode, seed=1)
    expected = case.run("triton" if DEVICE.type == "cuda" else "torch")
    assert_bitwise_equal(case.run("auto"), expected)


# ---------------------------------------------------------------------------------------
# Chunking over the vocabulary
# ---------------------------------------------------------------------------------------


def _stats(case):
    """The three statistics arguments of a backend launcher, in order."""
    return case.logits_max, case.sum_exp_logits, case.softmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_torch_backend_chunks_equal_one_chunk(mode, dtype, monkeypatch):
    bt, h, v = 5, 24, 700
    assert memory.columns(bt, v, DEVICE.type, "logits") == v  # default: one chunk
    case = make_case(bt, h, v, dtype=dtype, mode=mode, seed=8, label_smoothing=0.1)

    def run(case):
        lmax, lsum, softmax = _stats(case)
        terms = GradTerms(case.grad, 0.9, 0.1 / v, None, None, lmax, lsum, softmax)
        return torch_backend.fused_backward(
            case.input,
            case.weight,
            case.masked_target.clamp(0, v - 1).masked_fill(case.not_here, -1),
            PLAIN,
            terms,
            Outputs(),
        )[:2]

    whole = run(case)
    monkeypatch.setitem(memory.WORKSPACE_BYTES, DEVICE.type, 1)  # the narrowest chunks
    assert math.ceil(v / memory.columns(bt, v, DEVICE.type, "logits")) >= 3  # several
    chunked = run(case)
    assert_matches_reference(chunked, case.reference(), dtype)
    for a, b in zip(chunked, whole, strict=True):
        close_to_reference(a, b.double(), dtype)
    # Every target in the last chunk, every row on this shard: the one-hot must land there.
    late = case.with_(
        masked_target=torch.full((bt,), v - 3, device=DEVICE),
        not_here=torch.zeros(bt, dtype=torch.bool, device=DEVICE),
    )
    assert_matches_reference(run(late), late.reference(), dtype)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
def test_triton_chunks_equal_one_chunk(mode, dtype, monkeypatch):
    from vocab_parallel.backends import triton_backend

    bt, h, v = 37, 20, 260
    case = make_case(bt, h, v, dtype=dtype, mode=mode, seed=6, label_smoothing=0.1)
    # Targets spread over every chunk, including the last, short one.
    case = case.with_(masked_target=torch.arange(bt, device=DEVICE) * 7 % v)

    def run():
        lmax, lsum, softmax = _stats(case)
        terms = GradTerms(case.grad, 0.9, 0.1 / v, None, None, lmax, lsum, softmax)
        return triton_backend.fused_backward(
            case.input,
            case.weight,
            case.masked_target.masked_fill(case.not_here, -1),
            PLAIN,
            terms,
            Outputs(),
        )[:2]

    whole = run()
    monkeypatch.setitem(memory.WORKSPACE_BYTES, DEVICE.type, 1)  # the narrowest chunks
    itemsize = torch.empty((), dtype=dtype).element_size()
    cv = memory.columns(bt, v, DEVICE.type, "logits", itemsize=itemsize, h=h)
    assert math.ceil(v / cv) >= 3  # several chunks
    chunked = run()
    assert_matches_reference(chunked, case.reference(), dtype)
    for a, b in zip(chunked, whole, strict=True):
        close_to_reference(a, b.double(), dtype)


# ---------------------------------------------------------------------------------------
# NaN and inf
# ---------------------------------------------------------------------------------------


def _poison(case, where: str, value: float, row: int):
    if where == "input":
        x = case.input.clone()
        x[row, 3] = value
        return case.with_(input=x)
    if where == "grad":
        g = case.grad.clone()
        g[row] = value
        return case.with_(grad=g)
    if where == "softmax":
        s = case.softmax.clone()
        s[row, 5] = value
        return case.with_(softmax=s)
    if where == "logits_max":
        m = case.logits_max.clone()
        m[row] = value
        return case.with_(logits_max=m)
    raise AssertionError(where)


POISONS = [
    ("memory_saving", "input", math.nan),
    ("memory_saving", "grad", math.nan),
    ("memory_saving", "logits_max", math.nan),
    ("high_performance", "grad", math.nan),
    ("high_performance", "softmax", math.nan),
    ("high_performance", "grad", math.inf),
    ("high_performance", "input", math.inf),
]


# numpy (the Triton interpreter) warns about inf * 0 and inf - inf: that is the point here.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("mode, where, value", POISONS)
def test_nan_and_inf_propagate_like_the_reference(backend, dtype, mode, where, value):
    row = 6
    case = _poison(make_case(37, 16, 129, dtype=dtype, mode=mode, seed=13), where, value, row)
    out = case.run(backend)
    ref = case.reference()
    for a, e, name in zip(out, ref, ("grad_input", "grad_weight"), strict=True):
        a = a.cpu()
        assert torch.equal(a.isnan(), e.isnan()), f"{name}: NaN pattern differs"
        assert torch.equal(a.isinf() & (a > 0), e.isinf() & (e > 0)), f"{name}: +inf differs"
        assert torch.equal(a.isinf() & (a < 0), e.isinf() & (e < 0)), f"{name}: -inf differs"
        finite = e.isfinite()
        if finite.any():
            close_to_reference(a[finite], e[finite], dtype, name)
    gi_bad_rows = (~out[0].isfinite()).any(dim=1).nonzero().flatten().tolist()
    if where != "input" or mode == "memory_saving":
        # The poisoned row of G is non-finite: exactly that row of grad_input follows.
        assert gi_bad_rows == [row]
    else:
        # A saved softmax keeps G finite: only grad_weight sees the bad input element.
        assert gi_bad_rows == []


# ---------------------------------------------------------------------------------------
# Determinism, inputs untouched, empty tensors
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_deterministic(backend, mode, dtype):
    case = make_case(37, 33, 129, dtype=dtype, mode=mode, seed=17, label_smoothing=0.05)
    first = case.run(backend)
    second = case.run(backend)
    assert_bitwise_equal(first, second)
    assert first[0].abs().max() > 0


@pytest.mark.parametrize("mask_form", ["packed", "bool"])
def test_inputs_are_not_modified(backend, mode, mask_form):
    case = make_case(37, 16, 129, mode=mode, seed=19, mask_form=mask_form, label_smoothing=0.1)
    before = {name: t.clone() for name, t in case.tensors().items()}
    case.run(backend)
    for name, t in case.tensors().items():
        assert torch.equal(t, before[name]), f"{name} was modified"


@pytest.mark.parametrize("grad_len", ["full", "one"])
def test_empty_batch(backend, mode, grad_len):
    h, v = 6, 11
    case = make_case(0, h, v, mode=mode)
    if grad_len == "one":
        case = case.with_(grad=torch.ones(1, device=DEVICE))
    assert case.target_mask.shape == (0,)
    gi, gw = case.run(backend)
    assert gi.shape == (0, h) and gi.dtype == torch.float32
    assert gw.shape == (v, h) and gw.dtype == torch.float32
    assert torch.equal(gw, torch.zeros_like(gw))


@pytest.mark.parametrize("bt", [0, 5])
def test_empty_hidden(backend, mode, bt):
    v = 11
    case = make_case(bt, 0, v, mode=mode)
    gi, gw = case.run(backend)
    assert gi.shape == (bt, 0) and gw.shape == (v, 0)
    assert gi.dtype == torch.float32 and gw.dtype == torch.float32


# ---------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------

BT, H, V = 17, 4, 6  # 17 rows: a packed mask needs 3 bytes


def _valid(mode="memory_saving") -> dict:
    case = make_case(BT, H, V, mode=mode, seed=23, device=torch.device("cpu"))
    return case.kwargs("torch")


def _hp() -> dict:
    return _valid("high_performance")


f32 = dict(dtype=torch.float32)
BAD_INPUTS = [
    # (id, make kwargs, exception, parameter named)
    ("grad-fp16", lambda k: k | dict(grad=k["grad"].half()), TypeError, "grad"),
    ("grad-int", lambda k: k | dict(grad=torch.ones(BT, dtype=torch.int64)), TypeError, "grad"),
    ("grad-2d", lambda k: k | dict(grad=k["grad"][:, None]), ValueError, "grad"),
    ("grad-short", lambda k: k | dict(grad=k["grad"][:-1]), ValueError, "grad"),
    ("grad-len2", lambda k: k | dict(grad=torch.ones(2)), ValueError, "grad"),
    ("grad-list", lambda k: k | dict(grad=[1.0] * BT), TypeError, "grad"),
    ("input-int", lambda k: k | dict(input=k["input"].to(torch.int32)), TypeError, "input"),
    ("input-fp64", lambda k: k | dict(input=k["input"].double()), TypeError, "input"),
    ("input-1d", lambda k: k | dict(input=k["input"][0]), ValueError, "input"),
    ("input-3d", lambda k: k | dict(input=k["input"][None]), ValueError, "input"),
    ("input-numpy", lambda k: k | dict(input=k["input"].numpy()), TypeError, "input"),
    ("weight-bf16", lambda k: k | dict(weight=k["weight"].bfloat16()), TypeError, "weight"),
    (
        "weight-input-half-mismatch",
        lambda k: k | dict(input=k["input"].half(), weight=k["weight"].bfloat16()),
        TypeError,
        "weight",
    ),
    ("weight-1d", lambda k: k | dict(weight=k["weight"][0]), ValueError, "weight"),
    ("weight-wrong-h", lambda k: k | dict(weight=torch.ones(V, H + 1)), ValueError, "weight"),
    ("weight-list", lambda k: k | dict(weight=[[0.0] * H] * V), TypeError, "weight"),
    (
        "mask-float",
        lambda k: k | dict(target_mask=torch.zeros(BT, **f32)),
        TypeError,
        "target_mask",
    ),
    (
        "mask-int32",
        lambda k: k | dict(target_mask=torch.zeros(BT, dtype=torch.int32)),
        TypeError,
        "target_mask",
    ),
    (
        "mask-2d",
        lambda k: k | dict(target_mask=torch.zeros(BT, 1, dtype=torch.bool)),
        ValueError,
        "target_mask",
    ),
    (
        "mask-packed-too-short",
        lambda k: k | dict(target_mask=torch.zeros(2, dtype=torch.uint8)),
        ValueError,
        "target_mask",
    ),
    (
        "mask-bool-short",
        lambda k: k | dict(target_mask=torch.zeros(BT - 1, dtype=torch.bool)),
        ValueError,
        "target_mask",
    ),
    (
        "mask-bool-long",
        lambda k: k | dict(target_mask=torch.zeros(BT + 1, dtype=torch.bool)),
        ValueError,
        "target_mask",
    ),
    ("mask-list", lambda k: k | dict(target_mask=[0, 0, 0]), TypeError, "target_mask"),
    (
        "target-float",
        lambda k: k | dict(masked_target=k["masked_target"].float()),
        TypeError,
        "masked_target",
    ),
    (
        "target-int16",
        lambda k: k | dict(masked_target=k["masked_target"].to(torch.int16)),
        TypeError,
        "masked_target",
    ),
    (
        "target-2d",
        lambda k: k | dict(masked_target=k["masked_target"][:, None]),
        ValueError,
        "masked_target",
    ),
    (
        "target-short",
        lambda k: k | dict(masked_target=k["masked_target"][:-1]),
        ValueError,
        "masked_target",
    ),
    ("target-list", lambda k: k | dict(masked_target=[0] * BT), TypeError, "masked_target"),
    (
        "logits-max-fp16",
        lambda k: k | dict(logits_max=k["logits_max"].half()),
        TypeError,
        "logits_max",
    ),
    (
        "sum-exp-fp64",
        lambda k: k | dict(sum_exp_logits=k["sum_exp_logits"].double()),
        TypeError,
        "sum_exp_logits",
    ),
    (
        "logits-max-2d",
        lambda k: k | dict(logits_max=k["logits_max"][:, None]),
        ValueError,
        "logits_max",
    ),
    (
        "sum-exp-short",
        lambda k: k | dict(sum_exp_logits=k["sum_exp_logits"][:-1]),
        ValueError,
        "sum_exp_logits",
    ),
    ("logits-max-float", lambda k: k | dict(logits_max=1.0), TypeError, "logits_max"),
    ("logits-max-missing", lambda k: k | dict(logits_max=None), ValueError, "logits_max"),
    (
        "sum-exp-missing",
        lambda k: k | dict(sum_exp_logits=None),
        ValueError,
        "sum_exp_logits",
    ),
    (
        "both-stats-missing",
        lambda k: k | dict(logits_max=None, sum_exp_logits=None),
        ValueError,
        "logits_max",
    ),
    (
        "softmax-bf16",
        lambda k: _hp() | dict(softmax=_hp()["softmax"].bfloat16()),
        TypeError,
        "softmax",
    ),
    ("softmax-fp16", lambda k: _hp() | dict(softmax=_hp()["softmax"].half()), TypeError, "softmax"),
    ("softmax-1d", lambda k: _hp() | dict(softmax=torch.zeros(BT * V)), ValueError, "softmax"),
    ("softmax-cols", lambda k: _hp() | dict(softmax=torch.zeros(BT, V + 1)), ValueError, "softmax"),
    ("softmax-rows", lambda k: _hp() | dict(softmax=torch.zeros(BT - 1, V)), ValueError, "softmax"),
    (
        "softmax-transposed",
        lambda k: _hp() | dict(softmax=torch.zeros(V, BT)),
        ValueError,
        "softmax",
    ),
    ("softmax-list", lambda k: _hp() | dict(softmax=[[0.0] * V] * BT), TypeError, "softmax"),
    ("smoothing-negative", lambda k: k | dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
    ("smoothing-one", lambda k: k | dict(label_smoothing=1.0), ValueError, "label_smoothing"),
    ("smoothing-big", lambda k: k | dict(label_smoothing=1.5), ValueError, "label_smoothing"),
    ("smoothing-nan", lambda k: k | dict(label_smoothing=math.nan), ValueError, "label_smoothing"),
    ("smoothing-bool", lambda k: k | dict(label_smoothing=True), TypeError, "label_smoothing"),
    ("smoothing-str", lambda k: k | dict(label_smoothing="0.1"), TypeError, "label_smoothing"),
    ("smoothing-none", lambda k: k | dict(label_smoothing=None), TypeError, "label_smoothing"),
    (
        "vocab-smaller-than-v",
        lambda k: k | dict(global_vocab_size=V - 1),
        ValueError,
        "global_vocab_size",
    ),
    ("vocab-zero", lambda k: k | dict(global_vocab_size=0), ValueError, "global_vocab_size"),
    ("vocab-float", lambda k: k | dict(global_vocab_size=100.0), TypeError, "global_vocab_size"),
    ("vocab-bool", lambda k: k | dict(global_vocab_size=True), TypeError, "global_vocab_size"),
    ("backend-bad", lambda k: k | dict(backend="cuda"), ValueError, "backend"),
    ("backend-none", lambda k: k | dict(backend=None), ValueError, "backend"),
]


# Validation is backend-independent: ``fused_linear_cross_entropy_loss_grad`` checks every
# argument (the backend name last) before it dispatches, so each case runs once. That no
# backend is reached is asserted, which is what makes one run enough.
@pytest.mark.parametrize(
    "make, exc, name", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_input_raises(make, exc, name, monkeypatch):
    def unreachable(*args, **kwargs):
        raise AssertionError("bad input reached the torch backend")

    monkeypatch.setattr(torch_backend, "fused_backward", unreachable)
    kwargs = make(_valid())
    with pytest.raises(exc) as info:
        fused_linear_cross_entropy_loss_grad(**kwargs)
    assert type(info.value) is exc
    message = str(info.value)
    assert first_named_parameter(message) == name, message


META_CASES = ["grad", "weight", "target_mask", "masked_target", "logits_max", "sum_exp_logits"]


@pytest.mark.parametrize("name", [*META_CASES, "softmax"])
def test_tensors_on_another_device(name):
    kwargs = _hp() if name == "softmax" else _valid()
    kwargs[name] = kwargs[name].to("meta")
    with pytest.raises(ValueError) as info:
        fused_linear_cross_entropy_loss_grad(**kwargs)
    message = str(info.value)
    assert first_named_parameter(message) == name, message
    assert "device" in message


def test_input_on_another_device_than_the_rest():
    kwargs = _valid()
    kwargs["input"] = kwargs["input"].to("meta")
    with pytest.raises(ValueError, match="device"):
        fused_linear_cross_entropy_loss_grad(**kwargs)


def test_softmax_mode_ignores_statistics(backend):
    """With softmax given, logits_max/sum_exp_logits are not required nor read."""
    case = make_case(BT, H, V, mode="high_performance", seed=29)
    out = case.run(backend)
    junk = case.with_(
        logits_max=torch.full((BT,), math.nan, device=DEVICE),
        sum_exp_logits=torch.zeros(BT, device=DEVICE),
    )
    assert_bitwise_equal(junk.run(backend), out)
    assert_matches_reference(out, case.reference(), torch.float32)


# ---------------------------------------------------------------------------------------
# The checks above can fail
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("bug", ["no-one-hot", "scale-5pct", "no-smoothing", "grad-ignored"])
def test_tolerance_catches_real_bugs(dtype, bug, mode):
    """A reference computed with a typical bug is rejected by the comparison we use."""
    case = make_case(37, 33, 129, dtype=dtype, mode=mode, seed=31, label_smoothing=0.1)
    case = case.with_(global_vocab_size=200)
    good = case.reference()
    if bug == "no-one-hot":
        bad = case.with_(not_here=torch.ones_like(case.not_here)).reference()
    elif bug == "scale-5pct":
        bad = case.with_(grad=case.grad * 1.05).reference()
    elif bug == "no-smoothing":
        bad = case.with_(label_smoothing=0.0).reference()
    else:
        bad = case.with_(grad=torch.ones_like(case.grad)).reference()
    with pytest.raises(AssertionError):
        assert_matches_reference(bad, good, dtype)
