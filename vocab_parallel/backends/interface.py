"""The one backend interface: what every backend implements, and its value types.

A backend computes one vocabulary shard's share of the loss: the local forward statistics,
the fused backward and chunks of logits (``docs/design.md``, "Backends"). Two implement
:class:`Backend`: ``"torch"`` (``vocab_parallel.backends.torch_backend``: chunked PyTorch, the CPU
path) and ``"triton"`` (``vocab_parallel.backends.triton_backend``, the launchers of the Triton
kernels in ``vocab_parallel.kernels``: CUDA or the interpreter); the registry that picks one
is ``vocab_parallel.backends.registry``. Both take their inputs validated, and know nothing of
torch.distributed, reductions or modes.

Per row ``i`` and shard column ``j`` (``t_i``: the row's local target column, -1 when its
target is on another shard or ignored):

    z_ij = cap(x_i @ W_j + b_j) * inv_temperature_i           (:class:`Logits`)
    G_ij = (p_ij * (prob_scale_i + entropy_i * (z_ij - max_i))
            - on_target_i [j == t_i] - smooth * class_weight_j)
           * grad_i * inv_temperature_i * cap'(r_ij)             (:class:`GradTerms`)

with ``p_ij = exp(z_ij - logits_max_i) / sum_exp_i`` (or a saved softmax), ``cap(r) = c
tanh(r / c)`` for ``softcap`` c (else the identity), ``cap'`` its derivative. The
``entropy`` term (0 for the loss) is what the gradient of an entropy adds: ``p_j (z_j -
max)`` is ``p_j log p_j`` up to a per-row constant, which ``prob_scale`` carries
(``vocab_parallel.token_stats``). ``G`` is
rounded to the input dtype once; ``grad_input = G @ W``, ``grad_weight = G.T @ x``,
``grad_bias = G.sum(0)``, accumulated in fp32 (``vocab_parallel.engine.precision``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from vocab_parallel.engine.filtering import GradientFilter


@dataclass(frozen=True, eq=False)
class Logits:
    """How this shard's logits are made from ``x @ W.T``: ``bias`` (``[V]``, input dtype),
    ``softcap`` (c > 0 or None), ``inv_temperature`` (fp32 ``[BT]`` or None for 1)."""

    bias: torch.Tensor | None = None
    softcap: float | None = None
    inv_temperature: torch.Tensor | None = None

    def through_cap(self, g: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``g`` (a gradient w.r.t. the capped logits ``z``, before any temperature) times
        ``dz/dr = 1 - (z / c)^2``, in place; as it is without a cap."""
        if self.softcap is not None:
            g.mul_(torch.div(z, self.softcap).square_().neg_().add_(1.0))
        return g


PLAIN = Logits()


@dataclass(frozen=True, eq=False)
class GradTerms:
    """The per-row terms of ``G`` (the module docstring) and where its softmax comes from.

    ``grad``: fp32 ``[BT]`` or ``[1]`` upstream gradient of each row's loss.
    ``on_target``: what the one-hot subtracts, a float or fp32 ``[BT]`` (``1 - eps``, times
    the target's class weight with class weights). ``smooth``: ``eps / global_vocab_size``.
    ``prob_scale``: fp32 ``[BT]`` factor of the softmax (None: 1). ``class_weight``: fp32
    ``[V]`` factor of ``smooth`` per column (None: 1).
    Softmax source, in order: ``softmax`` (fp32 ``[BT, V]``), else ``logits`` (the saved
    ``z``, with the statistics), else recomputed ``z`` (with the statistics).
    ``reuse_logits``: ``G`` may overwrite the saved ``logits``.
    ``entropy``: fp32 ``[BT]`` factor of ``p_ij (z_ij - logits_max_i)`` (None: 0); needs
    the logits (recomputed or saved), never a saved softmax.
    """

    grad: torch.Tensor
    on_target: float | torch.Tensor = 1.0
    smooth: float = 0.0
    prob_scale: torch.Tensor | None = None
    class_weight: torch.Tensor | None = None
    logits_max: torch.Tensor | None = None
    sum_exp: torch.Tensor | None = None
    softmax: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    reuse_logits: bool = False
    entropy: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class Outputs:
    """Which gradients to compute and where to put them.

    ``grad_input_dtype``: of ``grad_input`` (default the input dtype). The caller's buffers
    (``mode="grad_in_forward"`` walks the tokens in chunks): ``grad_input_out`` receives
    ``grad_input`` (fp32); ``grad_weight_acc`` and ``grad_bias_acc`` get the products
    added, or written when ``accumulate`` is False (the first chunk). ``filter``: the
    tiles of ``G`` the products may leave out (``vocab_parallel.engine.filtering``; None: exact).
    ``g_out``: ``[BT, V]`` in the inputs' dtype: ``G`` is written there, rounded as the
    products would see it, and no product is made (grad_in_forward's kept ``G``, whose
    GEMMs run in the backward).
    """

    need_input: bool = True
    need_weight: bool = True
    need_bias: bool = False
    grad_input_dtype: torch.dtype | None = None
    grad_input_out: torch.Tensor | None = None
    grad_weight_acc: torch.Tensor | None = None
    grad_bias_acc: torch.Tensor | None = None
    accumulate: bool = True
    filter: GradientFilter | None = None
    g_out: torch.Tensor | None = None


