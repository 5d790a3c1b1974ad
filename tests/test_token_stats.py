"""Token statistics (RL): every field and the gradients of ``a * logprobs + b * entropy``
against float64 references on materialised logits (``vocab_parallel.reference``), alone
and on 2-4 gloo ranks with uneven shards, sequence parallelism and DTensor weights; ties,
k larger than a shard, gradcheck, determinism, errors on every rank, memory flat in V."""

from __future__ import annotations

import itertools
import textwrap
from dataclasses import dataclass, replace

import pytest
import torch
from helpers import CPU, HAS_TRITON, device_for, moved, peak_extra_in_child
from multirank import run_ranks

import vocab_parallel as vp
from vocab_parallel.parallel.layout import shard_bounds
from vocab_parallel.reference import scaled_logits_reference, token_stats_reference
from vocab_parallel.testing import token_split

FIELDS = ("logprobs", "entropy", "sum_p_squared", "topk_logprobs")
# Largest |error| relative to the largest |reference value| (values: fp32 accumulation
# only, either dtype, the reference seeing the same rounded inputs; gradients: G is
# rounded to the input dtype once).
VALUE_TOL = 2e-5
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


@dataclass(frozen=True)
class TSCase:
    tokens: int = 37
    hidden: int = 16
    vocab: int = 131  # uneven over 2 and 3 ranks
    dtype: torch.dtype = torch.float32
    backend: str = "torch"
    mode: str = "auto"
    temperature: str = "float"  # "one", "float" (0.7) or "tensor" (per token)
    softcap: float | None = None
    bias: bool = False
    ignored: bool = True
    top_k: int = 5
    sp: str | None = None  # sequence parallelism: the token split ("uneven", "empty")
    dtensor: bool = False
    seed: int = 0


def _problem(case: TSCase):
    g = torch.Generator().manual_seed(case.seed)
    x = torch.randn(case.tokens, case.hidden, generator=g).to(case.dtype)
    w = (torch.randn(case.vocab, case.hidden, generator=g) * 0.7).to(case.dtype)
    y = torch.randint(0, case.vocab, (case.tokens,), generator=g)
    if case.ignored:
        y[::4] = -100
    b = (torch.randn(case.vocab, generator=g) * 0.3).to(case.dtype) if case.bias else None
    temp = {"one": 1.0, "float": 0.7}.get(case.temperature)
    if case.temperature == "tensor":
        temp = torch.rand(case.tokens, generator=g) + 0.5
    a = torch.randn(case.tokens, generator=g)
    b_up = torch.randn(case.tokens, generator=g)
    return x, w, y, b, temp, a, b_up


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if b.numel() == 0:  # a rank without tokens (sequence parallelism)
        return 0.0
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def check(case: TSCase, group=None) -> list[str]:
    """Our token statistics against the reference on this rank (its shard of the
    vocabulary; its tokens under sequence parallelism): every field, top-k ids as values
    (a near-tie may order differently in fp32 and float64) and the three gradients.
    Returns the mismatches (empty when all agree). One process runs on the backend's
    device, gloo ranks on the CPU; the reference is on the CPU."""
    world = 1 if group is None else torch.distributed.get_world_size(group)
    rank = 0 if group is None else torch.distributed.get_rank(group)
    dev = device_for(case.backend) if group is None else CPU
    x, w, y, b, temp, a, b_up = _problem(case)
    lo, hi = shard_bounds(case.vocab, world)[rank]  # uneven: 66 + 65, 44 + 44 + 43
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
    else:
        weight = w[lo:hi].to(dev, copy=True).requires_grad_(True)
        bias = None if b is None else b[lo:hi].to(dev, copy=True).requires_grad_(True)
        kwargs = dict(process_group=group)
        if world > 1 and case.seed % 2:  # the stated layout (no layout collective)
            kwargs |= dict(vocab_start_index=lo, global_vocab_size=case.vocab)
    temp_here = moved(temp[tokens] if isinstance(temp, torch.Tensor) else temp, dev)
    out = vp.vocab_parallel_token_stats(
        hidden, weight, y[tokens].to(dev), temperature=temp_here, softcap=case.softcap, bias=bias,
        entropy=True, sum_p_squared=True, top_k=case.top_k, argmax=True,
        sequence_parallel=case.sp is not None, mode=case.mode, backend=case.backend,
        **kwargs,
    )  # fmt: skip
    (a[tokens].to(dev) * out.logprobs + b_up[tokens].to(dev) * out.entropy).sum().backward()
    out = vp.TokenStats(*(None if t is None else t.detach().cpu() for t in out))

    x64 = x.double().requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    b64 = None if b is None else b.double().requires_grad_(True)
    ref = token_stats_reference(
        x64, w64, y, temperature=temp, softcap=case.softcap, bias=b64, top_k=case.top_k
    )
    (a.double() * ref["logprobs"] + b_up.double() * ref["entropy"]).sum().backward()

    errors = []
    for name in FIELDS:
        got, want = getattr(out, name), ref[name][tokens]
        if got.dtype != torch.float32 or _rel(got, want) > VALUE_TOL:
            errors.append(f"{name}: {got.dtype}, rel error {_rel(got, want):.2e}")
    # The ids: each names a column with the value reported (and -1 where ignored).
    ids = out.topk_ids
    ignored = (y[tokens] == -100)[:, None].expand_as(ids)
    if not torch.equal(ids[ignored], torch.full_like(ids[ignored], -1)):
        errors.append("topk_ids: not -1 at ignored tokens")
    z_lp = torch.log_softmax(scaled_logits_reference(x, w, b, case.softcap, temp), dim=-1)[tokens]
    at_ids = z_lp.gather(1, ids.clamp(min=0)).masked_fill(ignored, 0.0)
    if _rel(out.topk_logprobs, at_ids) > VALUE_TOL:
        errors.append("topk_ids: the ids do not name the values reported")
    best = z_lp.gather(1, out.argmax.clamp(min=0)[:, None]).squeeze(1)
    keep = ~ignored[:, 0]
    if _rel(best[keep], z_lp.max(dim=1).values[keep]) > VALUE_TOL:
        errors.append("argmax: not a largest logit")
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


