"""Sequence parallelism: each rank of the tensor-parallel group brings its own tokens.

Megatron-core (``sequence_parallel=True`` with tensor parallelism) and DeepSpeed (its
``sp_group``) split the hidden states along the token dimension across the group before
the LM head: rank r holds tokens ``[offset_r, offset_r + n_r)`` of the group's ``N``
tokens (uneven ``n_r`` allowed, 0 included). The vocabulary-parallel loss needs every
token on every rank (each rank scores all tokens against its vocabulary rows), so

    forward   exchange the token counts (one tiny all-reduce), then all-gather the hidden
              states ``[n_r, H] -> [N, H]`` and the targets ``[n_r] -> [N]`` (padded to
              the largest slice: gloo and NCCL gather equal sizes);
    backward  each rank keeps the rows of ``grad_input`` of its own tokens.

The loss already sums ``grad_input`` over the group (an fp32 all-reduce), so the gradient
of the gathered hidden states arrives complete and identical on every rank: the backward
of the gather is then a slice, no collective.

With ``reduction="none"`` a rank's per-token losses are those of its own tokens
(:func:`own_tokens`); their upstream gradients are all-gathered in the backward (fp32,
``[N]``), since every rank's vocabulary rows need the gradient of every token.

Every collective that fails raises a ``RuntimeError`` naming the payload and the ranks,
as :mod:`vocab_parallel.parallel.collectives` does; ranks that disagree about the hidden size,
dtype or whether a gradient is wanted raise the same ``ValueError`` on every rank,
before any large collective.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from vocab_parallel.parallel.collectives import CollectiveError, all_reduce, group_ranks, world_size

# Codes of the dtypes in the size exchange (ranks must agree on the dtype of hidden).
_DTYPE_CODES = {
    dt: i
    for i, dt in enumerate((torch.float32, torch.float16, torch.bfloat16, torch.float64), start=1)
}


def check_flag(sequence_parallel: object) -> bool:
    """``sequence_parallel`` must be a bool (raises ``TypeError`` naming it)."""
    if not isinstance(sequence_parallel, bool):
        raise TypeError(
            f"sequence_parallel: expected a bool, got {type(sequence_parallel).__name__}"
        )
    return sequence_parallel


@dataclass(frozen=True)
class TokenSlices:
    """How the group's tokens are split: ``sizes[r]`` tokens on the r-th rank of the group."""

    sizes: tuple[int, ...]
    rank: int  # this process's rank in the group
    process_group: dist.ProcessGroup | None

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def offset(self) -> int:
        """First token of this rank in the gathered ``[N]`` order."""
        return sum(self.sizes[: self.rank])

    @property
    def size(self) -> int:
        return self.sizes[self.rank]

    @property
    def even(self) -> bool:
        return len(set(self.sizes)) == 1


def _collective(
    call: Callable[[], object], what: str, process_group: dist.ProcessGroup | None
) -> None:
    """Run a collective; a failure names ``what`` and the ranks of ``process_group``."""
    try:
        call()
    except RuntimeError as exc:  # DistBackendError and timeouts derive from it
        raise CollectiveError(
            f"vocab_parallel: {what} over ranks {group_ranks(process_group)} of process_group "
            f"failed (a rank died, stopped or left the group, or the group's timeout ran "
            f"out): {exc}"
        ) from exc


_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def exchange_sizes(
    hidden: torch.Tensor, process_group: dist.ProcessGroup | None, wants_grad: bool
) -> TokenSlices:
    """Every rank's token count (one small all-reduce), checked alike on every rank.

    ``hidden`` is this rank's ``[n, H]``. Raises ``ValueError`` on every rank of the group
    when the ranks pass different hidden sizes or dtypes, or some want a gradient of
    ``hidden`` and others not (their backwards would enter different collectives).
    """
    n, rank = world_size(process_group), dist.get_rank(process_group)
    table = torch.zeros((n, 4), dtype=torch.int64, device=hidden.device)
    table[rank] = torch.tensor(
        [hidden.shape[0], hidden.shape[1], _DTYPE_CODES.get(hidden.dtype, 0), wants_grad],
        dtype=torch.int64,
    )
    rows = all_reduce(table, "SUM", process_group, "token counts (sequence_parallel)").tolist()
    names = [f"rank {r}" for r in group_ranks(process_group)]

    def differ(col: int, what: str, show=str) -> None:
        if len({row[col] for row in rows}) > 1:
            per_rank = ", ".join(
                f"{m}: {show(row[col])}" for m, row in zip(names, rows, strict=True)
            )
            raise ValueError(
                f"hidden: under sequence_parallel the ranks of process_group pass different "
                f"{what} ({per_rank}); they must agree"
            )

    codes = {code: str(dt).removeprefix("torch.") for dt, code in _DTYPE_CODES.items()}
    differ(1, "hidden sizes (last dim)")
    differ(2, "dtypes", lambda c: codes.get(c, "other"))
    differ(3, "gradient needs (requires_grad of hidden, under grad mode)", bool)
    return TokenSlices(tuple(row[0] for row in rows), rank, process_group)


