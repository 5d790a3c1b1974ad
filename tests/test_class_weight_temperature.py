"""Class weights and temperature, the two options built on the options value.

Every result is compared with the unsharded float64 reference on materialised logits:
``F.cross_entropy(softcap(F.linear(x, W, b)) / T, y, weight=w, label_smoothing=eps,
reduction=r, ignore_index=i)`` (torch's weighted mean: divided by the sum of the targets'
weights). Single process here (both backends, every mode and reduction, fp32/bf16,
float64 gradcheck, the operator); 1-4 gloo ranks, sequence parallelism and DTensor
inputs through ``vocab_parallel.testing``'s per-rank checks.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F
from helpers import CPU, HAS_TRITON, device_for, moved
from multirank import run_ranks

import vocab_parallel as vp
from vocab_parallel.reference import linear_cross_entropy_reference
from vocab_parallel.testing import (
    Case,
    check_case,
    check_dtensor_case,
    check_sequence_parallel_case,
)


def _problem(bt=37, h=20, v=129, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bt, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) / h**0.5 * 3).to(dtype)
    y = torch.randint(0, v, (bt,), generator=g)
    y[torch.rand(bt, generator=g) < 0.2] = -100
    cw = torch.rand(v, generator=g) * 1.5 + 0.5
    temp = torch.rand(bt, generator=g) * 1.5 + 0.5
    return x, w, y, cw, temp


def _ours(x, w, y, *, backend="torch", up=None, **options):
    """Ours on ``backend``'s device (``helpers.device_for``): inputs copied there."""
    dev = device_for(backend)
    x = x.to(dev, copy=True).requires_grad_(True)
    w = w.to(dev, copy=True).requires_grad_(True)
    y, up, options = moved((y, up, options), dev)
    loss = vp.vocab_parallel_linear_cross_entropy(x, w, y, backend=backend, **options)
    out = loss[0] if isinstance(loss, tuple) else loss
    out.backward(torch.ones_like(out) if up is None else up)
    return loss, x.grad, w.grad


def _reference(x, w, y, *, up=None, **options):
    x64 = x.double().requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    loss, lse = linear_cross_entropy_reference(x64, w64, y, **options)
    loss.backward(torch.ones_like(loss) if up is None else up.double())
    return loss, lse, x64.grad, w64.grad


def _rel(a, b):
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


SETTINGS = [
    s
    for s in itertools.product(
        ("grad_in_forward", "memory_saving", "high_performance"),
        ("none", "sum", "mean"),
        (0.0, 0.1),
        ("weights", "temperature", "both"),
    )
    if not (s[0] == "grad_in_forward" and s[1] == "none")  # runs as memory-saving mode
]


@pytest.mark.parametrize("mode,reduction,eps,which", SETTINGS)
def test_fp32_matches_the_weighted_scaled_cross_entropy(backend, mode, reduction, eps, which):
    x, w, y, cw, temp = _problem(seed=len(mode) + int(eps * 10))
    options = dict(mode=mode, reduction=reduction, label_smoothing=eps)
    if which in ("weights", "both"):
        options["class_weight"] = cw
    if which in ("temperature", "both"):
        options["temperature"] = temp if reduction != "sum" else 0.7  # tensor and float
    up = torch.rand(y.shape) + 0.5 if reduction == "none" else torch.tensor(1.7)
    loss, gx, gw = _ours(x, w, y, backend=backend, up=up, **options)
    ref_opts = {k: v for k, v in options.items() if k != "mode"}
    ref, _, rx, rw = _reference(x, w, y, up=up, **ref_opts)
    assert _rel(loss, ref) < 2e-6
    assert _rel(gx, rx) < 2e-5 and _rel(gw, rw) < 2e-5


