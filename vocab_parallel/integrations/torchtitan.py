"""torchtitan plug-in: the training loss from the hidden states and ``lm_head``, no logits.

    from vocab_parallel.integrations.torchtitan import VocabParallelLossWrapper

    config.loss = VocabParallelLossWrapper.Config()      # instead of ChunkedLossWrapper.Config()
    # any loss option: VocabParallelLossWrapper.Config(z_loss=1e-4, label_smoothing=0.1)

torchtitan 0.3's trainer hands a ``ChunkedLossWrapper`` (``components/loss.py``) the model's
``lm_head`` (``set_lm_head``) and makes the model return its final hidden states
(``_skip_lm_head``); it then calls ``loss_fn(pred, labels, global_valid_tokens)`` and
expects ``(loss, metrics)``, the loss being this rank's SUM of token losses divided by the
valid tokens of the whole step (``global_valid_tokens``, over the data-parallel ranks and
micro-batches). :class:`VocabParallelLossWrapper` is a ``ChunkedLossWrapper`` (so the
trainer wires it the same way) whose call runs :func:`vocab_parallel.loss.run_loss` on those
hidden states and ``lm_head``'s weight instead of chunks of logits:

* **Tensor parallelism**: ``lm_head`` is ``ColwiseParallel``: its weight a ``Shard(0)``
  DTensor over the ``tp`` mesh (uneven DTensor chunks allowed), the hidden states a
  ``Replicate()`` DTensor (the root norm all-gathers sequence-parallel states), as
  ``vocab_parallel.parallel.dtensor`` reads them. The loss all-reduces the gradient of the hidden
  states, so it arrives complete, as the ``Replicate()`` placement says.
* **FSDP2** (``lm_head`` an ``FSDPModule``, grouped with the root norm): the loss
  unshards it (its weight is then the tensor-parallel DTensor) and leaves the rest to
  FSDP: the weight's gradient is reduce-scattered by FSDP's post-backward (the root's
  final callback runs it for a module whose forward did not run), as after any backward.
* Labels of ``-100`` (torchtitan's ``IGNORE_INDEX``) are ignored.
* **SPMD backend**: tensor parallelism needs ``parallelism.spmd_backend="partial_dtensor"``
  (the DTensor placements above). torchtitan 0.3's default, ``"spmd_types"``, gives
  ``lm_head`` a plain local shard and plain hidden states whose gradient it expects
  rank-local: ``set_lm_head`` and the call refuse it (``ValueError`` naming
  ``parallelism.spmd_backend``, on every rank) at a tensor-parallel degree above 1;
  at degree 1 either backend works. A plain weight of other than ``out_features`` rows
  (a shard whose place nothing states) is refused by :func:`lm_head_loss` as well,
  never scored as if it were the whole vocabulary.

The plain function :func:`lm_head_loss` does the same for callers of their own.
torchtitan is imported only when :class:`VocabParallelLossWrapper` is first used (PEP 562
module ``__getattr__``): importing this module does not import it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from vocab_parallel.loss import run_loss
from vocab_parallel.options import LossOptions
from vocab_parallel.parallel.dtensor import is_dtensor

__all__ = ["VocabParallelLossWrapper", "lm_head_loss"]  # noqa: F822 (made lazily, below)

IGNORE_INDEX = -100  # torchtitan's (components/loss.py)


def _is_fsdp(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def lm_head_loss(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor,
    global_valid_tokens: torch.Tensor | int | None = None,
    options: LossOptions | None = None,
) -> torch.Tensor:
    """This rank's summed token losses of ``lm_head(hidden)`` against ``labels``, divided by
    ``global_valid_tokens`` when given (torchtitan's normalisation), without logits.

    Args:
        hidden: ``[B, L, D]`` final hidden states: a plain tensor, or a ``Replicate()``
            DTensor on the tensor-parallel mesh.
        lm_head: an ``nn.Linear`` (possibly ``ColwiseParallel``: a ``Shard(0)`` DTensor
            weight; possibly an ``FSDPModule``); its bias, if any, is used too. A plain
            weight must be the whole vocabulary (``out_features`` rows).
        labels: ``[B, L]`` token ids, ``-100`` ignored.
        options: the loss options (``reduction`` is ``"sum"`` here whatever it says;
            ``ignore_index`` defaults to -100).
    """
    if not isinstance(lm_head, nn.Module) or not isinstance(
        getattr(lm_head, "weight", None), torch.Tensor
    ):
        raise TypeError("lm_head: expected an nn.Linear-like module with a weight")
    opts = (options or LossOptions()).replace(reduction="sum")
    if _is_fsdp(lm_head):
        lm_head.unshard()  # its parameters are the unsharded (tensor-parallel) ones now
    if _plain_shard(lm_head):
        raise ValueError(
            f"lm_head: its weight is a plain tensor whose rows are not lm_head.out_features "
            f"({lm_head.out_features}): a shard of the vocabulary whose place nothing states. "
            "Give the Shard(0) DTensor weight of ColwiseParallel (torchtitan: "
            "parallelism.spmd_backend='partial_dtensor'), or call the loss with the shard's "
            "process_group and layout (vocab_parallel.loss.run_loss)"
        )
    bias = getattr(lm_head, "bias", None)
    if bias is not None:
        opts = opts.replace(bias=bias)
    loss = run_loss(hidden, lm_head.weight, labels, opts)
    if global_valid_tokens is not None:
        loss = loss / global_valid_tokens
    return loss


def _plain_shard(lm_head: nn.Module) -> bool:
    """Whether ``lm_head``'s weight is a plain tensor of other than ``out_features`` rows:
    a local shard (torchtitan's ``spmd_types`` backend gives one), whose rows' place in
    the vocabulary and whose group a plain tensor does not carry."""
    vocab = getattr(lm_head, "out_features", None)
    weight = lm_head.weight
    return (
        isinstance(vocab, int)
        and not is_dtensor(weight)
        and weight.dim() == 2
        and weight.shape[0] != vocab
    )


def _check_spmd_backend(lm_head: nn.Module) -> None:
    """Refuse torchtitan's ``spmd_types`` backend under tensor parallelism, the same way on
    every rank: its ``lm_head`` weight is a plain local shard and its hidden states plain
    tensors whose gradient it expects rank-local (``Partial`` on the tp axis), neither of
    which the loss can be told. (At TP 1 the weight is the whole vocabulary: accepted.)"""
    try:
        from torchtitan.distributed.spmd_types import spmd_mesh_size
        from torchtitan.distributed.utils import get_spmd_backend
    except ImportError:  # a torchtitan without SPMD backends
        return
    if get_spmd_backend() != "spmd_types":
        return
    if spmd_mesh_size("tp") > 1 or _plain_shard(lm_head):
        raise ValueError(
            "parallelism.spmd_backend: 'spmd_types' (torchtitan's default) with tensor "
            "parallelism gives lm_head a plain local shard of the vocabulary, whose layout "
            "and group the vocabulary-parallel loss cannot read; set "
            "parallelism.spmd_backend='partial_dtensor' (lm_head ColwiseParallel: a Shard(0) "
            "DTensor weight). At tensor_parallel_degree 1 either backend works"
        )


# The torchtitan component, made when first asked for (it subclasses torchtitan's class).
_OPTION_FIELDS = (
    "label_smoothing", "z_loss", "softcap", "mode", "backend", "check_inputs", "filter_eps",
    "filter_grads",
)  # fmt: skip
_component: type | None = None


def _make_component() -> type:
    from torchtitan.components.loss import ChunkedLossWrapper

    @dataclasses.dataclass(kw_only=True, slots=True)
    class _Config(ChunkedLossWrapper.Config):
        """``ChunkedLossWrapper.Config`` plus the loss options (``num_chunks`` and
        ``loss_fn`` are not used: no logits are made)."""

        label_smoothing: float = 0.0
        z_loss: float = 0.0
        softcap: float | None = None
        mode: str = "auto"
        backend: str = "auto"
        check_inputs: bool = True
        filter_eps: float | str | None = None
        filter_grads: str = "both"

    class VocabParallelLossWrapper(ChunkedLossWrapper):
        """torchtitan's ``ChunkedLossWrapper`` slot, filled by the vocabulary-parallel
        loss (see :mod:`vocab_parallel.integrations.torchtitan`)."""

        Config = _Config

        def __init__(self, config: _Config, *, compile_config: Any = None) -> None:
            # ChunkedLossWrapper.__init__ would build its logits loss: not needed.
            self.lm_head = None
            self.options = LossOptions(
                ignore_index=IGNORE_INDEX,
                reduction="sum",
                **{name: getattr(config, name) for name in _OPTION_FIELDS},
            )

        def set_lm_head(self, lm_head: nn.Module) -> None:
            """As ``ChunkedLossWrapper.set_lm_head``; refuses a tensor-parallel ``lm_head``
            of torchtitan's ``spmd_types`` backend at once (``parallelism.spmd_backend``)."""
            _check_spmd_backend(lm_head)
            self.lm_head = lm_head

        def __call__(
            self,
            pred: torch.Tensor,
            labels: torch.Tensor,
            global_valid_tokens: torch.Tensor | None = None,
            **loss_inputs: Any,
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            if self.lm_head is None:
                raise ValueError(
                    "lm_head: not set; call set_lm_head(model.lm_head) first (torchtitan's "
                    "trainer does) and build the model with _skip_lm_head=True"
                )
            del loss_inputs  # e.g. positions: nothing a per-token loss needs
            _check_spmd_backend(self.lm_head)  # the tp mesh is known inside the step only
            loss = lm_head_loss(pred, self.lm_head, labels, global_valid_tokens, self.options)
            return loss, {}

    _Config._owner = VocabParallelLossWrapper
    VocabParallelLossWrapper.__module__ = __name__
    return VocabParallelLossWrapper


def __getattr__(name: str) -> Any:
    global _component
    if name == "VocabParallelLossWrapper":
        if _component is None:
            _component = _make_component()
        return _component
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
