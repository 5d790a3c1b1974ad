"""Sampling replay: token statistics of the distribution the rollout engine sampled from
(``sample_top_k``, ``sample_top_p``, ``sample_min_p``), against float64 on materialised
logits (``vocab_parallel.reference.sampled_token_stats_reference``): log-probs, entropy
and the kept log-mass, and the gradients of ``a logprob + b entropy`` with the kept set
held fixed; both backends, both modes, per-token parameters, temperature, softcap and bias,
the radix select forced, 1-4 gloo ranks with uneven shards and sequence parallelism."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from helpers import HAS_TRITON, device_for
from multirank import run_ranks

import vocab_parallel as vp
from vocab_parallel.objectives import sampling
from vocab_parallel.parallel.layout import shard_bounds
from vocab_parallel.reference import sampled_token_stats_reference


@dataclass(frozen=True)
class SCase:
    top_k: object = 0
    top_p: object = 1.0
    min_p: object = 0.0
    tokens: int = 29
    vocab: int = 211
    hidden: int = 24
    dtype: torch.dtype = torch.float32
    mode: str = "memory_saving"
    backend: str = "torch"
    temperature: str = "one"  # "one", "float", "tensor"
    softcap: float | None = None
    bias: bool = False
    entropy: bool = True
    seed: int = 0
    sp: bool = False


def _problem(case: SCase):
    g = torch.Generator().manual_seed(case.seed)
    x = torch.randn(case.tokens, case.hidden, generator=g).to(case.dtype)
    w = (torch.randn(case.vocab, case.hidden, generator=g) * 0.7).to(case.dtype)
    b = (torch.randn(case.vocab, generator=g) * 0.5).to(case.dtype) if case.bias else None
    temp = {"one": 1.0, "float": 0.7,
            "tensor": torch.rand(case.tokens, generator=g) + 0.5}[case.temperature]  # fmt: skip
    # Targets mostly among the top few logits (what a sampler draws), some anywhere.
    z = x.double() @ w.double().T
    ranked = z.argsort(dim=1, descending=True)
    pick = torch.randint(0, 4, (case.tokens,), generator=g)
    y = ranked.gather(1, pick[:, None])[:, 0]
    y[::5] = torch.randint(0, case.vocab, (len(y[::5]),), generator=g)
    y[3] = -100

    def param(v, dtype):
        if v == "tensor_k":
            return torch.randint(-1, 12, (case.tokens,), generator=g)
        if v == "tensor_p":
            return torch.rand(case.tokens, generator=g).clamp(0.05, 1.0).to(dtype)
        if v == "tensor_min_p":
            return (torch.rand(case.tokens, generator=g) * 0.3).to(dtype)
        return v

    params = dict(sample_top_k=param(case.top_k, torch.int64),
                  sample_top_p=param(case.top_p, torch.float32),
                  sample_min_p=param(case.min_p, torch.float32))  # fmt: skip
    return x, w, b, y, temp, params


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def check(case: SCase, group=None) -> list[str]:
    world = 1 if group is None else torch.distributed.get_world_size(group)
    rank = 0 if group is None else torch.distributed.get_rank(group)
    x, w, b, y, temp, params = _problem(case)
    uneven = {3: [(0, 50), (50, 51), (51, case.vocab)], 4: [(0, 0), (0, 90), (90, 91), (91, 211)]}
    bounds = uneven.get(world) or shard_bounds(case.vocab, world)
    lo, hi = bounds[rank]
    dev = device_for(case.backend)
    tokens = slice(None)
    if case.sp:  # uneven token slices
        cuts = [0, 11, case.tokens] if world == 2 else None
        tokens = slice(cuts[rank], cuts[rank + 1])
    g = torch.Generator().manual_seed(100 + case.seed)
    a, bb = torch.randn(case.tokens, generator=g), torch.randn(case.tokens, generator=g)

    def sliced(t):
        return t[tokens] if isinstance(t, torch.Tensor) and t.dim() == 1 else t

    hidden = x[tokens].clone().to(dev).requires_grad_(True)
    weight = w[lo:hi].clone().to(dev).requires_grad_(True)
    bias = None if b is None else b[lo:hi].clone().to(dev).requires_grad_(True)
    kw = {k: (sliced(v).to(dev) if isinstance(v, torch.Tensor) else v) for k, v in params.items()}
    tt = sliced(temp).to(dev) if isinstance(temp, torch.Tensor) else temp
    out = vp.vocab_parallel_token_stats(
        hidden, weight, y[tokens].to(dev), process_group=group, entropy=case.entropy,
        temperature=tt, softcap=case.softcap, bias=bias, mode=case.mode,
        backend=case.backend, sequence_parallel=case.sp, **kw,
    )  # fmt: skip
    lp = out.logprobs.detach().cpu()
    got_lp = out.logprobs.cpu()
    loss = (a[tokens] * torch.where(torch.isfinite(got_lp), got_lp, 0.0)).sum()
    if case.entropy:
        loss = loss + (bb[tokens] * out.entropy.cpu()).sum()
    loss.backward()

    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    b64 = None if b is None else b.double().requires_grad_(True)
    ref = sampled_token_stats_reference(
        x64, w64, y, temperature=temp, softcap=case.softcap, bias=b64,
        **{k: v for k, v in params.items()},
    )  # fmt: skip
    rlp = ref["logprobs"]
    ref_loss = (a.double() * torch.where(torch.isfinite(rlp), rlp, 0.0)).sum()
    if case.entropy:
        ref_loss = ref_loss + (bb.double() * ref["entropy"]).sum()
    ref_loss.backward()

    errors = []
    tol = 1e-5 if case.dtype == torch.float32 else 2e-2
    want_lp = rlp[tokens].detach()
    if not torch.equal(torch.isfinite(lp), torch.isfinite(want_lp)):
        errors.append(f"kept targets differ: {torch.isfinite(lp).tolist()}")
    fin = torch.isfinite(want_lp) & torch.isfinite(lp)
    lp_err = float((lp[fin].double() - want_lp[fin]).abs().max()) if fin.any() else 0.0
    if lp_err > tol * 10:
        errors.append(f"logprobs off by {lp_err:.2e}")
    if case.entropy:
        ent_err = (out.entropy.detach().cpu().double() - ref["entropy"][tokens].detach()).abs()
        if float(ent_err.max()) > tol * 10:
            errors.append("entropy")
    kept = out.kept_logmass.cpu().double()
    kept_err = float((kept - ref["kept_logmass"][tokens].detach()).abs().max())
    if kept_err > tol * 10 or bool((kept > 1e-6).any()):
        errors.append("kept_logmass")
    gtol = 1e-4 if case.dtype == torch.float32 else 3e-2
    grads = [("hidden", hidden.grad.cpu(), x64.grad[tokens]),
             ("weight", weight.grad.cpu(), w64.grad[lo:hi])]  # fmt: skip
    if b is not None:
        grads.append(("bias", bias.grad.cpu(), b64.grad[lo:hi]))
    for name, got, want in grads:
        if _rel(got, want) > gtol:
            errors.append(f"grad_{name}: rel {_rel(got, want):.2e}")
    return [f"{case}: {e}" for e in errors]


CASES = [
    SCase(top_k=5),
    SCase(top_p=0.8, seed=1),
    SCase(min_p=0.05, seed=2),
    SCase(top_k=20, top_p=0.9, min_p=0.01, seed=3),
    SCase(top_k="tensor_k", top_p="tensor_p", min_p="tensor_min_p", seed=4),
    SCase(top_k=7, top_p=0.7, temperature="tensor", softcap=4.0, bias=True, seed=5),
    SCase(top_p=0.6, temperature="float", mode="high_performance", seed=6),
    SCase(top_k=3, entropy=False, seed=7),
    SCase(top_k=8, top_p=0.85, dtype=torch.bfloat16, seed=8),
    SCase(top_k=211, top_p=0.95, seed=9),  # k = V: the candidates cannot hold them
    SCase(top_k=1, seed=10),
    SCase(top_k=12, top_p=0.9, dtype=torch.float64, seed=11),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_float64(case):
    assert check(case) == []


@pytest.mark.parametrize("case", [CASES[3], CASES[4], CASES[5], CASES[9], CASES[11]], ids=str)
def test_the_radix_select_is_exact(case, monkeypatch):
    """Two candidates per rank: almost every threshold falls below them and is found by
    the radix select over the float's bits."""
    monkeypatch.setattr(sampling, "MIN_CANDIDATES", 2)
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 2)
    monkeypatch.setattr(sampling, "MAX_CANDIDATES", 2)
    assert check(case) == []


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("case", [CASES[3], CASES[5], CASES[6]], ids=str)
def test_triton_backend(case):
    assert check(replace(case, backend="triton")) == []


