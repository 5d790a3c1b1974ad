"""sequence_parallel=True: each rank passes its slice of the tokens (uneven, even empty);
every rank's loss, hidden.grad slice and weight.grad shard against the unsharded float64
``F.cross_entropy(F.linear(x, W_full), y)`` over all tokens, on gloo ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import triton_interpreter_cases
from multirank import run_ranks

from vocab_parallel import VocabParallelLinearCrossEntropy, vocab_parallel_linear_cross_entropy
from vocab_parallel.loss import MODES
from vocab_parallel.testing import Case, check_sequence_parallel_case, grid, token_split

# Multi-process (or compiling every kernel variant): out of the fast loop (-m "not slow").
pytestmark = pytest.mark.slow

CPU = torch.device("cpu")


def _check_all(group, jobs, extra=None):
    """The grid cases on this rank; with ``extra``, also ``extra(group)`` (one spawn of the
    ranks for both: it costs seconds)."""
    results = [check_sequence_parallel_case(case, group, CPU, split) for case, split in jobs]
    return results if extra is None else (results, extra(group))


def _assert_ok(per_rank: list[list[dict]]) -> None:
    bad = [r for rank in per_rank for r in rank if not r["ok"]]
    assert not bad, "mismatches:\n" + "\n".join(str(b) for b in bad[:10])
    assert len({len(rank) for rank in per_rank}) == 1


def test_token_split():
    assert token_split(37, 2, "uneven") == [12, 25]
    assert token_split(37, 3, "empty") == [19, 0, 18]
    assert token_split(10, 4, "even") == [3, 3, 2, 2]
    assert token_split(3, 4, "uneven") == [0, 0, 0, 3]
    with pytest.raises(ValueError, match="split"):
        token_split(3, 2, "odd")


def _triton_jobs() -> list:
    """Triton kernels through the interpreter: tiny shapes, a subset."""
    return [(c, "uneven") for c in triton_interpreter_cases()]


# torch backend: every mode (as the loss lists them), reduction, smoothing and dtype, on
# uneven vocabulary shards (V=389) and uneven token slices (world 3: a rank without
# tokens; world 4: a smaller grid, and fewer tokens than ranks); world 2 also runs the
# Triton subset, world 3 the module, head, collective-count and error checks (_misc).
@pytest.mark.parametrize("world, split", [(2, "uneven"), (3, "empty"), (4, "uneven")])
def test_grid(world, split):
    smoothing = (0.0, 0.1) if world < 4 else (0.1,)
    cases = grid(backends=("torch",), modes=MODES, label_smoothing=smoothing)
    jobs = [(c, split) for c in cases]
    jobs += [
        (dataclasses.replace(cases[0], all_ignored=True, reduction=r), split)
        for r in ("mean", "sum")
    ]
    reversed_layout = grid(
        backends=("torch",), dtypes=("float32",), label_smoothing=(0.1,), layouts=("reversed",)
    )
    jobs += [(c, "even") for c in reversed_layout]
    if world == 2:
        jobs += _triton_jobs()
    if world == 4:
        jobs += [(Case(tokens=3, reduction=r, backend="torch"), "uneven") for r in ("none", "mean")]
    extra = _misc if world == 3 else None
    per_rank = run_ranks(_check_all, world, jobs, extra)
    if extra is None:
        _assert_ok(per_rank)
        return
    _assert_ok([cases for cases, _ in per_rank])
    _check_misc([misc for _, misc in per_rank])


def test_alone_equals_plain_loss():
    """No group (or one rank): sequence_parallel changes nothing and needs no collective."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 5, 8, generator=g), torch.randn(11, 8, generator=g)
    y = torch.randint(0, 11, (2, 5), generator=g)
    for reduction in ("none", "mean"):
        a = vocab_parallel_linear_cross_entropy(x, w, y, reduction=reduction, backend="torch")
        b = vocab_parallel_linear_cross_entropy(
            x, w, y, reduction=reduction, backend="torch", sequence_parallel=True
        )
        assert torch.equal(a, b)


def test_flag_must_be_bool():
    x, w, y = torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long)
    with pytest.raises(TypeError, match="^sequence_parallel: expected a bool"):
        vocab_parallel_linear_cross_entropy(x, w, y, sequence_parallel=1)
    with pytest.raises(TypeError, match="^sequence_parallel"):
        VocabParallelLinearCrossEntropy(sequence_parallel="yes")