SINGLE = [
    TSCase(),
    TSCase(temperature="tensor", softcap=4.0, bias=True, seed=1),
    TSCase(temperature="one", ignored=False, mode="high_performance", seed=2),
    TSCase(dtype=torch.bfloat16, bias=True, temperature="tensor", seed=3),
    TSCase(dtype=torch.bfloat16, softcap=3.0, mode="high_performance", seed=4),
    TSCase(tokens=129, hidden=8, vocab=389, top_k=64, seed=5),
]
TRITON = [
    TSCase(backend="triton", temperature="tensor", softcap=4.0, bias=True, seed=6),
    TSCase(backend="triton", dtype=torch.bfloat16, mode="high_performance", seed=7),
    TSCase(backend="triton", dtype=torch.bfloat16, bias=True, temperature="one", seed=8),
]


@pytest.mark.parametrize("case", SINGLE, ids=str)
def test_single_process_torch(case):
    assert check(case) == []


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("case", TRITON, ids=str)
def test_single_process_triton(case):
    assert check(case) == []


def test_fields_not_asked_for_are_none_and_logprobs_alone_match():
    x, w, y, *_ = _problem(TSCase())
    out = vp.vocab_parallel_token_stats(x, w, y)
    assert isinstance(out, vp.TokenStats)
    assert out.entropy is None and out.sum_p_squared is None and out.argmax is None
    assert out.topk_logprobs is None and out.topk_ids is None
    ref = token_stats_reference(x, w, y)
    assert _rel(out.logprobs, ref["logprobs"]) < VALUE_TOL
    # The log-probs are minus the loss's per-token cross entropy (same statistics).
    ce = vp.vocab_parallel_linear_cross_entropy(x, w, y, reduction="none")
    torch.testing.assert_close(out.logprobs, -ce, rtol=0, atol=1e-6)


