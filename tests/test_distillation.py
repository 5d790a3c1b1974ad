"""Distillation: the loss and the student's gradients against the float64 reference on
materialised logits (``vocab_parallel.reference.distillation_reference``: ``F.kl_div``, the
JSD mixture, the top-k bins and the tail bin), alone and on 2-4 gloo ranks with uneven
shards, sequence parallelism and DTensor weights; every divergence, temperature, softcap,
the hard-label mix, ignored tokens, top-k teachers with k = 1..64 with and without tail
mass, a teacher of another hidden size; gradcheck, errors on every rank, memory flat in V.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, replace

import pytest
import torch
from helpers import CPU, HAS_TRITON, device_for, moved, peak_extra_in_child
from multirank import run_ranks

import vocab_parallel as vp
from vocab_parallel.parallel.layout import shard_bounds
from vocab_parallel.reference import distillation_reference
from vocab_parallel.testing import token_split

# Largest |error| relative to the largest |reference value|. The loss: fp32 accumulation
# only (the reference sees the same rounded inputs); gradients: G rounded to the input
# dtype once.
LOSS_TOL = 2e-5
GRAD_TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float64: 1e-10}


@dataclass(frozen=True)
class DCase:
    tokens: int = 29
    hidden: int = 12
    teacher_hidden: int = 20  # another hidden size than the student's
    vocab: int = 131  # uneven over 2, 3 and 4 ranks
    dtype: torch.dtype = torch.float32
    backend: str = "torch"
    mode: str = "auto"
    divergence: str = "forward_kl"
    beta: float = 0.5
    temperature: str = "float"  # "one", "float" (0.7) or "tensor" (per token)
    softcap: float | None = None
    bias: bool = False
    teacher_bias: bool = False
    hard_label_weight: float = 0.0
    target: bool = True  # hard labels given (some ignored)
    top_k: int = 0  # > 0: the sparse teacher
    tail: bool = True  # top-k: the teacher's full log-probs (tail mass), else renormalised
    reduction: str = "mean"
    sp: str | None = None  # sequence parallelism: the token split ("uneven", "empty")
    dtensor: bool = False
    seed: int = 0


def _problem(case: DCase):
    g = torch.Generator().manual_seed(case.seed)
    n, h, ht, v = case.tokens, case.hidden, case.teacher_hidden, case.vocab
    x = torch.randn(n, h, generator=g).to(case.dtype)
    w = (torch.randn(v, h, generator=g) * 0.6).to(case.dtype)
    xt = torch.randn(n, ht, generator=g).to(case.dtype)
    wt = (torch.randn(v, ht, generator=g) * 0.8).to(case.dtype)
    y = torch.randint(0, v, (n,), generator=g)
    y[::4] = -100
    b = (torch.randn(v, generator=g) * 0.3).to(case.dtype) if case.bias else None
    bt = (torch.randn(v, generator=g) * 0.3).to(case.dtype) if case.teacher_bias else None
    temp = {"one": 1.0, "float": 0.7}.get(case.temperature)
    if case.temperature == "tensor":
        temp = torch.rand(n, generator=g) + 0.5
    up = torch.randn(n, generator=g).double()  # the upstream gradient of "none"
    ids = lps = None
    if case.top_k:
        zt = (xt.double() @ wt.double().T) / (temp[:, None] if torch.is_tensor(temp) else temp)
        top = torch.log_softmax(zt, dim=-1).topk(case.top_k, dim=-1)
        ids, lps = top.indices, top.values
        if not case.tail:  # the teacher's mass on its k ids only: r = 0
            lps = torch.log_softmax(lps, dim=-1)
        lps = lps.float()
    return x, w, xt, wt, y, b, bt, temp, up, ids, lps


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if b.numel() == 0:
        return 0.0
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _teacher_args(case, xt, wt, bt, ids, lps, lo, hi, tokens):
    if case.top_k:
        return dict(teacher_topk_ids=ids[tokens], teacher_topk_logprobs=lps[tokens])
    return dict(
        teacher_hidden=xt[tokens], teacher_weight=wt[lo:hi],
        teacher_bias=None if bt is None else bt[lo:hi],
    )  # fmt: skip


def check(case: DCase, group=None) -> list[str]:
    """Our loss and gradients against the reference on this rank (its shard, its tokens
    under sequence parallelism); the mismatches (empty when all agree). One process runs
    on the backend's device, gloo ranks on the CPU; the reference is on the CPU."""
    world = 1 if group is None else torch.distributed.get_world_size(group)
    rank = 0 if group is None else torch.distributed.get_rank(group)
    dev = device_for(case.backend) if group is None else CPU
    x, w, xt, wt, y, b, bt, temp, up, ids, lps = _problem(case)
    lo, hi = shard_bounds(case.vocab, world)[rank]
    tokens = slice(0, case.tokens)
    if case.sp:
        sizes = token_split(case.tokens, world, case.sp)
        start = sum(sizes[:rank])
        tokens = slice(start, start + sizes[rank])
    hidden = x[tokens].to(dev, copy=True).requires_grad_(True)
    kwargs = {}
    if case.dtensor:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        mesh = init_device_mesh("cpu", (world,))
        weight = torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
        (rows, _), (lo, _) = compute_local_shape_and_global_offset(w.shape, mesh, [Shard(0)])
        hi = lo + rows
        bias = None if b is None else torch.nn.Parameter(distribute_tensor(b, mesh, [Shard(0)]))
        teacher = _teacher_args(case, xt, wt, bt, ids, lps, lo, hi, tokens)
        if "teacher_weight" in teacher:  # the teacher's weight a DTensor as well
            teacher["teacher_weight"] = distribute_tensor(wt, mesh, [Shard(0)])
    else:
        weight = w[lo:hi].to(dev, copy=True).requires_grad_(True)
        bias = None if b is None else b[lo:hi].to(dev, copy=True).requires_grad_(True)
        kwargs = dict(process_group=group)
        if world > 1 and case.seed % 2:  # the stated layout (no layout collective)
            kwargs |= dict(vocab_start_index=lo, global_vocab_size=case.vocab)
        teacher = moved(_teacher_args(case, xt, wt, bt, ids, lps, lo, hi, tokens), dev)
    temp_here = moved(temp[tokens] if isinstance(temp, torch.Tensor) else temp, dev)
    loss = vp.vocab_parallel_distillation_loss(
        hidden, weight, **teacher, target=y[tokens].to(dev) if case.target else None,
        divergence=case.divergence, beta=case.beta, temperature=temp_here,
        hard_label_weight=case.hard_label_weight, reduction=case.reduction, bias=bias,
        softcap=case.softcap, sequence_parallel=case.sp is not None, mode=case.mode,
        backend=case.backend, **kwargs,
    )  # fmt: skip
    up_here = up[tokens].to(loss.device, loss.dtype)
    (loss * up_here if case.reduction == "none" else loss).sum().backward()

    x64 = x.double().requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    b64 = None if b is None else b.double().requires_grad_(True)
    teacher64 = _teacher_args(case, xt.double(), wt.double(), bt, ids, lps, 0, case.vocab,
                              slice(None))  # fmt: skip
    if bt is not None:
        teacher64["teacher_bias"] = bt.double()
    ref = distillation_reference(
        x64, w64, **teacher64, target=y if case.target else None, divergence=case.divergence,
        beta=case.beta, temperature=temp, hard_label_weight=case.hard_label_weight,
        reduction=case.reduction, bias=b64, softcap=case.softcap,
    )  # fmt: skip
    (ref * up if case.reduction == "none" else ref).sum().backward()

    errors = []
    want = ref[tokens] if case.reduction == "none" else ref
    accum = torch.float64 if case.dtype == torch.float64 else torch.float32
    if loss.dtype != accum or _rel(loss, want) > LOSS_TOL:
        errors.append(f"loss: {loss.dtype}, rel error {_rel(loss, want):.2e}")
    tol = GRAD_TOL[case.dtype]
    grads = [("grad_hidden", hidden.grad, x64.grad[tokens])]
    w_grad = weight.grad.to_local() if case.dtensor else weight.grad
    grads.append(("grad_weight", w_grad, w64.grad[lo:hi]))
    if b is not None:
        b_grad = bias.grad.to_local() if case.dtensor else bias.grad
        grads.append(("grad_bias", b_grad, b64.grad[lo:hi]))
    for name, got, want in grads:
        if got is None or got.shape != want.shape or _rel(got, want) > tol:
            err = "missing" if got is None else f"rel error {_rel(got, want):.2e}"
            errors.append(f"{name}: {err}")
    return [f"{case}: {e}" for e in errors]


