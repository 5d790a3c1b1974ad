"""Weights that a data-parallel sharding framework partitions: DeepSpeed ZeRO-3 and FSDP2.

Both frameworks keep only a slice of each parameter between uses and put the whole
tensor back for the forward (and backward) of the module that owns it:

- **ZeRO-3** leaves the ``nn.Parameter`` object in place but empties it: outside a gather
  ``param.shape`` is ``(0,)`` (``ds_status`` ``NOT_AVAILABLE``), the full shape is
  ``param.ds_shape``, the partition lives in ``param.ds_tensor``. Inside the forward of the
  module that owns the parameter, or of any parent module (the engine hooks the model's
  forward), attribute access (``module.weight``) gathers it (ZeRO-3 swaps every module's
  parameter dict for one that does) and keeps it for that module's backward.
- **FSDP2** (``fully_shard``) swaps the parameter object itself: outside the forward of its
  FSDP module it is a ``DTensor`` sharded over the data-parallel mesh, inside it the whole
  (unsharded) parameter.

So the loss reads its weight where the framework has gathered it (the LM head's forward,
or the model's) and must never read a partition as if it were the weight: an empty ZeRO-3
partition would fail obscurely, and an FSDP2 shard looks like a vocabulary shard of
tensor parallelism. Nothing here imports DeepSpeed (the attributes are duck-typed).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from vocab_parallel.parallel.dtensor import is_dtensor

ZERO3_FIX = (
    "ZeRO-3 gathers a parameter only inside the forward of the module that owns it or of a "
    "parent module (the model's forward, which the engine hooks): compute the loss there, with "
    "a VocabParallelLMHead submodule or apply_vocab_parallel_loss(model), not on the parameter "
    "after the forward (and never with deepspeed.zero.GatheredParameters inside a forward)"
)


def zero3_partitioned(t: object) -> bool:
    """Whether ``t`` is a DeepSpeed ZeRO-3 parameter whose data is not gathered now."""
    shape = getattr(t, "ds_shape", None)
    return shape is not None and isinstance(t, torch.Tensor) and tuple(t.shape) != tuple(shape)


def full_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The shape of the whole parameter: ZeRO-3's ``ds_shape``, else ``t.shape``."""
    shape = getattr(t, "ds_shape", None)
    return tuple(shape) if shape is not None else tuple(t.shape)


def check_gathered(name: str, t: object) -> None:
    """``ValueError`` naming ``name`` if ``t`` is a ZeRO-3 partition read outside a gather.

    Every data-parallel rank holds an empty parameter alike, so every rank raises alike."""
    if zero3_partitioned(t):
        raise ValueError(
            f"{name}: a DeepSpeed ZeRO-3 partition read outside a gather (shape "
            f"{tuple(t.shape)}, whole parameter {full_shape(t)}); {ZERO3_FIX}"
        )


def is_fsdp_module(module: object) -> bool:
    """Whether ``module`` is an FSDP2 module (``fully_shard`` made it one), without
    importing ``torch.distributed.fsdp``."""
    mod = sys.modules.get("torch.distributed.fsdp")
    return mod is not None and isinstance(module, mod.FSDPModule)


def check_plain(name: str, t: object) -> None:
    """``ValueError`` naming ``name`` if a head that holds a plain tensor finds a DTensor
    there: FSDP2's shard over the data-parallel mesh, read outside the forward of its FSDP
    module. (Taken for a vocabulary shard it would state the wrong rows.)"""
    if is_dtensor(t):
        ranks = t.device_mesh.mesh.flatten().tolist()
        raise ValueError(
            f"{name}: a DTensor (placed {tuple(t.placements)} over ranks {ranks}) where the "
            "head holds a plain tensor: an FSDP2 (fully_shard) shard, read outside the forward "
            "of its FSDP module. FSDP2 gathers a parameter only inside that forward: call the "
            "head inside the model's forward (or fully_shard the head on its own and call it)"
        )


def unshard_fsdp_module(layer: nn.Module) -> None:
    """FSDP2's ``unshard()`` of an output layer that is an FSDP2 module of its own.

    FSDP2 gathers a module's parameters for its forward, and a loss on the hidden states
    never runs the output layer's forward; so the layer is unsharded here, inside the
    model's forward, as torchtitan's plug-in does. FSDP2 then finishes the job itself: its
    post-backward (which the root's final callback runs for a module whose forward was
    skipped) reduce-scatters the weight's gradient and reshards the weight. A no-op for any
    other module, and for one already unsharded."""
    if is_fsdp_module(layer):
        layer.unshard()
