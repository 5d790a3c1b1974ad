"""Triton kernels of the fused linear + cross-entropy backward: ``G``, by chunk or whole rows.

The backward of ``loss = CE(z, y) + z_loss * lse^2`` with ``z = cap(r)``,
``r = x @ W.T + b`` (``cap(r) = c * tanh(r / c)`` with ``softcap`` c, else the identity),
over one vocabulary shard is (the operator's math: ``vocab_parallel.ops``)

    G           = (softmax(z) * (1 + 2 z_loss lse) - q) * grad[:, None] * cap'(r)
                  (the token statistics' entropy: softmax(z) * (s + ent * (z - max)))
    cap'(r)     = 1 - tanh(r / c)^2                           (q: target distribution)
    grad_input  = G @ W;   grad_weight = G.T @ x;   grad_bias = G.sum(0)

``logits_grad_kernel`` makes one chunk ``G[:, v0:v0+CV]`` (its launcher,
``vocab_parallel.backends.triton_backend.fused_backward``, walks the vocabulary in chunks
and hands each to the two gradient GEMMs): it recomputes the logits tile by tile
(memory-saving mode: bias and cap included), or reads the saved softmax or the saved
capped logits (high-performance mode), and applies the whole epilogue in registers
(``grad_tile``): cap, exp, normalise, z-loss scale, one-hot, label smoothing, scale by
``grad``, the cap's derivative, round to the input dtype.

``logits_grad_rows_kernel`` makes ``G`` of whole rows in one launch, written over the
saved fp32 logits it reads (grad_in_forward's token chunk, whose logits nobody reads
again): no buffer of its own, and the two GEMMs read it in one piece.

Every kernel output element is written by one program (no atomics): results are bitwise
deterministic.
"""

from __future__ import annotations

import dataclasses
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


@triton.jit
def grad_tile(
    prob,  # [M, N] fp32 softmax of the tile's rows
    z,  # [M, N] fp32 capped logits (read with ENTROPY)
    t,  # [M, N] fp32 tanh(r / c) of the cap (read with SOFTCAP)
    row_max,  # [M] fp32 global logits max (read with ENTROPY)
    rows,  # [M] int64 rows of the tile
    row_ok,  # [M] rows < BT
    vcols,  # [N] shard columns of the tile
    col_ok,  # [N] the tile's columns that exist
    inv_t,  # [M] fp32 inverse temperature (read when SCALED)
    pscale_ptr, stride_ps, ent_ptr, target_ptr, grad_ptr, stride_grad, ontarget_ptr, cw_ptr,
    on_target,  # what the one-hot subtracts (the same for every row unless SCALED)
    smooth_all,  # label_smoothing / global_vocab_size
    SOFTCAP: tl.constexpr,
    SCALED: tl.constexpr,
    ENTROPY: tl.constexpr,
):  # fmt: skip
    """One fp32 tile of ``G`` from its softmax and the rows' terms (the kernels' pointers,
    loaded here, each where it is first used: the order keeps the chunk kernel's tiles in
    their registers): the z-loss scale (or the entropy's factor), the one-hot and label
    smoothing, the upstream gradient, the cap's derivative. Both G kernels' epilogue."""
    # z-loss: softmax * (1 + 2 z_loss lse); exactly the softmax (times 1.0) without it.
    pscale = tl.load(pscale_ptr + rows * stride_ps, mask=row_ok, other=1.0)
    if ENTROPY:  # token statistics: p * (pscale + ent * (z - max)), z - max = log(p sum)
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        zm = z - row_max[:, None]
        zm = tl.where(zm > float("-inf"), zm, 0.0)  # a -inf logit: p = 0, a finite factor
        prob = prob * (pscale[:, None] + ent[:, None] * zm)
    else:
        prob = prob * pscale[:, None]
    # One-hot of the local target (-1, never a column, where the target is elsewhere).
    target = tl.load(target_ptr + rows, mask=row_ok, other=-1)
    upstream = tl.load(grad_ptr + rows * stride_grad, mask=row_ok, other=0.0)
    if SCALED:
        hot = tl.load(ontarget_ptr + rows, mask=row_ok, other=0.0)
        onehot = tl.where(vcols[None, :] == target[:, None], hot[:, None], 0.0)
        cw = tl.load(cw_ptr + vcols, mask=col_ok, other=0.0)
        upstream = upstream * inv_t  # d z / d cap(r) = 1 / T
        g = (prob - smooth_all * cw[None, :] - onehot) * upstream[:, None]
    else:
        onehot = tl.where(vcols[None, :] == target[:, None], on_target, 0.0)
        g = (prob - smooth_all - onehot) * upstream[:, None]
    if SOFTCAP:  # through the cap: dz/dr = 1 - tanh(r / c)^2
        g = g * (1.0 - t * t)
    return g