def all_gather_rows(x: torch.Tensor, slices: TokenSlices, what: str) -> torch.Tensor:
    """``[n_r, ...]`` on each rank -> ``[N, ...]`` in rank order (every rank gets all).

    Padded to the largest slice (one equal-size gather), then compacted when uneven. Any
    dtype (bf16 too: a gather moves bytes, it adds nothing up).
    """
    rest = tuple(x.shape[1:])
    n, most = len(slices.sizes), max(slices.sizes)
    if slices.total == 0 or 0 in rest:
        return x.new_empty((slices.total, *rest))  # nothing to move (the same on every rank)
    src = x.contiguous()
    if x.shape[0] < most:  # pad this rank's slice to the largest
        src = torch.cat([src, src.new_zeros((most - x.shape[0], *rest))])
    padded = x.new_empty((n * most, *rest))
    _collective(
        lambda: _all_gather_single(padded, src, group=slices.process_group),
        f"all-gather of {what} (sequence_parallel)",
        slices.process_group,
    )
    if slices.even:
        return padded
    return torch.cat([padded[r * most : r * most + s] for r, s in enumerate(slices.sizes)])


class GatherTokens(torch.autograd.Function):
    """``hidden [n_r, H] -> [N, H]``: all ranks' tokens forward; this rank's rows backward.

    The gradient of the gathered tokens arrives already summed over the group (the loss's
    ``grad_input`` all-reduce), identical on every rank: the backward keeps this rank's
    rows, no collective.
    """

    @staticmethod
    def forward(ctx, hidden, slices):
        ctx.slices, ctx.dtype = slices, hidden.dtype
        return all_gather_rows(hidden, slices, "hidden")

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        s = ctx.slices
        # A copy: a view would keep the whole [N, H] gradient alive as hidden.grad.
        mine = grad.narrow(0, s.offset, s.size).clone()
        return mine.to(ctx.dtype), None


class OwnTokens(torch.autograd.Function):
    """``[N, ...]`` (identical on every rank) -> this rank's rows ``[n_r, ...]``; the
    backward all-gathers the upstream gradients of every rank's rows (fp32)."""

    @staticmethod
    def forward(ctx, full, slices):
        ctx.slices = slices
        return full.narrow(0, slices.offset, slices.size).clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        grad = grad.to(torch.promote_types(grad.dtype, torch.float32))  # fp32, or fp64
        return all_gather_rows(grad, ctx.slices, "upstream gradients"), None


def gather_tokens(
    hidden: torch.Tensor,
    target: torch.Tensor,
    process_group: dist.ProcessGroup | None,
    *,
    extra: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, TokenSlices | None, torch.Tensor | None]:
    """All tokens of the group from this rank's slice: ``(hidden [N, H], target [N],
    slices, extra [N])``.

    ``hidden`` is this rank's ``[n_r, H]``, ``target`` its ``[n_r]``, ``extra`` an optional
    per-token fp32 ``[n_r]`` (a temperature per token) gathered like the targets. Alone (no
    group, or one rank) nothing happens and ``slices`` is None. The gathered hidden states
    carry the backward of :class:`GatherTokens`; the others need none.
    """
    if world_size(process_group) == 1:
        return hidden, target, None, extra
    wants_grad = torch.is_grad_enabled() and hidden.requires_grad
    slices = exchange_sizes(hidden, process_group, wants_grad)
    hidden_all = GatherTokens.apply(hidden, slices)
    target_all = all_gather_rows(target, slices, "target")
    if extra is not None:
        extra = all_gather_rows(extra, slices, "temperature")
    return hidden_all, target_all, slices, extra


def own_tokens(per_token: torch.Tensor, slices: TokenSlices | None) -> torch.Tensor:
    """This rank's rows of a per-token result ``[N, ...]`` of the gathered tokens (e.g. the
    losses of ``reduction="none"``); differentiable. ``slices=None``: ``per_token`` itself."""
    if slices is None:
        return per_token
    return OwnTokens.apply(per_token, slices)
