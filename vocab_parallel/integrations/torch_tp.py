"""torch-native tensor parallelism (``parallelize_module``, torchtitan): our head on a
``ColwiseParallel`` output projection.

``head_from_colwise(model.output)`` gives a :class:`DTensorLMHead` that holds the very
DTensor parameters of the projection (no copy); the loss unwraps them
(``vocab_parallel.parallel.dtensor``). ``torch.distributed.tensor`` is imported only when used.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vocab_parallel.lm_head import VocabParallelLMHead
from vocab_parallel.parallel.dtensor import is_dtensor, weight_shard


class DTensorLMHead(VocabParallelLMHead):
    """A :class:`VocabParallelLMHead` whose ``weight`` (and ``bias``, if any) is a
    ``Shard(0)`` DTensor parameter (made by :func:`head_from_colwise`); their gradients are
    DTensors with that placement."""

    _dtensor_weight = True

    @torch.no_grad()
    def full_weight(self) -> torch.Tensor:
        """The whole ``[vocab_size, hidden_size]`` weight (a collective: ``full_tensor()``)."""
        return self.weight.full_tensor().detach().clone()

    @torch.no_grad()
    def load_full_weight_(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of a full ``[vocab_size, hidden_size]`` weight."""
        expected = (self.vocab_size, self.hidden_size)
        if tuple(weight.shape) != expected:
            raise ValueError(f"weight: expected shape {expected}, got {tuple(weight.shape)}")
        self.weight.to_local().copy_(weight[self.vocab_start_index : self.vocab_end_index])


def head_from_colwise(linear: nn.Linear, **loss_options: Any) -> DTensorLMHead:
    """Our LM head on the weight of an output projection parallelised with ``ColwiseParallel``.

    ``linear.weight`` must be a ``[V, H]`` DTensor parameter placed ``Shard(0)`` on a 1-D
    mesh (what ``parallelize_module(model, tp_mesh, {"output": ColwiseParallel()})``
    makes). The head holds that very parameter (no copy: the optimizer, checkpoints and
    ``linear`` keep seeing it; its gradient is a ``Shard(0)`` DTensor), and ``linear.bias``
    the same way if there is one (passed to the loss as its ``bias``). ``loss_options``
    are the head's (``reduction``, ``mode``, ``sequence_parallel``...). Then

        model.output = head_from_colwise(model.output)
        loss = model.output(hidden, labels)    # instead of F.cross_entropy(model.output(h), ..)

    The head runs none of ``ColwiseParallel``'s input/output hooks: ``hidden`` may be a
    plain tensor or a DTensor, as ``vocab_parallel.parallel.dtensor.unwrap_inputs`` describes.
    """
    weight = getattr(linear, "weight", None)
    if not is_dtensor(weight) or not isinstance(weight, nn.Parameter):
        raise TypeError(
            "linear: expected a module whose weight is a DTensor parameter (an output "
            f"projection after parallelize_module with ColwiseParallel), got weight of type "
            f"{type(weight).__name__}"
        )
    bias = getattr(linear, "bias", None)
    if bias is not None:
        if not is_dtensor(bias) or not isinstance(bias, nn.Parameter):
            raise TypeError(
                f"linear: its bias is a {type(bias).__name__}, its weight a DTensor; expected "
                "both DTensor parameters (ColwiseParallel places both Shard(0))"
            )
        if "bias" in loss_options:
            raise TypeError("bias: set by head_from_colwise from linear.bias, not an option")
    shard = weight_shard(weight)
    local = nn.Parameter(weight.to_local().detach(), requires_grad=weight.requires_grad)
    head = DTensorLMHead.from_shard(
        local, shard.vocab, shard.start, shard.process_group, **loss_options
    )
    del head.weight  # the stand-in (a view of the local shard) makes way for the DTensor
    head.weight = weight
    if bias is not None:
        head.bias = bias  # registered: in parameters() and the state dict, like linear's
    return head
