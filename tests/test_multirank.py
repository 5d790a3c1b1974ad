"""Multi-rank correctness: every rank's loss, hidden.grad and weight.grad shard against the
unsharded float64 ``F.cross_entropy(F.linear(x, W_full), y)``, on gloo ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import HAS_TRITON
from multirank import run_ranks

from vocab_parallel.testing import Case, check_case, grid

# Multi-process (or compiling every kernel variant): out of the fast loop (-m "not slow").
pytestmark = pytest.mark.slow


def _check_all(group, cases):
    return [check_case(c, group, torch.device("cpu")) for c in cases]


def _assert_ok(per_rank: list[list[dict]]) -> None:
    bad = [r for rank in per_rank for r in rank if not r["ok"]]
    assert not bad, "mismatches:\n" + "\n".join(str(b) for b in bad[:10])
    # Every case ran on every rank.
    assert len({len(rank) for rank in per_rank}) == 1


# torch backend: the whole grid (modes x reductions x label smoothing x dtypes); V=389 is
# uneven for every world size.
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_torch_backend_grid(world):
    cases = grid(backends=("torch",))
    cases += [dataclasses.replace(cases[0], all_ignored=True, reduction=r) for r in ("mean", "sum")]
    if world > 1:
        cases += grid(backends=("torch",), layouts=("reversed",), reductions=("none",))
    _assert_ok(run_ranks(_check_all, world, cases))


# Triton kernels through the interpreter: smaller shapes, every mode, dtype and smoothing.
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("world", [2, 3])
def test_triton_backend_grid(world):
    cases = grid(
        tokens=(19,),
        hidden=(21,),
        vocab=(131,),
        backends=("triton",),
        reductions=("none", "mean"),
    )
    _assert_ok(run_ranks(_check_all, world, cases))


def test_no_process_group_equals_reference():
    """process_group=None: no collectives at all, in a process without torch.distributed."""
    results = _check_all(None, grid(backends=("torch",)))
    assert all(r["ok"] for r in results), [r for r in results if not r["ok"]]


def test_failing_rank_does_not_hang():
    """A rank that raises makes run_ranks fail fast with its traceback."""
    with pytest.raises(AssertionError, match="rank 1 of 2 failed"):
        run_ranks(_fail_on_rank_1, 2, timeout=120)


def _fail_on_rank_1(group):
    import torch.distributed as dist

    if dist.get_rank(group) == 1:
        raise RuntimeError("boom")
    check_case(Case(), group, torch.device("cpu"))  # waits in a collective for rank 1
