"""Checks of the sharded loss against the unsharded float64 reference, rank by rank.

Used by ``launch/verify.py`` (under torchrun) and by the multi-rank tests. Every rank
builds the same full problem from a seed, keeps its own shard of the weight, runs
:func:`vocab_parallel_linear_cross_entropy` forward and backward with a random upstream
gradient, and compares the loss, ``hidden.grad`` and its ``weight.grad`` shard with
``F.cross_entropy(F.linear(x, W_full), y)`` computed in float64.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vocab_parallel.layout import shard_bounds
from vocab_parallel.loss import vocab_parallel_linear_cross_entropy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Relative (to the reference's largest magnitude) error allowed per input dtype. Half
# precision is bounded by rounding G to the input dtype before the products (SPEC).
TOLERANCE = {"float32": 2e-5, "bfloat16": 3e-2, "float16": 5e-3}
# The loss itself accumulates exact products in fp32 whatever the input dtype.
LOSS_TOLERANCE = 1e-5


@dataclass(frozen=True)
class Case:
    """One configuration to check."""

    tokens: int = 37
    hidden: int = 33
    vocab: int = 389
    dtype: str = "float32"
    mode: str = "memory_saving"
    reduction: str = "mean"
    label_smoothing: float = 0.0
    backend: str = "auto"
    layout: str = "contiguous"  # or "reversed": rank r holds shard n-1-r via vocab_start_index
    all_ignored: bool = False
    seed: int = 0


def grid(
    *,
    tokens=(37,),
    hidden=(33,),
    vocab=(389,),
    dtypes=("float32", "bfloat16"),
    modes=("memory_saving", "high_performance"),
    reductions=("none", "sum", "mean"),
    label_smoothing=(0.0, 0.1),
    backends=("auto",),
    layouts=("contiguous",),
) -> list[Case]:
    """Cartesian product of the options, as Cases."""
    combos = itertools.product(
        tokens, hidden, vocab, dtypes, modes, reductions, label_smoothing, backends, layouts
    )
    return [Case(*c) for c in combos]


def _problem(case: Case, device: torch.device):
    g = torch.Generator().manual_seed(case.seed)
    bt, h, v = case.tokens, case.hidden, case.vocab
    x = torch.randn(bt, h, generator=g)
    w = torch.randn(v, h, generator=g) / h**0.5 * 4.0  # logits of a few units
    y = torch.randint(0, v, (bt,), generator=g)
    y[torch.rand(bt, generator=g) < 0.2] = -100  # some ignored tokens
    if case.all_ignored:
        y.fill_(-100)
    upstream = torch.rand(bt, generator=g) + 0.5  # per-token, never all ones
    scalar = float(torch.rand((), generator=g) + 0.5)
    dt = DTYPES[case.dtype]
    return x.to(dt).to(device), w.to(dt).to(device), y.to(device), upstream.to(device), scalar


def check_case(case: Case, group: dist.ProcessGroup | None, device: torch.device) -> dict:
    """Run one case on this rank; returns its errors and verdict (no collectives but the loss's)."""
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    x, w_full, y, upstream, scalar = _problem(case, device)
    shard = rank if case.layout == "contiguous" else world - 1 - rank
    lo, hi = shard_bounds(case.vocab, world)[shard]
    # The reversed layout also states the global size: the path without the layout collective.
    start, global_size = (None, None) if case.layout == "contiguous" else (lo, case.vocab)

    hidden = x.clone().requires_grad_(True)
    weight = w_full[lo:hi].clone().requires_grad_(True)
    loss = vocab_parallel_linear_cross_entropy(
        hidden,
        weight,
        y,
        process_group=group,
        vocab_start_index=start,
        global_vocab_size=global_size,
        reduction=case.reduction,
        label_smoothing=case.label_smoothing,
        mode=case.mode,
        backend=case.backend,
    )
    up = upstream if case.reduction == "none" else torch.tensor(scalar, device=device)
    loss.backward(up)

    x64 = x.double().requires_grad_(True)
    w64 = w_full.double().requires_grad_(True)
    ref = F.cross_entropy(
        F.linear(x64, w64),
        y,
        reduction=case.reduction,
        label_smoothing=case.label_smoothing,
    )
    if case.reduction == "mean" and case.all_ignored:
        ref = (F.linear(x64, w64).sum() * 0.0).reshape(())  # torch gives NaN; we promise 0
    ref.backward(up.double())

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        if not torch.isfinite(a).all():
            return float("inf")
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-6)) if b.numel() else 0.0

    errors = {
        "loss": rel(loss, ref),
        "grad_hidden": rel(hidden.grad, x64.grad),
        "grad_weight": rel(weight.grad, w64.grad[lo:hi]),
    }
    tol = TOLERANCE[case.dtype]
    ok = errors["loss"] <= LOSS_TOLERANCE and max(errors.values()) <= tol
    return {**asdict(case), "world": world, "rank": rank, **errors, "ok": bool(ok)}
