"""Triton kernels of the fused linear + cross-entropy backward.

The backward of ``loss = CE(x @ W.T, y)`` over one vocabulary shard is

    G           = (softmax(x @ W.T) - q) * grad[:, None]      (q: target distribution)
    grad_input  = G @ W
    grad_weight = G.T @ x

The full ``G`` is ``[BT, V]``; we never hold it. The launcher walks the vocabulary in
chunks of ``CV`` columns. For each chunk:

1. ``_logits_grad_kernel`` recomputes the logits tile by tile (memory-saving mode) or
   reads the saved softmax (high-performance mode) and applies the whole epilogue in
   registers: exp, normalise, one-hot, label smoothing, scale by ``grad``, round to the
   input dtype. Only the chunk ``G[:, v0:v0+CV]`` reaches memory.
2. ``_matmul_kernel`` adds ``G_chunk @ W_chunk`` into an fp32 ``grad_input``
   accumulator, and writes ``G_chunk.T @ x`` straight into ``grad_weight[v0:v0+CV]``.

Every output element is produced by exactly one program, and chunks are visited in a
fixed order, so results are bitwise deterministic (no atomics). Memory beyond inputs and
outputs is one ``[BT, CV]`` chunk plus the ``[BT, H]`` fp32 accumulator; neither grows
with V.

This module knows nothing of torch.distributed nor of input validation: the public
operator validates, this launcher allocates and launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vocab_parallel.kernels.common import dot_in_fp32, interpreting, logits_tile, tile_config

# Bytes of the G chunk buffer the launcher aims for; ``CV`` follows from it and BT.
CHUNK_BYTES = 256 * 1024 * 1024


@triton.jit
def _round_bf16_rtne(v):
    """Round fp32 to the nearest bf16 (ties to even), still held as fp32.

    Triton's interpreter converts fp32 to bf16 by truncation; rounding first makes that
    truncation exact, so interpreted results match the GPU's round-to-nearest-even.
    """
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
    return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))


@triton.jit
def _logits_grad_kernel(
    # Pointers
    x_ptr,  # [BT, H] input
    w_ptr,  # [V, H] weight (rows of this shard)
    softmax_ptr,  # [BT, V] fp32 saved softmax (only read when HAS_SOFTMAX)
    grad_ptr,  # [BT] or [1] fp32 upstream gradient
    mask_ptr,  # uint8: packed bits (MASK_PACKED) or one byte per row
    target_ptr,  # [BT] int32/int64 local target index
    max_ptr,  # [BT] fp32 global logits max (memory-saving mode)
    sumexp_ptr,  # [BT] fp32 global sum of exp(logits - max) (memory-saving mode)
    g_ptr,  # [BT, CV] output chunk of G, input dtype
    # Sizes
    BT,
    H,
    V,  # columns of the whole shard (for clamping targets)
    v_start,  # first shard column of this chunk
    n_cols,  # columns in this chunk
    # Strides
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sm,
    stride_sn,
    stride_grad,  # 0 broadcasts a single upstream gradient
    stride_target,
    stride_gm,
    stride_gn,
    # Scalars of the target distribution q = on_target * onehot + smooth_all
    on_target,  # 1 - label_smoothing
    smooth_all,  # label_smoothing / global_vocab_size
    # Meta-parameters
    HAS_SOFTMAX: tl.constexpr,
    MASK_PACKED: tl.constexpr,
    DOT_FP32: tl.constexpr,  # cast operands to fp32 before tl.dot (fp32 inputs, interpreter)
    ROUND_BF16: tl.constexpr,  # round G to bf16 by hand (interpreter truncates)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns within the chunk
    row_ok = rows < BT
    col_ok = cols < n_cols
    tile_ok = row_ok[:, None] & col_ok[None, :]
    vcols = v_start + cols  # columns within the shard

    if HAS_SOFTMAX:
        prob = tl.load(
            softmax_ptr + rows[:, None] * stride_sm + vcols[None, :] * stride_sn,
            mask=tile_ok,
            other=0.0,
        ).to(tl.float32)
    else:
        acc = logits_tile(
            x_ptr, w_ptr, rows, vcols, row_ok, col_ok,
            H, stride_xm, stride_xk, stride_wn, stride_wk,
            DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        row_max = tl.load(max_ptr + rows, mask=row_ok, other=0.0)
        row_sum = tl.load(sumexp_ptr + rows, mask=row_ok, other=1.0)
        prob = tl.exp(acc - row_max[:, None]) / row_sum[:, None]

    # One-hot of the local target, only where the row's target lives on this shard.
    target = tl.load(target_ptr + rows * stride_target, mask=row_ok, other=0).to(tl.int64)
    target = tl.minimum(tl.maximum(target, 0), V - 1)
    if MASK_PACKED:
        byte = tl.load(mask_ptr + rows // 8, mask=row_ok, other=1).to(tl.int32)
        not_here = (byte >> (rows % 8)) & 1
    else:
        not_here = tl.load(mask_ptr + rows, mask=row_ok, other=1).to(tl.int32)
    here = (1 - not_here).to(tl.float32)
    is_target = vcols[None, :] == target[:, None]
    onehot = tl.where(is_target, (here * on_target)[:, None], 0.0)

    upstream = tl.load(grad_ptr + rows * stride_grad, mask=row_ok, other=0.0)
    g = (prob - smooth_all - onehot) * upstream[:, None]
    if ROUND_BF16:
        g = _round_bf16_rtne(g)
    tl.store(
        g_ptr + rows[:, None] * stride_gm + cols[None, :] * stride_gn,
        g.to(g_ptr.dtype.element_ty),
        mask=tile_ok,
    )


@triton.jit
def _matmul_kernel(
    # Pointers
    a_ptr,  # [M, K]
    b_ptr,  # [K, N]
    c_ptr,  # [M, N] output; read too when ACCUMULATE
    # Sizes
    M,
    N,
    K,
    # Strides
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    # Meta-parameters
    ACCUMULATE: tl.constexpr,  # c += a @ b instead of c = a @ b
    DOT_FP32: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,  # row-blocks per group, for L2 reuse of b
):
    # Grouped ordering: consecutive programs share columns of b.
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * n_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_size = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        a = tl.load(
            a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak,
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn,
            mask=k_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        if DOT_FP32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    c_ok = m_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=c_ok, other=0.0).to(tl.float32)
    if ROUND_BF16:
        acc = _round_bf16_rtne(acc)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_ok)


def _matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, accumulate: bool) -> None:
    """``c (+)= a @ b`` with fp32 accumulation; any strides, any sizes."""
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:
        return
    bm, bn, bk, warps = tile_config(a.dtype)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _matmul_kernel[grid](
        a, b, c,
        M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        ACCUMULATE=accumulate,
        DOT_FP32=dot_in_fp32(a.dtype),
        ROUND_BF16=interpreting() and c.dtype == torch.bfloat16,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
        num_warps=warps,
    )  # fmt: skip


def chunk_columns(bt: int, v: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Columns per vocabulary chunk: ``[bt, cols]`` of ``itemsize`` fits ``chunk_bytes``."""
    cols = chunk_bytes // max(1, bt * itemsize)
    cols = max(128, cols // 128 * 128)
    return max(1, min(v, cols))


def fused_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mask: torch.Tensor,
    mask_packed: bool,
    target: torch.Tensor,
    logits_max: torch.Tensor | None,
    sum_exp_logits: torch.Tensor | None,
    softmax: torch.Tensor | None,
    on_target: float,
    smooth_all: float,
    grad_input_dtype: torch.dtype | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward over vocabulary chunks; inputs are already validated.

    ``mask`` is uint8 (bit-packed when ``mask_packed``, else one byte per row);
    ``grad`` is ``[BT]`` or ``[1]`` fp32. Returns ``(grad_input, grad_weight)`` in
    ``x.dtype``.
    """
    bt, h = x.shape
    v = weight.shape[0]
    grad_weight = torch.empty((v, h), dtype=x.dtype, device=x.device)
    if bt == 0 or h == 0 or v == 0:
        grad_weight.zero_()
        return torch.zeros((bt, h), dtype=grad_input_dtype or x.dtype, device=x.device), grad_weight

    has_softmax = softmax is not None
    dummy = grad  # stands in for pointers the chosen mode never reads
    smax = softmax if has_softmax else dummy
    lmax = dummy if has_softmax else logits_max
    lsum = dummy if has_softmax else sum_exp_logits
    s_strides = (softmax.stride(0), softmax.stride(1)) if has_softmax else (0, 0)

    cv = chunk_columns(bt, v, x.element_size(), chunk_bytes)
    g_chunk = torch.empty((bt, cv), dtype=x.dtype, device=x.device)
    acc_input = torch.empty((bt, h), dtype=torch.float32, device=x.device)
    bm, bn, bk, warps = tile_config(x.dtype)
    dot_fp32 = dot_in_fp32(x.dtype)
    for v0 in range(0, v, cv):
        n = min(cv, v - v0)
        g = g_chunk[:, :n]
        grid = (triton.cdiv(bt, bm), triton.cdiv(n, bn))
        _logits_grad_kernel[grid](
            x, weight, smax, grad, mask, target, lmax, lsum, g,
            bt, h, v, v0, n,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
            s_strides[0], s_strides[1],
            grad.stride(0) if grad.shape[0] == bt else 0,
            target.stride(0), g.stride(0), g.stride(1),
            on_target, smooth_all,
            HAS_SOFTMAX=has_softmax, MASK_PACKED=mask_packed, DOT_FP32=dot_fp32,
            ROUND_BF16=interpreting() and x.dtype == torch.bfloat16,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            num_warps=warps,
        )  # fmt: skip
        w_chunk = weight[v0 : v0 + n]
        _matmul(g, w_chunk, acc_input, accumulate=v0 > 0)
        _matmul(g.t(), x, grad_weight[v0 : v0 + n], accumulate=False)
    return acc_input.to(grad_input_dtype or x.dtype), grad_weight
