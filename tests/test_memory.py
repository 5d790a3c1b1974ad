"""Memory: the peak extra memory of memory-saving and grad-in-forward modes does not grow
with the vocabulary.

Each measurement runs in a fresh subprocess (peak RSS on CPU, see benchmarks/memory.py).
The forward + backward of the loss at V and at 4V, same BT and H: beyond the weight's
gradient (which is V x H by nature), the peak must stay flat, while the naive
``F.cross_entropy(F.linear(...))`` grows with V, which shows the measurement can fail.
"""

from __future__ import annotations

import textwrap

import pytest
from helpers import peak_extra_in_child

# Fresh subprocesses measuring peak memory: out of the fast loop (-m "not slow").
pytestmark = pytest.mark.slow

MIB = 1 << 20
# The child runs in the repository root, where ``python -c`` finds ``benchmarks``.

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.nn.functional as F
    import vocab_parallel as vp
    import vocab_parallel.engine.memory_policy
    from benchmarks.memory import PeakMemory

    impl, bt, h, v = sys.argv[1], *map(int, sys.argv[2:5])
    if impl == "grad_in_forward":
        # A chunk budget that binds at both V (else the chunk is 512 rows, growing with V
        # up to the 128 MiB budget): what is checked is everything else staying flat.
        vocab_parallel.engine.memory_policy.WORKSPACE_BYTES["cpu"] = 16 << 20
    torch.manual_seed(0)
    x = torch.randn(bt, h).requires_grad_(True)
    w = (torch.randn(v, h) * 0.05).requires_grad_(True)
    y = torch.randint(0, v, (bt,))

    def run(x, w, y):
        if impl == "naive":
            loss = F.cross_entropy(F.linear(x, w), y)
        else:
            loss = vp.vocab_parallel_linear_cross_entropy(x, w, y, mode=impl, backend="torch")
        loss.backward()

    # Warm up thread pools and lazy initialisation on a tiny problem.
    run(x[:8].detach().requires_grad_(True), w[:64].detach().requires_grad_(True), y[:8] % 64)
    with PeakMemory("cpu") as peak:
        run(x, w, y)
    grad_w = w.grad.numel() * w.grad.element_size()
    print(json.dumps({"extra": peak.extra_bytes - grad_w, "exact": peak.exact}))
    """
)


def measure(impl: str, bt: int, h: int, v: int) -> int:
    return peak_extra_in_child(CHILD, impl, bt, h, v)


@pytest.mark.parametrize("mode", ["memory_saving", "grad_in_forward"])
def test_peak_does_not_grow_with_vocab(mode):
    bt, h, v = 1024, 64, 16384
    ours = {n: measure(mode, bt, h, n) for n in (v, 4 * v)}
    naive = {n: measure("naive", bt, h, n) for n in (v, 4 * v)}
    print(
        f"extra beyond grad_weight, MiB: ours {ours[v] / MIB:.0f} -> {ours[4 * v] / MIB:.0f}, "
        f"naive {naive[v] / MIB:.0f} -> {naive[4 * v] / MIB:.0f}"
    )
    # The naive path materialises [BT, V] logits: its extra memory grows with V...
    assert naive[4 * v] > 3 * naive[v]
    # ...ours holds one chunk of logits whatever V is (slack for allocator noise).
    assert ours[4 * v] <= 1.2 * ours[v] + 16 * MIB
    # At 4V ours needs a fraction of the naive extra memory.
    assert ours[4 * v] < naive[4 * v] / 3