def test_off_values_are_the_plain_statistics():
    x, w, _, y, *_ = _problem(SCase())
    plain = vp.vocab_parallel_token_stats(x, w, y, entropy=True)
    off = vp.vocab_parallel_token_stats(
        x, w, y, entropy=True, sample_top_k=-1, sample_top_p=1.0, sample_min_p=0.0
    )
    assert off.kept_logmass is None and plain.kept_logmass is None
    assert torch.equal(off.logprobs, plain.logprobs) and torch.equal(off.entropy, plain.entropy)


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(sample_top_p=0.0), ValueError, "sample_top_p"),
        (dict(sample_top_p=1.5), ValueError, "sample_top_p"),
        (dict(sample_top_p=float("nan")), ValueError, "sample_top_p"),
        (dict(sample_min_p=-0.1), ValueError, "sample_min_p"),
        (dict(sample_min_p=float("nan")), ValueError, "sample_min_p"),
        (dict(sample_top_k=2.5), TypeError, "sample_top_k"),
        (dict(sample_top_k=True), TypeError, "sample_top_k"),
        (dict(sample_top_p="0.9"), TypeError, "sample_top_p"),
        (dict(sample_top_k=torch.ones(3, dtype=torch.int64)), ValueError, "sample_top_k"),
        (dict(sample_top_p=torch.ones(29, dtype=torch.int64)), TypeError, "sample_top_p"),
        (dict(sample_top_p=torch.full((29,), 1.5)), ValueError, "sample_top_p"),
        (dict(sample_top_k=5, top_k=3), ValueError, "sample_top_k"),
        (dict(sample_top_p=0.5, sum_p_squared=True), ValueError, "sample_top_p"),
    ],
)
def test_bad_values_name_the_parameter(kwargs, error, name):
    x, w, _, y, *_ = _problem(SCase())
    with pytest.raises(error, match=f"^{name}"):
        vp.vocab_parallel_token_stats(x, w, y, **kwargs)