@pytest.mark.parametrize("mode", ["grad_in_forward", "memory_saving", "high_performance"])
def test_every_option_together_bf16(backend, mode):
    x, w, y, cw, temp = _problem(dtype=torch.bfloat16, seed=3)
    g = torch.Generator().manual_seed(5)
    b = torch.randn(w.shape[0], generator=g).to(torch.bfloat16)
    options = dict(class_weight=cw, temperature=temp, softcap=4.0, z_loss=1e-3)
    options |= dict(label_smoothing=0.1, mode=mode)
    dev = device_for(backend)
    xb, wb, bb = (t.to(dev, copy=True).requires_grad_(True) for t in (x, w, b))
    loss, lse = vp.vocab_parallel_linear_cross_entropy(
        xb, wb, y.to(dev), bias=bb, backend=backend, return_lse=True, **moved(options, dev)
    )
    loss.backward()
    x64, w64, b64 = (t.double().requires_grad_(True) for t in (x, w, b))
    ref_opts = {k: v for k, v in options.items() if k != "mode"}
    ref, ref_lse = linear_cross_entropy_reference(x64, w64, y, bias=b64, **ref_opts)
    ref.backward()
    assert _rel(loss, ref) < 1e-5  # fp32 statistics whatever the input dtype
    assert _rel(lse, ref_lse) < 1e-5  # the lse of the scaled logits
    for got, want in ((xb.grad, x64.grad), (wb.grad, w64.grad), (bb.grad, b64.grad)):
        assert _rel(got, want) < 2e-2  # G rounded to bf16 before the products


def test_temperature_scales_the_logits_and_carries_no_gradient():
    x, w, y, _, temp = _problem(seed=9)
    t = temp.clone().requires_grad_(True)
    loss = vp.vocab_parallel_linear_cross_entropy(x, w.requires_grad_(True), y, temperature=t)
    loss.backward()
    assert t.grad is None  # no gradient reaches the temperature
    direct = vp.vocab_parallel_linear_cross_entropy(x / temp[:, None], w.detach(), y)
    assert _rel(loss, direct) < 1e-6  # z / T without bias or cap: x / T
    _, lse = vp.vocab_parallel_linear_cross_entropy(x, w, y, temperature=2.0, return_lse=True)
    want = torch.logsumexp(F.linear(x.double(), w.detach().double()) / 2.0, dim=1)
    assert _rel(lse[y != -100], want[y != -100]) < 1e-6


def test_all_ignored_weighted_mean_is_zero():
    x, w, y, cw, _ = _problem(seed=2)
    y = torch.full_like(y, -100)
    loss, gx, gw = _ours(x, w, y, class_weight=cw)
    assert loss.item() == 0.0 and not gx.any() and not gw.any()


def test_gradcheck_float64():
    x, w, y, cw, temp = _problem(bt=6, h=4, v=11, dtype=torch.float64, seed=4)
    x.requires_grad_(True)
    w.requires_grad_(True)
    b = torch.randn(11, dtype=torch.float64, requires_grad=True)

    def fn(x, w, b):
        return vp.vocab_parallel_linear_cross_entropy(
            x, w, y, bias=b, class_weight=cw.double(), temperature=temp.double(),
            label_smoothing=0.1, softcap=3.0, mode="memory_saving",
        )  # fmt: skip

    assert torch.autograd.gradcheck(fn, (x, w, b))