def test_shapes_follow_target_and_ignored_tokens_are_zero():
    x, w, y, *_ = _problem(TSCase(tokens=24))
    out = vp.vocab_parallel_token_stats(
        x.reshape(4, 6, -1), w, y.reshape(4, 6), entropy=True, sum_p_squared=True, top_k=3,
        argmax=True,
    )  # fmt: skip
    assert out.logprobs.shape == out.entropy.shape == out.argmax.shape == (4, 6)
    assert out.topk_ids.shape == out.topk_logprobs.shape == (4, 6, 3)
    ignored = y.reshape(4, 6) == -100
    assert ignored.any()
    for t in (out.logprobs, out.entropy, out.sum_p_squared, out.topk_logprobs):
        assert (t[ignored] == 0).all()
    assert (out.argmax[ignored] == -1).all() and (out.topk_ids[ignored] == -1).all()


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed"))])  # fmt: skip
def test_ties_go_to_the_lower_id(backend):
    """Exact ties (zero weight, the bias alone makes the logits): the lower id first."""
    bias = torch.tensor([0.0, 2.0, 1.0, 2.0, 2.0, 1.0, -1.0, 1.0])
    x = torch.randn(3, 4)
    w = torch.zeros(8, 4)
    y = torch.tensor([1, 2, 3])
    x, w, y, bias = moved((x, w, y, bias), device_for(backend))
    out = vp.vocab_parallel_token_stats(x, w, y, bias=bias, top_k=6, argmax=True, backend=backend)
    out = vp.TokenStats(*(None if t is None else t.cpu() for t in out))
    want = torch.tensor([1, 3, 4, 2, 5, 7]).expand(3, 6)
    assert torch.equal(out.topk_ids, want)
    assert torch.equal(out.argmax, torch.tensor([1, 1, 1]))


