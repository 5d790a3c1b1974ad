"""The options LLM trainers use: softcap, z-loss, log-sum-exp, bias, autocast, float64.

Every option, alone and combined (with label smoothing, ignored tokens, each reduction
and random per-token upstream gradients), on both backends (Triton under the
interpreter without a GPU) and both modes, against the float64 reference written with
plain torch ops (``vocab_parallel.reference.linear_cross_entropy_reference``:
``F.linear``, ``torch.tanh``, ``F.cross_entropy``, ``torch.logsumexp``); ``gradcheck``
in float64 for every combination; the backward operator's new keyword arguments; bad
options; autocast; memory-saving mode's peak memory with every option on.
Multi-rank checks: ``test_options_multirank.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import textwrap

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICE, HAS_TRITON, dtype_id, peak_extra_in_child

import vocab_parallel as vp
from vocab_parallel.reference import linear_cross_entropy_reference, loss_grad_reference
from vocab_parallel.testing import Case, check_case

MIB = 1 << 20


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny problems gain nothing from threads; on a busy machine a 2-thread reduction of a
    5 x 7 tensor waits milliseconds for the other thread, times thousands of calls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The option sets: each alone, then all together.
OPTION_SETS = {
    "softcap": dict(softcap=3.0),
    "z_loss": dict(z_loss=0.05),
    "bias": dict(bias=True),
    "lse": dict(return_lse=True),
    "all": dict(softcap=3.0, z_loss=0.05, bias=True, return_lse=True),
}


def _cases(backend: str, mode: str) -> list[Case]:
    """Each option set with each reduction, label smoothing and (torch: both) dtypes.

    ``Case`` has ignored tokens (20%) and random per-token upstream gradients for
    ``"none"``; V=131 and H=21 are multiples of no tile size.
    """
    cases = []
    for i, (opts, reduction) in enumerate(
        itertools.product(OPTION_SETS.values(), ("none", "sum", "mean"))
    ):
        base = Case(tokens=19, hidden=21, vocab=131, backend=backend, mode=mode, seed=i)
        if backend == "torch":
            variants = itertools.product(("float32", "bfloat16"), (0.0, 0.1))
        else:  # the interpreter is slow: one dtype and smoothing per case, both covered
            variants = [(("float32", "bfloat16")[i % 2], (0.0, 0.1)[(i // 2) % 2])]
        for dtype, eps in variants:
            changes = dict(dtype=dtype, reduction=reduction, label_smoothing=eps, **opts)
            cases.append(dataclasses.replace(base, **changes))
    return cases


def _failures(results: list[dict]) -> str:
    bad = [r for r in results if not r["ok"]]
    return "mismatches:\n" + "\n".join(str(r) for r in bad[:10])


def test_every_option_matches_the_float64_reference(backend, mode):
    results = [check_case(c, None, DEVICE) for c in _cases(backend, mode)]
    assert all(r["ok"] for r in results), _failures(results)
    # The checks saw every option: the bias gradient and the lse were compared.
    assert any("grad_bias" in r for r in results) and any("lse" in r for r in results)


def test_all_ignored_with_every_option(backend):
    for reduction in ("mean", "sum", "none"):
        case = Case(tokens=9, hidden=5, vocab=40, backend=backend, all_ignored=True)
        case = dataclasses.replace(case, reduction=reduction, **OPTION_SETS["all"])
        result = check_case(case, None, DEVICE)
        assert result["ok"], result


# ---------------------------------------------------------------------------------------
# The options themselves
# ---------------------------------------------------------------------------------------


def _problem(shape=(3, 5), h=17, v=129, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, h, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(v, h, generator=g) * 0.5).to(dtype).to(DEVICE)
    b = torch.randn(v, generator=g).to(dtype).to(DEVICE)
    y = torch.randint(0, v, shape, generator=g).to(DEVICE)
    y.view(-1)[::4] = -100
    return x, w, b, y


def test_return_lse_is_the_log_sum_exp_of_the_capped_biased_logits(backend, mode):
    x, w, b, y = _problem()
    x.requires_grad_(True)
    for reduction in ("none", "mean"):
        loss, lse = vp.vocab_parallel_linear_cross_entropy(
            x, w, y, bias=b, softcap=4.0, return_lse=True, reduction=reduction,
            mode=mode, backend=backend,
        )  # fmt: skip
        z = 4.0 * torch.tanh(F.linear(x.double(), w.double(), b.double()) / 4.0)
        expected = torch.logsumexp(z, dim=-1).masked_fill(y == -100, 0.0)
        assert lse.shape == y.shape and lse.dtype == torch.float32
        assert not lse.requires_grad and lse.grad_fn is None
        assert torch.all(lse[y == -100] == 0)
        torch.testing.assert_close(lse.double(), expected, rtol=1e-6, atol=1e-6)
        assert loss.requires_grad
        loss.sum().backward()  # the loss still has its gradient


def test_options_off_are_bitwise_the_plain_loss(backend, mode):
    """softcap=None, z_loss=0, a zero bias: exactly the loss without options (the option
    paths add nothing when off; a zero bias adds exact zeros)."""
    x, w, _, y = _problem(dtype=torch.bfloat16, seed=3)
    runs = []
    for extra in ({}, dict(softcap=None, z_loss=0.0), dict(bias=torch.zeros_like(w[:, 0]))):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = vp.vocab_parallel_linear_cross_entropy(
            xi, wi, y, mode=mode, backend=backend, reduction="none", **extra
        )
        loss.backward(torch.linspace(-1, 2, loss.numel(), device=DEVICE).reshape(loss.shape))
        runs.append((loss.detach(), xi.grad, wi.grad))
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)


def test_bias_gradient_in_the_bias_dtype_and_frozen_parts(backend):
    x, w, b, y = _problem(dtype=torch.bfloat16, seed=4)
    b.requires_grad_(True)
    loss = vp.vocab_parallel_linear_cross_entropy(x, w, y, bias=b, backend=backend)
    loss.backward()
    assert b.grad.dtype == torch.bfloat16 and b.grad.shape == b.shape
    b64 = b.detach().double().requires_grad_(True)
    ref, _ = linear_cross_entropy_reference(x.double(), w.double(), y, bias=b64)
    ref.backward()
    err = (b.grad.double() - b64.grad).abs().max() / b64.grad.abs().max()
    assert err < 2e-2
    # Only the bias trains: hidden and weight get no gradient, the bias the same one.
    b2 = b.detach().clone().requires_grad_(True)
    vp.vocab_parallel_linear_cross_entropy(x, w, y, bias=b2, backend=backend).backward()
    assert torch.equal(b2.grad, b.grad)


def test_z_loss_adds_w_lse_squared(backend):
    x, w, _, y = _problem(seed=5)
    plain, lse = vp.vocab_parallel_linear_cross_entropy(
        x, w, y, reduction="none", return_lse=True, backend=backend
    )
    zl = vp.vocab_parallel_linear_cross_entropy(
        x, w, y, reduction="none", z_loss=0.3, backend=backend
    )
    torch.testing.assert_close(zl, plain + 0.3 * lse.square(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape, h, v", [((1,), 1, 1), ((2, 3), 5, 2), ((4, 1, 3), 3, 67)])
def test_odd_shapes(backend, mode, shape, h, v):
    x, w, b, y = _problem(shape=shape, h=h, v=v, seed=6)
    y.view(-1)[0] = 0  # at least one token counts
    x.requires_grad_(True)
    w.requires_grad_(True)
    b.requires_grad_(True)
    opts = dict(softcap=2.5, z_loss=0.1, label_smoothing=0.1, reduction="none")
    loss, lse = vp.vocab_parallel_linear_cross_entropy(
        x, w, y, bias=b, return_lse=True, mode=mode, backend=backend, **opts
    )
    up = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    loss.backward(up)
    leaves = [t.detach().double().requires_grad_(True) for t in (x, w, b)]
    ref, ref_lse = linear_cross_entropy_reference(*leaves[:2], y, bias=leaves[2], **opts)
    ref.backward(up.double())
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-6)
    for got, leaf in zip((x, w, b), leaves, strict=True):
        torch.testing.assert_close(got.grad.double(), leaf.grad, rtol=1e-4, atol=1e-5)


def test_every_option_bitwise_deterministic(backend, mode):
    x, w, b, y = _problem(dtype=torch.bfloat16, seed=7)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
        loss, lse = vp.vocab_parallel_linear_cross_entropy(
            leaves[0], leaves[1], y, bias=leaves[2], softcap=3.0, z_loss=1e-2,
            label_smoothing=0.1, return_lse=True, mode=mode, backend=backend,
        )  # fmt: skip
        loss.backward()
        runs.append((loss.detach(), lse, *(t.grad for t in leaves)))
    for a, b2 in zip(*runs, strict=True):
        assert torch.equal(a, b2)


def test_module_form_takes_the_options_and_the_bias():
    x, w, b, y = _problem(seed=8)
    module = vp.VocabParallelLinearCrossEntropy(softcap=3.0, z_loss=0.1, return_lse=True)
    loss, lse = module(x, w, y, bias=b)
    expected = vp.vocab_parallel_linear_cross_entropy(
        x, w, y, bias=b, softcap=3.0, z_loss=0.1, return_lse=True
    )
    assert torch.equal(loss, expected[0]) and torch.equal(lse, expected[1])
    assert "softcap=3.0" in repr(module) and "z_loss=0.1" in repr(module)


def test_lm_head_passes_the_loss_options_on():
    """The head passes every keyword option of the loss on (its own ``bias`` parameter is
    the head's business: lm_head.py)."""
    x, w, _, y = _problem(seed=9)
    head = vp.VocabParallelLMHead.from_full_weight(w, softcap=3.0, z_loss=0.1, return_lse=True)
    loss, lse = head(x, y)
    expected = vp.vocab_parallel_linear_cross_entropy(
        x, w, y, softcap=3.0, z_loss=0.1, return_lse=True
    )
    torch.testing.assert_close(loss, expected[0])
    torch.testing.assert_close(lse, expected[1])


# ---------------------------------------------------------------------------------------
# gradcheck in float64, every combination
# ---------------------------------------------------------------------------------------


COMBOS = list(
    itertools.product(
        (None, 1.5),  # softcap
        (0.0, 0.2),  # z_loss
        (False, True),  # bias
        (0.0, 0.3),  # label smoothing
        ("none", "mean"),
        ("memory_saving", "high_performance"),
    )
)


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_gradcheck_float64_every_option_combination(reduction):
    gen = torch.Generator().manual_seed(10)
    bt, h, v = 5, 3, 7
    x = torch.randn(bt, h, generator=gen, dtype=torch.float64)
    w = torch.randn(v, h, generator=gen, dtype=torch.float64)
    b = torch.randn(v, generator=gen, dtype=torch.float64)
    y = torch.tensor([0, 3, -100, 6, 2])
    checked = 0
    for softcap, z_loss, with_bias, eps, red, mode in COMBOS:
        if red != reduction:
            continue
        leaves = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
        if with_bias:
            leaves.append(b.clone().requires_grad_(True))

        def fn(*ts, softcap=softcap, z_loss=z_loss, eps=eps, mode=mode):
            out = vp.vocab_parallel_linear_cross_entropy(
                ts[0], ts[1], y, bias=ts[2] if len(ts) > 2 else None, softcap=softcap,
                z_loss=z_loss, label_smoothing=eps, reduction=reduction, mode=mode,
                backend="torch", return_lse=True,
            )  # fmt: skip
            assert out[0].dtype == torch.float64 and out[1].dtype == torch.float64
            return out[0]

        assert torch.autograd.gradcheck(fn, tuple(leaves), eps=1e-6, atol=1e-7, rtol=1e-5)
        checked += 1
    assert checked == len(COMBOS) // 2


def test_float64_auto_backend_and_triton_refusal():
    x, w, b, y = _problem(dtype=torch.float64, seed=11)
    loss = vp.vocab_parallel_linear_cross_entropy(x, w, y, bias=b, softcap=2.0)  # auto
    assert loss.dtype == torch.float64
    ref, _ = linear_cross_entropy_reference(x, w, y, bias=b, softcap=2.0)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    if HAS_TRITON:
        with pytest.raises(TypeError, match="^hidden: float64"):
            vp.vocab_parallel_linear_cross_entropy(x, w, y, backend="triton")


# ---------------------------------------------------------------------------------------
# Autocast
# ---------------------------------------------------------------------------------------


@pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU autocast")
def test_autocast_casts_like_f_linear_and_grads_reach_the_fp32_master(backend, mode):
    x, w, b, y = _problem(seed=12)
    masters = [t.clone().requires_grad_(True) for t in (x, w, b)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, lse = vp.vocab_parallel_linear_cross_entropy(
            masters[0], masters[1], y, bias=masters[2], softcap=3.0, z_loss=1e-2,
            return_lse=True, mode=mode, backend=backend,
        )  # fmt: skip
        assert F.linear(masters[0], masters[1], masters[2]).dtype == torch.bfloat16
        loss.backward()  # inside autocast too: the backward's products stay fp32
    # The same as casting by hand outside autocast: the internal products were not
    # autocast to bf16 (bitwise equal), and the gradients reach the fp32 masters.
    cast = [t.clone().bfloat16().requires_grad_(True) for t in (x, w, b)]
    loss2, lse2 = vp.vocab_parallel_linear_cross_entropy(
        cast[0], cast[1], y, bias=cast[2], softcap=3.0, z_loss=1e-2,
        return_lse=True, mode=mode, backend=backend,
    )  # fmt: skip
    loss2.backward()
    assert torch.equal(loss, loss2) and torch.equal(lse, lse2)
    for master, half in zip(masters, cast, strict=True):
        assert master.grad.dtype == torch.float32
        assert torch.equal(master.grad, half.grad.float())


@pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU autocast")
def test_autocast_leaves_float64_and_mismatches_outside_it_raise():
    x, w, _, y = _problem(seed=13)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = vp.vocab_parallel_linear_cross_entropy(x.double(), w.double(), y)
        mixed = vp.vocab_parallel_linear_cross_entropy(x.bfloat16(), w, y)  # both bf16 then
    assert loss.dtype == torch.float64 and mixed.dtype == torch.float32
    with pytest.raises(TypeError, match="^weight"):
        vp.vocab_parallel_linear_cross_entropy(x.bfloat16(), w, y)
    with pytest.raises(TypeError, match="^bias"):
        vp.vocab_parallel_linear_cross_entropy(x, w, y, bias=torch.zeros(w.shape[0]).half())


# ---------------------------------------------------------------------------------------
# Bad options
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(softcap=0.0), ValueError, "softcap"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(softcap=float("inf")), ValueError, "softcap"),
        (dict(softcap=float("nan")), ValueError, "softcap"),
        (dict(softcap="30"), TypeError, "softcap"),
        (dict(softcap=True), TypeError, "softcap"),
        (dict(z_loss=-1e-4), ValueError, "z_loss"),
        (dict(z_loss=float("nan")), ValueError, "z_loss"),
        (dict(z_loss=None), TypeError, "z_loss"),
        (dict(return_lse=1), TypeError, "return_lse"),
    ],
)
def test_bad_options_name_the_parameter(kwargs, exc, name):
    x, w, _, y = _problem()
    with pytest.raises(exc, match=f"^{name}"):
        vp.vocab_parallel_linear_cross_entropy(x, w, y, **kwargs)
    with pytest.raises(exc, match=f"^{name}"):
        vp.VocabParallelLinearCrossEntropy(**kwargs)


