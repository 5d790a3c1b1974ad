"""The loss options on gloo ranks: every rank's loss, lse, hidden.grad, weight.grad and
bias.grad shard against the unsharded float64 reference (plain torch ops), on uneven
shards (``vocab_parallel.shard_bounds``; V=131 is uneven for every world size), both
backends (Triton under the interpreter without a GPU), both modes, fp32 and bf16, random
per-token upstream gradients for ``reduction="none"``."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from helpers import HAS_TRITON
from multirank import run_ranks

from vocab_parallel.testing import Case, check_case

# Multi-process (or compiling every kernel variant): out of the fast loop (-m "not slow").
pytestmark = pytest.mark.slow

OPTION_SETS = (
    dict(softcap=3.0),
    dict(z_loss=0.05),
    dict(bias=True),
    dict(return_lse=True),
    dict(softcap=3.0, z_loss=0.05, bias=True, return_lse=True),
)


def _cases(backend: str, world: int, *, per_set: int) -> list[Case]:
    """Each option set with ``per_set`` settings cycling through mode, reduction, dtype,
    label smoothing and layout (the reversed layout states its bounds: no layout
    collective)."""
    settings = list(
        itertools.product(
            ("memory_saving", "high_performance"),
            ("none", "mean", "sum"),
            ("float32", "bfloat16"),
            (0.0, 0.1),
        )
    )
    cases = []
    for i, opts in enumerate(OPTION_SETS):
        for j in range(per_set):
            mode, reduction, dtype, eps = settings[(7 * i + 5 * j) % len(settings)]
            layout = "reversed" if world > 1 and (i + j) % 3 == 2 else "contiguous"
            base = Case(tokens=19, hidden=21, vocab=131, backend=backend, seed=10 * i + j)
            cases.append(
                dataclasses.replace(
                    base,
                    mode=mode,
                    reduction=reduction,
                    dtype=dtype,
                    label_smoothing=eps,
                    layout=layout,
                    **opts,
                )
            )
    return cases


def _check_all(group, cases):
    return [check_case(c, group, torch.device("cpu")) for c in cases]


def _assert_ok(per_rank: list[list[dict]]) -> None:
    bad = [r for rank in per_rank for r in rank if not r["ok"]]
    assert not bad, "mismatches:\n" + "\n".join(str(b) for b in bad[:10])
    assert len({len(rank) for rank in per_rank}) == 1  # every case ran on every rank
    results = per_rank[0]
    assert any("grad_bias" in r for r in results) and any("lse" in r for r in results)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_torch_backend_options(world):
    _assert_ok(run_ranks(_check_all, world, _cases("torch", world, per_set=6)))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("world", [2, 3])
def test_triton_backend_options(world):
    _assert_ok(run_ranks(_check_all, world, _cases("triton", world, per_set=2)))
