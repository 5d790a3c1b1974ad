"""The loss's public API in one process: shapes, options, errors, determinism, module form.

Multi-rank correctness lives in test_multirank.py; here process_group is None.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICE, make_case

import vocab_parallel as vp


def _problem(shape=(3, 5), h=17, v=129, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, h, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(v, h, generator=g) * 0.3).to(dtype).to(DEVICE)
    y = torch.randint(0, v, shape, generator=g).to(DEVICE)
    return x, w, y


def test_batched_hidden_and_reduction_none_shape(backend, mode):
    x, w, y = _problem(shape=(2, 3, 7))
    y[0, 0, :3] = -100
    x.requires_grad_(True)
    loss = vp.vocab_parallel_linear_cross_entropy(
        x, w, y, reduction="none", mode=mode, backend=backend
    )
    assert loss.shape == y.shape and loss.dtype == torch.float32
    assert torch.all(loss[0, 0, :3] == 0)
    ref = F.cross_entropy(
        F.linear(x.double(), w.double()).flatten(0, 2), y.flatten(), reduction="none"
    )
    torch.testing.assert_close(loss.double().flatten(), ref, rtol=1e-5, atol=1e-5)
    up = torch.randn_like(loss)
    loss.backward(up)
    x64 = x.detach().double().requires_grad_(True)
    F.cross_entropy(
        F.linear(x64, w.double()).flatten(0, 2), y.flatten(), reduction="none"
    ).backward(up.double().flatten())
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)


def test_forward_backward_bitwise_deterministic(backend, mode):
    x, w, y = _problem(dtype=torch.bfloat16)
    grads = []
    for _ in range(2):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = vp.vocab_parallel_linear_cross_entropy(
            xi, wi, y, mode=mode, backend=backend, label_smoothing=0.1
        )
        loss.backward()
        grads.append((loss.detach(), xi.grad, wi.grad))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_all_ignored_mean_gives_zero_loss_and_zero_grads():
    x, w, y = _problem()
    y.fill_(-100)
    x.requires_grad_(True)
    w.requires_grad_(True)
    loss = vp.vocab_parallel_linear_cross_entropy(x, w, y)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(x.grad) == 0 and torch.count_nonzero(w.grad) == 0


def test_custom_ignore_index():
    x, w, y = _problem()
    y[0, :2] = 7
    ours = vp.vocab_parallel_linear_cross_entropy(x, w, y, ignore_index=7)
    ref = F.cross_entropy(F.linear(x, w).flatten(0, 1), y.flatten(), ignore_index=7)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_module_equals_function_and_shows_its_options():
    x, w, y = _problem()
    module = vp.VocabParallelLinearCrossEntropy(
        reduction="sum", label_smoothing=0.2, mode="high_performance"
    )
    expected = vp.vocab_parallel_linear_cross_entropy(x, w, y, reduction="sum", label_smoothing=0.2)
    torch.testing.assert_close(module(x, w, y), expected, rtol=1e-6, atol=1e-5)
    assert "high_performance" in repr(module) and "label_smoothing=0.2" in repr(module)


def test_frozen_weight_still_gives_hidden_grad():
    x, w, y = _problem()
    x.requires_grad_(True)
    vp.vocab_parallel_linear_cross_entropy(x, w, y).backward()
    assert x.grad is not None and w.grad is None


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(reduction="avg"), ValueError, "reduction"),
        (dict(mode="fast"), ValueError, "mode"),
        (dict(backend="cuda"), ValueError, "backend"),
        (dict(label_smoothing=1.0), ValueError, "label_smoothing"),
        (dict(label_smoothing="0.1"), TypeError, "label_smoothing"),
        (dict(ignore_index=1.5), TypeError, "ignore_index"),
        (dict(vocab_start_index=-1), ValueError, "vocab_start_index"),
        (dict(global_vocab_size=0), ValueError, "global_vocab_size"),
    ],
)
def test_bad_options(kwargs, exc, name):
    x, w, y = _problem()
    with pytest.raises(exc, match=name):
        vp.vocab_parallel_linear_cross_entropy(x, w, y, **kwargs)
    with pytest.raises(exc, match=name):
        vp.VocabParallelLinearCrossEntropy(**kwargs)


def test_global_vocab_size_smaller_than_the_shard_end():
    x, w, y = _problem()  # 129 local rows
    with pytest.raises(ValueError, match="global_vocab_size"):
        vp.vocab_parallel_linear_cross_entropy(
            x, w, y, vocab_start_index=100, global_vocab_size=150
        )


def test_global_vocab_size_sets_the_smoothing_denominator():
    x, w, y = _problem()
    eps, vg = 0.2, 1000  # this shard is rows [0, 129) of a 1000-row vocabulary
    kw = dict(label_smoothing=eps, vocab_start_index=0, global_vocab_size=vg)
    # Checked, one shard without a group must be the whole vocabulary; check_inputs=False
    # takes the stated layout as it is: the loss of this shard alone.
    with pytest.raises(ValueError, match=r"^global_vocab_size: 1000, but rows \[129, 1000\)"):
        vp.vocab_parallel_linear_cross_entropy(x, w, y, **kw)
    ours = vp.vocab_parallel_linear_cross_entropy(x, w, y, check_inputs=False, **kw)
    logits = F.linear(x.double(), w.double()).flatten(0, 1)
    lse = torch.logsumexp(logits, dim=1)
    nll = lse - logits.gather(1, y.flatten()[:, None]).squeeze(1)
    expected = ((1 - eps) * nll + eps * (lse - logits.sum(dim=1) / vg)).mean()
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "change, exc, name",
    [
        (lambda x, w, y: (x.long(), w, y), TypeError, "hidden"),
        (lambda x, w, y: ([1.0], w, y), TypeError, "hidden"),
        (lambda x, w, y: (x, w.double(), y), TypeError, "weight"),
        (lambda x, w, y: (x, w[:, :-1], y), ValueError, "weight"),
        (lambda x, w, y: (x, w[0], y), ValueError, "weight"),
        (lambda x, w, y: (x, w, y.float()), TypeError, "target"),
        (lambda x, w, y: (x, w, y[:, :-1]), ValueError, "target"),
        (lambda x, w, y: (x, w, y.tolist()), TypeError, "target"),
    ],
)
def test_bad_tensors(change, exc, name):
    with pytest.raises(exc, match=name):
        vp.vocab_parallel_linear_cross_entropy(*change(*_problem()))


def test_grad_input_dtype_returns_the_fp32_accumulator(backend):
    case = make_case(37, 33, 129, dtype=torch.bfloat16)
    rounded, gw = case.run(backend)
    full, gw32 = vp.fused_linear_cross_entropy_loss_grad(
        **case.kwargs(backend), grad_input_dtype=torch.float32
    )
    assert full.dtype == torch.float32 and gw32.dtype == torch.bfloat16
    assert torch.equal(full.to(torch.bfloat16), rounded) and torch.equal(gw, gw32)


def test_grad_input_dtype_must_be_a_float_dtype():
    # Checked with the other arguments, before the backend is chosen: one run covers both.
    case = make_case(37, 33, 129, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="grad_input_dtype"):
        vp.fused_linear_cross_entropy_loss_grad(
            **case.kwargs("torch"), grad_input_dtype=torch.int32
        )
