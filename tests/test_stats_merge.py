"""The statistics kernel's splits merged in one launch (``stats_merge_kernel``, launched
by ``triton_backend.merge_splits``).

Checked against the merge in float64 (each split's sums moved to the row's max,
``LocalStats.rescaled_extras``' formulas): random partials with an odd number of rows
over more than one program, splits of no columns (the smallest finite max, zero sums),
rows whose every split is empty, with and without the shifted and squared sums; the
result bitwise the same run after run; one split costs no launch (views of the partials).
"""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

FLT_MIN = torch.finfo(torch.float32).min


def _partials(k: int, splits: int, bt: int, seed: int) -> torch.Tensor:
    """Partials as the statistics kernel writes them: per split a finite max (the
    smallest finite value where the split had no columns), ``sum e^(z - max)`` >= 1 there
    (0 for an empty split), and the other sums (0 for an empty split)."""
    g = torch.Generator().manual_seed(seed)
    part = torch.empty((k, splits, bt), dtype=torch.float64)
    part[0] = torch.randn(splits, bt, generator=g, dtype=torch.float64) * 8
    part[1] = 1 + torch.rand(splits, bt, generator=g, dtype=torch.float64) * 500
    part[2:] = torch.randn(k - 2, splits, bt, generator=g, dtype=torch.float64) * 30
    if k == 6:
        part[5] = torch.rand(splits, bt, generator=g, dtype=torch.float64) * 50  # sum e^2
    empty = torch.rand(splits, bt, generator=g) < 0.2
    empty[:, :3] = True  # rows with no columns in any split
    part[0][empty] = FLT_MIN
    for i in range(1, k):
        part[i][empty] = 0.0
    return part.float()


def _reference(part: torch.Tensor, k: int) -> torch.Tensor:
    """The merge in float64: ``m = max_s m_s``, ``sum = sum_s e^(m_s - m) sum_s``, the
    predicted and logit sums added, the extras moved as ``LocalStats.rescaled_extras``."""
    p = part.double()
    m = p[0].amax(dim=0)
    d = p[0] - m
    decay = torch.exp(d)
    out = [m, (p[1] * decay).sum(0), p[2].sum(0), p[3].sum(0)]
    if k == 6:
        moved = torch.where(p[1] > 0, p[4] + d * p[1], 0.0) * decay
        out += [moved.sum(0), (p[5] * decay.square()).sum(0)]
    return torch.stack(out)


@pytest.mark.parametrize("extra", [False, True], ids=["four", "extra_sums"])
@pytest.mark.parametrize(("splits", "bt"), [(2, 37), (3, 1030), (7, 513)])
def test_merge_matches_float64(extra, splits, bt):
    from vocab_parallel.backends.triton_backend import merge_splits

    k = 6 if extra else 4
    part = _partials(k, splits, bt, seed=splits * 1000 + bt)
    got = merge_splits(part.to(DEVICE), extra).cpu()
    want = _reference(part, k)
    assert got.shape == (k, bt) and got.dtype == torch.float32
    assert torch.equal(got[0], want[0].float())  # the max: exact
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-4)
    # rows with no columns anywhere: the smallest finite max, every sum 0
    assert torch.all(got[0, :3] == FLT_MIN) and torch.all(got[1:, :3] == 0)
    again = merge_splits(part.to(DEVICE), extra).cpu()
    assert torch.equal(got, again)  # bitwise deterministic


def test_one_split_is_its_own_statistics_without_a_launch(monkeypatch):
    from vocab_parallel.backends import triton_backend
    from vocab_parallel.kernels import forward

    class Refused:
        def __getitem__(self, grid):
            raise AssertionError("one split launched the merge")

    monkeypatch.setattr(forward, "stats_merge_kernel", Refused())
    part = _partials(6, 1, 9, seed=3).to(DEVICE)
    got = triton_backend.merge_splits(part, True)
    assert got.data_ptr() == part.data_ptr() and torch.equal(got, part[:, 0])


def test_no_rows():
    from vocab_parallel.backends.triton_backend import merge_splits

    got = merge_splits(torch.empty((4, 3, 0), device=DEVICE), False)
    assert got.shape == (4, 0)