@pytest.mark.parametrize(
    "bias, exc",
    [
        (lambda w: [0.0] * w.shape[0], TypeError),
        (lambda w: torch.zeros(w.shape[0] + 1), ValueError),
        (lambda w: torch.zeros(w.shape[0], 1), ValueError),
        (lambda w: torch.zeros(w.shape[0], dtype=torch.float64), TypeError),
        (lambda w: torch.zeros(w.shape[0], device="meta"), ValueError),
    ],
)
def test_bad_bias_names_it(bias, exc):
    x, w, _, y = _problem()
    with pytest.raises(exc, match="^bias"):
        vp.vocab_parallel_linear_cross_entropy(x, w, y, bias=bias(w))


# ---------------------------------------------------------------------------------------
# num_items_in_batch: one rule for ints, floats and tensors
# ---------------------------------------------------------------------------------------

INF, NAN = float("inf"), float("nan")
ZEROS = (0, 0.0, torch.tensor(0), torch.tensor([0.0]))


def _items_problem(all_ignored: bool = False):
    """On the CPU: a count refused there raises (on a GPU a device-side assertion does)."""
    x, w, _, y = (t.cpu() for t in _problem())
    if all_ignored:
        y = torch.full_like(y, -100)
    return x.requires_grad_(True), w.requires_grad_(True), y


