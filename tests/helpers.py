"""Helpers shared by the operator and loss tests: inputs, reference comparisons, constants.

Imported as ``helpers`` (pytest puts ``tests/`` on ``sys.path``). ``conftest.py`` switches
Triton's interpreter on before anything imports ``triton``; nothing here imports it.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field, replace

import torch

from vocab_parallel import fused_linear_cross_entropy_loss_grad, pack_target_mask
from vocab_parallel.reference import global_statistics, loss_grad_reference

HAS_TRITON = importlib.util.find_spec("triton") is not None
# Triton runs on CUDA tensors, or on CPU tensors under the interpreter: every tensor a test
# hands to the Triton backend is made on DEVICE (conftest.py's guard checks it).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CPU = torch.device("cpu")
BACKENDS = ("torch", "triton")
MODES = ("memory_saving", "high_performance")
HALF_DTYPES = (torch.float16, torch.bfloat16)
ALL_DTYPES = (torch.float32, *HALF_DTYPES)

# Largest |error| allowed, relative to the largest |value| of the reference output.
# fp32: only the fp32 accumulation order differs from the float64 reference. Half dtypes:
# the reference rounds G to the input dtype too, so what is left is a one-ulp flip of G
# where fp32 and float64 logits round differently, and the rounding of the output.
# Both are far below what a real bug costs (a missing one-hot or a wrong scale is O(1)).
REL_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def device_for(backend: str) -> torch.device:
    """Where a test's inputs for ``backend`` live: DEVICE for Triton, the CPU for torch."""
    return DEVICE if backend == "triton" else CPU


def moved(obj, device: torch.device):
    """``obj`` (a tensor, or a dict, list or tuple holding some) with its tensors on
    ``device``; anything else as it is."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: moved(v, device) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(moved(v, device) for v in obj)
    return obj


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class Case:
    """One set of operator inputs, with the unpacked mask the reference needs."""

    grad: torch.Tensor
    input: torch.Tensor
    weight: torch.Tensor
    not_here: torch.Tensor  # bool [BT], the truth the mask encodes
    target_mask: torch.Tensor  # packed uint8 or bool: what the operator is given
    masked_target: torch.Tensor
    label_smoothing: float = 0.0
    logits_max: torch.Tensor | None = None
    sum_exp_logits: torch.Tensor | None = None
    softmax: torch.Tensor | None = None
    global_vocab_size: int | None = None
    extra: dict = field(default_factory=dict)

    def tensors(self) -> dict[str, torch.Tensor]:
        names = ("grad", "input", "weight", "target_mask", "masked_target")
        names += ("logits_max", "sum_exp_logits", "softmax")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def kwargs(self, backend: str) -> dict:
        """Every argument of the operator, by name."""
        return dict(
            grad=self.grad,
            input=self.input,
            weight=self.weight,
            target_mask=self.target_mask,
            masked_target=self.masked_target,
            label_smoothing=self.label_smoothing,
            logits_max=self.logits_max,
            sum_exp_logits=self.sum_exp_logits,
            softmax=self.softmax,
            global_vocab_size=self.global_vocab_size,
            backend=backend,
        )

    def run(self, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_linear_cross_entropy_loss_grad(**self.kwargs(backend))

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float64 reference, computed on CPU, in ``input.dtype``."""

        def cpu(t):
            return None if t is None else t.cpu()

        return loss_grad_reference(
            cpu(self.grad),
            cpu(self.input),
            cpu(self.weight),
            cpu(self.not_here),
            cpu(self.masked_target),
            self.label_smoothing,
            cpu(self.logits_max),
            cpu(self.sum_exp_logits),
            cpu(self.softmax),
            self.global_vocab_size,
        )

    def with_(self, **changes) -> Case:
        return replace(self, **changes)


