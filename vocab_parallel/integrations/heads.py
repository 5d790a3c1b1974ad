"""From any LM head layer to our head: the one adapter the integrations share.

The DeepSpeed and Hugging Face integrations (and users) meet the output layer in several
forms: a plain ``nn.Linear`` (no tensor parallelism), DeepSpeed AutoTP's
``VocabParallelLinear`` (rows of the vocabulary over ``mp_group``), a ``ColwiseParallel``
projection (a ``Shard(0)`` DTensor weight), or our own :class:`VocabParallelLMHead`.
:func:`head_from_layer` turns each into our head on the very same parameters, so the
optimizer, checkpoints and the layer keep seeing them. Nothing here imports DeepSpeed or
transformers (duck-typed).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vocab_parallel.integrations.torch_tp import DTensorLMHead, head_from_colwise
from vocab_parallel.lm_head import VocabParallelLMHead
from vocab_parallel.parallel.dtensor import is_dtensor
from vocab_parallel.parallel.sharded import full_shape, unshard_fsdp_module


def head_from_layer(layer: nn.Module, **loss_options: Any) -> VocabParallelLMHead:
    """Our head for an LM head ``layer`` of any kind, on its very parameters (no copy):

    - our own :class:`VocabParallelLMHead` (a :class:`DTensorLMHead` too): as it is, with its
      own options, unless ``loss_options`` asks for others (then a head with those);
    - a ``ColwiseParallel`` projection (DTensor weight): :func:`head_from_colwise`;
    - DeepSpeed AutoTP's ``VocabParallelLinear``, or a plain ``nn.Linear`` (one shard):
      :func:`head_from_autotp`.

    An FSDP2 module of its own (``fully_shard(lm_head)``) is unsharded first (call this
    inside the model's forward then): the head is built on its whole parameters, and the
    loss does not run the layer's forward, where FSDP2 would gather them
    (:func:`vocab_parallel.parallel.sharded.unshard_fsdp_module`). Our own head used as it is needs
    none of that: called as a module, FSDP2 gathers it for its forward.
    """
    if isinstance(layer, VocabParallelLMHead) and _keeps_options(layer, loss_options):
        return layer  # ours (DTensorLMHead too), with its own options: used as it is
    unshard_fsdp_module(layer)
    if isinstance(layer, VocabParallelLMHead):  # ours, other options: a head on its params
        return _own_head(layer, loss_options)
    if is_dtensor(getattr(layer, "weight", None)):  # ColwiseParallel (parallelize_module)
        return head_from_colwise(layer, **loss_options)
    return head_from_autotp(layer, **loss_options)  # AutoTP's, or a plain nn.Linear


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return type(a) is type(b) and a == b


def _keeps_options(layer: VocabParallelLMHead, given: dict[str, Any]) -> bool:
    """Whether ``given`` asks for nothing but what our head ``layer`` already has."""
    own = {k: v for k, v in layer.loss_options.items() if k != "bias"}
    return all(k in own and _same(own[k], v) for k, v in given.items())


def _own_head(layer: VocabParallelLMHead, given: dict[str, Any]) -> VocabParallelLMHead:
    """The model's own :class:`VocabParallelLMHead`: as it is, with its own options, unless
    ``apply_vocab_parallel_loss`` was given other values (then a head with those, on the
    very same parameters: nothing is copied, the layer is not changed)."""
    if _keeps_options(layer, given):
        return layer
    own = {k: v for k, v in layer.loss_options.items() if k != "bias"}
    options = own | dict(given)
    if isinstance(layer, DTensorLMHead):  # its weight and bias are DTensor parameters
        return head_from_colwise(layer, **options)
    bias = layer.bias if layer.bias is not None else layer.loss_options.get("bias")
    if bias is not None:
        options["bias"] = bias
    return VocabParallelLMHead.from_shard(
        layer.weight, layer.vocab_size, layer.vocab_start_index, layer.process_group, **options
    )


def layer_group(layer: nn.Module) -> dist.ProcessGroup | None:
    """The tensor-parallel group the output layer is sharded over, as far as it can be told
    without validating the layer (``None``: none, or not known)."""
    if isinstance(layer, VocabParallelLMHead):
        return layer.process_group
    weight = getattr(layer, "weight", None)
    if is_dtensor(weight):
        mesh = weight.device_mesh
        return mesh.get_group() if mesh.ndim == 1 else None
    group = getattr(layer, "mp_group", None)
    return group if isinstance(group, dist.ProcessGroup) else None


AUTOTP_OPTION = '"tensor_parallel": {"autotp_size": N, "vocab_parallel_lm_head": true}'


def head_from_autotp(layer: nn.Module, **loss_options) -> VocabParallelLMHead:
    """Our loss head around DeepSpeed AutoTP's vocabulary-parallel LM head, sharing its shard;
    or around a plain ``nn.Linear`` head (no tensor parallelism).

    DeepSpeed's AutoTP (config ``"tensor_parallel": {"autotp_size": N,
    "vocab_parallel_lm_head": true}``) replaces a model's ``lm_head`` by
    ``deepspeed.module_inject.layers.VocabParallelLinear``: it holds rows
    ``[vocab_start_index, vocab_end_index)`` of the head over ``mp_group`` (uneven,
    grain-aligned shards: not necessarily our default layout, so the bounds are taken from
    the layer) and returns rank-local logits. The returned head computes the loss from the
    hidden states without those logits, on the **same** ``nn.Parameter`` (no second copy
    of the shard; gradients land in the layer's weight, which DeepSpeed already tags
    tensor-parallel and checkpoints).

    Any module with ``weight``, ``vocab_size`` (global), ``vocab_start_index``,
    ``vocab_end_index`` and ``mp_group`` works (duck-typed, so DeepSpeed is not imported).
    A plain ``nn.Linear`` (TP 1, or a head AutoTP left whole) gives a head over the whole
    vocabulary without collectives (``process_group=None``), on its weight, which is
    then left untagged (it counts once in gradient norms, also when tied to an embedding).

    A bias of the layer (this rank's rows) is passed to the loss as its ``bias`` option
    (the layer's own parameter: its gradient lands there).

    Args:
        layer: the AutoTP head or an ``nn.Linear``.
        **loss_options: any option of :class:`VocabParallelLMHead` (``ignore_index``,
            ``reduction``, ``label_smoothing``, ``mode``, ``backend``...).

    Raises:
        TypeError: ``layer`` is neither (e.g. AutoTP's column-parallel ``LinearLayer``,
            which gathers full logits, when ``vocab_parallel_lm_head`` is off); the message
            names the DeepSpeed option to turn on. Also a layer with a DTensor weight
            (``ColwiseParallel``): :func:`head_from_colwise` is its
            head.
        ValueError: a weight that does not match the layer's rows, an AutoTP shard
            partitioned by ZeRO stage 3, or a bias where the loss takes none. (A plain
            ``nn.Linear`` under ZeRO-3 is fine: see ``vocab_parallel.parallel.sharded``.)
    """
    fields = ("vocab_size", "vocab_start_index", "vocab_end_index", "mp_group")
    missing = [a for a in ("weight", *fields) if not hasattr(layer, a)]
    if missing and not isinstance(layer, nn.Linear):
        what = type(layer).__name__
        if hasattr(layer, "gather_output"):
            what += " (DeepSpeed AutoTP's column-parallel head, which gathers full logits)"
        raise TypeError(
            f"layer: {what} is not a vocabulary-parallel LM head (it lacks "
            f"{', '.join(missing)}): turn on {AUTOTP_OPTION} in the DeepSpeed config so that "
            "AutoTP shards lm_head by vocabulary (VocabParallelLinear), or pass a plain "
            "nn.Linear head (no tensor parallelism)"
        )
    weight, bias = layer.weight, getattr(layer, "bias", None)
    if is_dtensor(weight) or is_dtensor(bias):
        # torch-native tensor parallelism: the shard layout is the DTensor's, not rows of
        # the whole vocabulary (a plain-Linear head here would state the wrong rows)
        raise TypeError(
            f"layer: {type(layer).__name__}'s weight is a DTensor (parallelize_module with "
            "ColwiseParallel); use vocab_parallel.integrations.torch_tp.head_from_colwise(layer)"
        )
    if bias is not None:  # this rank's bias rows, the layer's parameter: passed to the loss
        if loss_options.get("bias") is not None:
            raise ValueError("bias: the layer has its own bias; do not pass one")
        loss_options = loss_options | {"bias": bias}
    if missing:  # a plain nn.Linear: the whole vocabulary on this rank
        # (under ZeRO-3 an empty partition outside a gather: the whole shape is ds_shape,
        # and the loss reads the weight where ZeRO-3 gathers it)
        shape = full_shape(weight) if isinstance(weight, torch.Tensor) else ()
        if not isinstance(weight, nn.Parameter) or len(shape) != 2:
            raise ValueError("layer.weight: expected a 2-D parameter [vocab_size, hidden_size]")
        return VocabParallelLMHead.from_shard(
            weight, shape[0], 0, process_group=None, **loss_options
        )
    if hasattr(weight, "ds_id"):  # AutoTP's shard, partitioned by ZeRO-3 on top
        raise ValueError(
            "layer.weight: DeepSpeed AutoTP's vocabulary shard, partitioned by ZeRO stage 3 as "
            "well, which DeepSpeed's AutoTP training does not combine; use ZeRO stage 0, 1 or 2 "
            "with AutoTP, or ZeRO-3 without tensor parallelism (a plain nn.Linear lm_head)"
        )
    start, end = int(layer.vocab_start_index), int(layer.vocab_end_index)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2 or weight.shape[0] != end - start:
        raise ValueError(
            f"layer.weight: expected a 2-D parameter of {end - start} rows "
            f"[vocab_start_index, vocab_end_index) = [{start}, {end}), got "
            f"{tuple(weight.shape)}"
        )
    return VocabParallelLMHead.from_shard(
        weight, int(layer.vocab_size), start, process_group=layer.mp_group, **loss_options
    )