def test_operator_class_weight_and_temperature(backend):
    x, w, y, cw, temp = _problem(bt=23, v=70, seed=6)
    eps = 0.1
    z = F.linear(x.double(), w.double()) / temp.double()[:, None]
    logits_max, _ = z.max(1)
    sum_exp = torch.exp(z - logits_max[:, None]).sum(1)
    here = y >= 0
    grad = (torch.rand(23) + 0.5) * here
    args = (grad, x, w, ~here, y.clamp(min=0), eps, logits_max.float(), sum_exp.float())
    gi, gw = vp.fused_linear_cross_entropy_loss_grad(
        *moved(args, device_for(backend)),
        **moved(dict(class_weight=cw, temperature=temp), device_for(backend)),
        backend=backend,
    )
    x64 = x.double().requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    per = F.cross_entropy(
        F.linear(x64, w64) / temp.double()[:, None], y, weight=cw.double(),
        label_smoothing=eps, reduction="none",
    )  # fmt: skip
    (per * grad.double()).sum().backward()
    assert _rel(gi, x64.grad) < 2e-5 and _rel(gw, w64.grad) < 2e-5


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=torch.ones(5)), "temperature"),
        (dict(temperature=torch.zeros(37)), "temperature"),
        (dict(class_weight=torch.ones(5)), "class_weight"),
        (dict(class_weight=torch.ones(129, dtype=torch.int64)), "class_weight"),
        (dict(class_weight=[1.0] * 129), "class_weight"),
    ],
)
def test_bad_values_name_the_parameter(options, match):
    x, w, y, _, _ = _problem()
    with pytest.raises((TypeError, ValueError), match=f"^{match}"):
        vp.vocab_parallel_linear_cross_entropy(x, w, y, **options)


def test_head_and_module_take_both():
    x, w, y, cw, temp = _problem(seed=12)
    head = vp.VocabParallelLMHead.from_full_weight(
        w.clone(), class_weight=cw, temperature=2.0, label_smoothing=0.1
    )
    loss = head(x, y)
    ref, *_ = _reference(x, w, y, class_weight=cw, temperature=2.0, label_smoothing=0.1)
    assert _rel(loss, ref) < 2e-6
    module = vp.VocabParallelLinearCrossEntropy(temperature=2.0, label_smoothing=0.1)
    assert _rel(module(x, w, y, class_weight=cw), ref) < 2e-6


# --- every rank against the unsharded reference -----------------------------------------


def _cases(backend: str) -> list[Case]:
    settings = itertools.product(
        ("grad_in_forward", "memory_saving", "high_performance"),
        ("none", "mean", "sum"),
        ((True, None), (False, "tensor"), (True, "scalar"), (True, "tensor")),
    )
    cases = []
    for i, (mode, reduction, (weights, temp)) in enumerate(settings):
        if mode == "grad_in_forward" and reduction == "none":
            continue
        base = Case(tokens=19, hidden=21, vocab=131, backend=backend, seed=i, mode=mode)
        cases.append(
            dataclasses.replace(
                base,
                reduction=reduction,
                class_weight=weights,
                temperature=temp,
                dtype=("float32", "bfloat16")[i % 2],
                label_smoothing=(0.0, 0.1)[(i // 2) % 2],
                layout="reversed" if i % 3 == 2 else "contiguous",
            )
        )
    return cases


def _check_all(group, cases):
    return [check_case(c, group, CPU) for c in cases]


def _check_sp(group, cases):
    return [check_sequence_parallel_case(c, group, CPU) for c in cases]


def _check_dtensor(group, cases):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist_world(group),))
    hidden_as = ("plain", "shard", "shard_sp")
    return [check_dtensor_case(c, mesh, hidden_as[i % 3]) for i, c in enumerate(cases)]


def dist_world(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


def _assert_ok(per_rank):
    bad = [r for rank in per_rank for r in rank if not r["ok"]]
    assert not bad, "mismatches:\n" + "\n".join(str(b) for b in bad[:5])


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_rank_torch_backend(world):
    _assert_ok(run_ranks(_check_all, world, _cases("torch")))


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_every_rank_triton_backend():
    _assert_ok(run_ranks(_check_all, 2, _cases("triton")[::3]))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_sequence_parallel(world):
    cases = [c for c in _cases("torch") if c.layout == "contiguous"]
    _assert_ok(run_ranks(_check_sp, world, cases))


@pytest.mark.slow
def test_dtensor_weight_and_class_weight():
    cases = [dataclasses.replace(c, layout="contiguous") for c in _cases("torch")[::2]]
    _assert_ok(run_ranks(_check_dtensor, 2, cases))
