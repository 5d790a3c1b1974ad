"""DTensor inputs of the loss (``torch.distributed.tensor``: torchtitan, ``parallelize_module``).

With torch-native tensor parallelism the LM head's weight is a DTensor: the full
``[V, H]`` tensor, placed ``Shard(0)`` on a 1-D DeviceMesh (the tensor-parallel group).
:func:`vocab_parallel.vocab_parallel_linear_cross_entropy` takes it as ``weight``:

    loss = vocab_parallel_linear_cross_entropy(hidden, model.output.weight, labels)

- The group is the mesh's; this rank's rows are where DTensor puts them (``torch.chunk``
  of the rows: ``ceil(V / world)`` per rank, the last ranks smaller or even empty, unlike
  :func:`vocab_parallel.shard_bounds`). ``process_group``, ``vocab_start_index`` and
  ``global_vocab_size`` may be left out; given, they must agree with the DTensor.
- ``weight.grad`` is a DTensor with the same placement (autograd goes through
  ``to_local()``), so optimizers and ``clip_grad_norm_`` see what they expect.
- ``hidden`` is a plain tensor (identical on the ranks), a ``Replicate()`` DTensor, or a
  ``Shard(d)`` DTensor on a token dim (torchtitan's ``SequenceParallel`` norm output):
  with ``sequence_parallel=True`` each rank then brings its shard of the tokens (the
  targets: a plain tensor of the full or of the local shape, or a DTensor sharded
  alike), without it the tokens are gathered (``full_tensor()``, differentiable).
  ``hidden.grad`` has ``hidden``'s placement.
- The loss is a plain tensor (the same scalar on every rank for ``"mean"``/``"sum"``).

``vocab_parallel.integrations.torch_tp.head_from_colwise`` turns an output projection
parallelised with ``ColwiseParallel`` into a head on the very same parameter; this module
holds only what the loss needs to unwrap DTensor inputs.

``torch.distributed.tensor`` is imported only when a DTensor is in use (it costs about a
second): the loss calls :func:`unwrap_inputs` only once that module is loaded.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from vocab_parallel.options import LossOptions
from vocab_parallel.parallel.collectives import group_ranks

_MODULE = "torch.distributed.tensor"


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (without importing ``torch.distributed.tensor``)."""
    mod = sys.modules.get(_MODULE)
    return mod is not None and isinstance(t, mod.DTensor)


@dataclass(frozen=True)
class VocabShard:
    """Where a ``Shard(0)`` DTensor weight's local rows sit."""

    process_group: dist.ProcessGroup
    start: int  # first global row of this rank
    rows: int  # rows on this rank (0 for the empty chunks of torch.chunk)
    vocab: int  # rows of the whole weight


def _placement(t, name: str):
    mesh = t.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"{name}: a DTensor on a {mesh.ndim}-D DeviceMesh; expected a 1-D mesh (the "
            "tensor-parallel group: pass mesh['tp']'s DTensor, or to_local() with "
            "process_group). Under FSDP2 x TP this is the weight's FSDP2 shard, read "
            "outside the forward of its FSDP module (fully_shard), where FSDP2 gives the "
            "1-D tp DTensor: compute the loss inside that forward"
        )
    return t.placements[0]


def _is_shard(p, dim: int | None = None, ndim: int = 0) -> bool:
    from torch.distributed.tensor import Shard

    if type(p) is not Shard:  # not _StridedShard and the like
        return False
    return dim is None or p.dim % ndim == dim % ndim


def _is_replicate(p) -> bool:
    from torch.distributed.tensor import Replicate

    return isinstance(p, Replicate)


def weight_shard(weight) -> VocabShard:
    """The group and rows of a ``[V, H]`` DTensor weight placed ``Shard(0)`` on a 1-D mesh
    (``ValueError`` naming ``weight`` otherwise)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-D DTensor [V, H], got shape {tuple(weight.shape)}")
    p = _placement(weight, "weight")
    if not _is_shard(p, 0, 2):
        raise ValueError(
            f"weight: a DTensor placed {p!r}; expected Shard(0) (vocabulary rows across the "
            "mesh, as ColwiseParallel places an output projection)"
        )
    mesh = weight.device_mesh
    shape, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    local = weight.to_local()
    if tuple(local.shape) != tuple(shape):  # a DTensor built with from_local(..., shape=...)
        raise ValueError(
            f"weight: this rank's local tensor has shape {tuple(local.shape)}, but DTensor's "
            f"Shard(0) chunking of {tuple(weight.shape)} puts {tuple(shape)} here"
        )
    return VocabShard(mesh.get_group(), int(offset[0]), int(shape[0]), int(weight.shape[0]))


def token_shape(hidden, sequence_parallel: bool) -> tuple:
    """The token dims of ``hidden`` as a call sees them (a sharded DTensor's local tokens
    under sequence parallelism, else its global ones)."""
    if is_dtensor(hidden) and sequence_parallel and not _is_replicate(hidden.placements[0]):
        return tuple(hidden.to_local().shape[:-1])
    return tuple(hidden.shape[:-1])


def local_tensor(t, name: str, sequence_parallel: bool = False, rows: bool = False):
    """An objective's own tensor argument as a plain tensor: a DTensor of vocabulary rows
    (``rows``: a weight or bias, placed Shard(0) on a 1-D mesh) gives its local rows, one
    of tokens its local tokens under sequence parallelism (else all of them); anything
    else is returned as it is."""
    if not is_dtensor(t):
        return t
    p = t.placements[0]
    if rows:
        if t.device_mesh.ndim != 1 or not _is_shard(p, 0, t.dim()):
            raise ValueError(f"{name}: a DTensor placed {p!r}; expected Shard(0) on a 1-D mesh")
        return t.to_local()
    if _is_replicate(p) or sequence_parallel:
        return t.to_local()
    return t.full_tensor()


def _check_stated(name: str, stated: Any, actual: Any, shown: str) -> None:
    if stated is not None and stated != actual:
        raise ValueError(f"{name}: {stated!r}, but the DTensor weight says {shown}")


def _local_target(target, hidden, sequence_parallel: bool):
    """The targets of the tokens ``hidden`` (a DTensor, before unwrapping) leaves here
    (None: no targets)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if target is None:
        return None
    if is_dtensor(target):
        if not sequence_parallel:
            return target.full_tensor()
        if is_dtensor(hidden) and tuple(target.placements) != tuple(hidden.placements):
            raise ValueError(
                f"target: a DTensor placed {tuple(target.placements)}; with sequence_parallel "
                f"it must be sharded like hidden ({tuple(hidden.placements)})"
            )
        return target.to_local()
    if not (sequence_parallel and is_dtensor(hidden) and not _is_replicate(hidden.placements[0])):
        return target
    tokens = tuple(hidden.shape[:-1])
    if tuple(target.shape) != tokens:  # this rank's targets already (or wrong: checked later)
        return target
    shape, offset = compute_local_shape_and_global_offset(
        hidden.shape, hidden.device_mesh, hidden.placements
    )
    index = tuple(slice(o, o + s) for o, s in zip(offset[:-1], shape[:-1], strict=True))
    return target[index]