BF16 = torch.bfloat16
SINGLE = [
    DCase(),
    DCase(divergence="reverse_kl", temperature="tensor", softcap=4.0, bias=True, seed=1),
    DCase(divergence="jsd", beta=0.3, teacher_bias=True, hard_label_weight=0.1, seed=2),
    DCase(divergence="jsd", beta=0.8, mode="memory_saving", reduction="sum", seed=3),
    DCase(
        hard_label_weight=0.1,
        temperature="float",
        softcap=3.0,
        mode="high_performance",
        teacher_bias=True,
        seed=4,
    ),  # fmt: skip
    DCase(divergence="reverse_kl", mode="memory_saving", reduction="none", target=False, seed=5),
    DCase(dtype=BF16, divergence="forward_kl", hard_label_weight=0.1, bias=True, seed=6),
    DCase(dtype=BF16, divergence="jsd", softcap=3.0, temperature="tensor", seed=7),
    DCase(dtype=BF16, divergence="reverse_kl", mode="high_performance", seed=8),
    DCase(top_k=5, hard_label_weight=0.2, seed=9),
    DCase(top_k=1, tail=False, mode="memory_saving", reduction="none", seed=10),
    DCase(top_k=64, temperature="tensor", softcap=3.0, bias=True, seed=11),
    DCase(top_k=16, tail=False, dtype=BF16, hard_label_weight=0.5, seed=12),
    DCase(tokens=300, vocab=1500, divergence="jsd", seed=13),  # several vocabulary chunks
]
TRITON = [
    DCase(
        backend="triton",
        tokens=20,
        vocab=67,
        hard_label_weight=0.1,
        softcap=3.0,
        bias=True,
        seed=20,
    ),  # fmt: skip
    DCase(
        backend="triton",
        tokens=20,
        vocab=67,
        dtype=BF16,
        divergence="jsd",
        temperature="tensor",
        mode="memory_saving",
        seed=21,
    ),  # fmt: skip
    DCase(
        backend="triton",
        tokens=20,
        vocab=67,
        divergence="reverse_kl",
        top_k=0,
        mode="high_performance",
        teacher_bias=True,
        seed=22,
    ),  # fmt: skip
    DCase(backend="triton", tokens=20, vocab=67, top_k=8, dtype=BF16, seed=23),
]


