"""Alone (no group of several ranks), the statistics are not moved to a group max.

``cross_entropy.reduce_statistics`` and ``epilogue.statistics`` skip, for one rank, the
passes that move each rank's sums to the all-reduced max and pack them for the SUM
all-reduce: moved to their own max the sums are unchanged (``e^0 = 1``; a shard of no
columns has zero sums). Checked here by running the group path at one rank (its
all-reduces then change nothing: exactly the computation before the shortcut) beside the
default one: losses, log-normalisers, statistics and gradients bitwise equal, with every
option that adds a statistic (label smoothing, z-loss, class weights, the entropy's
extra sums, ignored tokens, a masking bias that empties whole columns) and the
distillation epilogue's sums.
"""

from __future__ import annotations

import pytest
import torch
from helpers import device_for

import vocab_parallel as vp
from vocab_parallel.engine import epilogue
from vocab_parallel.objectives import cross_entropy

BACKENDS = ["torch", "triton"]


@pytest.fixture
def as_if_grouped(monkeypatch):
    """Make the statistics take the group path (their all-reduces stay no-ops alone)."""

    def grouped():
        monkeypatch.setattr(cross_entropy, "world_size", lambda group: 2)
        monkeypatch.setattr(epilogue, "world_size", lambda group: 2)

    return grouped


def _problem(dev, masked=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    n, h, v = 37, 16, 389
    x = torch.randn(n, h, generator=g).to(dev)
    w = (torch.randn(v, h, generator=g) * 0.5).to(dev)
    y = torch.randint(0, v, (n,), generator=g)
    y[::5] = -100
    bias = torch.randn(v, generator=g)
    if masked:  # columns no token can take (label smoothing's mean logit: -inf then)
        bias[::7] = float("-inf")
        y[y % 7 == 0] = 1
    cw = torch.rand(v, generator=g) + 0.5
    return x, w, y.to(dev), bias.to(dev), cw.to(dev)


def _cross_entropy(backend, mode, **options):
    dev = device_for(backend)
    x, w, y, bias, cw = _problem(dev, masked=not options.get("label_smoothing"))
    leaves = [t.clone().requires_grad_(True) for t in (x, w)]
    out = vp.vocab_parallel_linear_cross_entropy(
        leaves[0], leaves[1], y, bias=bias, class_weight=cw if options.pop("cw") else None,
        return_lse=True, backend=backend, mode=mode, **options,
    )  # fmt: skip
    (out.loss * 1.7).backward()
    return [out.loss, out.lse, leaves[0].grad, leaves[1].grad]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["grad_in_forward", "memory_saving"])
@pytest.mark.parametrize(
    "options",
    [
        dict(cw=False),
        dict(cw=False, label_smoothing=0.1, z_loss=1e-3),
        dict(cw=True, label_smoothing=0.2, reduction="sum"),
    ],
    ids=["plain", "smoothing_zloss", "class_weights"],
)
def test_cross_entropy_alone_equals_the_group_path(backend, mode, options, as_if_grouped):
    alone = _cross_entropy(backend, mode, **dict(options))
    as_if_grouped()
    grouped = _cross_entropy(backend, mode, **dict(options))
    for a, b in zip(alone, grouped, strict=True):
        assert torch.equal(a, b)
    assert bool(alone[0].isfinite())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampler", [{}, dict(sample_top_k=7, sample_top_p=0.9)],
                         ids=["plain", "sampling_replay"])  # fmt: skip
def test_token_statistics_alone_equal_the_group_path(backend, sampler, as_if_grouped):
    dev = device_for(backend)
    x, w, y, bias, _ = _problem(dev)
    g = torch.Generator().manual_seed(3)
    up = torch.randn(2, x.shape[0], generator=g).to(dev)  # random upstream gradients

    def run():
        leaf = x.clone().requires_grad_(True)
        s = vp.vocab_parallel_token_stats(
            leaf, w, y, bias=bias, entropy=not sampler, sum_p_squared=not sampler,
            temperature=0.7, backend=backend, **sampler,
        )  # fmt: skip
        if sampler:  # the truncated distribution's log-probs (an epilogue's statistics)
            (s.logprobs * up[0]).sum().backward()
            return [s.logprobs, s.kept_logmass, leaf.grad]
        ((s.logprobs * up[0]).sum() + (s.entropy * up[1]).sum()).backward()
        return [s.logprobs, s.entropy, s.sum_p_squared, leaf.grad]

    alone = run()
    as_if_grouped()
    for a, b in zip(alone, run(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_distillation_alone_equals_the_group_path(backend, divergence, as_if_grouped):
    dev = device_for(backend)
    x, w, y, bias, _ = _problem(dev)
    g = torch.Generator().manual_seed(2)
    xt = torch.randn(x.shape[0], 24, generator=g).to(dev)
    wt = (torch.randn(w.shape[0], 24, generator=g) * 0.5).to(dev)

    def run():
        leaf = w.clone().requires_grad_(True)
        loss = vp.vocab_parallel_distillation_loss(
            x, leaf, bias=bias, teacher_hidden=xt, teacher_weight=wt, target=y,
            divergence=divergence, temperature=1.3, hard_label_weight=0.1, backend=backend,
        )  # fmt: skip
        loss.backward()
        return [loss, leaf.grad]

    alone = run()
    as_if_grouped()
    for a, b in zip(alone, run(), strict=True):
        assert torch.equal(a, b)
