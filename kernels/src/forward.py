"""Triton kernel of the forward statistics of one vocabulary shard.

For every row i of ``logits = cap(x @ W.T + bias)`` (this shard's columns only; the
bias is optional, ``cap(r) = softcap * tanh(r / softcap)`` or the identity) one online
pass over vocabulary tiles gives

    local_max[i]  = max_j logits[i, j]
    local_sum[i]  = sum_j exp(logits[i, j] - local_max[i])
    predicted[i]  = logits[i, target[i]]   (0 where the target is not on this shard)
    logit_sum[i]  = sum_j logits[i, j]     (label smoothing needs the mean logit)
    shifted[i]    = sum_j e_ij (logits[i, j] - local_max[i])    (EXTRA_STATS: entropy)
    exp2[i]       = sum_j e_ij^2, e_ij = exp(logits[i, j] - local_max[i])   (sum p^2)

so the logits are produced once and never stored (unless high-performance mode asks for
them, to turn them into the saved softmax). With ``FROM_LOGITS`` the tile products are a
GEMM's of the launcher's (cuBLAS with fp32 output, into the logits buffer: the first GPU
run measured the tile GEMM here at half its rate), and the kernel is the epilogue alone:
it reads ``x @ W.T`` from the buffer, adds the bias, caps and tempers, writes ``z`` back
in place and keeps the same statistics. The vocabulary is cut into a fixed number of
splits that run in parallel; each writes its partial statistics and
``stats_merge_kernel`` (one launch, or none for one split) merges them in a fixed order
(deterministic, and bounded memory: ``[splits, BT]``, independent of V). Cross-rank
reduction belongs to the caller. Row and column indices are int64 (``common``): the
stored logits pass 2^31 elements at scale.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import triton
import triton.language as tl

from .common import TileConfig, dot_in_fp32, logits_tile, tanh, tile_configs


@triton.jit
def forward_stats_kernel(
    # Pointers
    x_ptr,  # [BT, H] input
    w_ptr,  # [V, H] weight rows of this shard
    target_ptr,  # [BT] int64 local target column, -1 where not on this shard
    b_ptr,  # [V] bias of this shard's rows, input dtype (only read when HAS_BIAS)
    invt_ptr,  # [BT] fp32 inverse temperature of each row, z = cap(r) * invt (SCALED)
    cw_ptr,  # [V] fp32 class weights of the logit sum (read when SCALED and LOGIT_SUM)
    logits_ptr,  # [BT, V] fp32 (capped) logits out (only written when STORE_LOGITS; with
    #              FROM_LOGITS it holds x @ W.T on entry and z on exit)
    max_ptr,  # [S, BT] fp32 partial max per split
    sum_ptr,  # [S, BT] fp32 partial sum of exp(logit - partial max)
    pred_ptr,  # [S, BT] fp32 partial target logit
    lsum_ptr,  # [S, BT] fp32 partial sum of logits
    shift_ptr,  # [S, BT] fp32 partial sum of e * (logit - partial max) (EXTRA_STATS)
    exp2_ptr,  # [S, BT] fp32 partial sum of e^2 (EXTRA_STATS)
    # Sizes
    BT,
    H,
    V,
    tiles_per_split,
    # Strides
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_lm,
    stride_ln,
    # Scalars
    softcap,  # c of z = c * tanh(r / c) (only read when SOFTCAP)
    # Meta-parameters
    STORE_LOGITS: tl.constexpr,
    LOGIT_SUM: tl.constexpr,  # compute logit_sum (label smoothing only), else leave it 0
    HAS_BIAS: tl.constexpr,  # add bias[cols] to the logits
    SOFTCAP: tl.constexpr,  # cap the logits: softcap * tanh(logits / softcap)
    SCALED: tl.constexpr,  # per-row inverse temperature and per-column class weights
    EXTRA_STATS: tl.constexpr,  # also the shifted and squared sums (token statistics)
    FROM_LOGITS: tl.constexpr,  # the products are in logits_ptr already (a GEMM's)
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # int64 rows and columns: offsets such as rows * stride_lm pass 2^31 at scale.
    pid_m = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < BT
    target = tl.load(target_ptr + rows, mask=row_ok, other=-1)
    if SCALED:
        inv_t = tl.load(invt_ptr + rows, mask=row_ok, other=1.0)

    # The running max starts at the most negative finite fp32, not -inf: a tile whose
    # logits are all -inf (a masking bias) then adds exp(-inf - m) = 0 and rescales by
    # exp(0) = 1, never exp(-inf + inf) = NaN, at no extra register.
    run_max = tl.full((BLOCK_M,), -3.4028234663852886e38, dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    pred = tl.zeros((BLOCK_M,), dtype=tl.float32)
    lsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    shifted = tl.zeros((BLOCK_M,), dtype=tl.float32)
    exp2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    inv_softcap = 1.0 / softcap  # a multiplication per logit, not a division
    first_tile = pid_s * tiles_per_split
    n_tiles = tl.minimum(tiles_per_split, tl.cdiv(V, BLOCK_N) - first_tile)
    for t in range(0, n_tiles):
        cols = (first_tile + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < V
        if FROM_LOGITS:  # the launcher's GEMM wrote x @ W.T here
            z_ptrs = logits_ptr + rows[:, None] * stride_lm + cols.to(tl.int64)[None, :] * stride_ln
            acc = tl.load(z_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            if HAS_BIAS:
                bias = tl.load(b_ptr + cols.to(tl.int32), mask=col_ok, other=0.0)
                acc += bias.to(tl.float32)[None, :]
        else:
            acc = logits_tile(
                x_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok,
                H, stride_xm, stride_xk, stride_wn, stride_wk,
                HAS_BIAS, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
        if SOFTCAP:  # (the backward recomputes exactly this: tanh(r * inv) * softcap)
            acc = tanh(acc * inv_softcap) * softcap
        if SCALED:  # the temperature
            acc = acc * inv_t[:, None]
        if STORE_LOGITS:  # (addresses made here: none live through the products' loop)
            z_ptrs = logits_ptr + rows[:, None] * stride_lm + cols.to(tl.int64)[None, :] * stride_ln
            tl.store(z_ptrs, acc, mask=row_ok[:, None] & col_ok[None, :])
        # Online max / sum-exp; padding columns count as -inf (exp gives 0).
        masked = tl.where(col_ok[None, :], acc, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(masked, axis=1))
        if EXTRA_STATS:  # moved to the new max as the sum is (LocalStats.rescaled_extras)
            step = run_max - new_max  # <= 0
            decay = tl.exp(step)
            shifted = tl.where(run_sum > 0.0, shifted + step * run_sum, 0.0) * decay
            exp2 = exp2 * decay * decay
            zm = masked - new_max[:, None]
            e = tl.exp(zm)
            run_sum = run_sum * decay + tl.sum(e, axis=1)
            shifted += tl.sum(e * tl.where(e > 0.0, zm, 0.0), axis=1)  # never 0 * -inf
            exp2 += tl.sum(e * e, axis=1)
        else:
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(
                tl.exp(masked - new_max[:, None]), axis=1
            )
        run_max = new_max
        pred += tl.sum(tl.where(cols[None, :] == target[:, None], acc, 0.0), axis=1)
        if LOGIT_SUM:
            if SCALED:  # weighted by the class weights
                cw = tl.load(cw_ptr + cols, mask=col_ok, other=0.0)
                lsum += tl.sum(tl.where(col_ok[None, :], acc * cw[None, :], 0.0), axis=1)
            else:
                lsum += tl.sum(tl.where(col_ok[None, :], acc, 0.0), axis=1)

    out = pid_s * BT + rows
    tl.store(max_ptr + out, run_max, mask=row_ok)
    tl.store(sum_ptr + out, run_sum, mask=row_ok)
    tl.store(pred_ptr + out, pred, mask=row_ok)
    tl.store(lsum_ptr + out, lsum, mask=row_ok)
    if EXTRA_STATS:
        tl.store(shift_ptr + out, shifted, mask=row_ok)
        tl.store(exp2_ptr + out, exp2, mask=row_ok)


@triton.jit
def stats_merge_kernel(
    part_ptr,  # [K, S, BT] fp32 partials of forward_stats_kernel's S splits (K = 4, or 6
    #            with EXTRA_STATS): max, sum, pred, lsum[, shifted, exp2], in that order
    out_ptr,  # [K, BT] fp32 out: the row's statistics, its sums at the row's max
    BT,  # rows
    S,  # splits (>= 1)
    EXTRA_STATS: tl.constexpr,  # merge the shifted and squared sums too
    BLOCK: tl.constexpr,  # rows per program
):
    """The launcher's merge of the splits' partials, one launch: the row's max over the
    splits, each split's sums moved to it (``LocalStats.rescaled_extras``: a split's
    maximum is finite, never -inf, so ``d`` is finite), added in split order: bitwise
    deterministic."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < BT
    plane = S.to(tl.int64) * BT  # one statistic's [S, BT]
    row_max = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for s in range(0, S):
        off = s * BT + rows  # (s: int32, BT: int32, rows int64: the sum is int64)
        row_max = tl.maximum(row_max, tl.load(part_ptr + off, mask=ok, other=0.0))
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    pred = tl.zeros((BLOCK,), dtype=tl.float32)
    lsum = tl.zeros((BLOCK,), dtype=tl.float32)
    shifted = tl.zeros((BLOCK,), dtype=tl.float32)
    exp2 = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, S):
        off = s * BT + rows
        d = tl.load(part_ptr + off, mask=ok, other=0.0) - row_max  # <= 0
        decay = tl.exp(d)
        split_sum = tl.load(part_ptr + plane + off, mask=ok, other=0.0)
        total += split_sum * decay
        pred += tl.load(part_ptr + 2 * plane + off, mask=ok, other=0.0)
        lsum += tl.load(part_ptr + 3 * plane + off, mask=ok, other=0.0)
        if EXTRA_STATS:
            sh = tl.load(part_ptr + 4 * plane + off, mask=ok, other=0.0)
            e2 = tl.load(part_ptr + 5 * plane + off, mask=ok, other=0.0)
            shifted += tl.where(split_sum > 0.0, sh + d * split_sum, 0.0) * decay
            exp2 += e2 * (decay * decay)
    tl.store(out_ptr + rows, row_max, mask=ok)
    tl.store(out_ptr + BT + rows, total, mask=ok)
    tl.store(out_ptr + 2 * BT + rows, pred, mask=ok)
    tl.store(out_ptr + 3 * BT + rows, lsum, mask=ok)
    if EXTRA_STATS:
        tl.store(out_ptr + 4 * BT + rows, shifted, mask=ok)
        tl.store(out_ptr + 5 * BT + rows, exp2, mask=ok)