def make_case(
    bt: int,
    h: int,
    v: int,
    *,
    dtype: torch.dtype = torch.float32,
    mode: str = "memory_saving",
    seed: int = 0,
    mask_form: str = "packed",
    target_dtype: torch.dtype = torch.int64,
    not_here: torch.Tensor | float = 0.3,
    label_smoothing: float = 0.0,
    global_vocab_size: int | None = None,
    device: torch.device = DEVICE,
) -> Case:
    """Random inputs with the global statistics of their own logits (fp32, as the op wants).

    ``not_here`` is a bool tensor or the probability that a row's target is elsewhere.
    ``grad`` is random (positive and negative), never all ones.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(bt, h, generator=gen).to(dtype)
    w = (torch.randn(v, h, generator=gen) * 0.3).to(dtype)
    grad = torch.randn(bt, generator=gen)
    target = torch.randint(0, max(v, 1), (bt,), generator=gen).to(target_dtype)
    if not isinstance(not_here, torch.Tensor):
        not_here = torch.rand(bt, generator=gen) < not_here
    lmax, sumexp, soft = (s.float() for s in global_statistics(x, w))
    mask = pack_target_mask(not_here) if mask_form == "packed" else not_here.clone()
    stats = (
        dict(logits_max=lmax, sum_exp_logits=sumexp)
        if mode == "memory_saving"
        else dict(softmax=soft)
    )
    stats = {k: t.to(device) for k, t in stats.items()}
    return Case(
        grad=grad.to(device),
        input=x.to(device),
        weight=w.to(device),
        not_here=not_here.to(device),
        target_mask=mask.to(device),
        masked_target=target.to(device),
        label_smoothing=label_smoothing,
        global_vocab_size=global_vocab_size,
        **stats,
    )


def close_to_reference(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = ""
) -> None:
    """Shape, dtype and values (max error relative to the reference's max magnitude)."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == dtype, f"{what}: dtype {actual.dtype} != {dtype}"
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    assert torch.isfinite(e).all(), f"{what}: reference not finite; compare NaNs separately"
    assert torch.isfinite(a).all(), f"{what}: non-finite values where the reference is finite"
    if e.numel() == 0:
        return
    scale = e.abs().max().item()
    err = (a - e).abs().max().item()
    bound = REL_TOL[dtype] * scale + 1e-6
    assert err <= bound, f"{what}: max error {err:.3e} > {bound:.3e} (max |ref| {scale:.3e})"


def assert_matches_reference(out, ref, dtype: torch.dtype) -> None:
    close_to_reference(out[0], ref[0], dtype, "grad_input")
    close_to_reference(out[1], ref[1], dtype, "grad_weight")


def assert_bitwise_equal(a, b, what: str = "") -> None:
    for x, y, name in zip(a, b, ("grad_input", "grad_weight"), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what} {name}"
        assert torch.equal(x, y), (
            f"{what} {name} differs: max |diff| {(x.double() - y.double()).abs().max()}"
        )


PARAM_NAMES = (
    "grad",
    "input",
    "weight",
    "target_mask",
    "masked_target",
    "label_smoothing",
    "logits_max",
    "sum_exp_logits",
    "softmax",
    "global_vocab_size",
    "backend",
)


def first_named_parameter(message: str) -> str | None:
    """The operator parameter mentioned first in an error message."""
    hits = []
    for name in PARAM_NAMES:
        m = re.search(rf"\b{name}\b", message)
        if m:
            hits.append((m.start(), name))
    return min(hits)[1] if hits else None


def triton_interpreter_cases() -> list:
    """The multi-rank Triton subset (the interpreter is slow: tiny shapes, smoothing on,
    both modes, reductions none and mean); empty without triton."""
    if not HAS_TRITON:
        return []
    from vocab_parallel.loss import MODES as LOSS_MODES
    from vocab_parallel.testing import grid

    return grid(
        tokens=(13,),
        hidden=(9,),
        vocab=(37,),
        backends=("triton",),
        modes=LOSS_MODES,
        reductions=("none", "mean"),
        label_smoothing=(0.1,),
    )


def peak_extra_in_child(code: str, *args: object) -> int:
    """Run ``python -c code args...`` from the repository root (a fresh process, so its peak
    RSS is the measurement's alone); its last stdout line is ``{"extra": bytes, "exact":
    bool}``. Skips the test where the peak cannot be reset (no /proc)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    out = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not result["exact"]:
        pytest.skip("no /proc: peak RSS cannot be reset on this platform")
    return result["extra"]
