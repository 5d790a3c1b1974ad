"""Starting torch.distributed for the launch jobs, from torchrun's environment.

These are process-wide decisions that belong to an application, not to the library:
defaults for the launcher's variables (so that ``python launch/verify.py`` is a world of
one), the backend and device of the rank, a timeout on every collective, and the number
of CPU threads each rank may use (``torch.set_num_threads`` affects the whole process).
Both ``train.py`` and ``verify.py`` start this way.

The DeepSpeed engine also needs DeepSpeed's own communication layer on top of the same
process group; :func:`init_distributed` sets it up when the options ask for DeepSpeed.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_from_env(timeout_s: float, default_port: int = 29511) -> tuple[str, torch.device]:
    """Start the default process group from torchrun's environment (collective).

    NCCL on the local GPU when CUDA is available, gloo on CPUs otherwise (with the CPU
    threads split between the local ranks, which would otherwise oversubscribe the
    cores). Without torchrun's variables it is a world of one process. ``timeout_s``
    bounds every collective, so a rank never waits forever for a failed one.
    Returns ``(backend, device)``.
    """
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(default_port))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group(
        backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if backend == "nccl" else None,
    )
    return backend, device


def init_distributed(o: dict) -> tuple[str, torch.device]:
    """Process group from torchrun's environment: NCCL with GPUs, gloo otherwise."""
    backend, device = init_from_env(o["timeout_s"], default_port=29512)
    if o["engine"] == "deepspeed":
        # DeepSpeed adopts the process group above (and its timeout) rather than making one.
        deepspeed_integration().init_distributed(backend, timeout=o["timeout_s"])
    return backend, device


def deepspeed_integration():
    """``vocab_parallel.integrations.deepspeed``, or a clear exit where it cannot load."""
    try:
        from vocab_parallel.integrations import deepspeed as integration
    except ImportError as exc:
        raise SystemExit(f"--engine deepspeed needs DeepSpeed and our integration: {exc}") from exc
    return integration
