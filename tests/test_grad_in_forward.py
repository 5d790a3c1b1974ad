"""mode="grad_in_forward" (and mode="auto"): gradients computed in the forward pass.

Against the unsharded float64 reference with a random upstream scalar, over several token
chunks (the chunk budget is shrunk so that 37 tokens take 4-8 chunks), both backends,
every option; bitwise determinism, the overlap on and off, a second backward through the
same graph, the fall-backs, frozen inputs, and every rank of 2-4 gloo ranks.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import BACKENDS, DEVICE, HAS_TRITON, device_for
from multirank import run_ranks

from vocab_parallel import vocab_parallel_linear_cross_entropy
from vocab_parallel.engine import grad_in_forward
from vocab_parallel.engine import memory_policy as memory
from vocab_parallel.engine.memory_policy import token_rows
from vocab_parallel.loss import resolve_mode
from vocab_parallel.objectives import cross_entropy_autograd
from vocab_parallel.objectives.cross_entropy_autograd import GradInForwardLinearCE
from vocab_parallel.testing import Case, check_case, grid

CPU = torch.device("cpu")


def small_chunks(rows: int, vocab: int, world: int = 1) -> int:
    """A chunk budget that gives ``rows`` token rows per chunk at this vocabulary."""
    return rows * 4 * -(-vocab // world)


@pytest.fixture
def chunked(monkeypatch):
    """5 token rows per chunk at V=389 (37 tokens: 8 chunks, the last one short), on the
    CPU and on DEVICE (where the Triton tests run)."""
    for device_type in {"cpu", DEVICE.type}:
        monkeypatch.setitem(memory.WORKSPACE_BYTES, device_type, small_chunks(5, 389))


def assert_bitwise_equal(a, b, names=("loss", "grad_hidden", "grad_weight")) -> None:
    for x, y, name in zip(a, b, names, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x, y), f"{name}: max |diff| {(x.double() - y.double()).abs().max()}"


def _run(backend, mode, dtype=torch.float32, reduction="mean", scale=0.7, seed=0, **options):
    """Loss and gradients (on the CPU) of one call on ``backend``'s device."""
    gen, dev = torch.Generator().manual_seed(seed), device_for(backend)
    x = torch.randn(37, 33, generator=gen).to(dtype).to(dev).requires_grad_(True)
    w = (torch.randn(389, 33, generator=gen) / 33**0.5 * 4).to(dtype).to(dev).requires_grad_(True)
    y = torch.randint(0, 389, (37,), generator=gen)
    y[::5] = -100
    out = vocab_parallel_linear_cross_entropy(
        x, w, y.to(dev), reduction=reduction, mode=mode, backend=backend, **options
    )
    loss = out[0] if isinstance(out, tuple) else out
    (loss * scale).backward()
    return loss.detach().cpu(), x.grad.cpu(), w.grad.cpu()


# --- against the float64 reference, one process, many chunks ---------------------------