@pytest.mark.parametrize("case", SINGLE, ids=str)
def test_single_process_torch(case):
    assert check(case) == []


# Grad-in-forward's kept blocks walked in chunks of 128 columns (the narrowest the memory
# policy gives): every temperature form, with and without the CE, a cap, a bias.
KEPT = [
    DCase(temperature="one", hard_label_weight=0.1, bias=True, teacher_bias=True, seed=30),
    DCase(temperature="tensor", reduction="sum", seed=31),
    DCase(temperature="float", hard_label_weight=0.3, seed=32),
    DCase(temperature="one", softcap=3.0, hard_label_weight=0.2, seed=33),
    DCase(temperature="tensor", softcap=2.5, hard_label_weight=0.1, bias=True, seed=34),
    DCase(dtype=BF16, temperature="one", hard_label_weight=0.1, seed=35),
    DCase(dtype=BF16, temperature="float", softcap=3.0, target=False, seed=36),
    DCase(dtype=torch.float64, mode="grad_in_forward", hard_label_weight=0.1, seed=37),
]


@pytest.mark.parametrize("case", KEPT, ids=str)
def test_grad_in_forward_kept_blocks(case, monkeypatch):
    from vocab_parallel.engine import memory_policy as memory

    monkeypatch.setitem(memory.WORKSPACE_BYTES, "cpu", 1)  # the narrowest blocks
    assert memory.columns(case.tokens, case.vocab, "cpu", "epilogue") == 128
    assert check(replace(case, tokens=29, vocab=291)) == []  # 3 blocks, the last short


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("case", TRITON, ids=str)
def test_single_process_triton(case):
    assert check(case) == []


# The Triton backend's chunks of logits under distillation's epilogue:
# odd shapes (37 tokens, V 389, H 48 / H_t 80: edge tiles in every dimension), both KLs
# and the JSD's first pass, the CE mix with ignored tokens at T = 1 (the target logit
# only) and T != 1 (the untempered sums too), a bias on either head, memory-saving
# (nothing stored) and high-performance (both heads' logits stored by the kernel) modes,
# grad-in-forward's chunks for the reverse KL (stored into its kept chunk).
ODD = dict(backend="triton", tokens=37, vocab=389, hidden=48, teacher_hidden=80)
FUSED = [
    DCase(**ODD, mode="memory_saving", temperature="float", softcap=3.0, bias=True,
          teacher_bias=True, hard_label_weight=0.2, seed=60),
    DCase(**ODD, mode="memory_saving", divergence="reverse_kl", temperature="tensor",
          softcap=3.0, bias=True, hard_label_weight=0.1, seed=61),
    DCase(**ODD, mode="high_performance", temperature="tensor", teacher_bias=True,
          hard_label_weight=0.3, seed=62),
    DCase(**ODD, mode="high_performance", divergence="reverse_kl", temperature="one",
          bias=True, hard_label_weight=0.1, seed=63),
    DCase(**ODD, mode="memory_saving", dtype=BF16, temperature="float", softcap=3.0,
          bias=True, hard_label_weight=0.1, seed=64),
    DCase(**ODD, mode="high_performance", dtype=BF16, divergence="reverse_kl",
          temperature="tensor", teacher_bias=True, hard_label_weight=0.2, seed=65),
    DCase(**ODD, mode="memory_saving", divergence="reverse_kl", reduction="none",
          target=False, seed=66),
    DCase(**ODD, mode="memory_saving", divergence="jsd", temperature="float", softcap=3.0,
          hard_label_weight=0.1, seed=67),
    DCase(**ODD, divergence="reverse_kl", temperature="float", bias=True,
          hard_label_weight=0.1, seed=68),  # auto: grad-in-forward
    # The forward KL's G in its kernel too (memory-saving): the CE at T = 1 (p1 = p_s),
    # no CE at all.
    DCase(**ODD, mode="memory_saving", temperature="one", teacher_bias=True,
          hard_label_weight=0.3, seed=69),
    DCase(**ODD, mode="memory_saving", temperature="tensor", softcap=2.5, reduction="sum",
          seed=71),
    DCase(**ODD, mode="auto", dtype=torch.float16, temperature="tensor", softcap=3.0,
          bias=True, hard_label_weight=0.2, seed=72),  # fp16 auto: memory-saving
    # The JSD's second pass and the other divergences' G in their kernels (memory-saving).
    DCase(**ODD, mode="memory_saving", dtype=BF16, divergence="jsd", beta=0.3,
          temperature="tensor", bias=True, teacher_bias=True, hard_label_weight=0.2,
          seed=73),
    DCase(**ODD, mode="memory_saving", divergence="jsd", beta=0.8, temperature="one",
          teacher_bias=True, hard_label_weight=0.3, seed=74),  # the CE's p1 = p_s
    DCase(**ODD, mode="memory_saving", divergence="reverse_kl", temperature="one",
          teacher_bias=True, hard_label_weight=0.3, seed=75),
]  # fmt: skip


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("case", FUSED, ids=str)
def test_triton_odd_shapes(case):
    assert check(case) == []