MERGE_BLOCK = 512  # rows per program of stats_merge_kernel (4 warps)


def merge_meta(dtype: torch.dtype, extra_stats: bool) -> dict:
    """Constexprs and launch options of a :func:`stats_merge_kernel` launch (``dtype``: the
    partials', fp32)."""
    return dict(EXTRA_STATS=extra_stats, BLOCK=MERGE_BLOCK, num_warps=4, num_stages=1)


def epilogue_tile(tile: TileConfig) -> TileConfig:
    """The tile of a ``FROM_LOGITS`` launch: half the columns of the products' tile. No
    products, but the tile's int64 addresses are live from its load to its store: at the
    products' width ptxas needs 255 registers (and spills on sm_80) for odd strides
    (``scripts/aot_compile.py --match FROM_LOGITS``)."""
    return dataclasses.replace(tile, BLOCK_N=max(16, tile.BLOCK_N // 2))


def meta(
    dtype: torch.dtype,
    store_logits: bool,
    logit_sum: bool,
    has_bias: bool,
    softcap: bool,
    scaled: bool,
    tile: TileConfig,
    extra_stats: bool = False,
    from_logits: bool = False,
) -> dict:
    """Constexprs and launch options of one launch (the launcher's and
    :func:`launch_variants`'); ``from_logits`` only with ``store_logits``."""
    return dict(
        FROM_LOGITS=from_logits,
        STORE_LOGITS=store_logits,
        LOGIT_SUM=logit_sum,
        HAS_BIAS=has_bias,
        SOFTCAP=softcap,
        SCALED=scaled,
        EXTRA_STATS=extra_stats,
        DOT_FP32=dot_in_fp32(dtype),
        **tile.meta(),
    )


def launch_variants(capability: tuple[int, int]) -> list[tuple[object, torch.dtype, dict]]:
    """Every ``(kernel, input dtype, constexprs and launch options)`` the launcher
    (``vocab_parallel.backends.triton_backend.forward_stats``) can choose on a GPU of
    ``capability``: what the ahead-of-time compile test compiles."""
    variants = []
    # store, logit sum, bias, cap, scaled, extra stats (never with the logit sum: the token
    # statistics have no label smoothing), and from the products of a GEMM (a kept block,
    # stored where the bias, cap or temperature changed it, or a column chunk, not). The
    # kernel's own tile GEMM only for half inputs,
    # where torch has no half GEMM with fp32 output (an older torch): fp32 products are
    # always a GEMM's.
    flags = itertools.product((False, True), repeat=7)
    for store, logit_sum, has_bias, softcap, scaled, extra, from_logits in flags:
        if logit_sum and extra:
            continue
        if from_logits and store and not (has_bias or softcap or scaled or extra):
            continue  # the products unchanged: not written back
        if from_logits and extra and not store:
            continue  # written back (without, the extra sums spill at some sizes/tritons)
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            if not from_logits and dtype == torch.float32:
                continue
            for tile in tile_configs("forward_stats", dtype, capability, heavy_epilogue=extra):
                tile = epilogue_tile(tile) if from_logits else tile
                kw = meta(dtype, store, logit_sum, has_bias, softcap, scaled, tile, extra,
                          from_logits)  # fmt: skip
                variants.append((forward_stats_kernel, dtype, kw))
    for extra in (False, True):  # the splits' merge reads fp32 partials: listed once
        variants.append((stats_merge_kernel, torch.float32, merge_meta(torch.float32, extra)))
    return variants
