"""The registry of backends: which implementation of ``vocab_parallel.backends.interface.Backend``
runs a call (``docs/design.md``, "Backends").

``"torch"`` is ``vocab_parallel.backends.torch_backend`` (chunked PyTorch, the CPU path);
``"triton"`` is ``vocab_parallel.backends.triton_backend`` (the launchers of the Triton kernels,
on CUDA or under the interpreter);
``"auto"`` picks Triton on CUDA. Backends are imported when first asked for. Only this
registry and the options compare backend names: everything else asks the backend.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch

from vocab_parallel.backends.interface import Backend
from vocab_parallel.options import check_backend_name


@dataclass(frozen=True)
class _Functions:
    """A backend made of its functions (both backends are modules of functions)."""

    name: str
    forward_stats: object
    fused_backward: object
    chunk_logits: object
    # Fused objective epilogues (a module of launchers), or None: the objectives' own
    # torch epilogues run (``vocab_parallel.backends.interface.Backend``, its epilogues).
    epilogues: object = None


@functools.cache
def get_backend(name: str) -> Backend:
    """The resolved backend ``name`` (``"torch"`` or ``"triton"``)."""
    if name == "triton":
        from vocab_parallel.backends import triton_backend as tb
        from vocab_parallel.backends import triton_epilogues as te

        return _Functions("triton", tb.forward_stats, tb.fused_backward, tb.chunk_logits, te)
    if name == "torch":
        from vocab_parallel.backends import torch_backend as tb

        return _Functions("torch", tb.forward_stats, tb.fused_backward, tb.chunk_logits)
    raise ValueError(f"backend: expected 'torch' or 'triton', got {name!r}")


def resolve_backend(
    backend: str, device: torch.device, dtype: torch.dtype | None = None, name: str = "input"
) -> str:
    """``"auto"`` means Triton on CUDA tensors and the torch backend elsewhere (and for
    float64 inputs, which only the torch backend computes).

    ``"triton"`` needs CUDA tensors, or CPU tensors with Triton's interpreter switched on
    (``TRITON_INTERPRET=1`` before triton is imported); anything else would fail inside
    Triton with "0 active drivers", so it is refused here, naming ``backend``. float64
    inputs (``dtype``) on ``"triton"`` raise a TypeError naming the input ``name``.
    """
    check_backend_name(backend)
    if backend == "auto":
        return "triton" if device.type == "cuda" and dtype != torch.float64 else "torch"
    if backend == "triton" and dtype == torch.float64:
        raise TypeError(
            f"{name}: float64 is not supported by backend='triton' (its kernels compute in "
            "fp32); use backend='torch' (or 'auto'), which computes float64 in float64"
        )
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ValueError(
                "backend: 'triton' needs the triton package (pip install triton); "
                "use backend='torch'"
            )
        interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        if device.type != "cuda" and not interpreted:
            raise ValueError(
                f"backend: 'triton' runs on CUDA tensors (these are on {device}), or under "
                "Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported, for "
                "tests); use backend='torch' or 'auto'"
            )
    return backend
