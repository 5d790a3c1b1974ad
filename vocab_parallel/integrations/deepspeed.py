"""DeepSpeed plug-in: train a model whose LM head is a :class:`VocabParallelLMHead`.

    from vocab_parallel.integrations import deepspeed as vp_deepspeed
    from vocab_parallel.parallel.groups import init_parallel_groups

    vp_deepspeed.init_distributed()                    # nccl on GPUs, gloo on CPUs
    groups = init_parallel_groups(tp_size=2)           # TP groups x DP groups
    model = GPT(cfg, process_group=groups.tp_group)    # or any model using our head
    engine, optimizer, _, _ = vp_deepspeed.initialize(
        model, groups, config, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4)
    )
    loss = engine(idx, targets); engine.backward(loss); engine.step()

What DeepSpeed needs from us, and why:

* **The mpu** (:class:`~vocab_parallel.parallel.groups.ModelParallelUnit`). Without it DeepSpeed
  takes every rank for a data-parallel replica: it would average gradients (and ZeRO
  partition state) over the whole world, averaging one TP rank's head rows with another
  rank's different rows. With it, gradients are averaged and ZeRO partitions over the
  data-parallel group only, checkpoints are written per model-parallel rank
  (``mp_rank_XX_model_states.pt``, each with its own head shard), and gradient norms are
  summed over the TP group.
* **Tensor-parallel attributes on the sharded weight** (``tensor_model_parallel``, set by
  the head itself). DeepSpeed's gradient clipping (stage 0: ``runtime.utils.clip_grad_norm_``;
  ZeRO-1/2: the ZeRO optimizer's norm) counts a gradient on TP rank 0, or on every TP rank
  if the parameter is tensor-parallel, and then sums the squares over the TP group. So the
  replicated body counts once and each head shard counts once: the norm of the full model.
  Without the attribute the shards of ranks > 0 would be silently dropped from the norm.
  (One DeepSpeed path drops them anyway, fp16/bf16 without ZeRO: :func:`initialize`
  refuses it when clipping.)
* Nothing else: the head's loss all-reduces ``grad_input`` over the TP group in its
  backward, so the replicated body receives identical gradients on every TP rank and stays
  replicated under any optimizer.

DeepSpeed is imported inside the functions only: importing this module costs nothing and
works where DeepSpeed is not installed.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vocab_parallel.integrations.heads import AUTOTP_OPTION, head_from_autotp
from vocab_parallel.lm_head import VocabParallelLMHead
from vocab_parallel.parallel.groups import ModelParallelUnit, ParallelGroups

# head_from_autotp lives with the other layer adapters (integrations/heads.py); it is part
# of this integration's API.
__all__ = ["AUTOTP_OPTION", "head_from_autotp", "init_distributed", "initialize", "check_heads"]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def init_distributed(
    backend: str | None = None, timeout: datetime.timedelta | float | None = None
) -> None:
    """Start torch.distributed through DeepSpeed (NCCL on CUDA machines, gloo elsewhere).

    DeepSpeed's own communication layer (``deepspeed.comm``) must be set up by
    ``deepspeed.init_distributed``: a plain ``torch.distributed.init_process_group`` is not
    enough for DeepSpeed's collectives (e.g. its vocabulary-parallel losses and AutoTP
    layers fail with "DeepSpeed backend not set"). If torch.distributed is already
    initialised (e.g. by ``init_process_group`` with a store), DeepSpeed wraps that group
    and ``backend`` is ignored.

    Started without a launcher (no ``RANK``/``WORLD_SIZE`` in the environment), this is a
    world of one process on ``127.0.0.1`` instead of DeepSpeed's MPI discovery.

    ``deepspeed.initialize`` also wants ``LOCAL_RANK`` in the environment (torchrun and
    the DeepSpeed launcher set it; set it yourself when starting processes otherwise).

    On CPU the first call in a fresh environment JIT-compiles DeepSpeed's shared-memory
    communication op with the C++ compiler (0.5-2 minutes on 2 cores; cached under
    ``~/.cache/torch_extensions``, or ``TORCH_EXTENSIONS_DIR``, afterwards).

    Args:
        backend: ``"nccl"``, ``"gloo"``...; default NCCL when CUDA is available, else
            gloo.
        timeout: collective timeout (a timedelta or seconds), default 30 minutes.
    """
    import deepspeed

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    elif not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if not dist.is_initialized() and "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        for key, value in (
            ("RANK", "0"),
            ("LOCAL_RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", str(_free_port())),
        ):
            os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)


def initialize(
    model: nn.Module,
    groups: ParallelGroups,
    config: Mapping[str, Any] | str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    **kwargs,
):
    """``deepspeed.initialize`` for a model with vocabulary-parallel heads; same return value
    ``(engine, optimizer, dataloader, lr_scheduler)``.

    Passes ``mpu=ModelParallelUnit(groups)`` so that ZeRO (stages 0, 1, 2) partitions over
    the data-parallel group and gradient clipping sums norms over the tensor-parallel group
    (see the module docstring). Checks first that every :class:`VocabParallelLMHead` of the
    model is sharded over ``groups``' TP group and tagged tensor-parallel: a head on another
    group would train, but with a wrongly clipped gradient norm. Refuses
    fp16/bf16 without ZeRO when clipping with TP > 1, where DeepSpeed's norm misses the
    shards (see ``_check_clipping``): use ZeRO 1 or 2 with half precision.

    Args:
        model: the model; its heads use ``groups.tp_group``.
        groups: from :func:`vocab_parallel.parallel.groups.init_parallel_groups`.
        config: a DeepSpeed config (dict, or path to a JSON/HJSON file); not modified.
        optimizer: a torch optimizer over ``model.parameters()``, or ``None`` to let the
            config's ``"optimizer"`` section build one. Given a torch optimizer, the config
            defaults ``"zero_allow_untested_optimizer"`` to true: ZeRO-1/2 hand it flat fp32
            partitions, which is exact for any elementwise optimizer (SGD, Adam, ...), but
            DeepSpeed refuses types outside its short list unless told. Passing a torch
            optimizer also avoids the config's ``AdamW``, which JIT-builds DeepSpeed's
            ``fused_adam`` C++ op on CPU (minutes, first time).
        **kwargs: passed on to ``deepspeed.initialize`` (``model_parameters``,
            ``lr_scheduler``, ``training_data``...); ``mpu`` is ours.
    """
    import deepspeed

    if "mpu" in kwargs:
        raise TypeError("initialize: mpu is built from groups; do not pass one")
    config = _load_config(config)
    if optimizer is not None:
        config.setdefault("zero_allow_untested_optimizer", True)
    check_heads(model, groups)
    result = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        config=config,
        mpu=ModelParallelUnit(groups),
        **kwargs,
    )
    _check_clipping(result[0], groups)
    return result


def _check_clipping(engine, groups: ParallelGroups) -> None:
    """Refuse the one DeepSpeed path whose clipping norm ignores tensor parallelism.

    With fp16/bf16 and no ZeRO, DeepSpeed wraps any optimizer other than its FusedAdam in
    ``FP16_UnfusedOptimizer``, which flattens the gradients *before* asking whether they are
    tensor-parallel (``runtime.utils.get_weight_norm``): the flat tensor has no
    ``tensor_model_parallel`` attribute, so TP ranks > 0 drop their head shards from the
    norm, and every step is clipped with too small a norm (DeepSpeed 0.19.8). fp32 at stage
    0 and ZeRO 1/2 in every precision count the shards correctly.
    """
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if (
        groups.tp_size > 1
        and engine.gradient_clipping() > 0
        and isinstance(engine.optimizer, FP16_UnfusedOptimizer)
    ):
        raise ValueError(
            "DeepSpeed's fp16/bf16 optimizer without ZeRO (FP16_UnfusedOptimizer) leaves the "
            "tensor-parallel head shards of TP ranks > 0 out of the gradient-clipping norm; "
            'use "zero_optimization": {"stage": 1} or 2 with fp16/bf16, fp32, or '
            '"gradient_clipping": 0'
        )


def check_heads(model: nn.Module, groups: ParallelGroups) -> None:
    """Raise ``ValueError`` unless every vocabulary-parallel head of ``model`` is sharded over
    ``groups.tp_group`` and its weight carries the tensor-parallel attribute."""
    want = _ranks(groups.tp_group)
    for name, module in model.named_modules():
        if not isinstance(module, VocabParallelLMHead):
            continue
        have = _ranks(module.process_group)
        if have != want:
            raise ValueError(
                f"model.{name or '<root>'}: head sharded over ranks {have}, but the "
                f"tensor-parallel group of `groups` is {want}; build the head with "
                "process_group=groups.tp_group"
            )
        if not getattr(module.weight, "tensor_model_parallel", False):
            raise ValueError(
                f"model.{name or '<root>'}.weight: missing tensor_model_parallel=True "
                "(gradient clipping would drop the shards of TP ranks > 0 from the norm)"
            )


def _ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group``; ``[this rank]`` for ``None`` or a group of one."""
    if group is None or dist.get_world_size(group) == 1:
        return [dist.get_rank()] if dist.is_initialized() else [0]
    return dist.get_process_group_ranks(group)


def _load_config(config: Mapping[str, Any] | str | os.PathLike) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    import hjson  # what DeepSpeed reads its config files with (JSON is a subset)

    with open(config) as f:
        return dict(hjson.load(f))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
