"""The launchers of the fused distillation kernels (``vocab_parallel.kernels.distill``,
whose docstring has the math): the Triton backend's ``distill``
(``vocab_parallel.backends.registry``).

``vocab_parallel.objectives.distill`` calls them where a dense teacher's two heads run in one
kernel (``fused_statistics`` there): :func:`distill_stats` (the forward statistics of both
heads), :func:`jsd_sums` (the JSD's second pass) and :func:`divergence_gradient` (the
divergence's ``G``, chunk by chunk, for the shared chunk loop's two torch GEMMs). Each
checks what the kernels cannot (one dtype for both heads, matching shapes), picks the tile
and grid (``vocab_parallel.backends.triton_backend``'s device helpers), allocates, launches, and
merges the splits' partial sums in split order (deterministic). Nothing here knows
torch.distributed: cross-rank reduction is the caller's.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton

from vocab_parallel.backends.triton_backend import device_capability, full_vector, num_splits
from vocab_parallel.engine.online import merge
from vocab_parallel.kernels import distill
from vocab_parallel.kernels.common import TileConfig, tile_config

# The start of every running maximum: the most negative finite fp32 (as the torch path).
LOWEST = torch.finfo(torch.float32).min


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
    ...]`` (``vocab_parallel.engine.online.merge``)."""
    top, sums = merge(p_max, *p_sums)
    return [top, *sums]


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
    capped = softcap is not None
    distill.distill_stats_kernel[(n_row_blocks, splits)](
        x, weight, b_s, teacher_x, teacher_weight, b_t, target.contiguous(), inv_t,
        zs, zt, p_ms, p_ss, p_mt, p_st, p_a, p_mc, p_sc, p_pred,
        bt, h, ht, v, tiles_per_split,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        teacher_x.stride(0), teacher_x.stride(1), teacher_weight.stride(0),
        teacher_weight.stride(1),
        zs.stride(0) if store else 0, zs.stride(1) if store else 0,
        zt.stride(0) if store else 0, zt.stride(1) if store else 0,
        1.0 if softcap is None else float(softcap),
        **distill.stats_meta(x.dtype, divergence, ce_sums, has_bias, capped, store, tile),
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
    if divergence not in distill.DIVERGENCES:
        raise ValueError(f"divergence: expected one of {distill.DIVERGENCES}, got {divergence!r}")


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
    distill.jsd_sums_kernel[(n_row_blocks, splits)](
        x, weight, b_s, teacher_x, teacher_weight, b_t, inv_t, _row(ls), _row(lt),
        part[0], part[1],
        bt, h, ht, v, tiles_per_split,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        teacher_x.stride(0), teacher_x.stride(1), teacher_weight.stride(0),
        teacher_weight.stride(1),
        1.0 if softcap is None else float(softcap), log_beta, log_1m_beta,
        **distill.jsd_meta(x.dtype, has_bias, softcap is not None, tile),
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
    """``make_g(v0, v1, x_op, w_op)`` of ``vocab_parallel.engine.chunking.gradient_products``:
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
    capped = softcap is not None
    meta = distill.grad_meta(x.dtype, divergence, ce, ce_scaled, has_bias, capped, tile)
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
        distill.divergence_grad_kernel[grid](
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
