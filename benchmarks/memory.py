"""Peak extra memory of a block of code, on CUDA and on CPU (benchmarks, tests/test_memory.py).

    with PeakMemory(device) as peak:
        loss = f(x); loss.backward()
    print(peak.extra_bytes)    # high-water mark during the block minus memory before it

CUDA: ``torch.cuda.max_memory_allocated`` (the caching allocator's exact view).
CPU: the process's resident set. Before the block, free heap is handed back to the OS
(``malloc_trim``) and the kernel's peak-RSS counter is reset (``/proc/self/clear_refs``);
the figure is ``VmHWM`` after the block minus ``VmRSS`` before it. That counts pages
really touched, so measure in a process that does little else (a fresh subprocess).
Without ``/proc`` it falls back to the growth of ``ru_maxrss``, a lower bound
(``exact`` is then False).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import resource
import sys

import torch


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _maxrss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def _reset_cpu_peak() -> bool:
    """Return free heap to the OS and reset the peak RSS; False where impossible."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Context manager: ``extra_bytes`` = peak memory during the block minus before it."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.extra_bytes = 0
        self.exact = True
        self.method = ""

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            self.method = "cuda.max_memory_allocated"
        else:
            self.exact = _reset_cpu_peak() and _status_bytes("VmRSS") is not None
            self._base = _status_bytes("VmRSS") if self.exact else _maxrss_bytes()
            self.method = "VmHWM - VmRSS" if self.exact else "ru_maxrss growth (lower bound)"
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _status_bytes("VmHWM") if self.exact else _maxrss_bytes()
        self.extra_bytes = max(0, peak - self._base)
