"""grad_in_forward on the Triton backend: ``G`` of a whole token chunk written over its
kept fp32 logits (``logits_grad_rows_kernel``), the two gradient GEMMs once per chunk.

Checked: which kernel each chunk launches (the row kernel, once per token chunk; the
chunked ``G`` kernel never), the results against the unsharded float64 reference and the
torch backend with every option that changes the row kernel's code (softcap, per-token
temperature with class weights, label smoothing, z-loss) in the three dtypes at an odd
vocabulary, the kernel against the chunked one on the same saved logits, and bitwise
determinism. The interpreter's tile is 2 rows of 64 columns: 389 columns are 7 steps,
the last one masked, and 5-row chunks end on a half-empty program.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, HAS_TRITON

from vocab_parallel import vocab_parallel_linear_cross_entropy
from vocab_parallel.backends import triton_backend
from vocab_parallel.backends.interface import GradTerms, Logits, Outputs
from vocab_parallel.engine import memory_policy as memory
from vocab_parallel.testing import Case, check_case

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

V = 389


@pytest.fixture
def chunks_of_5_rows(monkeypatch):
    """5 token rows per chunk at V = 389 (37 tokens: 8 chunks, the last one 2 rows)."""
    monkeypatch.setitem(memory.WORKSPACE_BYTES, DEVICE.type, 5 * 4 * V)


@pytest.fixture
def launches(monkeypatch):
    """Count the backward kernels' launches (each still runs)."""
    from vocab_parallel.kernels import backward

    counts = {"rows": 0, "chunks": 0}
    for name, key in (("logits_grad_rows_kernel", "rows"), ("logits_grad_kernel", "chunks")):
        kernel = getattr(backward, name)

        class Counted:
            def __getitem__(self, grid, kernel=kernel, key=key):
                counts[key] += 1
                return kernel[grid]

        monkeypatch.setattr(backward, name, Counted())
    return counts


CASES = [
    Case(mode="grad_in_forward", backend="triton", dtype=dtype, reduction=reduction, **opts)
    for dtype in ("float32", "bfloat16", "float16")
    for reduction, opts in (
        ("mean", {}),
        ("sum", dict(softcap=3.0, z_loss=1e-3, bias=True)),
        ("mean", dict(temperature="tensor", class_weight=True, label_smoothing=0.1)),
        ("sum", dict(softcap=2.0, temperature="scalar", label_smoothing=0.1, return_lse=True)),
    )
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.dtype}-{c.reduction}-{c.softcap}-"
                         f"{c.temperature}-{c.class_weight}")  # fmt: skip
def test_matches_float64_reference_with_one_g_launch_per_chunk(case, chunks_of_5_rows, launches):
    result = check_case(case, None, DEVICE)
    assert result["ok"], result
    assert launches["chunks"] == 0
    assert launches["rows"] == 8  # one per token chunk of 5 rows


def _grads(backend: str, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dev = DEVICE if backend == "triton" else torch.device("cpu")
    x = torch.randn(37, 33, generator=gen).to(dtype).to(dev).requires_grad_(True)
    w = (torch.randn(V, 33, generator=gen) / 33**0.5 * 4).to(dtype).to(dev).requires_grad_(True)
    y = torch.randint(0, V, (37,), generator=gen)
    y[::5] = -100
    temperature = (torch.rand(37, generator=gen) + 0.5).to(dev)
    loss = vocab_parallel_linear_cross_entropy(
        x, w, y.to(dev), mode="grad_in_forward", backend=backend, softcap=4.0,
        temperature=temperature, label_smoothing=0.1, z_loss=1e-3,
    )  # fmt: skip
    (loss * 0.37).backward()
    return [t.detach().cpu() for t in (loss, x.grad, w.grad)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bitwise_deterministic_and_equal_to_the_torch_backend(dtype, chunks_of_5_rows):
    first, again = _grads("triton", dtype), _grads("triton", dtype)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    torch_backend = _grads("torch", dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # G rounds to bf16 the same way: 1 ulp
    for a, b in zip(first, torch_backend, strict=True):
        assert (a.double() - b.double()).abs().max() <= tol * b.double().abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rows_kernel_equals_chunked_kernel_on_the_same_logits(dtype):
    """The same saved logits, ``G`` by the row kernel over them and by the chunked kernel
    into its own buffer: the same G, hence grad_bias bit for bit and the GEMMs' results
    to their rounding; the row kernel leaves ``G`` where the logits were."""
    gen = torch.Generator().manual_seed(3)
    n, h = 23, 40
    x = torch.randn(n, h, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(V, h, generator=gen) * 0.3).to(dtype).to(DEVICE)
    z = (x.float() @ w.float().T).contiguous()
    target = torch.randint(-1, V, (n,), generator=gen).to(DEVICE)
    lmax = z.max(dim=1).values
    lsum = torch.exp(z - lmax[:, None]).sum(dim=1)
    grad = (torch.rand(n, generator=gen) + 0.5).to(DEVICE)
    out = Outputs(need_input=True, need_weight=True, need_bias=True)
    grads = []
    for reuse in (False, True):
        saved = z.clone()
        terms = GradTerms(grad=grad, on_target=0.9, smooth=0.1 / V, logits_max=lmax,
                          sum_exp=lsum, logits=saved, reuse_logits=reuse)  # fmt: skip
        grads.append(triton_backend.fused_backward(x, w, target, Logits(), terms, out))
        if reuse:  # G of each row sits where the row's logits began
            g = saved.view(dtype)[:, :V] if dtype != torch.float32 else saved
            bias = grads[1].bias
            assert torch.equal(g.sum(0, dtype=torch.float32).to(bias.dtype), bias)
        else:
            assert torch.equal(saved, z)  # the chunked kernel only reads them
    chunked, rows = grads
    assert torch.equal(chunked.bias, rows.bias)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for a, b in ((chunked.input, rows.input), (chunked.weight, rows.weight)):
        assert (a.double() - b.double()).abs().max() <= tol * a.double().abs().max()
