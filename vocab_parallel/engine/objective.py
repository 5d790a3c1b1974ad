"""What an objective tells the engine's entry, and the call the entry prepares for it,
written once (``docs/design.md``, "The engine").

The cross entropy, the token statistics and distillation each hand
:func:`vocab_parallel.engine.entry.prepare_call` one :class:`Objective`: its name, its
own checks (made in the entry's guarded step, so that a value refused on one rank raises
on every rank; what it validates, its request, it keeps), its own entries of the ranks'
agreement, what it checks and prepares once the layout is known and the tokens gathered,
and the mode it runs. The entry does the rest alike for all of them (DTensors, autocast,
validation, agreement, sequence parallelism, layout, target checks) and returns one
:class:`Call`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from vocab_parallel.backends.interface import Logits
from vocab_parallel.options import LossOptions
from vocab_parallel.parallel.agreement import MAX_FIELDS, OBJECTIVES
from vocab_parallel.parallel.layout import ShardLayout

if TYPE_CHECKING:
    from vocab_parallel.parallel.sequence_parallel import TokenSlices

__all__ = ["MAX_FIELDS", "OBJECTIVES", "Call", "Objective", "resolve_mode"]


@dataclass(frozen=True, eq=False)
class Call:
    """One resolved call of an objective: what its autograd Functions need besides tensors
    that take a gradient. ``opts``: the validated options (its tensors already this call's);
    ``class_weight``: fp32 ``[V_local]`` or None; ``inv_temperature``: fp32 ``[BT]`` (all
    tokens of the call, gathered under sequence parallelism) or None for 1."""

    opts: LossOptions
    process_group: dist.ProcessGroup | None
    layout: ShardLayout
    backend: str
    mode: str
    track: bool = False  # whether a backward can follow (grad mode, an input requiring grad)
    class_weight: torch.Tensor | None = None
    inv_temperature: torch.Tensor | None = None
    # grad_input left rank-local (this rank's vocabulary rows' share), for a caller that
    # sums it over the group itself (verl's convention: vocab_parallel.integrations.verl)
    partial_grad_input: bool = False

    def logits(self, bias: torch.Tensor | None) -> Logits:
        """How the backends make this call's logits (``bias``: the cast one)."""
        return Logits(bias, self.opts.softcap, self.inv_temperature)


class Objective:
    """The entry's view of an objective; subclasses override what they add."""

    name: str = "cross entropy"

    def check(self, opts: LossOptions) -> None:
        """The objective's own checks of the call (``TypeError`` / ``ValueError`` naming the
        parameter), run in the entry's guarded step; what it validates it keeps."""

    def fields(self) -> list[tuple[str, str, object]]:
        """Its own entries of the ranks' agreement, after :meth:`check`: ``(what,
        parameter, value)``, the value a float or a 0-d tensor; at most
        :data:`MAX_FIELDS`, the same names on every rank that runs this objective."""
        return []

    def prepared(self, call: Call, target: torch.Tensor, slices: TokenSlices | None) -> None:
        """The call is prepared (``target``: the call's flattened, gathered targets;
        ``slices``: which are this rank's under sequence parallelism, else None): the
        objective's checks that need the layout or the gathered tokens (the same on every
        rank), and its own preparation."""

    def epilogue(self, call: Call, target: torch.Tensor, dtype: torch.dtype):
        """The objective's math on this rank's shard, where it is an
        :class:`~vocab_parallel.engine.epilogue.Epilogue` (``target``: the call's flat,
        gathered targets; ``dtype``: the inputs'): what ``vocab_parallel.engine.functions``
        runs."""
        raise NotImplementedError(f"{self.name} is not an epilogue objective")

    def mode(self, opts: LossOptions, track: bool, dtype: torch.dtype) -> str:
        """The mode that runs (``track``: whether a backward can follow): the loss's
        rule, :func:`resolve_mode`, unless the objective has its own."""
        return resolve_mode(opts.mode, opts.reduction, track, dtype)


def resolve_mode(mode: str, reduction: str, track: bool, dtype: torch.dtype | None = None) -> str:
    """The mode that runs: ``"auto"`` and ``"grad_in_forward"`` become
    ``"grad_in_forward"`` for a scalar loss that will be differentiated, else
    ``"memory_saving"`` (per-token upstream gradients are not known in the forward; without
    a backward there is nothing to compute early). ``"auto"`` also keeps fp16 inputs in
    memory-saving mode, where GradScaler's factor reaches ``G`` before its fp16 rounding.
    Asking for ``"grad_in_forward"`` with ``reduction="none"`` warns."""
    if mode not in ("auto", "grad_in_forward"):
        return mode
    if mode == "auto" and dtype in (torch.float16, torch.float64):
        # fp16: GradScaler's factor must reach G before its rounding. float64 (checks such
        # as gradcheck): a second backward must equal the first bit for bit.
        return "memory_saving"
    if reduction != "none" and track:
        return "grad_in_forward"
    if mode == "grad_in_forward" and reduction == "none":
        warnings.warn(
            'mode="grad_in_forward" needs reduction "sum" or "mean" (per-token upstream '
            'gradients are only known in the backward): running mode="memory_saving"',
            stacklevel=3,
        )
    return "memory_saving"