class LocalStats(NamedTuple):
    """A shard's per-row statistics of ``z``, each ``[BT]`` fp32 (float64 for float64).
    The last two only when asked for (``extra_stats``; the token statistics' entropy and
    sum of squared probabilities), else None."""

    max: torch.Tensor  # max_j z_ij (-inf for a shard of no columns)
    sum_exp: torch.Tensor  # sum_j exp(z_ij - max)
    predicted: torch.Tensor  # z_i[t_i] where the target is here, else 0
    logit_sum: torch.Tensor  # sum_j class_weight_j z_ij (zeros unless asked for)
    shifted_sum: torch.Tensor | None = None  # sum_j exp(z_ij - max) (z_ij - max)
    exp2_sum: torch.Tensor | None = None  # sum_j exp(2 (z_ij - max))

    def rescaled_extras(self, shift: torch.Tensor) -> list[torch.Tensor]:
        """The shifted and squared sums moved from this max ``m`` to ``shift`` (>= m, per
        row): ``e^(m - shift) (shifted + (m - shift) sum)`` and ``e^(2 (m - shift)) exp2``,
        so that they add up over shards, splits or chunks; [] when there are none. A zero
        sum (a shard of no columns, ``m = -inf``) moves to 0, never ``-inf * 0``."""
        if self.shifted_sum is None:
            return []
        d = self.max - shift
        decay = torch.exp(d)
        moved = torch.where(self.sum_exp > 0, self.shifted_sum + d * self.sum_exp, 0.0)
        return [moved * decay, self.exp2_sum * decay.square()]


class Grads(NamedTuple):
    """A shard's gradients before any all-reduce; None where not asked for."""

    input: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None


class Backend(Protocol):
    """What a backend implements (inputs validated; ``local_target`` int64 ``[BT]``).
    ``epilogues``: a module of fused objective epilogues over whole kept blocks (the
    Triton backend's ``vocab_parallel.backends.triton_epilogues``: the distillation's
    ``divergence_stats``, ``divergence_second``, ``divergence_grad``), or None."""

    name: str
    epilogues: object

    def forward_stats(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        local_target: torch.Tensor,
        logits: Logits = PLAIN,
        *,
        logits_out: torch.Tensor | None = None,
        logit_sum: bool = False,
        class_weight: torch.Tensor | None = None,
        extra_stats: bool = False,
    ) -> LocalStats:
        """:class:`LocalStats` of ``z``; ``logits_out`` (``[BT, V]``, the statistics' dtype)
        receives ``z`` when given; the logit sum is weighted by ``class_weight``;
        ``extra_stats``: also ``shifted_sum`` and ``exp2_sum``."""
        ...

    def fused_backward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        local_target: torch.Tensor,
        logits: Logits,
        terms: GradTerms,
        out: Outputs,
    ) -> Grads:
        """:class:`Grads` of ``G`` (the module docstring)."""
        ...

    def chunk_logits(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        logits: Logits = PLAIN,
        *,
        dtype: torch.dtype | None = None,
    ) -> Callable[..., torch.Tensor]:
        """``make(v0, v1, out=None)``: ``z`` of the shard's columns ``[v0, v1)`` (the module
        docstring), accumulated in fp32 (float64 for float64 inputs) and returned in
        ``dtype`` (None: that one; the Triton backend's are fp32), into ``out`` (``[BT, v1 -
        v0]``) when given. What ``x`` needs once (a cast) is done once per ``make``."""
        ...