def _cases(backend: str) -> list[Case]:
    dtypes = ("float32", "bfloat16")
    return grid(
        dtypes=dtypes,
        modes=("grad_in_forward",),
        reductions=("sum", "mean"),
        label_smoothing=(0.0, 0.1),
        backends=(backend,),
    ) + [
        Case(mode="grad_in_forward", backend=backend, softcap=3.0, z_loss=1e-3, bias=True),
        Case(mode="grad_in_forward", backend=backend, softcap=2.0, return_lse=True, bias=True),
        Case(mode="grad_in_forward", backend=backend, dtype="bfloat16", z_loss=1e-2, bias=True),
        Case(mode="grad_in_forward", backend=backend, all_ignored=True),
        Case(mode="grad_in_forward", backend=backend, all_ignored=True, reduction="sum"),
        Case(mode="grad_in_forward", backend=backend, tokens=1, seed=3),
        Case(mode="grad_in_forward", backend=backend, tokens=0, seed=3, bias=True),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference_over_many_chunks(backend, chunked):
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    results = [check_case(c, None, device_for(backend)) for c in _cases(backend)]
    bad = [r for r in results if not r["ok"]]
    assert not bad, bad[:5]


def test_float64_gradcheck(monkeypatch):
    """float64 (torch backend): gradcheck of the loss through several chunks."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(11, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(13, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(13, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 13, (11,), generator=gen)
    y[2] = -100
    monkeypatch.setitem(memory.WORKSPACE_BYTES, "cpu", small_chunks(3, 13))

    def fn(x, w, b):
        return vocab_parallel_linear_cross_entropy(
            x, w, y, bias=b, mode="grad_in_forward", label_smoothing=0.1, softcap=4.0,
            z_loss=1e-2, backend="torch",
        )  # fmt: skip

    # gradcheck runs the backward twice on one graph: the second one recomputes the
    # gradients (memory-saving style), equal up to float64 rounding, not bit for bit.
    assert torch.autograd.gradcheck(fn, (x, w, b), nondet_tol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bitwise_deterministic_and_close_to_memory_saving(backend, dtype, chunked):
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    first = _run(backend, "grad_in_forward", dtype, label_smoothing=0.1)
    again = _run(backend, "grad_in_forward", dtype, label_smoothing=0.1)
    assert_bitwise_equal(first, again)
    other = _run(backend, "memory_saving", dtype, label_smoothing=0.1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(first, other, strict=True):
        assert ((a.double() - b.double()).abs().max() / b.double().abs().max()) < tol


def test_chunking_changes_only_rounding(monkeypatch):
    """One chunk or eight: the same gradients up to fp32 rounding."""
    one = _run("torch", "grad_in_forward")
    monkeypatch.setitem(memory.WORKSPACE_BYTES, "cpu", small_chunks(5, 389))
    many = _run("torch", "grad_in_forward")
    for a, b in zip(one, many, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_token_rows_are_the_same_on_every_rank(monkeypatch):
    """Derived from tokens, global vocabulary, world size, hidden size and dtype only
    (never the local shard), so uneven shards still issue the same collectives; a
    multiple of 64 when large, the chunks as even as that allows."""
    assert token_rows(4096, 32768, 1, "cpu") == 512  # MAX_ROWS
    assert token_rows(4096, 131072, 1, "cpu") == 256
    assert token_rows(4096, 131072, 2, "cpu") == 512
    assert token_rows(4096, 131072, 4, "cpu") == 512
    assert token_rows(100, 32768, 1, "cpu") == 100
    assert token_rows(4096, 10**9, 1, "cpu") == 1  # never 0
    assert token_rows(0, 389, 1, "cpu") == 1
    assert token_rows(4096, 131072, 1, "cuda") == 1024
    # GPUs, half inputs: the gradients handed back bound the blocks (2 bytes x (V + N) x H)
    assert token_rows(8192, 128256, 1, "cuda", 1, 4096, 2) == 2048  # 1066 MiB: 4 chunks
    assert token_rows(8192, 128256, 1, "cuda", 1, 4096, 4) == 1024  # fp32: the workspace
    assert token_rows(4096, 128256, 1, "cuda", 2, 4096, 2) == 1024  # two heads
    assert token_rows(8192, 128256, 1, "cpu", 1, 4096, 2) == 256  # the CPU: the workspace
    assert token_rows(8000, 128256, 1, "cuda", 1, 4096, 2) == 2048  # 4 chunks, 64-row even
    assert token_rows(8192, 256000, 1, "cuda", 1, 2304, 2) == 1024  # 8 even chunks, not 7.1
    monkeypatch.setitem(memory.WORKSPACE_BYTES, "cpu", small_chunks(7, 389, 4))
    assert token_rows(4096, 389, 4, "cpu") == 7
    assert token_rows(4096, 389, 4, "cpu", heads=2) == 3  # two heads' blocks share it


def test_no_vocabulary_rows_on_this_rank_gives_zeros_in_the_callers_buffers():
    """A shard of 0 rows (TP 4 over 3 tokens of vocabulary) writes zeros into the
    grad_input rows it was handed, and leaves accumulators being added to alone."""
    from vocab_parallel.backends.interface import Outputs
    from vocab_parallel.engine.chunking import gradient_products

    x = torch.randn(5, 4)
    w = torch.empty(0, 4)
    out = torch.full((5, 4), float("nan"))
    acc = torch.full((0, 4), float("nan"))
    buffers = Outputs(grad_input_out=out, grad_weight_acc=acc, accumulate=False)
    gi, gw, _ = gradient_products(x, w, 8, None, buffers, g_reads_operands=False)
    assert gi is out and torch.equal(out, torch.zeros(5, 4)) and gw is acc
    kept = torch.ones(5, 4)
    buffers = Outputs(grad_input_out=kept)
    gi, _, _ = gradient_products(x, w, 8, None, buffers, g_reads_operands=False)
    assert gi is kept and torch.equal(kept, torch.zeros(5, 4))


def test_float16_forms_g_with_unit_token_gradients(monkeypatch):
    """fp16 + mean: G is rounded with a per-token gradient of 1 (1/count applied to the
    fp32 results), so terms far below 1/count's fp16 range survive."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(600, 16, generator=gen).half().requires_grad_(True)
    w = torch.randn(50, 16, generator=gen).half().requires_grad_(True)
    y = torch.randint(0, 50, (600,), generator=gen)
    seen = []
    fused = cross_entropy_autograd.shard_gradients

    def recording(call, grad, *args, **kwargs):
        seen.append(grad.unique().tolist())
        return fused(call, grad, *args, **kwargs)

    monkeypatch.setattr(cross_entropy_autograd, "shard_gradients", recording)
    loss = vocab_parallel_linear_cross_entropy(x, w, y, mode="grad_in_forward")
    loss.backward()
    assert seen and all(vals == [1.0] for vals in seen)
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    F.cross_entropy(F.linear(x64, w64), y).backward()
    for got, ref in ((x.grad, x64.grad), (w.grad, w64.grad)):
        assert ((got.double() - ref).abs().max() / ref.abs().max()) < 5e-3


# --- the backward: upstream scalar, second backward, double backward ----------------------


def test_upstream_scalar_scales_the_saved_gradients(chunked):
    loss1, gx1, gw1 = _run("torch", "grad_in_forward", scale=1.0)
    loss3, gx3, gw3 = _run("torch", "grad_in_forward", scale=-3.0)
    assert torch.equal(loss1, loss3)
    torch.testing.assert_close(gx3, -3.0 * gx1, rtol=1e-6, atol=0)
    torch.testing.assert_close(gw3, -3.0 * gw1, rtol=1e-6, atol=0)


@pytest.mark.parametrize("plan", ["accumulated", "kept_g"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_second_backward_through_the_same_graph_recomputes(backend, plan, chunked, monkeypatch):
    """retain_graph=True: the first backward hands out the forward's gradients, the second
    recomputes them (memory-saving style; a kept G makes its products again) with its own
    upstream scalar; after the graph is freed a third raises."""
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    if plan == "kept_g":  # the GPU plan, forced here
        monkeypatch.setattr(memory, "keeps_g", lambda *args: True)
    gen, dev = torch.Generator().manual_seed(2), device_for(backend)
    x = torch.randn(37, 33, generator=gen).to(dev).requires_grad_(True)
    w = torch.randn(389, 33, generator=gen).to(dev).requires_grad_(True)
    b = torch.randn(389, generator=gen).to(dev).requires_grad_(True)
    y = torch.randint(0, 389, (37,), generator=gen).to(dev)
    kw = dict(bias=b, z_loss=1e-3, softcap=5.0, label_smoothing=0.1, backend=backend)
    loss = vocab_parallel_linear_cross_entropy(x, w, y, mode="grad_in_forward", **kw)
    first = torch.autograd.grad(loss * 2.0, (x, w, b), retain_graph=True)
    second = torch.autograd.grad(loss * -0.5, (x, w, b))
    ref_loss = vocab_parallel_linear_cross_entropy(x, w, y, mode="memory_saving", **kw)
    ref = torch.autograd.grad(ref_loss, (x, w, b))
    for f, s, r in zip(first, second, ref, strict=True):
        torch.testing.assert_close(f, 2.0 * r, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s, -0.5 * r, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="second time|freed"):
        torch.autograd.grad(loss, (x,))


def test_double_backward_is_refused():
    x = torch.randn(5, 4, requires_grad=True)
    w = torch.randn(7, 4, requires_grad=True)
    loss = vocab_parallel_linear_cross_entropy(x, w, torch.arange(5), mode="grad_in_forward")
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        gx.sum().backward()


# --- what runs where: auto, fall-backs, frozen inputs --------------------------------------


def test_auto_picks_grad_in_forward_only_where_it_applies():
    assert resolve_mode("auto", "mean", True) == "grad_in_forward"
    assert resolve_mode("auto", "sum", True) == "grad_in_forward"
    assert resolve_mode("auto", "none", True) == "memory_saving"
    assert resolve_mode("auto", "mean", False) == "memory_saving"
    assert resolve_mode("grad_in_forward", "mean", False) == "memory_saving"
    assert resolve_mode("high_performance", "mean", True) == "high_performance"
    assert resolve_mode("auto", "mean", True, torch.float16) == "memory_saving"
    assert resolve_mode("auto", "mean", True, torch.bfloat16) == "grad_in_forward"
    assert resolve_mode("grad_in_forward", "mean", True, torch.float16) == "grad_in_forward"
    with pytest.warns(UserWarning, match='needs reduction "sum" or "mean"'):
        assert resolve_mode("grad_in_forward", "none", True) == "memory_saving"


def _count_calls(monkeypatch):
    calls = []
    apply = GradInForwardLinearCE.apply

    def counting(*args):
        calls.append(args[-1])  # needs
        return apply(*args)

    monkeypatch.setattr(GradInForwardLinearCE, "apply", counting)
    return calls


def test_default_mode_is_auto_and_falls_back_without_a_backward(monkeypatch):
    calls = _count_calls(monkeypatch)
    x = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(9, 4, requires_grad=True)
    y = torch.randint(0, 9, (6,))
    vocab_parallel_linear_cross_entropy(x, w, y).backward()
    assert calls == [(True, True, False)]
    with torch.no_grad():
        loss = vocab_parallel_linear_cross_entropy(x, w, y, mode="grad_in_forward")
    per_token = vocab_parallel_linear_cross_entropy(x, w, y, reduction="none")
    assert len(calls) == 1 and not loss.requires_grad and per_token.shape == (6,)
    with pytest.warns(UserWarning, match="memory_saving"):
        vocab_parallel_linear_cross_entropy(x, w, y, reduction="none", mode="grad_in_forward")
    assert len(calls) == 1


def test_reduction_none_fallback_keeps_per_token_gradients_exact():
    """grad_in_forward with reduction="none" runs memory-saving mode: per-token upstream
    gradients are honoured."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 11, (9,), generator=gen)
    up = torch.rand(9, generator=gen, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = vocab_parallel_linear_cross_entropy(x, w, y, reduction="none", mode="grad_in_forward")
    gx, gw = torch.autograd.grad(out, (x, w), up)
    ref = F.cross_entropy(F.linear(x, w), y, reduction="none")
    rx, rw = torch.autograd.grad(ref, (x, w), up)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)


@pytest.mark.parametrize("frozen", ["hidden", "weight", "bias"])
def test_frozen_inputs_cost_no_gradient(frozen, monkeypatch):
    """A frozen input's gradient is never computed (the backend is told so)."""
    calls = _count_calls(monkeypatch)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(8, 5, generator=gen, requires_grad=frozen != "hidden")
    w = torch.randn(10, 5, generator=gen, requires_grad=frozen != "weight")
    b = torch.randn(10, generator=gen, requires_grad=frozen != "bias")
    y = torch.randint(0, 10, (8,), generator=gen)
    loss = vocab_parallel_linear_cross_entropy(x, w, y, bias=b, mode="grad_in_forward")
    loss.backward()
    assert calls == [(frozen != "hidden", frozen != "weight", frozen != "bias")]
    for name, t in (("hidden", x), ("weight", w), ("bias", b)):
        assert (t.grad is None) == (name == frozen)
    tensors = {"hidden": x, "weight": w, "bias": b}
    fresh = {k: t.detach().requires_grad_(t.requires_grad) for k, t in tensors.items()}
    ref = vocab_parallel_linear_cross_entropy(
        fresh["hidden"], fresh["weight"], y, bias=fresh["bias"], mode="memory_saving"
    )
    ref.backward()
    for name, t in tensors.items():
        if name != frozen:
            torch.testing.assert_close(t.grad, fresh[name].grad, rtol=1e-5, atol=1e-7)


# --- every rank of 2-4 gloo ranks ------------------------------------------------------------


def _check_chunked(group, cases, rows, overlap=True):
    import torch.distributed as dist

    world = dist.get_world_size(group)
    memory.WORKSPACE_BYTES["cpu"] = small_chunks(rows, cases[0].vocab, world)
    grad_in_forward.OVERLAP = overlap
    return [check_case(c, group, CPU) for c in cases]


def _assert_ok(per_rank):
    bad = [r for rank in per_rank for r in rank if not r["ok"]]
    assert not bad, "mismatches:\n" + "\n".join(str(b) for b in bad[:10])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_matches_reference(world):
    """Uneven shards (V=389), both layouts, smoothing, both dtypes, options; 6 rows a chunk."""
    cases = grid(modes=("grad_in_forward",), reductions=("sum", "mean"), backends=("torch",))
    cases += grid(
        modes=("grad_in_forward",),
        reductions=("mean",),
        layouts=("reversed",),
        backends=("torch",),
        dtypes=("float32",),
    )
    cases += [
        Case(mode="grad_in_forward", softcap=3.0, z_loss=1e-3, bias=True, return_lse=True),
        dataclasses.replace(Case(mode="grad_in_forward"), all_ignored=True),
    ]
    _assert_ok(run_ranks(_check_chunked, world, cases, 6))


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_every_rank_matches_reference_triton():
    cases = grid(
        tokens=(19,),
        hidden=(21,),
        vocab=(131,),
        modes=("grad_in_forward",),
        reductions=("mean",),
        backends=("triton",),
    )
    _assert_ok(run_ranks(_check_chunked, 2, cases, 4))


def _overlap_on_and_off(group):
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(64, 48, generator=gen)
    w = torch.randn(389, 48, generator=gen) * 0.2
    y = torch.randint(0, 389, (64,), generator=gen)
    lo, hi = (0, 195) if rank == 0 else (195, 389)
    memory.WORKSPACE_BYTES["cpu"] = small_chunks(8, 389, world)
    out = []
    for overlap in (True, False):
        grad_in_forward.OVERLAP = overlap
        h = x.clone().requires_grad_(True)
        ws = w[lo:hi].clone().requires_grad_(True)
        loss = vocab_parallel_linear_cross_entropy(
            h, ws, y, process_group=group, mode="grad_in_forward", label_smoothing=0.1
        )
        loss.backward()
        # The bytes of each result (tensors do not travel back reliably through the queue).
        out.append([t.detach().numpy().tobytes() for t in (loss, h.grad, ws.grad)])
    return out


def test_overlap_changes_nothing_bitwise():
    """The async grad_input all-reduces give the same bits as blocking ones (8 chunks)."""
    for on, off in run_ranks(_overlap_on_and_off, 2):
        for a, b, name in zip(on, off, ("loss", "grad_hidden", "grad_weight"), strict=True):
            assert a == b, f"{name} differs with and without the overlap"