def test_gradcheck_float64():
    """float64 (torch backend): log-probs and entropy, temperature per token, softcap,
    bias, an ignored token, both modes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(11, 4, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.tensor([3, -100, 0, 10, 7])
    temp = torch.rand(5, dtype=torch.float64, generator=g) + 0.5
    for mode in ("memory_saving", "high_performance"):

        def f(x, w, b, mode=mode):
            out = vp.vocab_parallel_token_stats(
                x, w, y, temperature=temp, softcap=3.0, bias=b, entropy=True, mode=mode
            )
            return out.logprobs, out.entropy

        assert torch.autograd.gradcheck(f, (x, w, b))


def test_bitwise_deterministic():
    case = TSCase(temperature="tensor", bias=True)
    x, w, y, b, temp, a, b_up = _problem(case)
    runs = []
    for _ in range(2):
        xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = vp.vocab_parallel_token_stats(
            xs, ws, y, temperature=temp, bias=b, entropy=True, sum_p_squared=True, top_k=4
        )
        (a * out.logprobs + b_up * out.entropy).sum().backward()
        runs.append([out.logprobs, out.entropy, out.sum_p_squared, out.topk_logprobs,
                     xs.grad, ws.grad])  # fmt: skip
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


@pytest.mark.parametrize(
    ("kwargs", "param", "error"),
    [
        (dict(top_k=-1), "top_k", ValueError),
        (dict(top_k=2.0), "top_k", TypeError),
        (dict(top_k=132), "top_k", ValueError),
        (dict(entropy="yes"), "entropy", TypeError),
        (dict(argmax=1), "argmax", TypeError),
        (dict(mode="grad_in_forward"), "mode", ValueError),
        (dict(temperature=0.0), "temperature", ValueError),
        (dict(softcap=-1.0), "softcap", ValueError),
    ],
)
def test_errors_name_the_parameter(kwargs, param, error):
    x, w, y, *_ = _problem(TSCase())
    with pytest.raises(error) as info:
        vp.vocab_parallel_token_stats(x, w, y, **kwargs)
    assert str(info.value).startswith(f"{param}:"), str(info.value)


def test_head_token_stats_matches_the_function():
    torch.manual_seed(0)
    head = vp.VocabParallelLMHead(16, 129, bias=True)
    x = torch.randn(7, 16)
    y = torch.randint(0, 129, (7,))
    out = head.token_stats(x, y, entropy=True, top_k=2, temperature=0.8)
    want = vp.vocab_parallel_token_stats(
        x, head.weight, y, bias=head.bias, entropy=True, top_k=2, temperature=0.8
    )
    for got, ref in zip(out, want, strict=True):
        assert (got is None and ref is None) or torch.equal(got, ref)
    out.logprobs.sum().backward()
    assert head.weight.grad is not None and head.bias.grad is not None


# ---------------------------------------------------------------- multi-rank (gloo)


def _zero_token_errors(group, backend: str, sequence_parallel: bool = False) -> list[str]:
    """Token statistics of no tokens (``[0, H]``, ``[2, 0, H]``) with top-k and argmax
    asked for: every field empty, of the shape and dtype that a call on 3 tokens gives
    (less the token dims), and a backward that gives zero-size or zero gradients."""
    world = 1 if group is None else torch.distributed.get_world_size(group)
    rank = 0 if group is None else torch.distributed.get_rank(group)
    dev = device_for(backend) if group is None else CPU  # gloo ranks: the CPU
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(11, 8, generator=g), torch.randn(11, generator=g)
    lo, hi = shard_bounds(11, world)[rank]
    errors = []
    asks = (dict(top_k=3), dict(argmax=True),
            dict(top_k=2, argmax=True, entropy=True, sum_p_squared=True))  # fmt: skip
    for tokens in ((0,), (2, 0)):
        for ask, mode in itertools.product(asks, ("memory_saving", "high_performance")):

            def run(tok, ask=ask, mode=mode):
                h = torch.randn(*tok, 8, generator=g).to(dev).requires_grad_(True)
                weight, bias = (t[lo:hi].to(dev, copy=True).requires_grad_(True) for t in (w, b))
                target = torch.zeros(tok, dtype=torch.int64, device=dev)
                out = vp.vocab_parallel_token_stats(
                    h, weight, target, bias=bias, mode=mode,
                    process_group=group, sequence_parallel=sequence_parallel,
                    backend=backend, **ask,
                )  # fmt: skip
                ent = 0.0 if out.entropy is None else out.entropy.sum()
                (out.logprobs.sum() + ent).backward()
                return out, (h, weight, bias)

            tag = f"{tokens} {ask} {mode} {backend}"
            try:
                out, leaves = run(tokens)
            except RuntimeError as err:
                errors.append(f"{tag}: {err}")
                continue
            full, _ = run((3,))
            for name, got, want in zip(out._fields, out, full, strict=True):
                if (got is None) != (want is None):
                    errors.append(f"{tag}: {name} {got} but {want} on 3 tokens")
                elif got is not None and (
                    got.dtype != want.dtype or got.shape != (*tokens, *want.shape[1:])
                ):
                    errors.append(f"{tag}: {name} {got.dtype} {tuple(got.shape)}")
            for leaf in leaves:
                if leaf.grad is None or leaf.grad.shape != leaf.shape or leaf.grad.any():
                    errors.append(f"{tag}: a gradient {leaf.grad} of {tuple(leaf.shape)}")
    return errors


ZERO_BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed"))]  # fmt: skip


@pytest.mark.parametrize("backend", ZERO_BACKENDS)
def test_zero_tokens_with_top_k_and_argmax(backend):
    assert _zero_token_errors(None, backend) == []


def _zero_tokens_on_ranks(group):
    backends = ["torch"] + (["triton"] if HAS_TRITON else [])
    errors = [e for b in backends for e in _zero_token_errors(group, b)]
    return errors + _zero_token_errors(group, "torch", sequence_parallel=True)


@pytest.mark.slow
def test_zero_tokens_with_top_k_and_argmax_on_two_ranks():
    """Every rank without tokens: the candidates' all-gather is of ``[0, 2k]``."""
    errors = [e for rank in run_ranks(_zero_tokens_on_ranks, 2) for e in rank]
    assert errors == [], "\n".join(errors[:10])


