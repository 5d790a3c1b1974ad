"""The memory policy: every chunk height and width, of every objective, backend and device,
from one workspace budget (``docs/design.md``, "Memory policy").

Nothing in the library is ``[tokens, V_local]`` unless a mode promises it
(``high_performance``); everything else walks chunks whose sizes come from here:

    workspace      W = WORKSPACE_BYTES[device type] (128 MiB on CPUs, 512 MiB elsewhere:
                   GPUs need tall chunks for the grad_weight GEMM, K = rows, to run at
                   tensor-core speed; CPU GEMMs reach their best rate at 256-512 rows)

    token rows     grad_in_forward's chunk: the fp32 ``[rows, ceil(Vg / world)]`` logits
                   of every head the objective keeps (1: cross entropy; 2: a dense
                   teacher's distillation) fit W together; at most MAX_ROWS rows on CPUs;
                   a multiple of 64 above 64; sized from what every rank shares (tokens,
                   global vocabulary, world size), so every rank issues the same
                   collectives
    columns        a pass over vocabulary columns of ``rows`` tokens takes a SHARE of W:
                   its ``[rows, cols]`` block (and the fp32 ``[cols, H]`` product of
                   grad_weight's rows) fits ``SHARES[what] * W``; a multiple of 128 (whole
                   Triton tiles), at least 128, at most the shard

What each share buys (the blocks a pass holds at once):

    "logits"        the torch backend's forward and backward chunk (one fp32 block, two
                    of half the width with a softcap), and the Triton backend's G buffer
                    in the input dtype                                          W / 2
    "topk"          the token statistics' top-k chunk of logits                  W / 2
    "epilogue"      an epilogue objective's column chunks (distillation: both heads'
                    blocks and the math's temporaries, a handful of blocks)      W / 8

Tests shrink the workspace with ``monkeypatch.setitem(WORKSPACE_BYTES, "cpu", n)``.
"""

from __future__ import annotations

MiB = 1 << 20
# The workspace budget per device type (the key of torch.device.type); other devices
# (CUDA, ROCm, XPU...) get DEFAULT_WORKSPACE_BYTES.
WORKSPACE_BYTES = {"cpu": 128 * MiB}
DEFAULT_WORKSPACE_BYTES = 512 * MiB
# At most this many token rows per chunk: on CPUs GEMMs of 512 rows already run near
# their best rate, and taller chunks only cost memory.
MAX_ROWS = {"cpu": 512}
# The share of the workspace each column pass takes (the module docstring).
SHARES = {"logits": 1 / 2, "topk": 1 / 2, "epilogue": 1 / 16}
COLUMN_MULTIPLE = 128


def workspace_bytes(device_type: str) -> int:
    """The workspace budget of a device type."""
    return WORKSPACE_BYTES.get(device_type, DEFAULT_WORKSPACE_BYTES)


def token_rows(tokens: int, global_size: int, world: int, device_type: str, heads: int = 1) -> int:
    """Token rows per grad_in_forward chunk: ``heads`` fp32 ``[rows, ceil(global_size /
    world)]`` blocks (an even share of the vocabulary) fit the workspace, at most the
    device's :data:`MAX_ROWS`; at least one row, at most ``tokens``, a multiple of 64 when
    above 64. The same on every rank of the group."""
    per_row = 4 * max(1, heads) * max(1, -(-global_size // max(1, world)))
    rows = max(1, min(workspace_bytes(device_type) // per_row, MAX_ROWS.get(device_type, tokens)))
    if rows > 64:
        rows = rows // 64 * 64
    return max(1, min(tokens, rows))


def columns(
    rows: int,
    v: int,
    device_type: str,
    what: str,
    *,
    itemsize: int = 4,
    h: int = 0,
    blocks: int = 1,
) -> int:
    """Columns per vocabulary chunk of a ``what`` pass (a key of :data:`SHARES`) over
    ``rows`` tokens: ``blocks`` ``[rows, cols]`` blocks of ``itemsize`` bytes, and the fp32
    ``[cols, h]`` product of grad_weight's rows, each fit the pass's share of the
    workspace; a multiple of :data:`COLUMN_MULTIPLE`, at least that, at most ``v`` (and at
    least 1)."""
    budget = int(workspace_bytes(device_type) * SHARES[what])
    cols = budget // max(1, rows * itemsize * max(1, blocks), h * 4)
    cols = max(COLUMN_MULTIPLE, cols // COLUMN_MULTIPLE * COLUMN_MULTIPLE)
    return max(1, min(v, cols))