# The Triton backend's fused epilogue (``kernels/src/divergence.py``): whole kept blocks
# of both heads, one launch each for the statistics, the JSD's second sums and G, where
# there is no hard-label term and no softcap (grad-in-forward's token chunks: 5 rows, 8
# chunks, or high-performance mode's blocks of every token); the three dtypes, every
# temperature, biases on either head, a mean, a sum and no hard labels at all.
EPILOGUE = [
    DCase(**ODD, mode="grad_in_forward", temperature="tensor", teacher_bias=True, seed=80),
    DCase(**ODD, mode="grad_in_forward", divergence="reverse_kl", temperature="float",
          bias=True, seed=81),
    DCase(**ODD, mode="grad_in_forward", divergence="jsd", beta=0.3, temperature="one",
          reduction="sum", seed=82),
    DCase(**ODD, mode="high_performance", divergence="jsd", beta=0.8, temperature="tensor",
          teacher_bias=True, target=False, seed=83),
    DCase(**ODD, mode="grad_in_forward", dtype=BF16, divergence="jsd", temperature="tensor",
          bias=True, seed=84),
    DCase(**ODD, mode="high_performance", dtype=BF16, temperature="float", seed=85),
    DCase(**ODD, mode="grad_in_forward", dtype=torch.float16, divergence="reverse_kl",
          temperature="tensor", teacher_bias=True, seed=86),
    # memory-saving mode: both heads' column chunks (128 columns: 4 of them at V = 389)
    DCase(**ODD, mode="memory_saving", temperature="tensor", teacher_bias=True, seed=87),
    DCase(**ODD, mode="memory_saving", dtype=BF16, divergence="jsd", beta=0.4,
          temperature="float", bias=True, seed=88),
    DCase(**ODD, mode="memory_saving", divergence="reverse_kl", reduction="sum", seed=89),
]  # fmt: skip


