"""The memory policy: every chunk height and width, of every objective, backend and device,
from one workspace budget (``docs/design.md``, "Memory policy").

Nothing in the library is ``[tokens, V_local]`` unless a mode promises it
(``high_performance``); everything else walks chunks whose sizes come from here:

    workspace      W = WORKSPACE_BYTES[device type] (128 MiB on CPUs, 512 MiB elsewhere:
                   GPUs need tall chunks for the grad_weight GEMM, K = rows, to run at
                   tensor-core speed; CPU GEMMs reach their best rate at 256-512 rows)

    token rows     grad_in_forward's chunk: the fp32 ``[rows, ceil(Vg / world)]`` logits
                   of every head the objective keeps (1: cross entropy; 2: a dense
                   teacher's distillation) fit W together, or on GPUs with half inputs
                   the bytes of the gradients the call hands back if that is more (the
                   hand-out holds those and their fp32 accumulators at once: blocks up to
                   that size add nothing to the call's peak; the Llama-3 head at 8192
                   tokens: 1066 MiB, 2048 rows, 4 chunks); at most MAX_ROWS rows on
                   CPUs; a multiple of 64 above 64, the chunks as even as that allows;
                   sized from what every rank shares (tokens, global vocabulary, world
                   size, hidden size, dtype), so every rank issues the same collectives
    kept G         on GPUs, half inputs: grad_in_forward keeps G (``[tokens, V_local]``,
                   the inputs' dtype) for the backward's GEMMs where it is at most twice
                   the fp32 accumulators it replaces (:func:`keeps_g`; the Llama-3 head
                   at 8192 tokens: 2004 MiB against 2132 MiB; the Gemma-like head: 4000
                   against 2322), else the products are added into fp32 accumulators
                   chunk by chunk
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
# A kept G may take this many times the bytes of the fp32 accumulators it replaces
# (:func:`keeps_g`): at most their bytes more than the accumulated plan.
KEPT_G_RATIO = 2
COLUMN_MULTIPLE = 128


def workspace_bytes(device_type: str) -> int:
    """The workspace budget of a device type."""
    return WORKSPACE_BYTES.get(device_type, DEFAULT_WORKSPACE_BYTES)


def token_rows(
    tokens: int,
    global_size: int,
    world: int,
    device_type: str,
    heads: int = 1,
    hidden: int = 0,
    itemsize: int = 4,
) -> int:
    """Token rows per grad_in_forward chunk: ``heads`` fp32 ``[rows, ceil(global_size /
    world)]`` blocks (an even share of the vocabulary) fit the budget, at most the
    device's :data:`MAX_ROWS`; at least one row, at most ``tokens``, a multiple of 64 when
    above 64, and the tokens cut into chunks as even as that allows. The same on every
    rank of the group (nothing here differs between ranks).

    The budget is the workspace, and on GPUs (every device type but the CPU) with half
    inputs (``itemsize`` < 4) at least the bytes of the gradients the call hands back
    (:func:`returned_bytes`): the hand-out makes them from their fp32 accumulators while
    those still live, so kept blocks up to that size raise no peak of the call."""
    share = even_share(global_size, world)
    per_row = 4 * max(1, heads) * share
    budget = workspace_bytes(device_type)
    if device_type != "cpu" and itemsize < 4:
        budget = max(budget, returned_bytes(tokens, share, hidden, itemsize))
    rows = max(1, min(budget // per_row, MAX_ROWS.get(device_type, tokens)))
    if rows > 64:
        rows = rows // 64 * 64
    rows = max(1, min(tokens, rows))
    if rows > 64:  # as even as 64-row multiples allow: every chunk's GEMMs alike
        chunks = -(-tokens // rows)
        even = -(-tokens // chunks)
        rows = min(rows, -(-even // 64) * 64)
    return rows


def keeps_g(
    tokens: int, global_size: int, world: int, hidden: int, itemsize: int, device_type: str
) -> bool:
    """Whether grad_in_forward keeps ``G`` (``[tokens, V_local]`` in the inputs' dtype)
    for the backward's two GEMMs instead of adding each token chunk's products into fp32
    accumulators in the forward: on GPUs (every device type but the CPU), with half
    inputs, where ``G`` takes at most :data:`KEPT_G_RATIO` times the bytes of the fp32
    ``[V_local, H]`` and ``[tokens, H]`` accumulators it replaces (so it costs at most the
    accumulators' bytes more than accumulating), or no more than the workspace. Each
    later chunk's accumulating GEMM reads and writes the whole fp32 ``grad_weight`` (2 GiB
    at the Llama-3 head: 0.8 ms a chunk on an H200, the first GPU run measured; 8 ms a call
    at the Gemma-like head, 20% of its GEMMs); the GEMMs of the whole ``G`` run once, at
    the floor. The Llama-3 head at 8192 tokens: G 2004 MiB against 2132 MiB of
    accumulators; the Gemma-like head (8192 x 2304 x 256000): 4000 MiB against 2322 MiB,
    1678 MiB more for 8 ms less. Sized from what every rank shares (an even share of the
    vocabulary)."""
    if device_type == "cpu" or itemsize >= 4:
        return False
    share = even_share(global_size, world)
    accumulators = 4 * (share + tokens) * hidden
    room = max(KEPT_G_RATIO * accumulators, workspace_bytes(device_type))
    return itemsize * tokens * share <= room


def even_share(global_size: int, world: int) -> int:
    """A rank's even share of the vocabulary (at least 1): what every rank sizes from."""
    return max(1, -(-global_size // max(1, world)))


def returned_bytes(tokens: int, share: int, hidden: int, itemsize: int) -> int:
    """The bytes of grad_weight ``[share, hidden]`` and grad_input ``[tokens, hidden]`` in
    the inputs' dtype: what grad_in_forward hands back."""
    return itemsize * (share + tokens) * hidden


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
