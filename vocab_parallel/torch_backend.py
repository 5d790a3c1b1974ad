"""Chunked pure-PyTorch backend: the fast path on CPUs, same semantics as the kernels.

It walks the vocabulary in chunks exactly like the Triton launcher, so its extra memory
is one ``[BT, CV]`` chunk (two of half the columns with ``softcap``) and a ``[BT, H]``
fp32 accumulator, never ``[BT, V]``.

The chunk loop of the backward, :func:`gradient_products`, is shared with the Triton
launcher (``vocab_parallel.kernels.backward``): the backends differ only in how a chunk
of ``G`` is produced. Every product follows ``vocab_parallel.precision``: fp32
accumulation and fp32 results on every device (float64 for float64 inputs), ``G``
rounded to the input dtype once.

The backend interface (both backends, inputs already validated):

    forward_stats(x, weight, local_target, logits_out=None, with_logit_sum=True, *,
                  bias=None, softcap=None)
    fused_backward(grad, x, weight, local_target, logits_max, sum_exp_logits, softmax,
                   on_target, smooth_all, *, need_input_grad, need_weight_grad,
                   grad_input_dtype, bias=None, softcap=None, logits=None,
                   prob_scale=None, need_bias_grad=False, reuse_logits=False,
                   grad_input_out=None, grad_weight_acc=None, grad_bias_acc=None,
                   accumulate=True)

``local_target`` is int64 ``[BT]``: the target's column in this shard, -1 where the row's
target is not on this shard (or is ignored). The logits are ``z = cap(x @ W.T + bias)``
with ``cap(r) = softcap * tanh(r / softcap)`` (identity without ``softcap``); the
statistics, the stored logits (``logits_out``, ``logits``) and the softmax are of ``z``.
``prob_scale`` (``[BT]``, z-loss: ``1 + 2 * z_loss * lse``) multiplies the softmax
before the target distribution is subtracted; with ``softcap`` the gradient is then
multiplied by ``1 - tanh(r / softcap)^2``. ``fused_backward`` returns
``(grad_input, grad_weight)``, and ``grad_bias = G.sum(0)`` third when
``need_bias_grad``. ``mode="grad_in_forward"`` passes the token chunk's saved logits with
``reuse_logits`` (G may overwrite them) and its own buffers to write ``grad_input`` into
and to add ``grad_weight``, ``grad_bias`` to (``grad_input_out``, ``grad_weight_acc``,
``grad_bias_acc``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vocab_parallel import precision

# Target bytes of one fp32 [BT, CV] chunk of logits.
CHUNK_BYTES = 64 * 1024 * 1024

# make_g(v0, v1, x_op, w_op) -> G[:, v0:v1], fp32 or x.dtype (rounded by the loop).
MakeG = Callable[[int, int, "torch.Tensor | None", "torch.Tensor | None"], torch.Tensor]


def chunk_columns(bt: int, v: int, chunk_bytes: int = CHUNK_BYTES, h: int = 0) -> int:
    """Columns per vocabulary chunk so that an fp32 ``[bt, cols]`` chunk of logits, and the
    fp32 ``[cols, h]`` product of ``grad_weight``'s rows, each fit ``chunk_bytes``."""
    cols = chunk_bytes // max(1, bt * 4, h * 4)
    cols = max(256, cols // 64 * 64)
    return max(1, min(v, cols))


def gradient_products(
    x: torch.Tensor,
    weight: torch.Tensor,
    cv: int,
    make_g: MakeG,
    *,
    g_reads_operands: bool,
    need_input_grad: bool = True,
    need_weight_grad: bool = True,
    grad_input_dtype: torch.dtype | None = None,
    bias_grad_dtype: torch.dtype | None = None,
    grad_input_out: torch.Tensor | None = None,
    grad_weight_acc: torch.Tensor | None = None,
    grad_bias_acc: torch.Tensor | None = None,
    accumulate: bool = True,
) -> tuple[torch.Tensor | None, ...]:
    """``grad_input = G @ weight`` and ``grad_weight = G.T @ x`` over vocabulary chunks.

    For each chunk of ``cv`` columns (in order), ``make_g(v0, v1, x_op, w_op)`` gives
    ``G[:, v0:v1]`` (``x_op``, ``w_op``: ``x`` and ``weight[v0:v1]`` in the GEMM operand
    dtype, for a ``make_g`` that ``g_reads_operands``; else None unless a product needs
    them). Its
    values are rounded to ``x.dtype`` here, then ``grad_input`` accumulates ``G_c @ W_c``
    in fp32 and ``grad_weight[v0:v1] = G_c.T @ x`` (fp32, rounded once). A fixed chunk
    order and plain GEMMs: bitwise deterministic. A gradient that is not needed costs no
    GEMM and no memory and comes back as None.

    With ``bias_grad_dtype`` (not None) a third result is returned: ``grad_bias =
    G.sum(0)`` ``[V]``, the same rounded ``G`` summed in fp32, in ``bias_grad_dtype``.

    Caller's buffers (``mode="grad_in_forward"`` walks the tokens in chunks and adds each
    chunk's products up): ``grad_input_out`` (``[BT, H]``, fp32; float64 for float64
    inputs) receives ``grad_input``; ``grad_weight_acc`` (``[V, H]``) and
    ``grad_bias_acc`` (``[V]``), of that dtype too, get ``G.T @ x`` and ``G.sum(0)``
    added (``accumulate=False``: written, as into a fresh buffer: the first chunk). Each
    is returned in place of the gradient it holds.
    """
    bt, h = x.shape
    v = weight.shape[0]
    dtype, device = x.dtype, x.device
    need_bias_grad = bias_grad_dtype is not None
    if not (need_input_grad or need_weight_grad or need_bias_grad):
        return None, None
    gi_dtype = grad_input_dtype or dtype
    # H = 0: empty products, but the bias alone still makes logits (and a bias gradient).
    if bt == 0 or v == 0 or (h == 0 and not need_bias_grad):
        # No products: zeros, in the caller's buffers where it gave them (a written
        # grad_input, fresh accumulators; accumulators being added to stay as they are).
        def zeros(buf, add, shape, dt):
            if buf is None:
                return torch.zeros(shape, dtype=dt, device=device)
            return buf if add else buf.zero_()

        gi = zeros(grad_input_out, False, (bt, h), gi_dtype) if need_input_grad else None
        gw = zeros(grad_weight_acc, accumulate, (v, h), dtype) if need_weight_grad else None
        gb = zeros(grad_bias_acc, accumulate, v, bias_grad_dtype) if need_bias_grad else None
        return (gi, gw, gb) if need_bias_grad else (gi, gw)

    operand = precision.operand_dtype(dtype, device.type)
    accum = precision.accumulate_dtype(dtype)
    x_op = x.to(operand) if (need_weight_grad or g_reads_operands) else None
    grad_weight = acc_w = None  # acc_w: the caller's accumulator, else rows are written
    if need_weight_grad:
        acc_w = grad_weight_acc
        grad_weight = (
            acc_w if acc_w is not None else torch.empty((v, h), dtype=dtype, device=device)
        )
    acc = None
    if need_input_grad:
        acc = grad_input_out
        acc = torch.empty((bt, h), dtype=accum, device=device) if acc is None else acc
    grad_bias = acc_b = None
    if need_bias_grad:
        acc_b = grad_bias_acc
        grad_bias = (
            acc_b if acc_b is not None else torch.empty(v, dtype=bias_grad_dtype, device=device)
        )
    # fp32 products that are not written in place: one buffer, used by both products.
    sizes = [bt * h] if need_input_grad and operand != accum else []
    sizes += [cv * h] if need_weight_grad and (dtype != accum or operand != accum) else []
    scratch = torch.empty(max(sizes), dtype=accum, device=device) if sizes else None
    for v0 in range(0, v, cv):
        v1 = min(v, v0 + cv)
        w_op = weight[v0:v1].to(operand) if (need_input_grad or g_reads_operands) else None
        g = precision.round_to(make_g(v0, v1, x_op, w_op), dtype, operand)
        if need_bias_grad:  # the rounded G the products see, summed in fp32
            if acc_b is None or not accumulate:
                grad_bias[v0:v1] = g.sum(dim=0, dtype=accum)
            else:
                acc_b[v0:v1] += g.sum(dim=0, dtype=accum)
        if need_input_grad:
            if v0 == 0:
                precision.mm_fp32(g, w_op, out=acc)
            else:
                tmp = None if operand == accum else scratch[: bt * h].view(bt, h)
                precision.addmm_fp32_(acc, g, w_op, scratch=tmp)
        if need_weight_grad and acc_w is not None and accumulate:
            tmp = None if operand == accum else scratch[: (v1 - v0) * h].view(v1 - v0, h)
            precision.addmm_fp32_(acc_w[v0:v1], g.t(), x_op, scratch=tmp)
        elif need_weight_grad:
            rows = grad_weight[v0:v1]
            if grad_weight.dtype == accum:
                precision.mm_fp32(g.t(), x_op, out=rows)
            else:
                tmp = scratch[: (v1 - v0) * h].view(v1 - v0, h)
                rows.copy_(precision.mm_fp32(g.t(), x_op, out=tmp))
        del g  # free this chunk before the next one is allocated
    grad_input = None
    if need_input_grad:
        grad_input = acc if grad_input_out is not None else acc.to(gi_dtype)
    return (grad_input, grad_weight, grad_bias) if need_bias_grad else (grad_input, grad_weight)


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


def fused_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    local_target: torch.Tensor,
    logits_max: torch.Tensor | None,
    sum_exp_logits: torch.Tensor | None,
    softmax: torch.Tensor | None,
    on_target: float,
    smooth_all: float,
    *,
    need_input_grad: bool = True,
    need_weight_grad: bool = True,
    grad_input_dtype: torch.dtype | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    logits: torch.Tensor | None = None,
    prob_scale: torch.Tensor | None = None,
    need_bias_grad: bool = False,
    reuse_logits: bool = False,
    grad_input_out: torch.Tensor | None = None,
    grad_weight_acc: torch.Tensor | None = None,
    grad_bias_acc: torch.Tensor | None = None,
    accumulate: bool = True,
) -> tuple[torch.Tensor | None, ...]:
    """Backward over vocabulary chunks; inputs already validated.

    ``local_target`` is int64 ``[BT]`` in ``[0, V)``, -1 where no one-hot is subtracted on
    this shard; ``grad`` is ``[BT]`` or ``[1]`` fp32. The softmax comes from ``softmax``,
    else from the saved (capped) ``logits`` and the statistics, else from recomputed
    logits (``bias``, ``softcap``). Returns ``(grad_input, grad_weight)``, None for a
    gradient that is not needed, and ``grad_bias`` third when ``need_bias_grad``.

    ``reuse_logits``: ``G`` may be computed in place in the saved ``logits`` (which are
    then lost): no copy of a chunk. ``grad_input_out``, ``grad_weight_acc``,
    ``grad_bias_acc``: the caller's buffers (:func:`gradient_products`).
    """
    bt, h = x.shape
    v = weight.shape[0]
    accum = precision.accumulate_dtype(x.dtype)
    scale = grad.to(accum).reshape(-1, 1)  # [BT, 1] or [1, 1]
    # Per row: G = exp(z - lse) * factor - smooth - hot * onehot (then the cap's factor),
    # so that each element is touched by three passes (sub, exp, mul) without options.
    factor = scale if prob_scale is None else scale * prob_scale.to(accum)[:, None]
    smooth = scale * smooth_all
    # Amount subtracted at the target column: (1 - eps) where the target is on this shard.
    hot = ((local_target >= 0).to(accum) * on_target)[:, None].mul(scale).reshape(-1)
    lse = None if softmax is not None else (logits_max + torch.log(sum_exp_logits))[:, None]
    rows = torch.arange(bt, device=x.device)

    def make_g(v0: int, v1: int, x_op: torch.Tensor, w_op: torch.Tensor | None):
        tanh = None  # tanh(r / softcap) of the chunk, for the cap's derivative
        if softmax is not None:
            g = softmax[:, v0:v1].to(accum, copy=True)
        else:
            if logits is not None:  # saved capped logits z = softcap * tanh
                g = logits[:, v0:v1]
                g = g if reuse_logits and g.dtype == accum else g.to(accum, copy=True)
                if softcap is not None:
                    tanh = g / softcap
            else:
                g = linear_logits(x_op, w_op, None if bias is None else bias[v0:v1])
                if softcap is not None:
                    tanh = g.div_(softcap).tanh_()
                    g = tanh * softcap
            g.sub_(lse).exp_()
        g.mul_(factor)
        if smooth_all != 0.0:
            g.sub_(smooth)
        # One-hot: subtract where the target falls into this chunk.
        in_chunk = (local_target >= v0) & (local_target < v1)
        cols = (local_target - v0).clamp(0, v1 - v0 - 1)
        g[rows, cols] -= torch.where(in_chunk, hot, 0.0)
        if tanh is not None:  # through the cap: d z / d r = 1 - tanh^2
            g.mul_(tanh.square_().neg_().add_(1.0))
        return g

    # The softmax path never reads the operands, nor does a saved-logits one.
    recompute = softmax is None and logits is None
    bias_dtype = (x.dtype if bias is None else bias.dtype) if need_bias_grad else None
    # A softcap keeps tanh beside each chunk of G: half the columns, the same bytes.
    cv = chunk_columns(bt, v, chunk_bytes if softcap is None else chunk_bytes // 2, h)
    fp32_products = precision.operand_dtype(x.dtype, x.device.type) == accum == x.dtype
    in_place = reuse_logits and logits is not None and logits.dtype == accum
    if in_place and softcap is None and fp32_products:
        cv = v  # G overwrites the logits and no product needs a scratch: one chunk
    with precision.cpu_bf16_math(x.dtype, x.device.type):  # bf16 values: exact products
        return gradient_products(
            x,
            weight,
            cv,
            make_g,
            g_reads_operands=recompute,
            need_input_grad=need_input_grad,
            need_weight_grad=need_weight_grad,
            grad_input_dtype=grad_input_dtype,
            bias_grad_dtype=bias_dtype,
            grad_input_out=grad_input_out,
            grad_weight_acc=grad_weight_acc,
            grad_bias_acc=grad_bias_acc,
            accumulate=accumulate,
        )


# Columns per block of exp(z - max) when the logits must be kept (see _sum_exp).
SUM_EXP_BLOCK = 4096


def _sum_exp(logits: torch.Tensor, row_max: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``exp(logits - row_max).sum(1)`` in ``row_max``'s dtype: in place when the logits
    are not kept, else in column blocks, so that the kept logits (high-performance mode,
    grad-in-forward; half ones too) cost no second full-size temporary."""
    if in_place and logits.dtype == row_max.dtype:
        return logits.sub_(row_max).exp_().sum(dim=1)
    total = None
    for c0 in range(0, logits.shape[1], SUM_EXP_BLOCK):
        # (half - fp32 promotes to fp32: one new block, the kept logits untouched)
        part = torch.sub(logits[:, c0 : c0 + SUM_EXP_BLOCK], row_max).exp_().sum(dim=1)
        total = part if total is None else total.add_(part)
    return total


def forward_stats(
    x: torch.Tensor,
    weight: torch.Tensor,
    local_target: torch.Tensor,
    logits_out: torch.Tensor | None = None,
    with_logit_sum: bool = True,
    chunk_bytes: int = CHUNK_BYTES,
    *,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local ``(max, sum_exp, predicted, logit_sum)`` of ``z = cap(x @ weight.T + bias)``,
    each ``[BT]`` fp32 (float64 for float64 inputs).

    One online pass over vocabulary chunks (same contract as the Triton launcher
    ``vocab_parallel.kernels.forward.forward_stats``): ``local_target`` is int64, -1 where
    the target is not on this shard; ``logits_out`` (``[BT, V]``, the statistics' dtype)
    receives ``z`` when given, and then the chunk products are written straight into it.
    ``with_logit_sum=False`` skips the logit sum (only label smoothing needs it): zeros.
    """
    bt = x.shape[0]
    v = weight.shape[0]
    f32 = dict(dtype=precision.accumulate_dtype(x.dtype), device=x.device)
    row_max = torch.full((bt,), float("-inf"), **f32)
    row_sum = torch.zeros(bt, **f32)
    pred = torch.zeros(bt, **f32)
    lsum = torch.zeros(bt, **f32)
    if bt == 0 or v == 0:
        return row_max, row_sum, pred, lsum
    operand = precision.operand_dtype(x.dtype, x.device.type)
    x_op = x.to(operand)
    here = local_target >= 0
    cv = chunk_columns(bt, v, chunk_bytes)
    for v0 in range(0, v, cv):
        v1 = min(v, v0 + cv)
        w_op = weight[v0:v1].to(operand)
        out = None if logits_out is None else logits_out[:, v0:v1]
        b = None if bias is None else bias[v0:v1]
        with precision.cpu_bf16_math(x.dtype, x.device.type):  # bf16 values: exact
            raw = linear_logits(x_op, w_op, b, out=out)
        logits = cap_(raw, softcap)
        in_chunk = here & (local_target >= v0) & (local_target < v1)
        cols = (local_target - v0).clamp(0, v1 - v0 - 1)
        picked = logits.gather(1, cols[:, None]).squeeze(1).to(pred.dtype)
        pred += torch.where(in_chunk, picked, 0.0)
        if with_logit_sum:  # only label smoothing needs it: skip the pass otherwise
            lsum += logits.sum(dim=1, dtype=lsum.dtype)
        new_max = torch.maximum(row_max, logits.max(dim=1).values.to(row_max.dtype))
        row_sum.mul_(torch.exp(row_max - new_max))
        row_sum.add_(_sum_exp(logits, new_max[:, None], in_place=out is None))
        row_max = new_max
        del logits  # free this chunk before the next one is allocated
    return row_max, row_sum, pred, lsum
