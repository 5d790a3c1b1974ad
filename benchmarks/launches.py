"""Kernel launches and host syncs of one call, counted without a GPU and without arithmetic.

The call runs on ``meta`` tensors (shapes, dtypes, no data, no device) with the library's
device switches set as on a GPU (``vocab_parallel.engine.precision.CUDA_GEMMS``: half
operands to GEMMs with fp32 output, ``mm``/``addmm`` with ``out_dtype`` present;
``vocab_parallel.parallel.checks.ASYNC_CHECKS``: device-side asserts; the memory policy's
GPU workspace, which every device type but the CPU gets), so the library's own code takes
its CUDA path at the real shapes in seconds. A dispatch mode sees every ATen op the call
issues:

    launches   ops that run a kernel on a GPU: everything but views, allocations
               (``empty*``) and metadata queries; and each Triton kernel launch (the
               kernels' ``kernel[grid](...)``, replaced here by a counter that runs nothing)
    syncs      ops that copy a value to the host (``aten._local_scalar_dense``: ``.item()``,
               ``bool(t)``, ``.tolist()``; ``nonzero``), answered here with 0 (or nothing)
               so that the call goes on

Each count says where it came from (``by_op``), and each sync its line in the library, so
a budget test can tell a sync in the chunk loop from a check before it. Pass
``backend="triton"`` for the GPU's default backend (``"auto"`` picks it on CUDA only).

    from benchmarks.launches import count_call
    counts = count_call(lambda: loss_fn(...).backward())   # inputs made inside, on "meta"
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vocab_parallel.engine import precision
from vocab_parallel.parallel import checks

# Ops that launch nothing on a GPU: allocations and metadata.
_NO_KERNEL = {
    "aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
    "aten.new_empty.default", "aten.new_empty_strided.default", "aten.detach.default",
    "aten.lift_fresh.default", "aten.sym_size.int", "aten.sym_stride.int",
    "aten.sym_numel.default", "aten.sym_storage_offset.default", "aten.is_same_size.default",
    "aten.result_type.Tensor", "aten.result_type.Scalar", "aten.set_.source_Storage_storage_offset",
    "prim.device.default", "prim.layout.default",
}  # fmt: skip
# Ops whose result a host reads (a device-to-host copy and a wait).
_SYNCS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.equal.default"}


@dataclass
class Counts:
    """One call's launches and syncs."""

    launches: int = 0
    syncs: int = 0
    by_op: Counter = field(default_factory=Counter)
    sync_sites: Counter = field(default_factory=Counter)  # "file:line" of each sync

    def top(self, n: int = 8) -> str:
        return ", ".join(f"{op} {k}" for op, k in self.by_op.most_common(n))


class _Counting(TorchDispatchMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        c = self.counts
        if name in _SYNCS:
            c.syncs += 1
            c.sync_sites[_caller()] += 1
            c.by_op[name] += 1
            if name == "aten._local_scalar_dense.default":
                return 0  # the value a meta tensor cannot give: take the common branch
            if name == "aten.nonzero.default":
                return torch.empty((0, args[0].dim()), dtype=torch.int64, device="meta")
        elif name not in _NO_KERNEL and not getattr(func, "is_view", False):
            c.launches += 1
            c.by_op[name.removeprefix("aten.").removesuffix(".default")] += 1
        return func(*args, **(kwargs or {}))


def _caller() -> str:
    """The innermost frame of the library (or a test) that issued the op."""
    for frame in reversed(traceback.extract_stack()):
        if "vocab_parallel" in frame.filename and "launches.py" not in frame.filename:
            return f"{frame.filename.rsplit('vocab_parallel/', 1)[-1]}:{frame.lineno}"
    return "?"


@contextlib.contextmanager
def _counted_triton_launches(counts: Counts):
    """Every Triton kernel launch counted (by the kernel's name) and not run."""
    try:
        from triton.runtime.jit import KernelInterface
    except ImportError:  # no triton: nothing to count
        yield
        return
    original = KernelInterface.__getitem__

    def launch(self, grid):
        def run(*args, **kwargs):
            counts.launches += 1
            counts.by_op["triton:" + getattr(self, "__name__", type(self).__name__)] += 1

        return run

    KernelInterface.__getitem__ = launch
    try:
        yield
    finally:
        KernelInterface.__getitem__ = original


@contextlib.contextmanager
def _gpu_switches():
    """The library's device switches set for ``meta`` as for ``cuda``."""
    saved = (precision.mm_out_dtype_supported, precision.addmm_out_dtype_supported)
    precision.CUDA_GEMMS.add("meta")
    checks.ASYNC_CHECKS.add("meta")
    precision.mm_out_dtype_supported = lambda device_type: device_type in precision.CUDA_GEMMS
    precision.addmm_out_dtype_supported = precision.mm_out_dtype_supported
    try:
        yield
    finally:
        precision.CUDA_GEMMS.discard("meta")
        checks.ASYNC_CHECKS.discard("meta")
        precision.mm_out_dtype_supported, precision.addmm_out_dtype_supported = saved


def count_call(fn) -> Counts:
    """Run ``fn`` (which makes its inputs on the ``meta`` device and calls the library)
    with the GPU's switches and count its launches and syncs."""
    counts = Counts()
    with _gpu_switches(), _counted_triton_launches(counts), _Counting(counts):
        fn()
    return counts