def _local_hidden(hidden, sequence_parallel: bool):
    p = _placement(hidden, "hidden")
    if _is_replicate(p):
        if sequence_parallel:
            raise ValueError(
                "hidden: a Replicate() DTensor holds every token; sequence_parallel=True "
                "expects this rank's tokens (a Shard(d) DTensor or a plain tensor)"
            )
        return hidden.to_local()
    if hidden.dim() >= 2 and _is_shard(p) and p.dim % hidden.dim() != hidden.dim() - 1:
        return hidden.to_local() if sequence_parallel else hidden.full_tensor()
    raise ValueError(
        f"hidden: a DTensor placed {p!r}; expected Replicate() or Shard(d) on a token dim "
        "(not the hidden dim)"
    )


def _row_shards(opts: LossOptions) -> dict:
    """The ``bias`` / ``class_weight`` DTensors of ``opts`` as local tensors (each must be a
    ``[V]`` DTensor placed ``Shard(0)``, like the weight; autograd goes through them)."""
    local = {}
    for name in ("bias", "class_weight"):
        t = getattr(opts, name)
        if not is_dtensor(t):
            continue
        p = _placement(t, name)
        if t.dim() != 1 or not _is_shard(p, 0, 1):
            raise ValueError(
                f"{name}: a DTensor of shape {tuple(t.shape)} placed {p!r}; expected a [V] "
                "DTensor placed Shard(0), like the weight"
            )
        local[name] = t.to_local()
    return local


def unwrap_inputs(hidden, weight, target, opts: LossOptions, process_group) -> tuple:
    """Plain tensors and the layout for the loss, from inputs that may be DTensors.

    Returns ``(hidden, weight, target, opts, process_group)``: ``opts`` with the layout
    (``vocab_start_index``, ``global_vocab_size``) of a DTensor weight and local ``bias`` /
    ``class_weight`` rows; without a DTensor among the inputs, everything as it is. The
    local tensors stay connected to the DTensors for autograd. A DTensor ``bias`` (``[V]``,
    what ``ColwiseParallel`` makes of a projection's bias) must be placed ``Shard(0)`` like
    the weight; its gradient is then a DTensor placed alike.
    """
    rows = (opts.bias, opts.class_weight)
    if not any(is_dtensor(t) for t in (hidden, weight, target, *rows)):
        return hidden, weight, target, opts, process_group
    changes = _row_shards(opts)
    if is_dtensor(weight):
        shard = weight_shard(weight)
        if process_group is not None and group_ranks(process_group) != group_ranks(
            shard.process_group
        ):
            raise ValueError(
                f"process_group: ranks {group_ranks(process_group)}, but the mesh of the "
                f"DTensor weight has ranks {group_ranks(shard.process_group)}; leave "
                "process_group out (the mesh's group is used)"
            )
        _check_stated("vocab_start_index", opts.vocab_start_index, shard.start, f"{shard.start}")
        _check_stated("global_vocab_size", opts.global_vocab_size, shard.vocab, f"{shard.vocab}")
        process_group = process_group if process_group is not None else shard.process_group
        changes |= {"vocab_start_index": shard.start, "global_vocab_size": shard.vocab}
        weight = weight.to_local()
    sequence_parallel = opts.sequence_parallel
    target = _local_target(target, hidden, sequence_parallel)
    if is_dtensor(hidden):
        if sequence_parallel and not _is_replicate(_placement(hidden, "hidden")):
            ranks = group_ranks(hidden.device_mesh.get_group())
            if process_group is None or group_ranks(process_group) != ranks:
                raise ValueError(
                    f"hidden: sharded over the mesh of ranks {ranks}, but process_group "
                    f"(the tensor-parallel group) has ranks {group_ranks(process_group)}; "
                    "with sequence_parallel they must be the same group"
                )
        hidden = _local_hidden(hidden, sequence_parallel)
    return hidden, weight, target, opts.replace(**changes) if changes else opts, process_group