def _sum_over(n, all_ignored: bool = False, head: bool = False):
    x, w, y = _items_problem(all_ignored)
    if head:
        lm = vp.VocabParallelLMHead.from_shard(torch.nn.Parameter(w), w.shape[0], 0)
        return lm(x, y, num_items_in_batch=n), x, lm.weight
    loss = vp.vocab_parallel_linear_cross_entropy(x, w, y, reduction="sum", num_items_in_batch=n)
    return loss, x, w


@pytest.mark.parametrize("n", [3, 2.5, torch.tensor(3), torch.tensor([2.5])], ids=str)
def test_num_items_in_batch_divides_the_sum(n):
    x, w, y = _items_problem()
    total = vp.vocab_parallel_linear_cross_entropy(x, w, y, reduction="sum")
    loss, _, _ = _sum_over(n)
    torch.testing.assert_close(loss, total / float(n), rtol=1e-6, atol=0)


@pytest.mark.parametrize("head", [False, True], ids=["loss", "head"])
@pytest.mark.parametrize("n", ZEROS, ids=str)
def test_num_items_zero_on_an_all_ignored_batch_gives_zero_loss_and_gradients(n, head):
    loss, x, w = _sum_over(n, all_ignored=True, head=head)
    loss.backward()
    assert loss.item() == 0.0
    assert not x.grad.any() and not w.grad.any()


