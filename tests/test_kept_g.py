"""grad_in_forward with ``G`` kept for the backward's GEMMs (``KeptG``,
``vocab_parallel.engine.memory_policy.keeps_g``): the GPU plan for half inputs where ``G``
is no larger than the fp32 accumulators it replaces.

The policy picks it on GPUs only; here it is forced on (``memory.keeps_g`` answers yes)
so that the same plan runs on the CPU (torch backend) and under Triton's interpreter.
Checked: every option of the cross entropy and distillation against the unsharded
float64 reference over several token chunks, both backends; a random upstream scalar; a
mean over class weights (its 1 / count applied when the products are made); a second
backward through the same graph and the error after the graph is freed; frozen inputs;
``G`` freed by autograd after the backward; every rank of 2 and 3 gloo ranks; and the
policy's own answers.
"""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import BACKENDS, DEVICE, HAS_TRITON, device_for
from multirank import run_ranks

import vocab_parallel as vp
from vocab_parallel.engine import grad_in_forward
from vocab_parallel.engine import memory_policy as memory
from vocab_parallel.testing import Case, check_case

V = 389


def _force(monkeypatch_or_none=None):
    """Kept G everywhere, 5-row token chunks at V = 389 (37 tokens: 8 chunks)."""
    if monkeypatch_or_none is None:  # a rank's process: set directly
        memory.keeps_g = lambda *args: True
        memory.WORKSPACE_BYTES["cpu"] = 5 * 4 * V
        return
    monkeypatch_or_none.setattr(memory, "keeps_g", lambda *args: True)
    for device_type in {"cpu", DEVICE.type}:
        monkeypatch_or_none.setitem(memory.WORKSPACE_BYTES, device_type, 5 * 4 * V)


@pytest.fixture
def kept(monkeypatch):
    _force(monkeypatch)
    seen = []
    original = grad_in_forward.KeptG.__init__

    def init(self, *args):
        seen.append(args[0].shape)
        original(self, *args)

    monkeypatch.setattr(grad_in_forward.KeptG, "__init__", init)
    return seen


def test_the_policy_keeps_g_on_gpus_where_it_is_at_most_twice_the_accumulators():
    # Llama-3 head, 8192 tokens: G 2004 MiB <= accumulators 2132 MiB
    assert memory.keeps_g(8192, 128256, 1, 4096, 2, "cuda")
    assert memory.keeps_g(4096, 128256, 1, 4096, 2, "cuda")
    # Gemma-like head: G 4000 MiB <= 2 x 2322 MiB; the Llama-3 head at 16384 tokens:
    # 4008 <= 2 x 2260
    assert memory.keeps_g(8192, 256000, 1, 2304, 2, "cuda")
    assert memory.keeps_g(16384, 128256, 1, 4096, 2, "cuda")
    # more tokens than about 4 H: G is over twice the accumulators, they are added to
    assert not memory.keeps_g(32768, 128256, 1, 4096, 2, "cuda")
    assert not memory.keeps_g(16384, 256000, 1, 2304, 2, "cuda")
    assert memory.keeps_g(32768, 128256, 8, 4096, 2, "cuda")  # 8-way TP: its share
    assert not memory.keeps_g(8192, 128256, 1, 4096, 2, "cpu")  # the CPU plan as it was
    assert not memory.keeps_g(8192, 128256, 1, 4096, 4, "cuda")  # fp32 inputs


def test_a_larger_workspace_buys_a_kept_g_larger_than_twice_the_accumulators(monkeypatch):
    assert not memory.keeps_g(16384, 256000, 1, 2304, 2, "cuda")  # G: 7.8 GiB
    monkeypatch.setitem(memory.WORKSPACE_BYTES, "cuda", 8 << 30)
    assert memory.keeps_g(16384, 256000, 1, 2304, 2, "cuda")