def _misc(group):
    """The checks that are not grid cases, in one group (spawning ranks costs seconds)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from vocab_parallel import VocabParallelLMHead, shard_bounds
    from vocab_parallel.parallel import sequence_parallel as sp

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out = {}
    g = torch.Generator().manual_seed(1)
    sizes = token_split(11, world, "uneven")  # per rank: [b=2, s_r, H] hidden states
    x = torch.randn(2, sum(sizes), 16, generator=g)
    w = torch.randn(53, 16, generator=g) / 4
    y = torch.randint(0, 53, (2, sum(sizes)), generator=g)
    off = sum(sizes[:rank])
    mine = slice(off, off + sizes[rank])
    lo, hi = shard_bounds(53, world)[rank]

    # The nn.Module, the LM head (the option passed on generically) and the function agree,
    # on 3-D hidden states; the backward is bitwise deterministic.
    def run(make_loss):
        h = x[:, mine].clone().requires_grad_(True)
        loss = make_loss(h)
        loss.backward()
        return loss.detach(), h.grad

    module = VocabParallelLinearCrossEntropy(process_group=group, sequence_parallel=True)
    head = VocabParallelLMHead.from_full_weight(w, group, sequence_parallel=True, backend="torch")
    results = [
        run(lambda h: vocab_parallel_linear_cross_entropy(
            h, w[lo:hi], y[:, mine], process_group=group, sequence_parallel=True
        )),
        run(lambda h: module(h, w[lo:hi], y[:, mine])),
        run(lambda h: head(h, y[:, mine])),
        run(lambda h: head(h, y[:, mine])),
    ]  # fmt: skip
    x64 = x.double().requires_grad_(True)
    ref = F.cross_entropy(F.linear(x64, w.double()).flatten(0, 1), y.flatten())
    ref.backward()
    out["same"] = all(
        torch.equal(a, results[0][0]) and torch.equal(b, results[0][1]) for a, b in results
    )
    out["ref_loss"] = abs(float(results[0][0]) - float(ref)) / float(ref)
    out["ref_grad"] = float((results[0][1] - x64.grad[:, mine]).abs().max())

    # Collectives: forward = token counts (all-reduce) + 2 all-gathers; backward of "mean"
    # none of ours (the loss's grad_input all-reduce is already there), of "none" one
    # (the upstream gradients).
    counts = {"gather": 0}
    real = sp._all_gather_single

    def counting(*args, **kwargs):
        counts["gather"] += 1
        return real(*args, **kwargs)

    sp._all_gather_single = counting
    try:
        for reduction in ("mean", "none"):
            h = x[:, mine].clone().requires_grad_(True)
            loss = vocab_parallel_linear_cross_entropy(
                h, w[lo:hi], y[:, mine], process_group=group, sequence_parallel=True,
                reduction=reduction,
            )  # fmt: skip
            out[f"gathers_forward_{reduction}"] = counts["gather"]
            loss.backward(torch.ones_like(loss))
            out[f"gathers_total_{reduction}"] = counts["gather"]
            counts["gather"] = 0
    finally:
        sp._all_gather_single = real

    # Ranks that disagree raise the same ValueError on every rank, before the big gathers.
    def message(h, target):
        try:
            vocab_parallel_linear_cross_entropy(
                h, w[lo:hi, : h.shape[-1]].to(h.dtype), target, process_group=group,
                sequence_parallel=True,
            )  # fmt: skip
        except ValueError as exc:
            return str(exc)
        return "no error"

    h = x[0, mine]
    out["bad_hidden_size"] = message(h[:, : 16 if rank else 15], y[0, mine])
    out["bad_dtype"] = message(h.to(torch.bfloat16) if rank else h, y[0, mine])
    out["bad_grad"] = message(h.clone().requires_grad_(rank == 0), y[0, mine])
    return out


def _check_misc(per_rank: list[dict]) -> None:
    """The verdicts of :func:`_misc` on every rank."""
    for r in per_rank:
        assert r["same"], r
        assert r["ref_loss"] < 1e-5 and r["ref_grad"] < 1e-5, r
        assert r["gathers_forward_mean"] == 2 and r["gathers_total_mean"] == 2, r
        assert r["gathers_forward_none"] == 2 and r["gathers_total_none"] == 3, r
        assert r["bad_hidden_size"].startswith("hidden: under sequence_parallel"), r
        assert "hidden sizes" in r["bad_hidden_size"] and "rank 0: 15" in r["bad_hidden_size"]
        assert "dtypes" in r["bad_dtype"] and "rank 1: bfloat16" in r["bad_dtype"], r
        assert "gradient needs" in r["bad_grad"], r
    # the same message on every rank
    for key in ("bad_hidden_size", "bad_dtype", "bad_grad"):
        assert len({r[key] for r in per_rank}) == 1