def _ranks(group):
    world = torch.distributed.get_world_size(group)
    errors = []
    for case in (CASES[3], CASES[4], CASES[5], CASES[9]):
        errors += check(case, group)
    if world == 2:
        errors += check(replace(CASES[3], sp=True), group)
        errors += check(replace(CASES[4], sp=True, mode="high_performance"), group)
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_matches_float64(world):
    errors = [e for rank in run_ranks(_ranks, world) for e in rank]
    assert errors == [], "\n".join(errors[:10])


def _forced_radix(group):
    sampling.MIN_CANDIDATES = sampling.TOP_P_CANDIDATES = sampling.MAX_CANDIDATES = 2
    return check(CASES[3], group) + check(CASES[9], group)


@pytest.mark.slow
def test_radix_select_over_ranks():
    errors = [e for rank in run_ranks(_forced_radix, 2) for e in rank]
    assert errors == [], "\n".join(errors[:10])


def _disagree(group):
    rank = torch.distributed.get_rank(group)
    x, w, _, y, *_ = _problem(SCase())
    lo, hi = shard_bounds(211, 2)[rank]
    try:
        vp.vocab_parallel_token_stats(
            x, w[lo:hi], y, process_group=group, sample_top_p=0.9 if rank else 0.8
        )
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.slow
def test_ranks_passing_different_values_fail_alike():
    messages = run_ranks(_disagree, 2)
    assert messages[0] is not None and messages[0].startswith("sample_top_p")
    assert messages[0] == messages[1]


def test_the_head_takes_the_same_keywords():
    torch.manual_seed(0)
    head = vp.VocabParallelLMHead(24, 211, softcap=5.0)
    x, _, _, y, _, params = _problem(SCase(top_k=6, top_p=0.8, min_p=0.02))
    got = head.token_stats(x, y, entropy=True, temperature=0.9, **params)
    want = vp.vocab_parallel_token_stats(
        x, head.weight, y, entropy=True, temperature=0.9, softcap=5.0, **params
    )
    for a, b in ((got.logprobs, want.logprobs), (got.entropy, want.entropy),
                 (got.kept_logmass, want.kept_logmass)):  # fmt: skip
        assert torch.equal(a, b)
    assert bool((got.kept_logmass < 0).any())