@pytest.fixture
def fused_launches(monkeypatch):
    """Count the fused epilogue's launchers' calls (each still runs)."""
    from vocab_parallel.backends import triton_epilogues

    counts = {}
    for name in ("divergence_stats", "divergence_second", "divergence_grad"):
        original = getattr(triton_epilogues, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(triton_epilogues, name, counted)
    return counts


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("case", EPILOGUE, ids=str)
def test_triton_fused_epilogue(case, fused_launches, monkeypatch):
    from vocab_parallel.engine import memory_policy as memory

    rows = 5 if case.mode == "grad_in_forward" else case.tokens
    workspace = rows * 8 * case.vocab
    if case.mode == "memory_saving":  # both heads' fp32 [tokens, 128] in half of it
        workspace = 16 * case.tokens * 128
    for device_type in {"cpu", device_for("triton").type}:
        monkeypatch.setitem(memory.WORKSPACE_BYTES, device_type, workspace)
    assert check(case) == []
    chunks = -(-case.tokens // rows)
    if case.mode == "memory_saving":  # column chunks, each walk
        chunks = -(-case.vocab // 128)
    assert fused_launches["divergence_stats"] == chunks
    assert fused_launches["divergence_grad"] == chunks
    assert fused_launches.get("divergence_second", 0) == (chunks if case.divergence == "jsd" else 0)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("case", [EPILOGUE[4]], ids=str)
def test_fused_g_is_written_into_the_kept_g(case, monkeypatch):
    """With a kept G (the GPU plan, forced on here), the fused G kernel writes each
    chunk's G into the kept G's rows itself: nothing to copy, and the results hold."""
    from vocab_parallel.backends import triton_epilogues
    from vocab_parallel.engine import memory_policy as memory

    monkeypatch.setattr(memory, "keeps_g", lambda *args: True)
    for device_type in {"cpu", device_for("triton").type}:
        monkeypatch.setitem(memory.WORKSPACE_BYTES, device_type, 5 * 8 * case.vocab)
    written = []
    original = triton_epilogues.divergence_grad

    def spy(*args, out=None, **kwargs):
        g = original(*args, out=out, **kwargs)
        written.append(out is not None and g.data_ptr() == out.data_ptr())
        return g

    monkeypatch.setattr(triton_epilogues, "divergence_grad", spy)
    assert check(case) == []
    assert written and all(written), written


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_fused_epilogue_with_masked_columns_equals_the_torch_epilogue(divergence, fused_launches):
    """-inf logits (a masking bias on both heads, a column only one head masks) add
    nothing and give no NaN: the kernels agree with the torch epilogue."""
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(13, 16, generator=g), torch.randn(389, 16, generator=g) * 0.5
    xt, wt = torch.randn(13, 24, generator=g), torch.randn(389, 24, generator=g) * 0.5
    b, bt = torch.zeros(389), torch.zeros(389)
    b[::7] = bt[::7] = float("-inf")
    # One head alone masks: the one whose zeros keep the divergence finite (the forward
    # KL(t || s) the teacher, the reverse KL(s || t) the student; the JSD either).
    (b if divergence == "reverse_kl" else bt)[3::11] = float("-inf")
    out = {}
    for backend in ("torch", "triton"):
        dev = device_for(backend)
        leaves = [t.to(dev).requires_grad_(True) for t in (x, w)]
        loss = vp.vocab_parallel_distillation_loss(
            leaves[0], leaves[1], bias=b.to(dev), teacher_hidden=xt.to(dev),
            teacher_weight=wt.to(dev), teacher_bias=bt.to(dev), divergence=divergence,
            temperature=1.3, mode="grad_in_forward", backend=backend,
        )  # fmt: skip
        loss.backward()
        out[backend] = [t.detach().cpu() for t in (loss, leaves[0].grad, leaves[1].grad)]
    assert fused_launches["divergence_grad"] == 1
    for a, r in zip(out["triton"], out["torch"], strict=True):
        assert bool(a.isfinite().all())
        assert (a - r).abs().max() <= 2e-5 * r.abs().max()


def _problem_args(case: DCase) -> dict:
    x, w, xt, wt, y, b, bt, temp, *_ = _problem(case)
    return dict(
        hidden=x, weight=w, teacher_hidden=xt, teacher_weight=wt, target=y, bias=b,
        teacher_bias=bt, temperature=temp, divergence=case.divergence, softcap=case.softcap,
        hard_label_weight=case.hard_label_weight, backend=case.backend,
    )  # fmt: skip


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("case", [FUSED[1], FUSED[4], FUSED[5]], ids=str)
def test_triton_bitwise_deterministic(case):
    args = moved(_problem_args(case), device_for(case.backend))
    x = args.pop("hidden")
    results = []
    for _ in range(2):
        h = x.clone().requires_grad_(True)
        w = args["weight"].clone().requires_grad_(True)
        loss = vp.vocab_parallel_distillation_loss(h, **(args | dict(weight=w)), mode=case.mode)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    for first, second in zip(*results, strict=True):
        assert torch.equal(first, second)


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd", "topk"])
def test_gradcheck_float64(divergence):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    xt, wt = torch.randn(4, 5, generator=g).double(), torch.randn(7, 5, generator=g).double()
    y = torch.tensor([1, -100, 3, 6])
    teacher = dict(teacher_hidden=xt, teacher_weight=wt)
    if divergence == "topk":
        top = torch.log_softmax(xt @ wt.T, dim=-1).topk(3, dim=-1)
        teacher = dict(teacher_topk_ids=top.indices, teacher_topk_logprobs=top.values)
    div = "forward_kl" if divergence == "topk" else divergence
    for mode in ("memory_saving", "grad_in_forward"):  # (high-performance: the same G)

        def f(x, w, b, mode=mode):
            return vp.vocab_parallel_distillation_loss(
                x, w, **teacher, target=y, bias=b, divergence=div, beta=0.4,
                temperature=0.8, softcap=5.0, hard_label_weight=0.25, mode=mode,
            )  # fmt: skip

        assert torch.autograd.gradcheck(f, (x, w, b))


def test_no_gradient_reaches_the_teacher():
    case = DCase(teacher_bias=True)
    x, w, xt, wt, y, _, bt, *_ = _problem(case)
    xt, wt, bt = (t.clone().requires_grad_(True) for t in (xt, wt, bt))
    hidden = x.clone().requires_grad_(True)
    vp.vocab_parallel_distillation_loss(
        hidden, w, teacher_hidden=xt, teacher_weight=wt, teacher_bias=bt, target=y
    ).backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
    assert xt.grad is None and wt.grad is None and bt.grad is None


def test_identical_heads_give_zero_and_modes_agree():
    """A teacher equal to the student: every divergence is 0 and so is its gradient; and
    the three modes give the same loss and gradients for a real teacher."""
    x, w, xt, wt, y, *_ = _problem(DCase(hidden=12, teacher_hidden=12))
    for div in ("forward_kl", "reverse_kl", "jsd"):
        h = x.clone().requires_grad_(True)
        loss = vp.vocab_parallel_distillation_loss(
            h, w, teacher_hidden=x, teacher_weight=w, divergence=div, target=y
        )
        loss.backward()
        assert abs(float(loss.detach())) < 1e-6 and float(h.grad.abs().max()) < 1e-6
    results = []
    for mode in ("memory_saving", "high_performance", "grad_in_forward"):
        h = x.clone().requires_grad_(True)
        loss = vp.vocab_parallel_distillation_loss(
            h, w, teacher_hidden=xt, teacher_weight=wt, target=y, divergence="jsd", mode=mode
        )
        loss.backward()
        results.append((loss.detach(), h.grad))
    for loss, grad in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, results[0][1], rtol=1e-5, atol=1e-7)


def test_checker_is_not_trivially_true():
    """The checker fails on a wrong answer: another divergence than the reference's."""
    case = DCase(tokens=9, vocab=31)
    x, w, xt, wt, y, *_ = _problem(case)
    ours = vp.vocab_parallel_distillation_loss(
        x, w, teacher_hidden=xt, teacher_weight=wt, target=y, divergence="reverse_kl"
    )
    ref = distillation_reference(x.double(), w.double(), teacher_hidden=xt.double(),
                                 teacher_weight=wt.double(), target=y)  # fmt: skip
    assert _rel(ours, ref) > 100 * LOSS_TOL
    assert check(replace(case, temperature="one")) == []


@pytest.mark.parametrize(
    ("changes", "param", "error"),
    [
        (dict(divergence="kl"), "divergence", ValueError),
        (dict(beta=1.0), "beta", ValueError),
        (dict(hard_label_weight=1.5), "hard_label_weight", ValueError),
        (dict(hard_label_weight=0.1, target=None), "target", ValueError),
        (dict(teacher_hidden=None), "teacher_hidden", TypeError),
        (dict(teacher_weight="w"), "teacher_weight", TypeError),
        (
            dict(teacher_topk_ids=torch.zeros(29, 2, dtype=torch.int64)),
            "teacher_hidden",
            ValueError,
        ),  # fmt: skip
        (dict(teacher_weight=torch.zeros(130, 20)), "teacher_weight", ValueError),
        (dict(teacher_hidden=torch.zeros(28, 20)), "teacher_hidden", ValueError),
        (dict(teacher_bias=torch.zeros(3)), "teacher_bias", ValueError),
    ],
)
def test_errors_name_the_parameter(changes, param, error):
    x, w, xt, wt, y, *_ = _problem(DCase())
    kwargs = dict(teacher_hidden=xt, teacher_weight=wt, target=y) | changes
    with pytest.raises(error) as err:
        vp.vocab_parallel_distillation_loss(x, w, **kwargs)
    assert str(err.value).startswith(param + ":"), str(err.value)


def test_topk_errors_name_the_parameter():
    x, w, *_ = _problem(DCase())
    ids = torch.arange(58).reshape(29, 2)
    lps = torch.full((29, 2), -1.0)
    cases = [
        (dict(teacher_topk_ids=ids.float()), "teacher_topk_ids", TypeError),
        (dict(teacher_topk_ids=ids + 200), "teacher_topk_ids", ValueError),
        (dict(teacher_topk_ids=ids * 0), "teacher_topk_ids", ValueError),  # not distinct
        (dict(teacher_topk_logprobs=lps + 1.0), "teacher_topk_logprobs", ValueError),
        (dict(teacher_topk_logprobs=lps[:, :1]), "teacher_topk_logprobs", ValueError),
        (dict(divergence="jsd"), "divergence", ValueError),
    ]
    for changes, param, error in cases:
        kwargs = dict(teacher_topk_ids=ids, teacher_topk_logprobs=lps) | changes
        with pytest.raises(error) as err:
            vp.vocab_parallel_distillation_loss(x, w, **kwargs)
        assert str(err.value).startswith(param + ":"), str(err.value)


# ------------------------------------------------ a top-k teacher's tail (issue 37, item 3)
# The student's mass off the teacher's ids, 1 - P, comes from a log-sum-exp over those
# columns: where the student is sure of the ids, 1 - P in fp32 is 0 (and the tail bin's
# log(1 - P) -inf) although it is e^-40 or so. A tail r <= 0 (the k log-probs summing to 1
# up to rounding) or no column off the ids (k = V) gives no tail bin.


def _tail_problem(name: str):
    """``(hidden [N, H], weight [V, H], ids [N, k], logprobs [N, k])``, fp32."""
    if name == "issue":  # logits [20, 0, -20, -20], a tail of 1e-4: float64 gives 7.32799
        x, w = torch.tensor([[20.0, 0.0, -20.0, -20.0]]), torch.eye(4)
        ids = torch.tensor([[0, 1]])
        return x, w, ids, torch.tensor([[0.6, 0.3999]], dtype=torch.float64).log().float()
    g = torch.Generator().manual_seed(7)
    v, h, n = (12, 8, 12) if name == "k_equals_v" else (37, 8, 16)
    x, w = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 3
    xt, wt = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 3
    if name == "k_equals_v":  # the README's recipe with k = V: rounding tails of ~6e-8
        top = torch.log_softmax(xt @ wt.T, -1).topk(v, dim=-1)
        return x, w, top.indices, top.values
    # A sure student (1 - P below fp32's rounding of 1) and a teacher on the student's
    # top-4 ids whose log-probs sum to 1 - 1e-4, 1 - 1e-7, 1 or 1 + 1e-7.
    w = w * 4
    ids = (x @ w.T).topk(4, dim=-1).indices
    lps = torch.log_softmax(torch.randn(n, 4, generator=g, dtype=torch.float64), -1)
    mass = torch.tensor([1 - 1e-4, 1 - 1e-7, 1.0, 1 + 1e-7], dtype=torch.float64)
    return x, w, ids, (lps + mass.repeat(n // 4).log()[:, None]).float()


def _tail_errors(group, backend: str, name: str) -> list[str]:
    """The top-k teacher of ``name`` on this rank's shard, in every mode, against the
    float64 reference on materialised logits: each token's loss within 1e-4 of it
    (relative), the gradients within 1e-4 of the largest; with k = V, the dense forward
    KL of the teacher's own log-probs."""
    world = 1 if group is None else torch.distributed.get_world_size(group)
    rank = 0 if group is None else torch.distributed.get_rank(group)
    dev = device_for(backend) if group is None else CPU  # gloo ranks: the CPU
    x, w, ids, lps = _tail_problem(name)
    lo, hi = shard_bounds(w.shape[0], world)[rank]
    up = torch.linspace(0.5, 1.5, x.shape[0], dtype=torch.float64)
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    teacher = dict(teacher_topk_ids=ids, teacher_topk_logprobs=lps)
    ref = distillation_reference(x64, w64, **teacher, reduction="none")
    errors = []
    if name == "k_equals_v":  # the dense forward KL of the same log-probs
        lt = torch.zeros(ids.shape, dtype=torch.float64).scatter_(1, ids, lps.double())
        ls = torch.log_softmax(x64 @ w64.T, -1)
        dense = torch.nn.functional.kl_div(ls, lt, reduction="none", log_target=True).sum(-1)
        if _rel(ref, dense) > 1e-12:
            errors.append(f"the reference with k = V: rel error {_rel(ref, dense):.2e}")
    for mode in ("memory_saving", "high_performance", "grad_in_forward"):
        scalar = mode == "grad_in_forward"  # (a scalar loss: the sum)
        hidden = x.to(dev, copy=True).requires_grad_(True)
        weight = w[lo:hi].to(dev, copy=True).requires_grad_(True)
        loss = vp.vocab_parallel_distillation_loss(
            hidden, weight, **moved(teacher, dev), process_group=group, backend=backend,
            mode=mode, reduction="sum" if scalar else "none",
        )  # fmt: skip
        (loss if scalar else loss * up.float().to(dev)).sum().backward()
        loss = loss.detach().cpu()
        want = ref.sum() if scalar else ref
        grads64 = torch.autograd.grad((want if scalar else want * up).sum(), (x64, w64),
                                      retain_graph=True)  # fmt: skip
        tag = f"{name} {backend} {mode}"
        err = (loss.detach().double() - want.detach()).abs() / want.detach().abs()
        if not bool(torch.isfinite(loss).all()) or float(err.max()) > 1e-4:
            errors.append(f"{tag}: loss {loss.tolist()}, float64 {want.tolist()}")
        got = (("hidden", hidden.grad.cpu(), grads64[0]),
               ("weight", weight.grad.cpu(), grads64[1][lo:hi]))  # fmt: skip
        for what, grad, grad64 in got:
            if not bool(torch.isfinite(grad).all()) or _rel(grad, grad64) > 1e-4:
                errors.append(f"{tag}: grad_{what} rel error {_rel(grad, grad64):.2e}")
    return errors


TAIL_BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed"))]  # fmt: skip


@pytest.mark.parametrize("backend", TAIL_BACKENDS)
@pytest.mark.parametrize("name", ["issue", "k_equals_v", "sure_student"])
def test_topk_small_tail_is_finite_and_exact(name, backend):
    assert _tail_errors(None, backend, name) == []


def test_topk_with_k_equal_to_v_is_the_dense_forward_kl():
    """The README's recipe with k = V gives the dense teacher's loss, token by token."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g) * 3
    xt, wt = torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g) * 3
    top = torch.log_softmax(xt @ wt.T, -1).topk(12, dim=-1)
    sparse = vp.vocab_parallel_distillation_loss(
        x, w, teacher_topk_ids=top.indices, teacher_topk_logprobs=top.values, reduction="none"
    )
    dense = vp.vocab_parallel_distillation_loss(
        x, w, teacher_hidden=xt, teacher_weight=wt, reduction="none"
    )
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-6)


def _tails_on_ranks(group):
    backends = ["torch"] + (["triton"] if HAS_TRITON else [])
    names = ("issue", "k_equals_v", "sure_student")
    return [e for b in backends for n in names for e in _tail_errors(group, b, n)]


@pytest.mark.slow
def test_topk_small_tail_on_two_ranks():
    """The mass off the ids is global (its log-sum-exp over every rank's columns): the
    issue's V = 4 on 2 ranks puts the ids on rank 0 and the tail's columns on rank 1."""
    errors = [e for rank in run_ranks(_tails_on_ranks, 2) for e in rank]
    assert errors == [], "\n".join(errors[:10])


def _head_against_function(group=None) -> list[str]:
    """``head.distillation_loss`` of two heads (hidden sizes 12 and 20) against the
    function on the same shards; the teacher's parameters get no gradient."""
    x, w, xt, wt, y, b, *_ = _problem(DCase(bias=True, seed=50))
    student = vp.VocabParallelLMHead.from_full_weight(w, group, bias=True, softcap=4.0)
    teacher = vp.VocabParallelLMHead.from_full_weight(wt, group)
    with torch.no_grad():
        student.bias.copy_(b[student.vocab_start_index : student.vocab_end_index])
    h = x.clone().requires_grad_(True)
    loss = student.distillation_loss(h, teacher, xt, y, divergence="jsd", beta=0.3,
                                     temperature=0.8, hard_label_weight=0.2)  # fmt: skip
    loss.backward()
    h2 = x.clone().requires_grad_(True)
    w2 = student.weight.detach().clone().requires_grad_(True)
    ref = vp.vocab_parallel_distillation_loss(
        h2, w2, teacher_hidden=xt, teacher_weight=teacher.weight.detach(), target=y,
        divergence="jsd", beta=0.3, temperature=0.8, hard_label_weight=0.2, softcap=4.0,
        bias=student.bias.detach(), process_group=group,
    )  # fmt: skip
    ref.backward()
    errors = []
    if not torch.equal(loss.detach(), ref.detach()) or not torch.equal(h.grad, h2.grad):
        errors.append(f"head: loss {float(loss.detach())} != {float(ref.detach())}")
    if not torch.equal(student.weight.grad, w2.grad) or student.bias.grad is None:
        errors.append("head: weight / bias gradients")
    if teacher.weight.grad is not None:
        errors.append("head: the teacher got a gradient")
    return errors


def test_head_distillation_loss_matches_the_function():
    assert _head_against_function() == []
    student = vp.VocabParallelLMHead(12, 131)
    with pytest.raises(ValueError, match="^teacher_head:"):
        student.distillation_loss(torch.randn(3, 12), vp.VocabParallelLMHead(20, 130),
                                  torch.randn(3, 20))  # fmt: skip
    with pytest.raises(TypeError, match="^teacher_head:"):
        student.distillation_loss(torch.randn(3, 12), torch.nn.Linear(20, 131), torch.randn(3, 20))


# ---------------------------------------------------------------- multi-rank (gloo)


def _check_all(group, cases):
    return [err for case in cases for err in check(case, group)]


def _multirank_cases(world: int) -> list[DCase]:
    cases = [
        DCase(seed=30, hard_label_weight=0.1),
        DCase(divergence="reverse_kl", temperature="tensor", softcap=4.0, bias=True, seed=31),
        DCase(divergence="jsd", dtype=BF16, mode="high_performance", teacher_bias=True, seed=32),
        DCase(sp="uneven", divergence="jsd", temperature="tensor", bias=True, seed=33),
        DCase(sp="empty", dtype=BF16, reduction="none", hard_label_weight=0.3, seed=34),
        DCase(dtensor=True, bias=True, temperature="tensor", seed=35),
        DCase(top_k=7, sp="uneven", hard_label_weight=0.1, seed=36),
        DCase(top_k=64, dtensor=True, tail=False, seed=37),
        DCase(vocab=5, top_k=3, seed=38),  # shards of 1-3 columns
    ]
    if HAS_TRITON:
        cases.append(DCase(backend="triton", tokens=16, vocab=67, softcap=3.0, bias=True,
                           hard_label_weight=0.1, seed=39))  # fmt: skip
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_matches_the_unsharded_reference(world):
    per_rank = run_ranks(_check_all, world, _multirank_cases(world))
    errors = [e for rank in per_rank for e in rank]
    assert errors == [], "\n".join(errors[:10])


def _fused_on_two_ranks(group):
    errors = []
    # Shards of 195/194 and 34/33 columns; the JSD's second pass.
    cases = [FUSED[0], FUSED[5], replace(FUSED[1], vocab=67), replace(FUSED[12], vocab=67)]
    cases += [EPILOGUE[-3], EPILOGUE[-2]]  # the fused epilogue over column chunks
    for case in cases:
        errors += check(case, group)
    return errors


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_two_ranks_triton():
    """The Triton backend's chunks through the collectives (the statistics, the JSD's
    second pass, G): 2 gloo ranks with uneven shards, each rank's loss and gradients against the
    unsharded reference."""
    errors = [e for rank in run_ranks(_fused_on_two_ranks, 2) for e in rank]
    assert errors == [], "\n".join(errors[:10])


def _four_ranks(group):
    errors = _check_all(group, [DCase(divergence="jsd", sp="uneven", seed=40),
                                DCase(top_k=9, seed=41, dtype=BF16)])  # fmt: skip
    errors += _head_against_function(group)
    x, w, xt, wt, y, *_ = _problem(DCase())
    rank = torch.distributed.get_rank(group)
    lo, hi = shard_bounds(131, 4)[rank]
    try:  # one rank passes another divergence: every rank raises the same error
        vp.vocab_parallel_distillation_loss(
            x, w[lo:hi], teacher_hidden=xt, teacher_weight=wt[lo:hi], process_group=group,
            beta=0.5 if rank else 0.25, divergence="jsd",
        )  # fmt: skip
    except ValueError as err:
        return errors, str(err)
    return errors, None


@pytest.mark.slow
def test_four_ranks_and_disagreement():
    per_rank = run_ranks(_four_ranks, 4)
    errors = [e for errs, _ in per_rank for e in errs]
    assert errors == [], "\n".join(errors[:10])
    messages = [m for _, m in per_rank]
    assert all(m is not None and m.startswith("beta:") for m in messages), messages
    assert len(set(messages)) == 1


# ---------------------------------------------------------------- memory

MIB = 1 << 20
CHILD = textwrap.dedent(
    """
    import ctypes, json, sys
    # A fixed mmap threshold (M_MMAP_THRESHOLD = -3): chunk-sized temporaries are mapped
    # and unmapped, not left in a heap whose high-water mark varies from run to run.
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)
    import torch
    import torch.nn.functional as F
    import vocab_parallel as vp
    from benchmarks.memory import PeakMemory

    impl, bt, h, v = sys.argv[1], *map(int, sys.argv[2:5])
    torch.manual_seed(0)
    x = torch.randn(bt, h).requires_grad_(True)
    w = (torch.randn(v, h) * 0.05).requires_grad_(True)
    xt, wt = torch.randn(bt, 2 * h), torch.randn(v, 2 * h) * 0.05
    y = torch.randint(0, v, (bt,))

    def run(x, w, xt, wt, y):
        if impl == "naive":
            ls = torch.log_softmax(x @ w.T, dim=-1)
            lt = torch.log_softmax(xt @ wt.T, dim=-1)
            kd = F.kl_div(ls, lt, reduction="batchmean", log_target=True)
            loss = 0.9 * kd + 0.1 * F.cross_entropy(x @ w.T, y)
        else:
            loss = vp.vocab_parallel_distillation_loss(
                x, w, teacher_hidden=xt, teacher_weight=wt, target=y, hard_label_weight=0.1,
                mode=impl, backend="torch")
        loss.backward()

    small = slice(0, 8)
    run(x[small].detach().requires_grad_(True), w[:64].detach().requires_grad_(True),
        xt[small], wt[:64], y[small] % 64)
    with PeakMemory("cpu") as peak:
        run(x, w, xt, wt, y)
    grad_w = w.grad.numel() * w.grad.element_size()
    print(json.dumps({"extra": peak.extra_bytes - grad_w, "exact": peak.exact}))
    """
)


@pytest.mark.slow
def test_peak_memory_flat_in_vocab():
    bt, h, v = 1024, 64, 16384
    ours = {n: peak_extra_in_child(CHILD, "memory_saving", bt, h, n) for n in (v, 4 * v)}
    naive = {n: peak_extra_in_child(CHILD, "naive", bt, h, n) for n in (v, 4 * v)}
    print(f"MiB: ours {ours[v] / MIB:.0f} -> {ours[4 * v] / MIB:.0f}, naive "
          f"{naive[v] / MIB:.0f} -> {naive[4 * v] / MIB:.0f}")  # fmt: skip
    assert naive[4 * v] > 3 * naive[v]  # the measurement can see logits
    assert ours[4 * v] <= 1.2 * ours[v] + 16 * MIB
    assert ours[4 * v] < naive[4 * v] / 3