def _check_all(group, cases):
    return [err for case in cases for err in check(case, group)]


def _multirank_cases(world: int) -> list[TSCase]:
    cases = [
        TSCase(seed=10),
        TSCase(temperature="tensor", softcap=4.0, bias=True, seed=11),
        TSCase(dtype=torch.bfloat16, mode="high_performance", seed=12),
        TSCase(sp="uneven", temperature="tensor", bias=True, seed=13),
        TSCase(sp="empty", dtype=torch.bfloat16, seed=14),
        TSCase(dtensor=True, bias=True, temperature="tensor", seed=15),
        TSCase(vocab=7, top_k=7, seed=17),  # k larger than every shard
    ]
    if HAS_TRITON:
        cases.append(TSCase(backend="triton", tokens=20, vocab=67, softcap=3.0, bias=True,
                            temperature="tensor", seed=16))  # fmt: skip
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_matches_the_unsharded_reference(world):
    per_rank = run_ranks(_check_all, world, _multirank_cases(world))
    errors = [e for rank in per_rank for e in rank]
    assert errors == [], "\n".join(errors[:10])


def _different_top_k(group):
    x, w, y, *_ = _problem(TSCase())
    rank = torch.distributed.get_rank(group)
    lo, hi = shard_bounds(131, 2)[rank]
    try:
        vp.vocab_parallel_token_stats(x, w[lo:hi], y, process_group=group, top_k=2 + rank)
    except ValueError as err:
        return str(err)
    return None


def _ties_across_ranks(group):
    """Exact ties spread over 4 shards of 2, 2, 2, 1 columns; k = 6 > every shard."""
    bias = torch.tensor([0.0, 2.0, 1.0, 2.0, 2.0, 1.0, -1.0])
    rank = torch.distributed.get_rank(group)
    lo, hi = shard_bounds(7, 4)[rank]
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))  # the same on all
    out = vp.vocab_parallel_token_stats(
        x, torch.zeros(hi - lo, 4), torch.tensor([1, 2, 6]), bias=bias[lo:hi],
        process_group=group, top_k=6, argmax=True,
    )  # fmt: skip
    return out.topk_ids.tolist(), out.argmax.tolist()


@pytest.mark.slow
def test_four_ranks_ties_and_disagreement():
    per_rank = run_ranks(_ties_across_ranks, 4)
    for ids, best in per_rank:
        assert ids == [[1, 3, 4, 2, 5, 0]] * 3 and best == [1, 1, 1]
    messages = run_ranks(_different_top_k, 2)
    assert all(m is not None and m.startswith("top_k:") for m in messages), messages
    assert messages[0] == messages[1]


# ---------------------------------------------------------------- memory