def _ce_cases(backend):
    return [
        Case(mode="grad_in_forward", backend=backend, dtype=dtype, reduction=reduction, **opts)
        for dtype in ("float32", "bfloat16")
        for reduction, opts in (
            ("mean", {}),
            ("sum", dict(softcap=3.0, z_loss=1e-3, bias=True, label_smoothing=0.1)),
            ("mean", dict(class_weight=True, temperature="tensor", label_smoothing=0.1)),
            ("sum", dict(all_ignored=True)),
            ("mean", dict(tokens=1, seed=3)),
            ("sum", dict(tokens=0, bias=True, seed=3)),
        )
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_matches_float64_reference(backend, kept):
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    results = [check_case(c, None, device_for(backend)) for c in _ce_cases(backend)]
    assert not [r for r in results if not r["ok"]], results
    assert kept and all(shape[1] == V and shape[0] in (37, 1, 0) for shape in kept)


def _distill(backend, dtype, divergence, scale):
    gen, dev = torch.Generator().manual_seed(4), device_for(backend)
    x = torch.randn(37, 24, generator=gen).to(dtype).to(dev).requires_grad_(True)
    w = (torch.randn(V, 24, generator=gen) * 0.4).to(dtype).to(dev).requires_grad_(True)
    xt = torch.randn(37, 16, generator=gen).to(dtype).to(dev)
    wt = (torch.randn(V, 16, generator=gen) * 0.4).to(dtype).to(dev)
    y = torch.randint(0, V, (37,), generator=gen).to(dev)
    y[::6] = -100
    loss = vp.vocab_parallel_distillation_loss(
        x, w, teacher_hidden=xt, teacher_weight=wt, divergence=divergence, target=y,
        hard_label_weight=0.3, temperature=1.5, backend=backend, mode="grad_in_forward",
    )  # fmt: skip
    (loss * scale).backward()
    return [t.detach().double().cpu() for t in (loss, x.grad, w.grad)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_distillation_equals_the_accumulated_plan(backend, divergence, monkeypatch):
    """The same epilogue's G, its products made in the backward instead of the forward."""
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setitem(memory.WORKSPACE_BYTES, "cpu", 5 * 8 * V)
    accumulated = _distill(backend, torch.float32, divergence, 0.6)
    _force(monkeypatch)
    kept = _distill(backend, torch.float32, divergence, 0.6)
    for a, b in zip(kept, accumulated, strict=True):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_autograd_frees_the_kept_g_with_the_graph(kept):
    """``G`` is saved for backward (not held by the Function): after a backward without
    ``retain_graph`` no ``[tokens, V]`` tensor is left, though the loss still is."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(37, 33, generator=gen, requires_grad=True)
    w = torch.randn(V, 33, generator=gen, requires_grad=True)
    y = torch.randint(0, V, (37,), generator=gen)
    loss = vp.vocab_parallel_linear_cross_entropy(x, w, y, mode="grad_in_forward")

    def alive():
        gc.collect()
        return [
            t for t in gc.get_objects()
            if type(t) is torch.Tensor and tuple(t.shape) == (37, V)
        ]  # fmt: skip

    assert len(alive()) == 1 and kept  # the kept G, before the backward
    loss.backward()
    assert not alive() and loss.grad_fn is not None


@pytest.mark.parametrize("frozen", ["hidden", "weight"])
def test_frozen_inputs_get_no_gradient(frozen, kept):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 33, generator=gen, requires_grad=frozen != "hidden")
    w = torch.randn(V, 33, generator=gen, requires_grad=frozen != "weight")
    y = torch.randint(0, V, (37,), generator=gen)
    loss = vp.vocab_parallel_linear_cross_entropy(x, w, y, mode="grad_in_forward")
    loss.backward()
    ref = vp.vocab_parallel_linear_cross_entropy(x, w, y, mode="memory_saving")
    live = x if frozen == "weight" else w
    (expected,) = torch.autograd.grad(ref, (live,))
    torch.testing.assert_close(live.grad, expected, rtol=1e-5, atol=1e-6)
    assert (w if frozen == "weight" else x).grad is None


def _ranks(group):
    _force()
    cases = [
        Case(mode="grad_in_forward", backend="torch", reduction="mean"),
        Case(
            mode="grad_in_forward",
            backend="torch",
            dtype="bfloat16",
            reduction="sum",
            softcap=3.0,
            bias=True,
            label_smoothing=0.1,
        ),  # fmt: skip
        Case(
            mode="grad_in_forward",
            backend="torch",
            reduction="mean",
            class_weight=True,
            layout="reversed",
        ),  # fmt: skip
        Case(
            mode="grad_in_forward",
            backend="triton",
            dtype="bfloat16",
            reduction="mean",
            label_smoothing=0.1,
            temperature="tensor",
        ),  # fmt: skip
    ]
    return [check_case(c, group, torch.device("cpu")) for c in cases]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="one case runs the Triton backend")
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_matches_reference(world):
    """Uneven shards: grad_input's one all-reduce in the backward, every rank checked,
    both backends (Triton's G of whole chunks into the kept G)."""
    bad = [r for rank in run_ranks(_ranks, world) for r in rank if not r["ok"]]
    assert not bad, bad


@pytest.mark.parametrize("which", ["both", "weight", "input"])
def test_filtering_leaves_out_the_columns_negligible_for_every_token(which, monkeypatch):
    """A kept G's filter: a column is left out of the products that ``filter_grads``
    names where every token's entry is below ``eps`` times its upstream gradient (a tile
    is the column of every token, whatever the device); the products are those of ``G``
    with exactly those columns zeroed (float64), the loss and grad_bias untouched; with
    nothing negligible the products are the unfiltered ones, bit for bit."""
    _force(monkeypatch)
    monkeypatch.setattr(grad_in_forward.filtering, "tile_rows", lambda device_type, rows: rows)
    seen = {}
    original = grad_in_forward.KeptG.hand_out

    def spy(self, grad_loss, dtypes, need, g):
        seen["g"] = g.clone()
        return original(self, grad_loss, dtypes, need, g)

    monkeypatch.setattr(grad_in_forward.KeptG, "hand_out", spy)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(37, 16, generator=gen)
    w = torch.randn(V, 16, generator=gen) * 3  # peaked: many columns negligible everywhere
    b = torch.randn(V, generator=gen)
    y = torch.randint(0, V, (37,), generator=gen)
    y[::5] = -100

    def run(filter_eps):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
        loss = vp.vocab_parallel_linear_cross_entropy(
            leaves[0], leaves[1], y, bias=leaves[2], mode="grad_in_forward",
            filter_eps=filter_eps, filter_grads=which,
        )  # fmt: skip
        (loss * 0.8).backward()
        return [loss.detach()] + [t.grad for t in leaves]

    exact = run(None)
    eps = 1e-3
    vp.gradient_filter_stats(reset=True)
    filtered = run(eps)
    stats = vp.gradient_filter_stats(reset=True)
    g = seen["g"].double()
    token_grad = (y != -100).double() / (y != -100).sum()
    live = token_grad[:, None] > 0  # an ignored token's G is 0: it keeps nothing
    kept = ((g.abs() >= eps * token_grad[:, None]) & live).any(dim=0)
    assert 0 < int((~kept).sum()) < V // 2 + V // 4  # some left out, not so many as dense
    assert stats.tiles == V and stats.skipped == int((~kept).sum()) * (2 if which == "both" else 1)
    gm = g * kept
    g_in = gm if which in ("both", "input") else g
    g_w = gm if which in ("both", "weight") else g
    torch.testing.assert_close(filtered[0], exact[0], rtol=0, atol=0)
    torch.testing.assert_close(filtered[1].double(), 0.8 * g_in @ w.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(filtered[2].double(), 0.8 * g_w.t() @ x.double(), rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    torch.testing.assert_close(filtered[3], exact[3], rtol=0, atol=0)
    nothing = run(1e-30)  # every column kept: the unfiltered products
    for a, e in zip(nothing, exact, strict=True):
        assert torch.equal(a, e)
