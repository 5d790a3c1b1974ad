"""Triton kernels of the distillation epilogue against a dense teacher: whole rows of
both heads' fp32 logits, one program per row.

For token i over this shard's columns j, the tempered logits ``u = z * invt`` (the
student's) and ``w = t * invt`` (the teacher's), and the divergence ``D`` (``KIND``: 0
forward KL, 1 reverse KL, 2 JSD with weight ``beta``):

    divergence_stats_kernel    the running maxima and sums of both heads, merged over
                               the columns as ``vocab_parallel.engine.online.Online`` does:
                               m_s, S_s = sum e^(u - m_s), A_s = sum e^(u - m_s) (u - w)
                               (reverse KL), m_t, S_t, A_t = sum e^(w - m_t) (w - u)
                               (forward KL)
    divergence_second_kernel   (JSD) with the global log-normalisers ``ls``, ``lt``:
                               K_t = sum p_t (lt_j - lm_j), K_s = sum p_s (ls_j - lm_j),
                               lm_j = log(beta p_t + (1 - beta) p_s)
    divergence_grad_kernel     G = c dD/du (``c``: the upstream gradient times the
                               inverse temperature, 0 where ignored), in the inputs'
                               dtype: forward KL p_s - p_t; reverse KL p_s (u - w +
                               coef); JSD (1 - beta) p_s (ls_j - lm_j - coef)

A term whose probability is 0 adds 0 (never ``0 * inf``): an ``-inf`` logit (a masking
bias) is allowed. Each row is one program's: sums in column order, results bitwise
deterministic. Offsets are int64.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from .common import interpreting, round_bf16_rtne

FLT_MIN = tl.constexpr(-3.4028234663852886e38)  # running maxima start here, never at -inf

KINDS = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}


@triton.jit
def _logaddexp(a, b):
    """``log(e^a + e^b)``; -inf where both are."""
    hi = tl.maximum(a, b)
    lo = tl.minimum(a, b)
    safe = tl.where(hi == float("-inf"), 0.0, hi)
    return tl.where(hi == float("-inf"), hi, safe + tl.log(1.0 + tl.exp(lo - safe)))


@triton.jit
def _row(s_ptr, t_ptr, invt_ptr, stride_s, stride_t, SCALED: tl.constexpr):
    """This program's row: ``(row, its student logits, its teacher logits, its inverse
    temperature)`` (1.0 unless SCALED)."""
    row = tl.program_id(0).to(tl.int64)
    if SCALED:  # noqa: SIM108 (a constexpr branch: one side is compiled)
        inv_t = tl.load(invt_ptr + row)
    else:
        inv_t = 1.0
    return row, s_ptr + row * stride_s, t_ptr + row * stride_t, inv_t


@triton.jit
def _tempered(s_row, t_row, c0, V, inv_t, SCALED: tl.constexpr, BLOCK_N: tl.constexpr):
    """Columns ``[c0, c0 + BLOCK_N)`` of a row of both heads, tempered: ``(cols, ok, u,
    w)``; ``-inf`` past ``V`` (a probability of 0)."""
    cols = c0 + tl.arange(0, BLOCK_N).to(tl.int64)
    ok = cols < V
    u = tl.load(s_row + cols, mask=ok, other=float("-inf"))
    w = tl.load(t_row + cols, mask=ok, other=float("-inf"))
    if SCALED:
        u = u * inv_t
        w = w * inv_t
    return cols, ok, u, w


@triton.jit
def divergence_stats_kernel(
    s_ptr,  # [BT, V] fp32 student logits (untempered), rows of stride_s elements
    t_ptr,  # [BT, V] fp32 teacher logits (untempered), rows of stride_t elements
    invt_ptr,  # [BT] fp32 inverse temperature of each row (SCALED)
    out_ptr,  # [6, BT] fp32 out: m_s, S_s, A_s, m_t, S_t, A_t (A_s, A_t: 0 unless KIND asks)
    BT,
    V,
    stride_s,
    stride_t,
    KIND: tl.constexpr,  # 0 forward KL, 1 reverse KL, 2 JSD
    SCALED: tl.constexpr,  # a per-row temperature
    BLOCK_N: tl.constexpr,  # columns per step
):
    row, s_row, t_row, inv_t = _row(s_ptr, t_ptr, invt_ptr, stride_s, stride_t, SCALED)
    m_s = tl.full((), FLT_MIN, tl.float32)
    m_t = tl.full((), FLT_MIN, tl.float32)
    sum_s = tl.zeros((), tl.float32)
    sum_t = tl.zeros((), tl.float32)
    a_s = tl.zeros((), tl.float32)
    a_t = tl.zeros((), tl.float32)
    for c0 in range(0, V, BLOCK_N):
        cols, ok, u, w = _tempered(s_row, t_row, c0, V, inv_t, SCALED, BLOCK_N)
        new_s = tl.maximum(m_s, tl.max(u, axis=0))
        new_t = tl.maximum(m_t, tl.max(w, axis=0))
        decay_s = tl.exp(m_s - new_s)
        decay_t = tl.exp(m_t - new_t)
        e_s = tl.exp(u - new_s)
        e_t = tl.exp(w - new_t)
        sum_s = sum_s * decay_s + tl.sum(e_s, axis=0)
        sum_t = sum_t * decay_t + tl.sum(e_t, axis=0)
        if KIND == 1:  # reverse KL: sum e^(u - m_s) (u - w)
            a_s = a_s * decay_s + tl.sum(tl.where(e_s > 0.0, e_s * (u - w), 0.0), axis=0)
        if KIND == 0:  # forward KL: sum e^(w - m_t) (w - u)
            a_t = a_t * decay_t + tl.sum(tl.where(e_t > 0.0, e_t * (w - u), 0.0), axis=0)
        m_s = new_s
        m_t = new_t
    tl.store(out_ptr + row, m_s)
    tl.store(out_ptr + BT + row, sum_s)
    tl.store(out_ptr + 2 * BT + row, a_s)
    tl.store(out_ptr + 3 * BT + row, m_t)
    tl.store(out_ptr + 4 * BT + row, sum_t)
    tl.store(out_ptr + 5 * BT + row, a_t)


@triton.jit
def divergence_second_kernel(
    s_ptr,  # [BT, V] fp32 student logits (untempered)
    t_ptr,  # [BT, V] fp32 teacher logits (untempered)
    invt_ptr,  # [BT] fp32 inverse temperature (SCALED)
    ls_ptr,  # [BT] fp32 the student's global log-normaliser (tempered)
    lt_ptr,  # [BT] fp32 the teacher's
    out_ptr,  # [2, BT] fp32 out: K_t, K_s
    BT,
    V,
    stride_s,
    stride_t,
    log_beta,  # log(beta)
    log_rest,  # log(1 - beta)
    SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row, s_row, t_row, inv_t = _row(s_ptr, t_ptr, invt_ptr, stride_s, stride_t, SCALED)
    ls = tl.load(ls_ptr + row)
    lt = tl.load(lt_ptr + row)
    k_t = tl.zeros((), tl.float32)
    k_s = tl.zeros((), tl.float32)
    for c0 in range(0, V, BLOCK_N):
        cols, ok, u, w = _tempered(s_row, t_row, c0, V, inv_t, SCALED, BLOCK_N)
        lp_s = u - ls
        lp_t = w - lt
        lm = _logaddexp(lp_t + log_beta, lp_s + log_rest)
        p_t = tl.exp(lp_t)
        p_s = tl.exp(lp_s)
        k_t += tl.sum(tl.where(p_t > 0.0, p_t * (lp_t - lm), 0.0), axis=0)
        k_s += tl.sum(tl.where(p_s > 0.0, p_s * (lp_s - lm), 0.0), axis=0)
    tl.store(out_ptr + row, k_t)
    tl.store(out_ptr + BT + row, k_s)


@triton.jit
def divergence_grad_kernel(
    s_ptr,  # [BT, V] fp32 student logits (untempered)
    t_ptr,  # [BT, V] fp32 teacher logits (untempered)
    g_ptr,  # [BT, V] out: G in the inputs' dtype, rows of stride_g elements
    invt_ptr,  # [BT] fp32 inverse temperature (SCALED)
    ls_ptr,  # [BT] fp32 the student's global log-normaliser (tempered)
    lt_ptr,  # [BT] fp32 the teacher's
    coef_ptr,  # [BT] fp32 the gradient's constant (reverse KL, JSD; else not read)
    c_ptr,  # [BT] fp32 each row's factor: upstream gradient x inverse temperature
    BT,
    V,
    stride_s,
    stride_t,
    stride_g,
    beta,  # the JSD's weight of the teacher
    log_beta,
    log_rest,
    KIND: tl.constexpr,
    SCALED: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # round G to bf16 by hand (the interpreter truncates)
    BLOCK_N: tl.constexpr,
):
    row, s_row, t_row, inv_t = _row(s_ptr, t_ptr, invt_ptr, stride_s, stride_t, SCALED)
    g_row = g_ptr + row * stride_g
    ls = tl.load(ls_ptr + row)
    lt = tl.load(lt_ptr + row)
    c = tl.load(c_ptr + row)
    if KIND != 0:
        coef = tl.load(coef_ptr + row)
    for c0 in range(0, V, BLOCK_N):
        cols, ok, u, w = _tempered(s_row, t_row, c0, V, inv_t, SCALED, BLOCK_N)
        lp_s = u - ls
        p_s = tl.exp(lp_s)
        if KIND == 0:
            d = p_s - tl.exp(w - lt)
        elif KIND == 1:
            d = p_s * tl.where(p_s > 0.0, (u - w) + coef, 0.0)
        else:
            lm = _logaddexp((w - lt) + log_beta, lp_s + log_rest)
            d = (1.0 - beta) * p_s * tl.where(p_s > 0.0, lp_s - lm - coef, 0.0)
        g = d * c
        if ROUND_BF16:
            g = round_bf16_rtne(g)
        tl.store(g_row + cols, g.to(g_ptr.dtype.element_ty), mask=ok)


def _launch() -> dict:
    """One row per program; on a GPU 1024 columns a step with 8 warps (4 fp32 values a
    thread of each head), the interpreter 64 (several steps in small tests)."""
    return dict(
        BLOCK_N=64 if interpreting() else 1024,
        num_warps=4 if interpreting() else 8,
        num_stages=1,
    )


def stats_meta(dtype: torch.dtype, kind: str, scaled: bool) -> dict:
    """Constexprs and launch options of a :func:`divergence_stats_kernel` launch
    (``dtype``: the inputs', which its fp32 logits do not depend on)."""
    return dict(KIND=KINDS[kind], SCALED=scaled, **_launch())


def second_meta(dtype: torch.dtype, scaled: bool) -> dict:
    """Constexprs and launch options of a :func:`divergence_second_kernel` launch."""
    return dict(SCALED=scaled, **_launch())


def grad_meta(dtype: torch.dtype, kind: str, scaled: bool) -> dict:
    """Constexprs and launch options of a :func:`divergence_grad_kernel` launch writing
    ``G`` in ``dtype``."""
    rounding = interpreting() and dtype == torch.bfloat16
    return dict(KIND=KINDS[kind], SCALED=scaled, ROUND_BF16=rounding, **_launch())


def launch_variants(capability: tuple[int, int]) -> list[tuple[object, torch.dtype, dict]]:
    """Every ``(kernel, input dtype, constexprs and launch options)`` the launchers
    (``vocab_parallel.backends.triton_epilogues``) can choose: what the ahead-of-time
    compile test compiles. The statistics kernels read fp32 logits whatever the inputs'
    dtype: listed once, as bf16."""
    variants = []
    for kind, scaled in itertools.product(KINDS, (False, True)):
        variants.append((divergence_stats_kernel, torch.bfloat16, stats_meta(None, kind, scaled)))
        if kind == "jsd":
            variants.append((divergence_second_kernel, torch.bfloat16, second_meta(None, scaled)))
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            variants.append((divergence_grad_kernel, dtype, grad_meta(dtype, kind, scaled)))
    return variants
