"""pytest set-up for the tests: Triton's interpreter without CUDA, and the shared fixtures.

Without a GPU the Triton kernels run under Triton's interpreter, which must be switched
on before ``triton`` is imported anywhere: that is done here, first thing. Nothing else
is pinned: the suite runs the precision defaults users get on this machine. The helpers
the tests import live in ``helpers.py``; nothing imports this module.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from helpers import BACKENDS, HAS_TRITON, MODES  # noqa: E402


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """Each backend in turn; Triton is skipped when not installed."""
    if request.param == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    return request.param


@pytest.fixture(params=MODES)
def mode(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _triton_inputs_on_device(request):
    """Every test whose id says "triton" launches Triton kernels only on tensors made on
    ``helpers.DEVICE`` (``device_guard.py``): a test that would fail on a GPU fails here."""
    if "triton" not in request.node.nodeid.lower() or not HAS_TRITON:
        yield
        return
    from device_guard import guarded
    from helpers import DEVICE

    with guarded(DEVICE):
        yield
