"""Chunked pure-PyTorch backend: the fast path on CPUs, same semantics as the kernels.

It implements :class:`vocab_parallel.backends.interface.Backend` (the math is there) by walking the
vocabulary in chunks, so its extra memory is one ``[BT, CV]`` chunk (two of half the
columns with ``softcap``) and a ``[BT, H]`` fp32 accumulator, never ``[BT, V]``. The two
gradient GEMMs of each chunk are the shared loop of ``vocab_parallel.engine.chunking``; every
product follows ``vocab_parallel.engine.precision``.

The softmax is formed in the order of the original operator, ``exp(z - max) / sum``
(``docs/design.md``, "The operator"): given statistics smaller than the true ones then
overflow exactly where the original's do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vocab_parallel.backends.interface import PLAIN, Grads, GradTerms, LocalStats, Logits, Outputs
from vocab_parallel.engine import memory_policy as memory
from vocab_parallel.engine import precision
from vocab_parallel.engine.chunking import gradient_products


def cap_(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(logits / softcap)`` in place (``logits`` as it is without a cap)."""
    if softcap is None:
        return logits
    return logits.div_(softcap).tanh_().mul_(softcap)


def linear_logits(
    x_op: torch.Tensor,
    w_op: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W_c.T + b_c`` of one chunk, accumulated in fp32 (float64 for float64 inputs;
    into ``out`` when given): the raw logits before any softcap."""
    logits = precision.mm_fp32(x_op, w_op.t(), out=out)
    if bias is not None:
        logits.add_(bias.to(logits.dtype))
    return logits


def chunk_logits(
    x: torch.Tensor,
    weight: torch.Tensor,
    logits: Logits = PLAIN,
    *,
    dtype: torch.dtype | None = None,
) -> Callable[..., torch.Tensor]:
    """``make(v0, v1, out=None)``: ``z`` of the shard's columns ``[v0, v1)``
    (``vocab_parallel.backends.interface.Backend.chunk_logits``): :func:`linear_logits` in fp32
    (float64 for float64 inputs; into ``out`` when given), in ``dtype`` (None: as it is),
    capped and tempered there. ``x`` is cast to the products' operand dtype once."""
    operand = precision.operand_dtype(x.dtype, x.device.type)
    x_op = None

    def make(v0: int, v1: int, out: torch.Tensor | None = None) -> torch.Tensor:
        nonlocal x_op
        if x_op is None:
            x_op = x.to(operand)
        bias = None if logits.bias is None else logits.bias[v0:v1]
        with precision.cpu_bf16_math(x.dtype, x.device.type):  # bf16 values: exact
            z = linear_logits(x_op, weight[v0:v1].to(operand), bias, out=out)
        z = z if dtype is None or z.dtype == dtype else z.to(dtype)
        z = cap_(z, logits.softcap)
        if logits.inv_temperature is not None:
            z.mul_(logits.inv_temperature.to(z.dtype)[:, None])
        return z

    return make


def _row(t: torch.Tensor | float | None, accum: torch.dtype) -> torch.Tensor | float | None:
    """A per-row term as an ``[BT, 1]`` column (a float or None as it is)."""
    return t.to(accum).reshape(-1, 1) if isinstance(t, torch.Tensor) else t


def fused_backward(
    x: torch.Tensor,
    weight: torch.Tensor,
    local_target: torch.Tensor,
    logits: Logits,
    terms: GradTerms,
    out: Outputs,
) -> Grads:
    """:class:`Grads` of ``G`` (``vocab_parallel.backends.registry``) over vocabulary chunks.

    ``terms.reuse_logits``: ``G`` may be computed in place in the saved fp32 ``logits``
    (which are then lost): no copy of a chunk.
    """
    bt, h = x.shape
    v = weight.shape[0]
    accum = precision.accumulate_dtype(x.dtype)
    softcap, inv_t = logits.softcap, _row(logits.inv_temperature, accum)
    # Per row: G = p * factor - smooth_row * class_weight - hot * onehot (then cap').
    scale = terms.grad.to(accum).reshape(-1, 1)  # [BT, 1] or [1, 1]
    if inv_t is not None:
        scale = scale * inv_t  # d z / d cap(r) = 1 / T
    factor = scale if terms.prob_scale is None else scale * _row(terms.prob_scale, accum)
    # The entropy's term p * ent * (z - max) (token statistics): needs z, never a softmax.
    ent = None if terms.entropy is None else scale * _row(terms.entropy, accum)
    smooth = scale * terms.smooth if terms.smooth != 0.0 else None
    cw = None if terms.class_weight is None else terms.class_weight.to(accum)
    on_target = _row(terms.on_target, accum)
    hot = ((local_target >= 0).to(accum)[:, None] * on_target * scale).reshape(-1)
    softmax, saved = terms.softmax, terms.logits
    if softmax is None:
        row_max = terms.logits_max.to(accum)[:, None]
        row_sum = terms.sum_exp.to(accum)[:, None]
    rows = torch.arange(bt, device=x.device)

    def make_g(v0: int, v1: int, x_op: torch.Tensor, w_op: torch.Tensor | None):
        tanh = None  # tanh(r / softcap) of the chunk, for the cap's derivative
        if softmax is not None:
            g = softmax[:, v0:v1].to(accum, copy=True)
        else:
            if saved is not None:  # the saved z = cap(r) / T
                g = saved[:, v0:v1]
                g = g if terms.reuse_logits and g.dtype == accum else g.to(accum, copy=True)
                if softcap is not None:
                    tanh = g / softcap if inv_t is None else g / (inv_t * softcap)
            else:
                g = linear_logits(x_op, w_op, None if logits.bias is None else logits.bias[v0:v1])
                if softcap is not None:
                    tanh = g.div_(softcap).tanh_()
                    g = tanh * softcap
                if inv_t is not None:
                    g.mul_(inv_t)
            g.sub_(row_max)
            if ent is not None:  # p (factor + ent (z - max)), block by block
                _entropy_epilogue_(g, row_sum, factor, ent)
            else:
                g.exp_().div_(row_sum)  # exp(z - max) / sum: the original operator's order
        if ent is None or softmax is not None:
            g.mul_(factor)
        if smooth is not None:
            g.sub_(smooth if cw is None else smooth * cw[v0:v1])
        # One-hot: subtract where the target falls into this chunk.
        in_chunk = (local_target >= v0) & (local_target < v1)
        cols = (local_target - v0).clamp(0, v1 - v0 - 1)
        g[rows, cols] -= torch.where(in_chunk, hot, 0.0)
        if tanh is not None:  # through the cap: d cap / d r = 1 - tanh^2
            g.mul_(tanh.square_().neg_().add_(1.0))
        return g

    # The softmax path never reads the operands, nor does a saved-logits one.
    recompute = softmax is None and saved is None
    bias_dtype = x.dtype if logits.bias is None else logits.bias.dtype
    # A softcap keeps tanh beside each chunk of G: half the columns, the same bytes.
    blocks = 1 if softcap is None else 2
    cv = memory.columns(bt, v, x.device.type, "logits", h=h, blocks=blocks)
    fp32_products = precision.operand_dtype(x.dtype, x.device.type) == accum == x.dtype
    in_place = terms.reuse_logits and saved is not None and saved.dtype == accum
    if in_place and softcap is None and fp32_products:
        cv = v  # G overwrites the logits and no product needs a scratch: one chunk
    with precision.cpu_bf16_math(x.dtype, x.device.type):  # bf16 values: exact products
        return gradient_products(
            x, weight, cv, make_g, out, g_reads_operands=recompute, bias_grad_dtype=bias_dtype
        )


# Columns per block of exp(z - max) when the logits must be kept (see _sum_exp).
SUM_EXP_BLOCK = 4096


def _sum_exp(logits: torch.Tensor, row_max: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``exp(logits - row_max).sum(1)`` in ``row_max``'s dtype: in place when the logits
    are not kept, else in column blocks, so that the kept logits (high-performance mode,
    grad-in-forward) cost no second full-size temporary."""
    if in_place and logits.dtype == row_max.dtype:
        return logits.sub_(row_max).exp_().sum(dim=1)
    total = None
    for c0 in range(0, logits.shape[1], SUM_EXP_BLOCK):
        part = torch.sub(logits[:, c0 : c0 + SUM_EXP_BLOCK], row_max).exp_().sum(dim=1)
        total = part if total is None else total.add_(part)
    return total


def forward_stats(
    x: torch.Tensor,
    weight: torch.Tensor,
    local_target: torch.Tensor,
    logits: Logits = PLAIN,
    *,
    logits_out: torch.Tensor | None = None,
    logit_sum: bool = False,
    class_weight: torch.Tensor | None = None,
    extra_stats: bool = False,
) -> LocalStats:
    """:class:`LocalStats` of ``z = cap(x @ weight.T + bias) / T`` in one online pass over
    vocabulary chunks (same contract as the Triton launcher).

    ``logits_out`` (``[BT, V]``, the statistics' dtype) receives ``z`` when given, and the
    chunk products are then written straight into it. ``logit_sum``: also the sum of ``z``
    weighted by ``class_weight`` (``[V]``, None: 1), which only label smoothing needs.
    ``extra_stats``: also ``shifted_sum = sum_j exp(z - max) (z - max)`` and ``exp2_sum =
    sum_j exp(2 (z - max))`` (the token statistics' entropy and sum of squared
    probabilities), kept online like the sum: when the max grows from ``m`` to ``m'`` they
    become ``e^(m - m') (shifted + (m - m') sum)`` and ``e^(2 (m - m')) exp2``.
    A chunk whose logits are all ``-inf`` (a masking bias) adds nothing (see the running
    maximum's start below); a row whose logits are all ``-inf`` has the most negative
    finite max and a zero sum.
    """
    bt = x.shape[0]
    v = weight.shape[0]
    accum = precision.accumulate_dtype(x.dtype)
    f32 = dict(dtype=accum, device=x.device)
    row_sum = torch.zeros(bt, **f32)
    pred = torch.zeros(bt, **f32)
    lsum = torch.zeros(bt, **f32)
    shifted = torch.zeros(bt, **f32) if extra_stats else None
    exp2 = torch.zeros(bt, **f32) if extra_stats else None
    if bt == 0 or v == 0:
        m = torch.full((bt,), float("-inf"), **f32)
        return LocalStats(m, row_sum, pred, lsum, shifted, exp2)
    # The running max starts at the most negative finite value, not -inf (as in the Triton
    # kernel): a chunk of -inf logits (a masking bias) adds exp(-inf - m) = 0 and rescales
    # by exp(0) = 1, never exp(-inf + inf) = NaN.
    row_max = torch.full((bt,), torch.finfo(f32["dtype"]).min, **f32)
    operand = precision.operand_dtype(x.dtype, x.device.type)
    x_op = x.to(operand)
    inv_t = _row(logits.inv_temperature, accum)
    cw = None if class_weight is None else class_weight.to(accum)
    here = local_target >= 0
    cv = memory.columns(bt, v, x.device.type, "logits")
    for v0 in range(0, v, cv):
        v1 = min(v, v0 + cv)
        w_op = weight[v0:v1].to(operand)
        out = None if logits_out is None else logits_out[:, v0:v1]
        b = None if logits.bias is None else logits.bias[v0:v1]
        with precision.cpu_bf16_math(x.dtype, x.device.type):  # bf16 values: exact
            z = cap_(linear_logits(x_op, w_op, b, out=out), logits.softcap)
        if inv_t is not None:
            z.mul_(inv_t)
        in_chunk = here & (local_target >= v0) & (local_target < v1)
        cols = (local_target - v0).clamp(0, v1 - v0 - 1)
        picked = z.gather(1, cols[:, None]).squeeze(1)
        pred += torch.where(in_chunk, picked, 0.0)
        if logit_sum:  # only label smoothing needs it: skip the pass otherwise
            lsum += z.sum(dim=1) if cw is None else torch.mv(z, cw[v0:v1])
        new_max = torch.maximum(row_max, z.amax(dim=1))
        if extra_stats:
            _extra_stats_(z, row_max, new_max, row_sum, shifted, exp2, in_place=out is None)
        else:
            row_sum.mul_(torch.exp(row_max - new_max))
            row_sum.add_(_sum_exp(z, new_max[:, None], in_place=out is None))
        row_max = new_max
        del z  # free this chunk before the next one is allocated
    return LocalStats(row_max, row_sum, pred, lsum, shifted, exp2)


# Elements of the per-block scratch of the token statistics' passes (1 MiB of fp32): a
# fresh [BT, CV] temporary per chunk costs more in page faults than the arithmetic.
BLOCK_ELEMENTS = 1 << 18


def _row_blocks(rows: int, cols: int):
    """``(r0, r1)`` row blocks of a ``[rows, cols]`` chunk whose scratch fits the block."""
    step = max(1, BLOCK_ELEMENTS // max(1, cols))
    return ((r0, min(rows, r0 + step)) for r0 in range(0, rows, step))


def _no_neginf(t: torch.Tensor) -> torch.Tensor:
    """``t`` with ``-inf`` (a masking bias' logits, ``p = 0``) as 0, so that ``p * t`` is 0,
    not NaN; ``t`` itself when it holds none."""
    if t.numel() and bool(t.min() == float("-inf")):
        return torch.nan_to_num(t, nan=float("nan"), neginf=0.0)
    return t


def _entropy_epilogue_(g, row_sum, factor, ent) -> None:
    """``g`` (``z - max`` of a chunk) becomes ``exp(g) / sum * (factor + ent * g)`` in place,
    a block of rows at a time through a small scratch for the factor."""
    rows, cols = g.shape
    scratch = torch.empty(min(rows, max(1, BLOCK_ELEMENTS // max(1, cols))) * cols,
                          dtype=g.dtype, device=g.device)  # fmt: skip
    per_row = factor.shape[0] > 1
    for r0, r1 in _row_blocks(rows, cols):
        zb = g[r0:r1]
        coef = scratch[: (r1 - r0) * cols].view(r1 - r0, cols)
        torch.addcmul(factor[r0:r1] if per_row else factor, _no_neginf(zb), ent[r0:r1], out=coef)
        zb.exp_().div_(row_sum[r0:r1]).mul_(coef)


def _extra_stats_(z, row_max, new_max, row_sum, shifted, exp2, in_place: bool) -> None:
    """The online update of ``row_sum``, ``shifted`` and ``exp2`` (in place) by one chunk
    ``z`` whose rows raise the running max from ``row_max`` to ``new_max``, a block of rows
    at a time through a small scratch for ``exp(z - max)``. A row whose sum is still 0 has
    no shifted sum to move (``(m - m') * 0`` could be ``-inf * 0``); a ``-inf`` logit adds
    ``0 * (z - max) = 0``, not NaN."""
    step = row_max - new_max  # <= 0
    decay = torch.exp(step)
    moved = torch.where(row_sum > 0, shifted + step * row_sum, 0.0)
    shifted.copy_(moved.mul_(decay))
    exp2.mul_(decay.square())
    row_sum.mul_(decay)
    rows, cols = z.shape
    n = min(rows, max(1, BLOCK_ELEMENTS // max(1, cols))) * cols
    e_buf = torch.empty(n, dtype=z.dtype, device=z.device)
    zm_buf = None if in_place else torch.empty(n, dtype=z.dtype, device=z.device)
    for r0, r1 in _row_blocks(rows, cols):
        shape = (r1 - r0, cols)
        if in_place:
            zb = z[r0:r1].sub_(new_max[r0:r1, None])
        else:  # the kept logits stay as they are
            zb = torch.sub(
                z[r0:r1], new_max[r0:r1, None], out=zm_buf[: shape[0] * cols].view(shape)
            )
        e = torch.exp(zb, out=e_buf[: shape[0] * cols].view(shape))
        row_sum[r0:r1] += e.sum(dim=1)
        shifted[r0:r1] += torch.linalg.vecdot(e, _no_neginf(zb))
        exp2[r0:r1] += torch.linalg.vecdot(e, e)
