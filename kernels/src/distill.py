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

exactly the sums of ``vocab_parallel.objectives.distill.local_statistics`` (a term whose
exponential is 0 adds 0, also where ``v - u`` is infinite; the running maxima start at
the most negative finite fp32, so a tile of ``-inf`` rescales by 1, never NaN). Neither
head's logits reach memory unless ``STORE_LOGITS`` (high-performance mode keeps both
heads' capped, untempered logits for the backward). The JSD's first pass is the variant
with neither KL term; its second pass needs both global normalisers (``log m`` is not a
sum of per-shard terms), so it is a kernel of its own, ``jsd_sums_kernel``: both tiles
again, ``K_t = sum p_t (log p_t - log m)`` and ``K_s = sum p_s (log p_s - log m)``
(``vocab_parallel.backends.triton_distill.jsd_sums``). The top-k teacher stays on the torch
epilogue over the forward-statistics kernel's logits (``vocab_parallel.objectives.distill``).

The backward from recomputed logits (memory-saving mode) has its own kernel,
``divergence_grad_kernel``: one ``G`` tile per program, both heads' tiles recomputed,
``G = c_d dD/du + c_ce (p1 - onehot)`` times the cap's derivative in registers (``dD/du``
of each divergence: ``vocab_parallel.backends.triton_distill.divergence_gradient``), written once
in the input dtype for the shared chunk loop's two torch GEMMs. ``G`` from kept logits
and the top-k teacher's are the torch epilogue's.

The vocabulary is cut into splits that run in parallel, as in ``forward.py``: each writes
its fp32 partials ``[splits, BT]``, and the launcher
(``vocab_parallel.backends.triton_distill.distill_stats``) merges them in split order
(deterministic; memory independent of V). Cross-rank reduction is the caller's. Row and
column indices are int64 (``common``).

One bias flag serves both heads: a head without a bias reads a vector of zeros (adding
0.0 leaves every logit as it was), and the inverse temperature is always read (ones for
T = 1: ``z * 1.0 == z``), which keeps the variants that ``scripts/aot_compile.py``
compiles to the 144 + 12 + 108 per target that ``launch_variants`` lists.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from .common import (
    TileConfig,
    dot_in_fp32,
    interpreting,
    logits_tile,
    round_bf16_rtne,
    tanh,
    tile_configs,
)

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


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
def distill_stats_kernel(
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
def jsd_sums_kernel(
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
def divergence_grad_kernel(
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


def stats_meta(
    dtype: torch.dtype,
    divergence: str,
    ce_sums: bool,
    has_bias: bool,
    softcap: bool,
    store_logits: bool,
    tile: TileConfig,
) -> dict:
    """Constexprs and launch options of one launch of the statistics (the launcher's and
    :func:`launch_variants`')."""
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


def grad_meta(
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


def jsd_meta(dtype: torch.dtype, has_bias: bool, softcap: bool, tile: TileConfig) -> dict:
    """Constexprs and launch options of one launch of the JSD's second pass."""
    return dict(HAS_BIAS=has_bias, SOFTCAP=softcap, DOT_FP32=dot_in_fp32(dtype), **tile.meta())


def launch_variants(capability: tuple[int, int]) -> list[tuple[object, torch.dtype, dict]]:
    """Every ``(kernel, input dtype, constexprs and launch options)`` the launchers
    (``vocab_parallel.backends.triton_distill``) can choose on a GPU of ``capability``: what the
    ahead-of-time compile test compiles."""
    variants = []
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    flags = itertools.product(DIVERGENCES, *[(False, True)] * 4)
    for divergence, ce_sums, has_bias, softcap, store in flags:
        for dtype in dtypes:
            for tile in tile_configs("distill_stats", dtype, capability):
                kw = stats_meta(dtype, divergence, ce_sums, has_bias, softcap, store, tile)
                variants.append((distill_stats_kernel, dtype, kw))
    for has_bias, softcap in itertools.product(*[(False, True)] * 2):
        for dtype in dtypes:
            for tile in tile_configs("distill_stats", dtype, capability):
                variants.append((jsd_sums_kernel, dtype, jsd_meta(dtype, has_bias, softcap, tile)))
    ce_kinds = ((False, False), (True, False), (True, True))  # none, at T = 1, at T != 1
    grad_flags = itertools.product(DIVERGENCES, ce_kinds, *[(False, True)] * 2)
    for divergence, (ce, ce_scaled), has_bias, softcap in grad_flags:
        for dtype in dtypes:
            for tile in tile_configs("distill_grad", dtype, capability):
                kw = grad_meta(dtype, divergence, ce, ce_scaled, has_bias, softcap, tile)
                variants.append((divergence_grad_kernel, dtype, kw))
    return variants