@triton.jit
def logits_grad_kernel(
    # Pointers
    x_ptr,  # [BT, H] input (memory-saving mode)
    w_ptr,  # [V, H] weight, rows of this shard (memory-saving mode)
    b_ptr,  # [V] bias of this shard's rows, input dtype (only read when HAS_BIAS)
    saved_ptr,  # [BT, V] fp32 saved softmax (HAS_SOFTMAX) or capped logits (HAS_LOGITS)
    grad_ptr,  # [BT] or [1] fp32 upstream gradient
    target_ptr,  # [BT] int64 local target column, -1 where not on this shard
    max_ptr,  # [BT] fp32 global logits max (not read when HAS_SOFTMAX)
    sumexp_ptr,  # [BT] fp32 global sum of exp(logits - max) (not read when HAS_SOFTMAX)
    pscale_ptr,  # [BT] or [1] fp32 factor of the softmax: 1 + 2 * z_loss * lse
    ontarget_ptr,  # [BT] fp32 what each row's one-hot subtracts (SCALED; else on_target)
    cw_ptr,  # [V] fp32 class weight of each shard column, factor of smooth_all (SCALED)
    invt_ptr,  # [BT] fp32 inverse temperature of each row, z = cap(r) * invt (SCALED)
    ent_ptr,  # [BT] fp32 factor of p * (z - max), the entropy's gradient (ENTROPY)
    g_ptr,  # [BT, CV] output chunk of G, input dtype
    # Sizes
    BT,
    H,
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
    stride_ps,  # 0 broadcasts a single factor (1.0 without z-loss)
    stride_gm,
    stride_gn,
    # Scalars of the target distribution q = on_target * onehot + smooth_all (* cw)
    on_target,  # 1 - label_smoothing (the same for every row unless SCALED)
    smooth_all,  # label_smoothing / global_vocab_size
    softcap,  # c of z = c * tanh(r / c) (only read when SOFTCAP)
    # Meta-parameters
    HAS_SOFTMAX: tl.constexpr,
    HAS_LOGITS: tl.constexpr,  # saved_ptr holds the capped logits z (and not HAS_SOFTMAX)
    HAS_BIAS: tl.constexpr,  # recomputed logits get bias[cols]
    SOFTCAP: tl.constexpr,  # z = softcap * tanh(r / softcap); G gets 1 - tanh^2
    SCALED: tl.constexpr,  # per-row temperature and on-target amount, per-column weights
    ENTROPY: tl.constexpr,  # the softmax's factor gets ent * (z - max) (not HAS_SOFTMAX)
    DOT_FP32: tl.constexpr,  # cast operands to fp32 before tl.dot (fp32 inputs, interpreter)
    ROUND_BF16: tl.constexpr,  # round G to bf16 by hand (interpreter truncates)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # int64 rows and columns: rows * stride_sm passes 2^31 for a big saved softmax.
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns within the chunk
    row_ok = rows < BT
    col_ok = cols < n_cols
    tile_ok = row_ok[:, None] & col_ok[None, :]
    vcols = v_start + cols  # columns within the shard
    if SCALED:
        inv_t = tl.load(invt_ptr + rows, mask=row_ok, other=1.0)

    if HAS_SOFTMAX:
        prob = tl.load(
            saved_ptr + rows[:, None] * stride_sm + vcols[None, :] * stride_sn,
            mask=tile_ok,
            other=0.0,
        ).to(tl.float32)
    else:
        if HAS_LOGITS:
            z = tl.load(
                saved_ptr + rows[:, None] * stride_sm + vcols[None, :] * stride_sn,
                mask=tile_ok,
                other=0.0,
            ).to(tl.float32)
            if SOFTCAP:  # z = c * tanh(r / c) (* invt): tanh from z
                if SCALED:  # noqa: SIM108 (a constexpr branch: one side is compiled)
                    t = z * (1.0 / (softcap * inv_t))[:, None]
                else:
                    t = z * (1.0 / softcap)
        else:
            z = logits_tile(
                x_ptr, w_ptr, b_ptr, rows, vcols, row_ok, col_ok,
                H, stride_xm, stride_xk, stride_wn, stride_wk,
                HAS_BIAS, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            if SOFTCAP:  # exactly the forward's z (forward_stats_kernel)
                t = tanh(z * (1.0 / softcap))
                z = t * softcap
            if SCALED:  # the temperature
                z = z * inv_t[:, None]
        row_max = tl.load(max_ptr + rows, mask=row_ok, other=0.0)
        row_sum = tl.load(sumexp_ptr + rows, mask=row_ok, other=1.0)
        prob = tl.exp(z - row_max[:, None]) / row_sum[:, None]
    if HAS_SOFTMAX:
        row_max = prob  # never read (no entropy from a saved softmax)
        z = prob
    if not SOFTCAP:
        t = prob  # never read
    if not SCALED:
        inv_t = prob  # never read
    g = grad_tile(
        prob, z, t, row_max, rows, row_ok, vcols, col_ok, inv_t,
        pscale_ptr, stride_ps, ent_ptr, target_ptr, grad_ptr, stride_grad, ontarget_ptr, cw_ptr,
        on_target, smooth_all, SOFTCAP, SCALED, ENTROPY,
    )  # fmt: skip
    if ROUND_BF16:
        g = round_bf16_rtne(g)
    tl.store(
        g_ptr + rows[:, None] * stride_gm + cols[None, :] * stride_gn,
        g.to(g_ptr.dtype.element_ty),
        mask=tile_ok,
    )


@triton.jit
def logits_grad_rows_kernel(
    # Pointers
    z_ptr,  # [BT, V] fp32 logits of columns [v_start, v_start + V), rows of stride_zm
    #         elements: the capped logits z, or with RAW the products x @ W.T; G overwrites them
    g_ptr,  # G, input dtype: z's storage (the same address), rows of stride_gm elements
    b_ptr,  # [V_shard] bias of the shard's rows, input dtype (read when HAS_BIAS)
    grad_ptr,  # [BT] or [1] fp32 upstream gradient
    target_ptr,  # [BT] int64 local target column (of the shard), -1 where not on it
    max_ptr,  # [BT] fp32 global logits max
    sumexp_ptr,  # [BT] fp32 global sum of exp(logits - max)
    pscale_ptr,  # [BT] or [1] fp32 factor of the softmax: 1 + 2 * z_loss * lse
    ontarget_ptr,  # [BT] fp32 what each row's one-hot subtracts (SCALED; else on_target)
    cw_ptr,  # [V_shard] fp32 class weight of each shard column, factor of smooth_all (SCALED)
    invt_ptr,  # [BT] fp32 inverse temperature of each row (SCALED)
    ent_ptr,  # [BT] fp32 factor of p * (z - max), the entropy's gradient (ENTROPY)
    # Sizes
    BT,
    V,  # columns of z (and of G)
    v_start,  # the shard column of z's first column
    # Strides (columns are contiguous)
    stride_zm,  # z's row stride, in fp32 elements
    stride_gm,  # G's row stride, in elements of the input dtype (stride_zm * 4 / itemsize)
    stride_grad,  # 0 broadcasts a single upstream gradient
    stride_ps,  # 0 broadcasts a single factor (1.0 without z-loss)
    # Scalars of the target distribution q = on_target * onehot + smooth_all (* cw)
    on_target,
    smooth_all,
    softcap,  # c of z = c * tanh(r / c) (only read when SOFTCAP)
    # Meta-parameters
    RAW: tl.constexpr,  # z_ptr holds x @ W.T: bias, cap and temperature applied here
    HAS_BIAS: tl.constexpr,  # (RAW) the products get bias[cols]
    SOFTCAP: tl.constexpr,
    SCALED: tl.constexpr,
    ENTROPY: tl.constexpr,  # the softmax's factor gets ent * (z - max)
    ROUND_BF16: tl.constexpr,  # round G to bf16 by hand (interpreter truncates)
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns per step of the row walk
):
    """``G`` of whole rows in place of their logits: ``G[i, j]`` is stored at element
    ``i * stride_gm + j`` of the input dtype, inside the bytes of ``z``'s row ``i`` (its
    first half for half inputs; the same elements for fp32). With ``RAW`` the logits are
    made from the products exactly as the forward statistics' kernel makes them
    (``FROM_LOGITS``: bias, ``tanh``, temperature, in that order). Each program owns
    ``BLOCK_M`` rows and walks their columns in order: a step's stores land on columns
    ``< (step + 1) * BLOCK_N`` of the same rows, which this program has read already, and
    its loads ahead of them are never written before they are read. The barrier between
    a step's loads and its stores keeps the warps of the program in step (a warp's
    stores would otherwise overwrite what a slower warp has still to read)."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    row_ok = rows < BT
    row_max = tl.load(max_ptr + rows, mask=row_ok, other=0.0)
    row_sum = tl.load(sumexp_ptr + rows, mask=row_ok, other=1.0)
    if SCALED:  # noqa: SIM108 (a constexpr branch: one side is compiled)
        inv_t = tl.load(invt_ptr + rows, mask=row_ok, other=1.0)
    else:
        inv_t = row_sum  # never read
    inv_softcap = 1.0 / softcap
    z_rows = z_ptr + rows[:, None] * stride_zm
    g_rows = g_ptr + rows[:, None] * stride_gm
    for c0 in range(0, V, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N).to(tl.int64)
        col_ok = cols < V
        vcols = v_start + cols  # shard columns
        tile_ok = row_ok[:, None] & col_ok[None, :]
        z = tl.load(z_rows + cols[None, :], mask=tile_ok, other=0.0)
        if RAW:  # the forward's z (forward_stats_kernel, FROM_LOGITS)
            if HAS_BIAS:
                bias = tl.load(b_ptr + vcols, mask=col_ok, other=0.0)
                z += bias.to(tl.float32)[None, :]
            if SOFTCAP:
                t = tanh(z * inv_softcap)
                z = t * softcap
            else:
                t = z  # never read
            if SCALED:
                z = z * inv_t[:, None]
        elif SOFTCAP:  # z = c * tanh(r / c) (* invt): tanh from z
            if SCALED:  # noqa: SIM108 (a constexpr branch: one side is compiled)
                t = z * (1.0 / (softcap * inv_t))[:, None]
            else:
                t = z * inv_softcap
        else:
            t = z  # never read
        prob = tl.exp(z - row_max[:, None]) / row_sum[:, None]
        g = grad_tile(
            prob, z, t, row_max, rows, row_ok, vcols, col_ok, inv_t,
            pscale_ptr, stride_ps, ent_ptr, target_ptr, grad_ptr, stride_grad, ontarget_ptr,
            cw_ptr, on_target, smooth_all, SOFTCAP, SCALED, ENTROPY,
        )  # fmt: skip
        if ROUND_BF16:
            g = round_bf16_rtne(g)
        tl.debug_barrier()  # every warp's loads of this step before any store over them
        tl.store(g_rows + cols[None, :], g.to(g_ptr.dtype.element_ty), mask=tile_ok)


# Where G's softmax comes from: recomputed logits, a saved softmax, saved capped logits.
SOURCES = ("recompute", "softmax", "logits")


def meta(
    dtype: torch.dtype,
    source: str,
    has_bias: bool,
    softcap: bool,
    scaled: bool,
    tile: TileConfig,
    entropy: bool = False,
) -> dict:
    """Constexprs and launch options of one launch (the launcher's and
    :func:`launch_variants`')."""
    return dict(
        HAS_SOFTMAX=source == "softmax",
        HAS_LOGITS=source == "logits",
        HAS_BIAS=has_bias,
        SOFTCAP=softcap,
        SCALED=scaled,
        ENTROPY=entropy,
        DOT_FP32=dot_in_fp32(dtype),
        ROUND_BF16=interpreting() and dtype == torch.bfloat16,
        **tile.meta(),
    )


def rows_meta(
    dtype: torch.dtype,
    softcap: bool,
    scaled: bool,
    entropy: bool = False,
    raw: bool = False,
    has_bias: bool = False,
) -> dict:
    """Constexprs and launch options of a :func:`logits_grad_rows_kernel` launch. On a
    GPU one row per program and 1024 columns a step (8 warps, 4 fp32 values a thread;
    at 8 values the softcap's ``tanh`` beside the entropy's term spills 4 bytes on sm_80,
    ``scripts/aot_compile.py --match rows``): a token chunk of 2048 rows is 2048
    programs, 16 per SM of an H200 (8 resident at 64 warps), 32 KiB of loads in flight
    per SM (what its bandwidth needs: about 26 KiB per SM, without a pipeline). The
    interpreter: 2 rows of 64 columns (several steps and masked rows in small tests)."""
    bm, bn, warps = (2, 64, 4) if interpreting() else (1, 1024, 8)
    return dict(
        RAW=raw,
        HAS_BIAS=has_bias,
        SOFTCAP=softcap,
        SCALED=scaled,
        ENTROPY=entropy,
        ROUND_BF16=interpreting() and dtype == torch.bfloat16,
        BLOCK_M=bm,
        BLOCK_N=bn,
        num_warps=warps,
        num_stages=1,
    )


def kernel_name(source: str) -> str:
    """The tile table entry: a saved tensor is streamed, recomputed logits are a matmul."""
    return "logits_grad" if source == "recompute" else "softmax_grad"


def _flags(source: str) -> list[tuple[bool, bool]]:
    """The ``(HAS_BIAS, SOFTCAP)`` a launch from ``source`` can have: the bias only matters
    to recomputed logits; a saved softmax cannot be softcapped (the operator refuses it:
    the cap's derivative needs the logits)."""
    if source == "softmax":
        return [(False, False)]
    biases = (False, True) if source == "recompute" else (False,)
    return [(b, c) for b in biases for c in (False, True)]


def entropy_tile(tile: TileConfig, entropy: bool, softcap: bool) -> TileConfig:
    """The entropy's term with a softcap holds ``z - max``, ``tanh`` and the softmax tile
    at once: half the columns again and half the depth of each product step (else 255
    registers on sm_100 with triton 3.9, spills there with 3.6:
    ``scripts/aot_compile.py --match ENTROPY``)."""
    if entropy and softcap:
        return dataclasses.replace(
            tile, BLOCK_N=max(32, tile.BLOCK_N // 2), BLOCK_K=max(16, tile.BLOCK_K // 2)
        )
    return tile


def launch_variants(capability: tuple[int, int]) -> list[tuple[object, torch.dtype, dict]]:
    """Every ``(kernel, input dtype, constexprs and launch options)`` the launcher
    (``vocab_parallel.backends.triton_backend.fused_backward``) can choose on a GPU of
    ``capability``: what the ahead-of-time compile test compiles."""
    variants = []
    # The entropy's term comes with per-row terms (SCALED) and needs the logits.
    kinds = [(False, False), (True, False), (True, True)]  # (scaled, entropy)
    for source in SOURCES:
        for (has_bias, softcap), (scaled, entropy) in itertools.product(_flags(source), kinds):
            if entropy and source == "softmax":
                continue
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                if source == "recompute" and dtype == torch.float32:
                    continue  # fp32 products are always a GEMM's (the row kernel's RAW)
                heavy = has_bias or softcap or scaled
                for tile in tile_configs(kernel_name(source), dtype, capability, heavy):
                    tile = entropy_tile(tile, entropy, softcap)
                    kw = meta(dtype, source, has_bias, softcap, scaled, tile, entropy)
                    variants.append((logits_grad_kernel, dtype, kw))
    # G of whole rows over their logits: grad_in_forward's kept token chunk (the cross
    # entropy: no entropy term), or a column chunk of products made by a GEMM (RAW: the
    # recomputing modes, bias included, the token statistics' entropy term too).
    for raw, has_bias, softcap, (scaled, entropy), dtype in itertools.product(
        (False, True), (False, True), (False, True), kinds,
        (torch.float16, torch.bfloat16, torch.float32),
    ):  # fmt: skip
        if (has_bias or entropy) and not raw:
            continue
        kw = rows_meta(dtype, softcap, scaled, entropy, raw, has_bias)
        variants.append((logits_grad_rows_kernel, dtype, kw))
    return variants