MEMORY_CHILD = """
import ctypes, json, sys
ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)
import torch
import vocab_parallel as vp
from benchmarks.memory import PeakMemory

impl, bt, h, v = sys.argv[1], *map(int, sys.argv[2:5])
torch.manual_seed(0)
x = torch.randn(bt, h).requires_grad_(True)
w = (torch.randn(v, h) * 0.05).requires_grad_(True)
y = torch.randint(0, v, (bt,))

def run():
    if impl == "naive":
        lp = torch.log_softmax(x @ w.T, -1)
        (lp.gather(1, y[:, None]).sum() + lp.exp().sum()).backward()
    else:
        s = vp.vocab_parallel_token_stats(x, w, y, entropy=True, sample_top_k=50,
                                          sample_top_p=0.9, backend="torch")
        lp = torch.where(torch.isfinite(s.logprobs), s.logprobs, 0.0)
        (lp.sum() + s.entropy.sum()).backward()

run()
x.grad = w.grad = None
with PeakMemory("cpu") as peak:
    run()
grad_w = w.grad.numel() * w.grad.element_size()  # the gradient grows with V: not counted
print(json.dumps({"extra": peak.extra_bytes - grad_w, "exact": peak.exact}))
"""


def test_peak_memory_flat_in_vocab():
    from helpers import peak_extra_in_child

    bt, h, v = 1024, 64, 16384
    ours = {n: peak_extra_in_child(MEMORY_CHILD, "ours", bt, h, n) for n in (v, 4 * v)}
    naive = {n: peak_extra_in_child(MEMORY_CHILD, "naive", bt, h, n) for n in (v, 4 * v)}
    assert naive[4 * v] > 3 * naive[v]  # the measurement sees logits
    assert ours[4 * v] <= 1.2 * ours[v] + 16 * (1 << 20)
    assert ours[4 * v] < naive[4 * v] / 3


def _example(group):
    from launch.sampling_replay import run

    plain, replay, kept = run(group, tokens=128, vocab=1031)
    return float(plain.mean()), float(replay.max()), float(kept.mean())


@pytest.mark.slow
def test_the_example_replays_the_engine_on_two_ranks():
    """``launch/sampling_replay.py``: the replayed log-probs equal the engine's; the plain
    ones are off by the kept log-mass (every draw is in the kept set)."""
    for plain, replay, kept in run_ranks(_example, 2):
        assert replay < 1e-4 and plain > 0.01
        assert abs(plain + kept) < 1e-4


def _dtensor(group):
    """A ``Shard(0)`` DTensor weight (DTensor's own uneven chunks) and a DTensor bias."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world = torch.distributed.get_world_size(group)
    mesh = init_device_mesh("cpu", (world,))
    case = SCase(top_k=8, top_p=0.85, min_p=0.01, bias=True, seed=21)
    x, w, b, y, temp, params = _problem(case)
    wd = distribute_tensor(w.clone(), mesh, [Shard(0)]).requires_grad_(True)
    bd = distribute_tensor(b.clone(), mesh, [Shard(0)]).requires_grad_(True)
    out = vp.vocab_parallel_token_stats(x, wd, y, entropy=True, bias=bd, **params)
    lp = torch.where(torch.isfinite(out.logprobs), out.logprobs, 0.0)
    (lp.sum() + out.entropy.sum()).backward()
    w64, b64 = w.double().requires_grad_(True), b.double().requires_grad_(True)
    ref = sampled_token_stats_reference(x.double(), w64, y, bias=b64, **params)
    rlp = ref["logprobs"]
    (torch.where(torch.isfinite(rlp), rlp, 0.0).sum() + ref["entropy"].sum()).backward()
    rank = torch.distributed.get_rank(group)
    rows = -(-case.vocab // world)
    lo, hi = rank * rows, min(case.vocab, (rank + 1) * rows)
    errors = []
    if not torch.equal(torch.isfinite(out.logprobs), torch.isfinite(rlp)):
        errors.append("dtensor: kept targets")
    if _rel(wd.grad.to_local(), w64.grad[lo:hi]) > 1e-4:
        errors.append(f"dtensor: grad_weight {_rel(wd.grad.to_local(), w64.grad[lo:hi]):.2e}")
    if _rel(bd.grad.to_local(), b64.grad[lo:hi]) > 1e-4:
        errors.append("dtensor: grad_bias")
    return errors


@pytest.mark.slow
def test_dtensor_weight_on_two_ranks():
    errors = [e for rank in run_ranks(_dtensor, 2) for e in rank]
    assert errors == [], "\n".join(errors)