@pytest.mark.parametrize("head", [False, True], ids=["loss", "head"])
@pytest.mark.parametrize(
    "n",
    [*ZEROS, -3, -0.5, torch.tensor(-2), torch.tensor([-1.0]), INF, NAN, torch.tensor(INF),
     torch.tensor(NAN), -INF],
    ids=str,
)  # fmt: skip
def test_num_items_in_batch_not_a_finite_positive_count_raises_naming_it(n, head):
    """0 with tokens that count (it gave the undivided sum for a tensor), an infinite count
    (it gave 0), a negative tensor (it counted as 1): a ValueError, for each kind alike."""
    with pytest.raises(ValueError, match="^num_items_in_batch: expected a finite count > 0"):
        _sum_over(n, head=head)


@pytest.mark.parametrize("n", [True, torch.tensor(True), "3", [3], torch.tensor(1j)], ids=str)
def test_num_items_in_batch_not_a_number_is_a_type_error_naming_it(n):
    with pytest.raises(TypeError, match="^num_items_in_batch: "):
        _sum_over(n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="about a GPU's host syncs")
def test_num_items_in_batch_on_a_gpu_is_checked_without_a_host_sync():
    """A CUDA count (and a count of 0 against CUDA targets) is checked by device-side
    assertions: reading it back would wait for the device at every step."""
    from vocab_parallel.engine.reduction import check_items_counted, check_num_items_in_batch

    y = torch.randint(0, 9, (8,), device="cuda")
    ignored = torch.full_like(y, -100)
    counts = [torch.tensor(5, device="cuda"), torch.tensor([0.0], device="cuda")]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for n, target in zip(counts, (y, ignored), strict=True):
            check_num_items_in_batch(n)
            check_items_counted(n, target, -100)
        check_items_counted(0, ignored, -100)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()  # and none of the assertions fired