MIB = 1 << 20
CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    import vocab_parallel as vp
    from benchmarks.memory import PeakMemory

    impl, bt, h, v = sys.argv[1], *map(int, sys.argv[2:5])
    torch.manual_seed(0)
    x = torch.randn(bt, h).requires_grad_(True)
    w = (torch.randn(v, h) * 0.05).requires_grad_(True)
    y = torch.randint(0, v, (bt,))
    a, b = torch.randn(bt), torch.randn(bt)

    def run(x, w, y):
        if impl == "naive":
            lp = torch.log_softmax(x @ w.T, dim=-1)
            logprobs = lp.gather(1, y[:, None]).squeeze(1)
            entropy = -(lp.exp() * lp).sum(-1)
        else:
            out = vp.vocab_parallel_token_stats(x, w, y, entropy=True, backend="torch")
            logprobs, entropy = out.logprobs, out.entropy
        (a[: len(y)] * logprobs + b[: len(y)] * entropy).sum().backward()

    run(x[:8].detach().requires_grad_(True), w[:64].detach().requires_grad_(True), y[:8] % 64)
    with PeakMemory("cpu") as peak:
        run(x, w, y)
    grad_w = w.grad.numel() * w.grad.element_size()
    print(json.dumps({"extra": peak.extra_bytes - grad_w, "exact": peak.exact}))
    """
)


@pytest.mark.slow
def test_peak_memory_flat_in_vocab():
    bt, h, v = 1024, 64, 16384
    ours = {n: peak_extra_in_child(CHILD, "ours", bt, h, n) for n in (v, 4 * v)}
    naive = {n: peak_extra_in_child(CHILD, "naive", bt, h, n) for n in (v, 4 * v)}
    print(f"MiB: ours {ours[v] / MIB:.0f} -> {ours[4 * v] / MIB:.0f}, naive "
          f"{naive[v] / MIB:.0f} -> {naive[4 * v] / MIB:.0f}")  # fmt: skip
    assert naive[4 * v] > 3 * naive[v]  # the measurement can see logits
    assert ours[4 * v] <= 1.2 * ours[v] + 16 * MIB
    assert ours[4 * v] < naive[4 * v] / 3


def test_case_helper_is_not_trivially_true():
    """The checker fails on a wrong answer: a shifted temperature changes every field."""
    case = TSCase(tokens=9, vocab=31)
    broken = replace(case, temperature="one")
    x, w, y, b, temp, a, b_up = _problem(case)
    out = vp.vocab_parallel_token_stats(x, w, y, temperature=1.0, entropy=True)
    ref = token_stats_reference(x, w, y, temperature=temp)
    assert _rel(out.logprobs, ref["logprobs"]) > 100 * VALUE_TOL
    assert broken != case


@pytest.mark.slow
def test_grpo_example_equals_full_logits_under_torchrun():
    """``launch/grpo_example.py`` on 2 gloo ranks: the policy loss from token statistics
    equals the one from materialised logits at every step (the script exits 1 if not)."""
    import subprocess
    import sys

    from launch_helpers import ROOT, train_env

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "launch" / "grpo_example.py"), "--steps", "3", "--vocab", "1031"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=train_env(), capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line[:4].strip().isdigit()]
    assert len(rows) == 3
    for _, ours, full, diff, _ in rows:
        assert abs(float(ours) - float(full)) <= 1e-5 and float(diff) <= 1e-5
    assert "ok" in out.stdout.splitlines()[-1]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed"))])  # fmt: skip
@pytest.mark.parametrize("mode", ["memory_saving", "high_performance"])
def test_masking_bias_of_minus_inf(backend, mode):
    """A bias of -inf on some columns (masked tokens, p = 0): finite entropy and
    gradients equal to the reference without those columns, never NaN."""
    g, dev = torch.Generator().manual_seed(3), device_for(backend)
    x = torch.randn(9, 8, generator=g).to(dev).requires_grad_(True)
    w = torch.randn(300, 8, generator=g).to(dev).requires_grad_(True)
    bias = torch.zeros(300)
    bias[::3] = float("-inf")
    y = torch.randint(0, 100, (9,), generator=g) * 3 + 1  # never a masked column
    out = vp.vocab_parallel_token_stats(x, w, y.to(dev), bias=bias.to(dev), entropy=True,
                                        sum_p_squared=True, top_k=3, backend=backend,
                                        mode=mode)  # fmt: skip
    (out.logprobs + out.entropy).sum().backward()
    keep = bias == 0
    x64 = x.detach().cpu().double().requires_grad_(True)
    w64 = w.detach().cpu().double()[keep].requires_grad_(True)
    y_kept = keep.cumsum(0)[y] - 1  # the targets' ids among the kept columns
    ref = token_stats_reference(x64, w64, y_kept, top_k=3)
    (ref["logprobs"] + ref["entropy"]).sum().backward()
    for name in ("logprobs", "entropy", "sum_p_squared", "topk_logprobs"):
        assert _rel(getattr(out, name), ref[name]) < VALUE_TOL, name
    assert _rel(x.grad, x64.grad) < 1e-5
    gw = w.grad.cpu()
    assert _rel(gw[keep], w64.grad) < 1e-5 and (gw[~keep] == 0).all()
