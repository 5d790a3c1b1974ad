"""What an objective tells the engine's entry, written once (``docs/design.md``, "The
engine").

The cross entropy, the token statistics and distillation each hand
:func:`vocab_parallel.engine.entry.prepare_call` one :class:`Objective`: its name, its own checks
(made in the entry's guarded step, so that a value refused on one rank raises on every
rank: its validated request is kept on the objective), its own entries of the ranks'
agreement, what it checks and prepares once the call is (the layout known, the tokens
gathered), and the mode it runs. The
entry does the rest alike for all of them (DTensors, autocast, validation, agreement,
sequence parallelism, layout, target checks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vocab_parallel.options import LossOptions

if TYPE_CHECKING:
    from vocab_parallel.objectives.cross_entropy import Call
    from vocab_parallel.parallel.sequence_parallel import TokenSlices

# The objectives, in the order of their code in the ranks' agreement.
OBJECTIVES = ("cross entropy", "token statistics", "distillation")
# The most agreement entries an objective adds (each rank's row is padded to it).
MAX_FIELDS = 12


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

    def mode(self, opts: LossOptions, track: bool, dtype: torch.dtype) -> str:
        """The mode that runs (``track``: whether a backward can follow)."""
        raise NotImplementedError