# ---------------------------------------------------------------------------------------
# The backward operator's options
# ---------------------------------------------------------------------------------------


def _op_inputs(bt, h, v, dtype, *, bias, softcap, seed=14):
    """Operator inputs whose statistics are those of ``cap(x @ W.T + b)`` (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(bt, h, generator=gen).to(dtype)
    w = (torch.randn(v, h, generator=gen) * 0.4).to(dtype)
    b = torch.randn(v, generator=gen).to(dtype) if bias else None
    r = x.double() @ w.double().T + (0.0 if b is None else b.double())
    z = r if softcap is None else softcap * torch.tanh(r / softcap)
    lmax = z.max(dim=1).values
    sumexp = torch.exp(z - lmax[:, None]).sum(dim=1)
    not_here = torch.rand(bt, generator=gen) < 0.3
    return dict(
        grad=torch.randn(bt, generator=gen),
        input=x,
        weight=w,
        target_mask=vp.pack_target_mask(not_here),
        masked_target=torch.randint(0, v, (bt,), generator=gen),
        logits_max=lmax.float(),
        sum_exp_logits=sumexp.float(),
        bias=b,
        softcap=softcap,
    ), dict(
        softmax=(torch.exp(z - lmax[:, None]) / sumexp[:, None]).float(),
        logits=z.float(),
        lse=(torch.log(sumexp) + lmax).float(),
        not_here=not_here,
    )


def _to(kwargs: dict) -> dict:
    return {k: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for k, t in kwargs.items()}


# A saved softmax cannot carry the cap's derivative: softmax + softcap is refused (below).
OPERATOR_FORMS = [
    (form, opts)
    for form in ("recompute", "softmax", "logits")
    for opts in ("softcap", "z_loss", "bias", "all")
    if not (form == "softmax" and opts in ("softcap", "all"))
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("form, opts", OPERATOR_FORMS)
def test_operator_options_match_the_reference(backend, dtype, form, opts):
    softcap = 2.0 if opts in ("softcap", "all") else None
    z_loss = 0.1 if opts in ("z_loss", "all") else 0.0
    with_bias = opts in ("bias", "all")
    kwargs, saved = _op_inputs(37, 20, 75, dtype, bias=with_bias, softcap=softcap)
    kwargs |= dict(z_loss=z_loss, label_smoothing=0.1, global_vocab_size=90)
    if form == "softmax":
        kwargs |= dict(softmax=saved["softmax"], lse=saved["lse"])
    elif form == "logits":
        kwargs |= dict(logits=saved["logits"])
    out = vp.fused_linear_cross_entropy_loss_grad(
        **_to(kwargs), backend=backend, return_bias_grad=True
    )
    ref_kwargs = {k: v for k, v in kwargs.items() if k != "target_mask"}
    ref = loss_grad_reference(not_here=saved["not_here"], return_bias_grad=True, **ref_kwargs)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for got, want, what in zip(out, ref, ("grad_input", "grad_weight", "grad_bias"), strict=True):
        assert got.dtype == dtype, what
        err = (got.cpu().double() - want.double()).abs().max().item()
        assert err <= tol * want.double().abs().max().item() + 1e-6, (what, err)
    # Without return_bias_grad: the seed's two results, the same values.
    two = vp.fused_linear_cross_entropy_loss_grad(**_to(kwargs), backend=backend)
    assert len(two) == 2 and torch.equal(two[0], out[0]) and torch.equal(two[1], out[1])


def test_operator_keeps_the_seed_signature_and_adds_keyword_only_options():
    params = inspect.signature(vp.fused_linear_cross_entropy_loss_grad).parameters
    seed = ["grad", "input", "weight", "target_mask", "masked_target", "label_smoothing"]
    seed += ["logits_max", "sum_exp_logits", "softmax"]
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == seed
    for name in ("bias", "softcap", "logits", "z_loss", "lse", "return_bias_grad"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY


def test_operator_z_loss_lse_defaults_to_the_statistics():
    kwargs, saved = _op_inputs(17, 6, 30, torch.float32, bias=False, softcap=None)
    implied = vp.fused_linear_cross_entropy_loss_grad(**kwargs, z_loss=0.2, backend="torch")
    given = vp.fused_linear_cross_entropy_loss_grad(
        **kwargs, z_loss=0.2, lse=saved["lse"], backend="torch"
    )
    for a, b in zip(implied, given, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "change, exc, name",
    [
        (lambda k, s: k | dict(softmax=s["softmax"], softcap=2.0), ValueError, "softmax"),
        (lambda k, s: k | dict(softmax=s["softmax"], logits=s["logits"]), ValueError, "logits"),
        (lambda k, s: k | dict(softmax=s["softmax"], z_loss=0.1), ValueError, "lse"),
        (lambda k, s: k | dict(logits=s["logits"][:, :-1]), ValueError, "logits"),
        (lambda k, s: k | dict(logits=s["logits"].half()), TypeError, "logits"),
        (lambda k, s: k | dict(lse=s["lse"][:-1], z_loss=0.1), ValueError, "lse"),
        (lambda k, s: k | dict(bias=torch.zeros(3)), ValueError, "bias"),
        (lambda k, s: k | dict(bias=torch.zeros(30).half()), TypeError, "bias"),
        (lambda k, s: k | dict(softcap=0.0), ValueError, "softcap"),
        (lambda k, s: k | dict(z_loss=-1.0), ValueError, "z_loss"),
        (lambda k, s: k | dict(return_bias_grad="yes"), TypeError, "return_bias_grad"),
        (
            lambda k, s: k | dict(input=k["input"].double(), weight=k["weight"].double()),
            TypeError,
            "input",
        ),
    ],
)
def test_operator_bad_options_name_the_parameter(change, exc, name):
    kwargs, saved = _op_inputs(17, 6, 30, torch.float32, bias=False, softcap=None)
    backend = "triton" if name == "input" else "torch"  # float64: refused by triton
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    with pytest.raises(exc, match=f"^{name}"):
        vp.fused_linear_cross_entropy_loss_grad(**change(kwargs, saved), backend=backend)


def test_operator_float64_on_the_torch_backend():
    kwargs, saved = _op_inputs(9, 4, 11, torch.float64, bias=True, softcap=1.5)
    kwargs = kwargs | dict(z_loss=0.3, grad=kwargs["grad"].double())
    out = vp.fused_linear_cross_entropy_loss_grad(**kwargs, backend="auto", return_bias_grad=True)
    ref_kwargs = {k: v for k, v in kwargs.items() if k != "target_mask"}
    ref = loss_grad_reference(not_here=saved["not_here"], return_bias_grad=True, **ref_kwargs)
    for got, want in zip(out, ref, strict=True):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # fp32 statistics


# ---------------------------------------------------------------------------------------
# Memory: O(chunk) with every option on
# ---------------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    import vocab_parallel as vp
    from benchmarks.memory import PeakMemory

    bt, h, v = map(int, sys.argv[1:4])
    torch.manual_seed(0)
    x = torch.randn(bt, h).requires_grad_(True)
    w = (torch.randn(v, h) * 0.05).requires_grad_(True)
    b = torch.zeros(v).requires_grad_(True)
    y = torch.randint(0, v, (bt,))
    opts = dict(softcap=30.0, z_loss=1e-4, label_smoothing=0.1, return_lse=True,
                mode="memory_saving", backend="torch")

    def run(x, w, b, y):
        loss, lse = vp.vocab_parallel_linear_cross_entropy(x, w, y, bias=b, **opts)
        loss.backward()

    small = [t[:64].detach().requires_grad_(True) for t in (w, b)]
    run(x[:8].detach().requires_grad_(True), *small, y[:8] % 64)  # warm up
    with PeakMemory("cpu") as peak:
        run(x, w, b, y)
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (w, b))
    print(json.dumps({"extra": peak.extra_bytes - grads, "exact": peak.exact}))
    """
)


