"""Test-only shims that let Megatron-core and torchtitan run on CPU gloo ranks.

Both frameworks are written for CUDA machines; a few of their calls name CUDA where the
computation itself runs on any device. Each shim below replaces one such call, for the
process that calls it (the test ranks), and says why. None of this is in the library:
``vocab_parallel.integrations.megatron`` / ``.torchtitan`` run unchanged on GPUs, and the
tests run them, and the frameworks' own loss paths they are compared with, as they are.
"""

from __future__ import annotations

import torch


def megatron_on_cpu(tp_size: int, seed: int = 0) -> None:
    """Megatron-core's parallel state on the gloo world ``run_ranks`` started, on CPU.

    - ``torch.cuda.current_device`` returns ``"cpu"``: Megatron allocates the buffers of
      its collectives (``tensor_parallel.mappings``: the sequence-parallel all-gather and
      reduce-scatter) and a few others with ``device=torch.cuda.current_device()``; on CPU
      they belong on the CPU.
    - ``initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)``: the
      training RNG tracker keeps CUDA generator states (``torch.cuda.get_rng_state``) for
      its model-parallel dropout streams; the inference tracker forks no CUDA stream. The
      models of the tests have no dropout (``hidden_dropout=attention_dropout=0``), so the
      streams change nothing there.
    - Layer norms that accept sequence parallelism (:class:`SequenceParallelLayerNorm`):
      Megatron's local layer spec takes Apex's ``FusedLayerNorm`` (CUDA) when Apex is
      installed, else ``WrappedTorchNorm``, which refuses ``sequence_parallel=True``.
    - An explicit boolean causal mask (:func:`causal_mask`) is passed to the model: without
      Transformer Engine, Megatron's local attention takes the mask it is given.
    """
    from megatron.core import parallel_state
    from megatron.core.models import backends
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import transformer_block

    torch.cuda.current_device = lambda: "cpu"
    backends.LNImpl = SequenceParallelLayerNorm
    transformer_block.LayerNormImpl = SequenceParallelLayerNorm
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(seed)


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` built as Megatron builds its norms, its parameters tagged
    ``sequence_parallel`` as Apex's ``FusedLayerNorm`` tags them (Megatron's
    ``finalize_model_grads`` all-reduces the gradients of such parameters over the
    tensor-parallel group: under sequence parallelism each rank's are partial)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel


def causal_mask(seq: int) -> torch.Tensor:
    """``[1, 1, seq, seq]`` boolean mask, True where attention is NOT allowed (Megatron's
    convention: future positions)."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


def torchtitan_on_cpu() -> None:
    """torchtitan's device on CPU gloo ranks.

    - ``torchtitan.distributed.parallel_dims.device_type = "cpu"``: torchtitan picks its
      device type once at import (``tools.utils.get_device_info``: ``"cuda"`` when no
      accelerator is found) and builds its device meshes on it.
    - The tests give each attention layer ``ScaledDotProductAttention`` (``sdpa_model``
      in the test): the default FlexAttention compiles its kernel, for CUDA.
    - ``set_force_sum_reduction_for_comms(True)`` on every FSDP module
      (:func:`fsdp_sum_reduction`): FSDP2 reduce-scatters with ``PREMUL_SUM`` (the gradient
      divide factor folded into the reduction), which gloo does not have.
    - ``torch.testing._internal.distributed.fake_pg`` imported: torchtitan builds the mesh
      dimensions of size 1 on the ``"fake"`` process-group backend, which that module
      registers (``dist.Backend.register_backend``); this process had not imported it.
    """
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
    from torchtitan.distributed import parallel_dims

    parallel_dims.device_type = "cpu"


def fsdp_sum_reduction(model) -> None:
    """Plain SUM reductions in every FSDP module of ``model`` (see :func:`torchtitan_on_cpu`)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def verl_module(name: str):
    """One module of verl (e.g. ``"verl.utils.experimental.torch_functional"``), loaded from
    its file without running ``verl/__init__.py``: that package init imports ``ray`` for
    verl's single controller (installed with verl's dependencies, not by the tests, which
    install verl ``--no-deps``), while the torch and Megatron reference functions the tests
    compare with import only torch and megatron.core."""
    import importlib.util
    import sys
    from pathlib import Path

    if name in sys.modules:
        return sys.modules[name]
    root = Path(importlib.util.find_spec("verl").origin).parent  # finds, does not import
    path = root.joinpath(*name.split(".")[1:]).with_suffix(".py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
