"""Triton kernels of distillation on one vocabulary shard (dense teacher): its forward
statistics, the JSD's second pass, and the divergence's ``G``.

For every row i, with the student's capped logits ``z = cap(x @ W.T + b)``, tempered
``u = z * inv_t``, and the teacher's ``v = cap(x_t @ W_t.T + b_t) * inv_t`` (``W_t`` the
same vocabulary rows, its hidden size ``H_t`` its own; the same cap), one online pass
over vocabulary tiles makes both heads' tiles in registers and keeps

    m_s, s_s = max_j u, sum_j e^(u - m_s)          m_t, s_t = max_j v, sum_j e^(v - m_t)
    a        = sum_j e^(v - m_t) (v - u)    (FORWARD_KL: A_t, rescaled with m_t)
             = sum_j e^(u - m_s) (u - v)    (REVERSE_KL: A_s, rescaled with m_s)
    m_c, s_c = max_j z, sum_j e^(z - m_c)   (CE_SUMS: the CE's untempered normaliser)
    pred     = z[target]                    (0 where the target is not on this shard)

exactly the sums of ``vocab_parallel.distill_stats.local_statistics`` (a term whose
exponential is 0 adds 0, also where ``v - u`` is infinite; the running maxima start at
the most negative finite fp32, so a tile of ``-inf`` rescales by 1, never NaN). Neither
head's logits reach memory unless ``STORE_LOGITS`` (high-performance mode keeps both
heads' capped, untempered logits for the backward). The JSD's first pass is the variant
with neither KL term; its second pass needs both global normalisers (``log m`` is not a
sum of per-shard terms), so it is a kernel of its own, ``_jsd_sums_kernel``: both tiles
again, ``K_t = sum p_t (log p_t - log m)`` and ``K_s = sum p_s (log p_s - log m)``
(:func:`jsd_sums`). The top-k teacher stays on the torch epilogue over the
forward-statistics kernel's logits (``vocab_parallel.distill_stats``).

The backward from recomputed logits (memory-saving mode) has its own kernel,
``_divergence_grad_kernel``: one ``G`` tile per program, both heads' tiles recomputed,
``G = c_d dD/du + c_ce (p1 - onehot)`` times the cap's derivative in registers (``dD/du``
of each divergence: :func:`divergence_gradient`), written once in the input dtype for the
shared chunk loop's two torch GEMMs. ``G`` from kept logits and the top-k teacher's are
the torch epilogue's.

The vocabulary is cut into splits that run in parallel, as in ``kernels/src/forward.py``:
each writes its fp32 partials ``[splits, BT]``, and the launcher merges them in split
order (deterministic; memory independent of V). Cross-rank reduction is the caller's.
Row and column indices are int64 (``vocab_parallel.kernels.common``).

One bias flag serves both heads: a head without a bias reads a vector of zeros (adding
0.0 leaves every logit as it was), and the inverse temperature is always read (ones for
T = 1: ``z * 1.0 == z``), which keeps the variants that ``scripts/aot_compile.py``
compiles to the 144 + 12 + 108 per target that ``launch_variants`` lists.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from vocab_parallel.kernels.common import (
    TileConfig,
    device_capability,
    dot_in_fp32,
    full_vector,
    interpreting,
    logits_tile,
    num_splits,
    round_bf16_rtne,
    tanh,
    tile_config,
    tile_configs,
)

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
# The start of every running maximum: the most negative finite fp32 (as the torch path).
LOWEST = torch.finfo(torch.float32).min


@triton.jit
def _online(run_max, run_sum, y, col_ok):
    """One tile's step of an online max / sum-exp: ``(new max, rescale factor of the old
    sums, e^(y - new max), new sum)``; padding columns count as ``-inf`` (their
    exponentials are 0)."""
    y = tl.where(col_ok[None, :], y, float("-inf"))
    new_max = tl.maximum(run_max, tl.max(y, axis=1))
    decay = tl.exp(run_max - new_max)
    e = tl.exp(y - new_max[:, None])
    return new_max, decay, e, run_sum * decay + tl.sum(e, axis=1)


@triton.jit
def _distill_stats_kernel(
    # Pointers: the student head
    x_ptr,  # [BT, H] student hidden
    w_ptr,  # [V, H] student weight rows of this shard
    b_ptr,  # [V] student bias, contiguous (read when HAS_BIAS; zeros if it has none)
    # Pointers: the teacher head
    xt_ptr,  # [BT, Ht] teacher hidden
    wt_ptr,  # [V, Ht] teacher weight rows (the same vocabulary rows)
    bt_ptr,  # [V] teacher bias, contiguous (read when HAS_BIAS; zeros if it has none)
    # Pointers: per row
    target_ptr,  # [BT] int64 local target column, -1 where not on this shard (or no CE)
    invt_ptr,  # [BT] fp32 inverse temperature of each row (ones for T = 1)
    # Pointers: outputs
    zs_ptr,  # [BT, V] fp32 student capped logits z (only written when STORE_LOGITS)
    zt_ptr,  # [BT, V] fp32 teacher capped, untempered logits (only when STORE_LOGITS)
    ms_ptr,  # [S, BT] fp32 partial max of u per split
    ss_ptr,  # [S, BT] fp32 partial sum of e^(u - m_s)
    mt_ptr,  # [S, BT] fp32 partial max of v
    st_ptr,  # [S, BT] fp32 partial sum of e^(v - m_t)
    a_ptr,  # [S, BT] fp32 partial A_t or A_s (written when FORWARD_KL or REVERSE_KL)
    mc_ptr,  # [S, BT] fp32 partial max of z (written when CE_SUMS)
    sc_ptr,  # [S, BT] fp32 partial sum of e^(z - m_c) (written when CE_SUMS)
    pred_ptr,  # [S, BT] fp32 partial z at the target
    # Sizes
    BT,
    H,
    Ht,
    V,
    tiles_per_split,
    # Strides
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_xtm,
    stride_xtk,
    stride_wtn,
    stride_wtk,
    stride_lm,
    stride_ln,
    stride_tm,
    stride_tn,
    # Scalars
    softcap,  # c of cap(r) = c * tanh(r / c), both heads (only read when SOFTCAP)
    # Meta-parameters
    FORWARD_KL: tl.constexpr,  # keep A_t = sum e^(v - m_t) (v - u)
    REVERSE_KL: tl.constexpr,  # keep A_s = sum e^(u - m_s) (u - v) (neither: the JSD)
    CE_SUMS: tl.constexpr,  # keep m_c, s_c of the untempered z (CE at T != 1)
    HAS_BIAS: tl.constexpr,  # add each head's bias (zeros for a head without one)
    SOFTCAP: tl.constexpr,  # cap both heads' logits
    STORE_LOGITS: tl.constexpr,  # write z and the teacher's capped logits
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
    inv_t = tl.load(invt_ptr + rows, mask=row_ok, other=1.0)

    # Running maxima from the most negative finite fp32 (kernels/src/forward.py: a tile of
    # -inf logits adds 0 and rescales by exp(0) = 1, never exp(-inf + inf)).
    lowest = -3.4028234663852886e38
    m_s = tl.full((BLOCK_M,), lowest, dtype=tl.float32)
    m_t = tl.full((BLOCK_M,), lowest, dtype=tl.float32)
    m_c = tl.full((BLOCK_M,), lowest, dtype=tl.float32)
    s_s = tl.zeros((BLOCK_M,), dtype=tl.float32)
    s_t = tl.zeros((BLOCK_M,), dtype=tl.float32)
    s_c = tl.zeros((BLOCK_M,), dtype=tl.float32)
    a = tl.zeros((BLOCK_M,), dtype=tl.float32)
    pred = tl.zeros((BLOCK_M,), dtype=tl.float32)
    inv_softcap = 1.0 / softcap  # a multiplication per logit, not a division
    # Every split walks tiles_per_split tiles: the last split's tiles past V are all
    # padding (-inf: they add exact zeros and rescale by 1), at no cost in wall time
    # (the other splits walk as many), and the trip count is a kernel argument, not a
    # register live through the loop (which ptxas spilled).
    first_col = pid_s * tiles_per_split * BLOCK_N
    for t in range(0, tiles_per_split):
        cols = first_col + t * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < V
        cols64 = cols.to(tl.int64)
        # The student's tile: z, then what the CE needs of it, then u.
        z = logits_tile(
            x_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok,
            H, stride_xm, stride_xk, stride_wn, stride_wk,
            HAS_BIAS, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        if SOFTCAP:  # (as kernels/src/forward.py, which the backward's recompute uses)
            z = tanh(z * inv_softcap) * softcap
        if STORE_LOGITS:
            tl.store(
                zs_ptr + rows[:, None] * stride_lm + cols64[None, :] * stride_ln,
                z,
                mask=row_ok[:, None] & col_ok[None, :],
            )
        pred += tl.sum(tl.where(cols[None, :] == target[:, None], z, 0.0), axis=1)
        if CE_SUMS:  # the untempered z's online max / sum-exp, as each head's below
            m_c, _, _, s_c = _online(m_c, s_c, z, col_ok)
        u = z * inv_t[:, None]  # (finite in padding columns: there x @ 0 + 0)
        # The teacher's tile.
        v = logits_tile(
            xt_ptr, wt_ptr, bt_ptr, rows, cols, row_ok, col_ok,
            Ht, stride_xtm, stride_xtk, stride_wtn, stride_wtk,
            HAS_BIAS, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        if SOFTCAP:
            v = tanh(v * inv_softcap) * softcap
        if STORE_LOGITS:
            tl.store(
                zt_ptr + rows[:, None] * stride_tm + cols64[None, :] * stride_tn,
                v,
                mask=row_ok[:, None] & col_ok[None, :],
            )
        v = v * inv_t[:, None]
        # Both heads' online sums; the KL's weighted sum moves with its head's maximum,
        # and a term whose exponential is 0 (padding too) adds 0 (never 0 * inf).
        m_s, decay_s, e_s, s_s = _online(m_s, s_s, u, col_ok)
        if REVERSE_KL:
            a = a * decay_s + tl.sum(tl.where(e_s > 0.0, e_s * (u - v), 0.0), axis=1)
        m_t, decay_t, e_t, s_t = _online(m_t, s_t, v, col_ok)
        if FORWARD_KL:
            a = a * decay_t + tl.sum(tl.where(e_t > 0.0, e_t * (v - u), 0.0), axis=1)

    out = pid_s * BT + rows
    tl.store(ms_ptr + out, m_s, mask=row_ok)
    tl.store(ss_ptr + out, s_s, mask=row_ok)
    tl.store(mt_ptr + out, m_t, mask=row_ok)
    tl.store(st_ptr + out, s_t, mask=row_ok)
    tl.store(pred_ptr + out, pred, mask=row_ok)
    if FORWARD_KL or REVERSE_KL:
        tl.store(a_ptr + out, a, mask=row_ok)
    if CE_SUMS:
        tl.store(mc_ptr + out, m_c, mask=row_ok)
        tl.store(sc_ptr + out, s_c, mask=row_ok)


@triton.jit
def _log_mixture(ls, lt, log_beta, log_1m_beta):
    """``log m = log(beta p_t + (1 - beta) p_s)`` from both heads' log-probabilities (a
    log-add-exp; NaN only where both are ``-inf``, where every caller masks it out)."""
    a = lt + log_beta
    b = ls + log_1m_beta
    top = tl.maximum(a, b)
    return top + tl.log(tl.exp(a - top) + tl.exp(b - top))


@triton.jit
def _jsd_sums_kernel(
    # Pointers: the student head
    x_ptr,  # [BT, H] student hidden
    w_ptr,  # [V, H] student weight rows of this shard
    b_ptr,  # [V] student bias, contiguous (read when HAS_BIAS; zeros if it has none)
    # Pointers: the teacher head
    xt_ptr,  # [BT, Ht] teacher hidden
    wt_ptr,  # [V, Ht] teacher weight rows (the same vocabulary rows)
    bt_ptr,  # [V] teacher bias, contiguous (read when HAS_BIAS; zeros if it has none)
    # Pointers: per row (fp32)
    invt_ptr,  # [BT] inverse temperature (ones for T = 1)
    ls_ptr,  # [BT] the student's global log-normaliser L_s of u
    lt_ptr,  # [BT] the teacher's L_t of v
    # Pointers: outputs
    kt_ptr,  # [S, BT] fp32 partial K_t = sum p_t (log p_t - log m) per split
    ks_ptr,  # [S, BT] fp32 partial K_s = sum p_s (log p_s - log m) per split
    # Sizes
    BT,
    H,
    Ht,
    V,
    tiles_per_split,
    # Strides
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_xtm,
    stride_xtk,
    stride_wtn,
    stride_wtk,
    # Scalars
    softcap,  # c of cap(r) = c * tanh(r / c), both heads (only read when SOFTCAP)
    log_beta,  # log beta of the mixture m = beta p_t + (1 - beta) p_s
    log_1m_beta,  # log (1 - beta)
    # Meta-parameters
    HAS_BIAS: tl.constexpr,  # add each head's bias (zeros for a head without one)
    SOFTCAP: tl.constexpr,  # cap both heads' logits
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The JSD's second pass over this split's tiles: both heads' tiles recomputed (the
    statistics kernel's), ``p = e^(y - L)`` with the reduced normalisers, and the two
    sums; a term whose probability is 0 adds 0 (also where ``log p - log m`` is NaN)."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < BT
    inv_t = tl.load(invt_ptr + rows, mask=row_ok, other=1.0)
    l_s = tl.load(ls_ptr + rows, mask=row_ok, other=0.0)
    l_t = tl.load(lt_ptr + rows, mask=row_ok, other=0.0)
    k_t = tl.zeros((BLOCK_M,), dtype=tl.float32)
    k_s = tl.zeros((BLOCK_M,), dtype=tl.float32)
    inv_softcap = 1.0 / softcap
    first_col = pid_s * tiles_per_split * BLOCK_N
    for t in range(0, tiles_per_split):  # (past V: padding columns, masked below)
        cols = first_col + t * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < V
        z = logits_tile(
            x_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok,
            H, stride_xm, stride_xk, stride_wn, stride_wk,
            HAS_BIAS, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        if SOFTCAP:
            z = tanh(z * inv_softcap) * softcap
        ls = z * inv_t[:, None] - l_s[:, None]
        v = logits_tile(
            xt_ptr, wt_ptr, bt_ptr, rows, cols, row_ok, col_ok,
            Ht, stride_xtm, stride_xtk, stride_wtn, stride_wtk,
            HAS_BIAS, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        if SOFTCAP:
            v = tanh(v * inv_softcap) * softcap
        lt = v * inv_t[:, None] - l_t[:, None]
        lm = _log_mixture(ls, lt, log_beta, log_1m_beta)
        p_t = tl.exp(lt)
        p_s = tl.exp(ls)
        # Padding columns have finite logits (x @ 0 + 0): masked by col_ok.
        k_t += tl.sum(tl.where(col_ok[None, :] & (p_t > 0.0), p_t * (lt - lm), 0.0), axis=1)
        k_s += tl.sum(tl.where(col_ok[None, :] & (p_s > 0.0), p_s * (ls - lm), 0.0), axis=1)
    out = pid_s * BT + rows
    tl.store(kt_ptr + out, k_t, mask=row_ok)
    tl.store(ks_ptr + out, k_s, mask=row_ok)


@triton.jit
def _divergence_grad_kernel(
    # Pointers: the student head
    x_ptr,  # [BT, H] student hidden
    w_ptr,  # [V, H] student weight rows of this shard
    b_ptr,  # [V] student bias, contiguous (read when HAS_BIAS; zeros if it has none)
    # Pointers: the teacher head
    xt_ptr,  # [BT, Ht] teacher hidden
    wt_ptr,  # [V, Ht] teacher weight rows (the same vocabulary rows)
    bt_ptr,  # [V] teacher bias, contiguous (read when HAS_BIAS; zeros if it has none)
    # Pointers: per row (fp32 unless said)
    invt_ptr,  # [BT] inverse temperature (ones for T = 1)
    ls_ptr,  # [BT] the student's global log-normaliser L_s of u
    lt_ptr,  # [BT] the teacher's L_t of v
    cd_ptr,  # [BT] c_d = upstream * (1 - a) / T (0 for ignored rows)
    coef_ptr,  # [BT] the divergence's constant (REVERSE_KL: L_t - L_s - D; JSD: K_s)
    cce_ptr,  # [BT] c_ce = upstream * a (read when CE)
    l1_ptr,  # [BT] the CE's untempered log-normaliser of z (read when CE_SCALED)
    target_ptr,  # [BT] int64 local target column, -1 where not on this shard (when CE)
    # Pointers: output
    g_ptr,  # [BT, CV] output chunk of G, input dtype
    # Sizes
    BT,
    H,
    Ht,
    v_start,  # first shard column of this chunk
    n_cols,  # columns in this chunk
    # Strides
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_xtm,
    stride_xtk,
    stride_wtn,
    stride_wtk,
    stride_gm,
    stride_gn,
    # Scalars
    softcap,  # c of cap(r) = c * tanh(r / c), both heads (only read when SOFTCAP)
    log_beta,  # JSD: log beta
    log_1m_beta,  # JSD: log (1 - beta)
    one_m_beta,  # JSD: 1 - beta
    # Meta-parameters
    REVERSE_KL: tl.constexpr,  # dD/du = p_s (u - v + coef)
    JSD: tl.constexpr,  # dD/du = (1 - beta) p_s (log p_s - log m - coef); neither: forward KL
    CE: tl.constexpr,  # the hard-label mix: + c_ce (p1 - onehot)
    CE_SCALED: tl.constexpr,  # p1 = e^(z - l1) (T != 1), else p1 = p_s (one coefficient)
    HAS_BIAS: tl.constexpr,  # add each head's bias (zeros for a head without one)
    SOFTCAP: tl.constexpr,  # cap both heads' logits; G gets the cap's derivative
    DOT_FP32: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # round G to bf16 by hand (the interpreter truncates)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One tile of ``G = c_d dD/du + c_ce (p1 - onehot)``, times ``cap'(r) = 1 - (z /
    c)^2``, from both heads' recomputed tiles (the forward's statistics already reduced:
    ``p_s = e^(u - L_s)``, ``p_t = e^(v - L_t)``); ``dD/du`` of the forward KL is ``p_s -
    p_t``, the others' are 0 where ``p_s`` is (never ``0 * inf``)."""
    # int64 rows and columns: rows * stride_gm passes 2^31 for a big chunk.
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns within the chunk
    row_ok = rows < BT
    col_ok = cols < n_cols
    vcols = v_start + cols  # columns within the shard
    inv_t = tl.load(invt_ptr + rows, mask=row_ok, other=1.0)
    inv_softcap = 1.0 / softcap

    # The student's tile and its probabilities (exactly the statistics kernel's z).
    z = logits_tile(
        x_ptr, w_ptr, b_ptr, rows, vcols, row_ok, col_ok,
        H, stride_xm, stride_xk, stride_wn, stride_wk,
        HAS_BIAS, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if SOFTCAP:
        z = tanh(z * inv_softcap) * softcap
    l_s = tl.load(ls_ptr + rows, mask=row_ok, other=0.0)
    c_d = tl.load(cd_ptr + rows, mask=row_ok, other=0.0)
    u = z * inv_t[:, None]
    ls = u - l_s[:, None]  # log p_s
    p_s = tl.exp(ls)
    if CE:
        c_ce = tl.load(cce_ptr + rows, mask=row_ok, other=0.0)
    # The teacher's tile.
    v = logits_tile(
        xt_ptr, wt_ptr, bt_ptr, rows, vcols, row_ok, col_ok,
        Ht, stride_xtm, stride_xtk, stride_wtn, stride_wtk,
        HAS_BIAS, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if SOFTCAP:
        v = tanh(v * inv_softcap) * softcap
    l_t = tl.load(lt_ptr + rows, mask=row_ok, other=0.0)
    v = v * inv_t[:, None]
    lt = v - l_t[:, None]  # log p_t
    if REVERSE_KL or JSD:
        coef = tl.load(coef_ptr + rows, mask=row_ok, other=0.0)
        if REVERSE_KL:
            dd = (u - v) + coef[:, None]
        else:
            lm = _log_mixture(ls, lt, log_beta, log_1m_beta)
            dd = one_m_beta * (ls - lm - coef[:, None])
        g = c_d[:, None] * tl.where(p_s > 0.0, p_s * dd, 0.0)
        if CE and not CE_SCALED:  # p1 = p_s
            g = g + c_ce[:, None] * p_s
    else:  # forward KL: c_s p_s - c_d p_t, c_s = c_d (+ c_ce where p1 = p_s)
        c_s = c_d + c_ce if CE and not CE_SCALED else c_d
        g = c_s[:, None] * p_s - c_d[:, None] * tl.exp(lt)
    if CE:
        if CE_SCALED:  # the CE's own softmax of the untempered z
            l_1 = tl.load(l1_ptr + rows, mask=row_ok, other=0.0)
            g = g + c_ce[:, None] * tl.exp(z - l_1[:, None])
        target = tl.load(target_ptr + rows, mask=row_ok, other=-1)
        g = g - tl.where(vcols[None, :] == target[:, None], c_ce[:, None], 0.0)
    if SOFTCAP:  # through the cap: dz/dr = 1 - (z / c)^2
        zc = z * inv_softcap
        g = g * (1.0 - zc * zc)
    if ROUND_BF16:
        g = round_bf16_rtne(g)
    tl.store(
        g_ptr + rows[:, None] * stride_gm + cols[None, :] * stride_gn,
        g.to(g_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def _meta(
    dtype: torch.dtype,
    divergence: str,
    ce_sums: bool,
    has_bias: bool,
    softcap: bool,
    store_logits: bool,
    tile: TileConfig,
) -> dict:
    """Constexprs and launch options of one launch (shared with :func:`launch_variants`)."""
    return dict(
        FORWARD_KL=divergence == "forward_kl",
        REVERSE_KL=divergence == "reverse_kl",
        CE_SUMS=ce_sums,
        HAS_BIAS=has_bias,
        SOFTCAP=softcap,
        STORE_LOGITS=store_logits,
        DOT_FP32=dot_in_fp32(dtype),
        **tile.meta(),
    )


def _grad_meta(
    dtype: torch.dtype,
    divergence: str,
    ce: bool,
    ce_scaled: bool,
    has_bias: bool,
    softcap: bool,
    tile: TileConfig,
) -> dict:
    """Constexprs and launch options of one launch of the divergence's ``G``."""
    return dict(
        REVERSE_KL=divergence == "reverse_kl",
        JSD=divergence == "jsd",
        CE=ce,
        CE_SCALED=ce_scaled,
        HAS_BIAS=has_bias,
        SOFTCAP=softcap,
        DOT_FP32=dot_in_fp32(dtype),
        ROUND_BF16=interpreting() and dtype == torch.bfloat16,
        **tile.meta(),
    )


def _jsd_meta(dtype: torch.dtype, has_bias: bool, softcap: bool, tile: TileConfig) -> dict:
    """Constexprs and launch options of one launch of the JSD's second pass."""
    return dict(HAS_BIAS=has_bias, SOFTCAP=softcap, DOT_FP32=dot_in_fp32(dtype), **tile.meta())


def launch_variants(capability: tuple[int, int]) -> list[tuple[object, torch.dtype, dict]]:
    """Every ``(kernel, input dtype, constexprs and launch options)`` these launchers can
    choose on a GPU of ``capability``: what the ahead-of-time compile test compiles."""
    variants = []
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    flags = itertools.product(DIVERGENCES, *[(False, True)] * 4)
    for divergence, ce_sums, has_bias, softcap, store in flags:
        for dtype in dtypes:
            for tile in tile_configs("distill_stats", dtype, capability):
                meta = _meta(dtype, divergence, ce_sums, has_bias, softcap, store, tile)
                variants.append((_distill_stats_kernel, dtype, meta))
    for has_bias, softcap in itertools.product(*[(False, True)] * 2):
        for dtype in dtypes:
            for tile in tile_configs("distill_stats", dtype, capability):
                meta = _jsd_meta(dtype, has_bias, softcap, tile)
                variants.append((_jsd_sums_kernel, dtype, meta))
    ce_kinds = ((False, False), (True, False), (True, True))  # none, at T = 1, at T != 1
    grad_flags = itertools.product(DIVERGENCES, ce_kinds, *[(False, True)] * 2)
    for divergence, (ce, ce_scaled), has_bias, softcap in grad_flags:
        for dtype in dtypes:
            for tile in tile_configs("distill_grad", dtype, capability):
                meta = _grad_meta(dtype, divergence, ce, ce_scaled, has_bias, softcap, tile)
                variants.append((_divergence_grad_kernel, dtype, meta))
    return variants


class DistillStats(NamedTuple):
    """This shard's per-row statistics (fp32 ``[BT]``), the splits merged: the student's
    ``m_s, s_s``, the teacher's ``m_t, s_t``, the KL's weighted sum ``a`` (``A_t`` with
    ``m_t``, ``A_s`` with ``m_s``; None for the JSD), the CE's untempered ``m_c, s_c``
    (None without ``ce_sums``) and ``z`` at the target ``predicted``."""

    m_s: torch.Tensor
    s_s: torch.Tensor
    m_t: torch.Tensor
    s_t: torch.Tensor
    a: torch.Tensor | None
    m_c: torch.Tensor | None
    s_c: torch.Tensor | None
    predicted: torch.Tensor


def _merge(p_max: torch.Tensor, *p_sums: torch.Tensor) -> list[torch.Tensor]:
    """Per-split maxima ``[S, BT]`` and their sums as the row's: ``[M, sum_s p e^(m - M)
    ...]`` in split order (every ``m`` is finite: no NaN)."""
    top = p_max.max(dim=0).values
    decay = torch.exp(p_max - top)
    return [top] + [(p * decay).sum(dim=0) for p in p_sums]


def distill_stats(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    teacher_x: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    *,
    divergence: str,
    softcap: float | None = None,
    inv_temperature: torch.Tensor | None = None,
    local_target: torch.Tensor | None = None,
    ce_sums: bool = False,
    logits_out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> DistillStats:
    """:class:`DistillStats` of the student ``x [BT, H] @ weight [V, H].T (+ bias)`` and
    the teacher ``teacher_x [BT, Ht] @ teacher_weight [V, Ht].T (+ teacher_bias)``, both
    capped by ``softcap`` and tempered by ``inv_temperature`` (fp32 ``[BT]``, None: 1).

    ``divergence``: which weighted sum ``a`` is kept (``"jsd"``: none). ``local_target``:
    int64 ``[BT]`` local column of the CE's target, -1 elsewhere (None: no CE, predicted
    0); ``ce_sums``: also the untempered ``m_c, s_c``. ``logits_out``: two fp32 ``[BT,
    V]`` buffers that receive the student's and the teacher's capped, untempered logits.
    Both heads' tensors must have one dtype (the kernel's tile products are of one type).
    A shard without columns gives the starting maxima and zero sums.
    """
    _check_divergence(divergence)
    bt, h, v, ht = _check_heads(x, weight, teacher_x, teacher_weight)
    f32 = dict(dtype=torch.float32, device=x.device)
    kl = divergence != "jsd"
    if logits_out is not None:
        for out in logits_out:
            if out.shape != (bt, v) or out.dtype != torch.float32:
                raise ValueError(
                    f"logits_out: expected fp32 [{bt}, {v}] buffers, got {out.dtype} "
                    f"{tuple(out.shape)}"
                )
    if bt == 0 or v == 0:
        start = torch.full((bt,), LOWEST, **f32)
        zeros = torch.zeros(bt, **f32)
        ce = (start, zeros) if ce_sums else (None, None)
        return DistillStats(start, zeros, start.clone(), zeros, zeros if kl else None, *ce,
                            zeros)  # fmt: skip
    tile, n_row_blocks, splits, tiles_per_split = _split_grid(x, bt, v)
    n_parts = 5 + int(kl) + 2 * int(ce_sums)
    part = torch.empty((n_parts, splits, bt), **f32)
    p_ms, p_ss, p_mt, p_st, p_pred, *rest = part
    p_a = rest.pop(0) if kl else part[0]  # (stand-ins: never written)
    p_mc, p_sc = rest if ce_sums else (part[0], part[0])
    has_bias, b_s, b_t = _biases(bias, teacher_bias, x, v)
    target = local_target
    if target is None:
        target = torch.full((bt,), -1, dtype=torch.int64, device=x.device)
    inv_t = full_vector(inv_temperature, bt, x.device)
    store = logits_out is not None
    zs, zt = logits_out if store else (part, part)
    _distill_stats_kernel[(n_row_blocks, splits)](
        x, weight, b_s, teacher_x, teacher_weight, b_t, target.contiguous(), inv_t,
        zs, zt, p_ms, p_ss, p_mt, p_st, p_a, p_mc, p_sc, p_pred,
        bt, h, ht, v, tiles_per_split,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        teacher_x.stride(0), teacher_x.stride(1), teacher_weight.stride(0),
        teacher_weight.stride(1),
        zs.stride(0) if store else 0, zs.stride(1) if store else 0,
        zt.stride(0) if store else 0, zt.stride(1) if store else 0,
        1.0 if softcap is None else float(softcap),
        **_meta(x.dtype, divergence, ce_sums, has_bias, softcap is not None, store, tile),
    )  # fmt: skip
    sums_s, sums_t = [p_ss], [p_st]
    if divergence == "reverse_kl":
        sums_s.append(p_a)
    elif divergence == "forward_kl":
        sums_t.append(p_a)
    m_s, s_s, *a_s = _merge(p_ms, *sums_s)
    m_t, s_t, *a_t = _merge(p_mt, *sums_t)
    m_c = s_c = None
    if ce_sums:
        m_c, s_c = _merge(p_mc, p_sc)
    a = (a_s + a_t)[0] if kl else None
    return DistillStats(m_s, s_s, m_t, s_t, a, m_c, s_c, p_pred.sum(dim=0))


def _check_divergence(divergence: str) -> None:
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence: expected one of {DIVERGENCES}, got {divergence!r}")


def _check_heads(x, weight, teacher_x, teacher_weight) -> tuple[int, int, int, int]:
    """``(BT, H, V, Ht)`` of two heads over the same rows and vocabulary rows, of one
    dtype (the kernels' tile products are of one type)."""
    bt, h = x.shape
    v, ht = weight.shape[0], teacher_x.shape[1]
    if teacher_x.shape[0] != bt or teacher_weight.shape != (v, ht) or weight.shape[1] != h:
        raise ValueError(
            f"teacher: expected teacher_x [{bt}, Ht] and teacher_weight [{v}, Ht] beside x "
            f"{tuple(x.shape)} and weight {tuple(weight.shape)}, got "
            f"{tuple(teacher_x.shape)} and {tuple(teacher_weight.shape)}"
        )
    dtypes = {x.dtype, weight.dtype, teacher_x.dtype, teacher_weight.dtype}
    if len(dtypes) != 1 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x: expected one dtype of fp16, bf16 or fp32 for both heads, got {dtypes}")
    return bt, h, v, ht


def _biases(bias, teacher_bias, x, v: int):
    """``(HAS_BIAS, student bias, teacher bias)`` of a launch: with either head's bias
    both read one (zeros for the other); without, ``x`` stands in (never read)."""
    if bias is None and teacher_bias is None:
        return False, x, x

    def of(b):
        return b.contiguous() if b is not None else torch.zeros(v, dtype=x.dtype, device=x.device)

    return True, of(bias), of(teacher_bias)


def _split_grid(x: torch.Tensor, bt: int, v: int) -> tuple[TileConfig, int, int, int]:
    """``(tile, row blocks, splits, tiles per split)`` of a launch that walks the shard's
    vocabulary in splits (the statistics and the JSD's second pass: the same tiles), no
    split empty."""
    tile = tile_config("distill_stats", x.dtype, device_capability(x.device), bt)
    n_tiles = triton.cdiv(v, tile.BLOCK_N)
    n_row_blocks = triton.cdiv(bt, tile.BLOCK_M)
    splits = num_splits(n_row_blocks, n_tiles, x.device)
    tiles_per_split = triton.cdiv(n_tiles, splits)
    return tile, n_row_blocks, triton.cdiv(n_tiles, tiles_per_split), tiles_per_split


def _row(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def _mixture_logs(beta: float) -> tuple[float, float]:
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta: expected 0 < beta < 1, got {beta!r}")
    return math.log(beta), math.log1p(-beta)


def jsd_sums(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    teacher_x: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    *,
    softcap: float | None,
    inv_temperature: torch.Tensor | None,
    ls: torch.Tensor,
    lt: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The JSD's second pass on this shard, fp32 ``[BT]`` each: ``K_t = sum_j p_t (log
    p_t - log m)`` and ``K_s = sum_j p_s (log p_s - log m)`` with ``m = beta p_t + (1 -
    beta) p_s``, ``p_s = e^(u - ls)``, ``p_t = e^(v - lt)`` (the reduced normalisers),
    both heads' tiles recomputed as :func:`distill_stats` makes them; the splits' partial
    sums added in split order (deterministic)."""
    bt, h, v, ht = _check_heads(x, weight, teacher_x, teacher_weight)
    log_beta, log_1m_beta = _mixture_logs(beta)
    f32 = dict(dtype=torch.float32, device=x.device)
    if bt == 0 or v == 0:
        return torch.zeros(bt, **f32), torch.zeros(bt, **f32)
    tile, n_row_blocks, splits, tiles_per_split = _split_grid(x, bt, v)
    part = torch.empty((2, splits, bt), **f32)
    has_bias, b_s, b_t = _biases(bias, teacher_bias, x, v)
    inv_t = full_vector(inv_temperature, bt, x.device)
    _jsd_sums_kernel[(n_row_blocks, splits)](
        x, weight, b_s, teacher_x, teacher_weight, b_t, inv_t, _row(ls), _row(lt),
        part[0], part[1],
        bt, h, ht, v, tiles_per_split,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        teacher_x.stride(0), teacher_x.stride(1), teacher_weight.stride(0),
        teacher_weight.stride(1),
        1.0 if softcap is None else float(softcap), log_beta, log_1m_beta,
        **_jsd_meta(x.dtype, has_bias, softcap is not None, tile),
    )  # fmt: skip
    k_t, k_s = part.sum(dim=1)
    return k_t, k_s


def divergence_gradient(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    teacher_x: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    *,
    divergence: str,
    softcap: float | None,
    inv_temperature: torch.Tensor | None,
    ls: torch.Tensor,
    lt: torch.Tensor,
    c_d: torch.Tensor,
    coef: torch.Tensor | None = None,
    beta: float = 0.5,
    c_ce: torch.Tensor | None = None,
    l1: torch.Tensor | None = None,
    local_target: torch.Tensor | None = None,
    chunk_columns: int,
):
    """``make_g(v0, v1, x_op, w_op)`` of ``vocab_parallel.chunking.gradient_products``:
    the dense divergence's ``G[:, v0:v1]`` in the input dtype, from both heads' tiles
    recomputed in registers (:func:`distill_stats`' heads and cap; the reduced
    normalisers ``ls``, ``lt`` fp32 ``[BT]``):

        G = c_d dD/du + c_ce (p1 - onehot(target)),  times 1 - (z / c)^2
        dD/du = p_s - p_t                                   forward KL
              = p_s (u - v + coef)                          reverse KL (coef = lt - ls - D)
              = (1 - beta) p_s (log p_s - log m - coef)     JSD (coef = K_s)

    ``c_d``: per row the upstream gradient times ``(1 - a) / T``; ``c_ce`` (None: no CE)
    the upstream times ``a``, with ``local_target`` (int64, -1 elsewhere) and ``l1`` (the
    untempered log-normaliser when ``T != 1``; None: ``p1 = p_s``). One ``[BT,
    chunk_columns]`` buffer holds each chunk in turn (the chunk loop consumes it first).
    """
    _check_divergence(divergence)
    bt, h, v, ht = _check_heads(x, weight, teacher_x, teacher_weight)
    ce, ce_scaled = c_ce is not None, l1 is not None
    if ce_scaled and not ce:
        raise ValueError("l1: the CE's normaliser without its coefficient c_ce")
    if (coef is None) != (divergence == "forward_kl"):
        given = "None" if coef is None else "a tensor"
        raise ValueError(f"coef: the reverse KL's and the JSD's constant, got {given} for "
                         f"{divergence!r}")  # fmt: skip
    log_beta, log_1m_beta = _mixture_logs(beta) if divergence == "jsd" else (0.0, 0.0)
    tile = tile_config("distill_grad", x.dtype, device_capability(x.device), bt)
    has_bias, b_s, b_t = _biases(bias, teacher_bias, x, v)
    inv_t = full_vector(inv_temperature, bt, x.device)
    ls, lt, c_d = _row(ls), _row(lt), _row(c_d)
    dummy = ls  # stands in for the vectors a variant does not read
    coef = dummy if coef is None else _row(coef)
    c_ce = _row(c_ce) if ce else dummy
    l1 = _row(l1) if ce_scaled else dummy
    target = local_target.contiguous() if ce else dummy
    meta = _grad_meta(x.dtype, divergence, ce, ce_scaled, has_bias, softcap is not None, tile)
    cap = 1.0 if softcap is None else float(softcap)
    g_buf = None

    def make_g(v0: int, v1: int, x_op=None, w_op=None) -> torch.Tensor:
        nonlocal g_buf
        if g_buf is None:
            g_buf = torch.empty((bt, chunk_columns), dtype=x.dtype, device=x.device)
        n = v1 - v0
        if not 0 <= v0 <= v1 <= v or n > chunk_columns:
            raise ValueError(f"v0, v1: expected a chunk of at most {chunk_columns} of the "
                             f"{v} columns, got [{v0}, {v1})")  # fmt: skip
        g = g_buf[:, :n]
        if bt == 0 or n == 0:
            return g
        grid = (triton.cdiv(bt, tile.BLOCK_M), triton.cdiv(n, tile.BLOCK_N))
        _divergence_grad_kernel[grid](
            x, weight, b_s, teacher_x, teacher_weight, b_t,
            inv_t, ls, lt, c_d, coef, c_ce, l1, target, g,
            bt, h, ht, v0, n,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
            teacher_x.stride(0), teacher_x.stride(1), teacher_weight.stride(0),
            teacher_weight.stride(1), g.stride(0), g.stride(1),
            cap, log_beta, log_1m_beta, 1.0 - beta,
            **meta,
        )  # fmt: skip
        return g

    return make_g