def _measure(bt: int, h: int, v: int) -> int:
    return peak_extra_in_child(CHILD, bt, h, v)


@pytest.mark.slow
def test_memory_saving_peak_stays_flat_in_v_with_every_option():
    bt, h, v = 1024, 64, 16384
    ours = {n: _measure(bt, h, n) for n in (v, 4 * v)}
    full_logits = bt * 4 * v * 4  # one fp32 [BT, 4V] tensor
    print(f"extra beyond the gradients, MiB: {ours[v] / MIB:.0f} -> {ours[4 * v] / MIB:.0f}")
    assert ours[4 * v] <= 1.2 * ours[v] + 16 * MIB  # flat in V: chunks only
    assert ours[4 * v] < full_logits / 2  # far from holding [BT, V] logits


def test_lm_head_owns_a_sharded_bias():
    """VocabParallelLMHead(bias=True): a [rows] parameter, tagged tensor-parallel, that gets
    the gradient of F.linear's bias; False/None: no bias."""
    import torch.nn.functional as F

    import vocab_parallel as vp

    torch.manual_seed(0)
    head = vp.VocabParallelLMHead(8, 37, bias=True)
    assert head.bias.shape == (37,) and head.bias.tensor_model_parallel
    with torch.no_grad():
        head.bias.normal_()
    x, y = torch.randn(5, 8), torch.randint(0, 37, (5,))
    loss = head(x, y)
    loss.backward()
    w = head.weight.detach().clone().requires_grad_()
    b = head.bias.detach().clone().requires_grad_()
    ref = F.cross_entropy(F.linear(x.double(), w.double(), b.double()), y)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.bias.grad, b.grad, rtol=1e-5, atol=1e-6)
    assert vp.VocabParallelLMHead(8, 37, bias=False).bias is None
