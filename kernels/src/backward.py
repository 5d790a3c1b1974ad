"""Triton kernel of the fused linear + cross-entropy backward, and its launcher.

The backward of ``loss = CE(z, y) + z_loss * lse^2`` with ``z = cap(r)``,
``r = x @ W.T + b`` (``cap(r) = c * tanh(r / c)`` with ``softcap`` c, else the identity),
over one vocabulary shard is (the operator's math: ``vocab_parallel.ops``)

    G           = (softmax(z) * (1 + 2 z_loss lse) - q) * grad[:, None] * cap'(r)
                  (the token statistics' entropy: softmax(z) * (s + ent * (z - max)))
    cap'(r)     = 1 - tanh(r / c)^2                           (q: target distribution)
    grad_input  = G @ W;   grad_weight = G.T @ x;   grad_bias = G.sum(0)

The full ``G`` is ``[BT, V]``; we never hold it. The launcher walks the vocabulary in
chunks of ``CV`` columns. For each chunk, ``_logits_grad_kernel`` recomputes the logits
tile by tile (memory-saving mode: bias and cap included), or reads the saved softmax or
the saved capped logits (high-performance mode) and applies the whole epilogue in
registers: cap, exp, normalise, z-loss scale, one-hot, label smoothing, scale by
``grad``, the cap's derivative, round to the input dtype. Only the chunk
``G[:, v0:v0+CV]`` reaches memory.

The two gradient GEMMs are what cuBLAS does best: they go through torch (fp32 outputs,
``vocab_parallel.precision``) in the chunk loop shared with the torch backend
(``vocab_parallel.chunking.gradient_products``): ``grad_input`` accumulates each
chunk's ``G_c @ W_c`` in fp32, ``grad_weight[v0:v0+CV] = G_c.T @ x``. Under Triton's
interpreter the same loop runs the same torch calls on CPU tensors.

Chunks are visited in a fixed order and every kernel output element is written by one
program (no atomics): results are bitwise deterministic. Memory beyond inputs and outputs
is one ``[BT, CV]`` chunk, the ``[BT, H]`` fp32 accumulator, and (half inputs) the fp32
products of one chunk; none grows with V.

This module knows nothing of torch.distributed nor of input validation: the public
operator validates, this launcher allocates and launches.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import triton
import triton.language as tl

from vocab_parallel import memory
from vocab_parallel.chunking import gradient_products
from vocab_parallel.interface import Grads, GradTerms, Logits, Outputs
from vocab_parallel.kernels.common import (
    TileConfig,
    device_capability,
    dot_in_fp32,
    full_vector,
    interpreting,
    logits_tile,
    round_bf16_rtne,
    tanh,
    tile_config,
    tile_configs,
)


@triton.jit
def _logits_grad_kernel(
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
            if SOFTCAP:  # exactly the forward's z (kernels.forward)
                t = tanh(z * (1.0 / softcap))
                z = t * softcap
            if SCALED:  # the temperature
                z = z * inv_t[:, None]
        row_max = tl.load(max_ptr + rows, mask=row_ok, other=0.0)
        row_sum = tl.load(sumexp_ptr + rows, mask=row_ok, other=1.0)
        prob = tl.exp(z - row_max[:, None]) / row_sum[:, None]
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
    if ROUND_BF16:
        g = round_bf16_rtne(g)
    tl.store(
        g_ptr + rows[:, None] * stride_gm + cols[None, :] * stride_gn,
        g.to(g_ptr.dtype.element_ty),
        mask=tile_ok,
    )


# Where G's softmax comes from: recomputed logits, a saved softmax, saved capped logits.
SOURCES = ("recompute", "softmax", "logits")


def _meta(
    dtype: torch.dtype,
    source: str,
    has_bias: bool,
    softcap: bool,
    scaled: bool,
    tile: TileConfig,
    entropy: bool = False,
) -> dict:
    """Constexprs and launch options of one launch (shared with :func:`launch_variants`)."""
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


def _kernel_name(source: str) -> str:
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


def _entropy_tile(tile: TileConfig, entropy: bool, softcap: bool) -> TileConfig:
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
    """Every ``(kernel, input dtype, constexprs and launch options)`` this launcher can
    choose on a GPU of ``capability``: what the ahead-of-time compile test compiles."""
    variants = []
    # The entropy's term comes with per-row terms (SCALED) and needs the logits.
    kinds = [(False, False), (True, False), (True, True)]  # (scaled, entropy)
    for source in SOURCES:
        for (has_bias, softcap), (scaled, entropy) in itertools.product(_flags(source), kinds):
            if entropy and source == "softmax":
                continue
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                heavy = has_bias or softcap or scaled
                for tile in tile_configs(_kernel_name(source), dtype, capability, heavy):
                    tile = _entropy_tile(tile, entropy, softcap)
                    meta = _meta(dtype, source, has_bias, softcap, scaled, tile, entropy)
                    variants.append((_logits_grad_kernel, dtype, meta))
    return variants


def fused_backward(
    x: torch.Tensor,
    weight: torch.Tensor,
    local_target: torch.Tensor,
    logits: Logits,
    terms: GradTerms,
    out: Outputs,
) -> Grads:
    """:class:`Grads` of ``G`` (``vocab_parallel.backend.Backend.fused_backward``) over
    vocabulary chunks; inputs are already validated. ``terms.reuse_logits`` changes
    nothing here (``G`` has its own buffer in the input dtype)."""
    bt, h = x.shape
    v = weight.shape[0]
    softmax, saved_logits, softcap = terms.softmax, terms.logits, logits.softcap
    source = (
        "softmax" if softmax is not None else "logits" if saved_logits is not None else "recompute"
    )
    has_bias = logits.bias is not None and source == "recompute"
    capability = device_capability(x.device)
    # A temperature, per-row on-target amounts or class weights: the SCALED variant; the
    # plain one takes on_target as a scalar.
    per_row_hot = isinstance(terms.on_target, torch.Tensor)
    entropy = terms.entropy is not None
    if entropy and source == "softmax":
        raise ValueError("terms: the entropy's term needs the logits, not a saved softmax")
    scaled = (
        logits.inv_temperature is not None
        or per_row_hot
        or terms.class_weight is not None
        or entropy
    )
    heavy = has_bias or softcap is not None or scaled  # see tile_config
    tile = tile_config(_kernel_name(source), x.dtype, capability, bt, heavy)
    tile = _entropy_tile(tile, entropy, softcap is not None)
    meta = _meta(x.dtype, source, has_bias, softcap is not None, scaled, tile, entropy)
    target = local_target.contiguous()
    grad = terms.grad.float().contiguous()
    dummy = grad  # stands in for pointers the chosen mode never reads
    saved = {"softmax": softmax, "logits": saved_logits}.get(source, dummy)
    lmax = dummy if source == "softmax" else terms.logits_max.contiguous()
    lsum = dummy if source == "softmax" else terms.sum_exp.contiguous()
    b = logits.bias.contiguous() if has_bias else x
    s_strides = (0, 0) if saved is dummy else (saved.stride(0), saved.stride(1))

    prob_scale = terms.prob_scale
    if prob_scale is None:  # one factor 1.0 for every row
        prob_scale = torch.ones(1, dtype=torch.float32, device=x.device)
    prob_scale = prob_scale.to(torch.float32).contiguous()
    stride_ps = prob_scale.stride(0) if prob_scale.shape[0] == bt else 0
    stride_grad = grad.stride(0) if grad.shape[0] == bt else 0
    hot = inv_t = cw = dummy  # the SCALED variant's vectors, in full
    if scaled:
        hot = full_vector(terms.on_target if per_row_hot else float(terms.on_target), bt, x.device)
        inv_t = full_vector(logits.inv_temperature, bt, x.device)
        cw = full_vector(terms.class_weight, v, x.device)
    ent = full_vector(terms.entropy, bt, x.device) if entropy else dummy
    on_target = 1.0 if per_row_hot else float(terms.on_target)
    cap = 1.0 if softcap is None else float(softcap)
    cv = memory.columns(bt, v, x.device.type, "logits", itemsize=x.element_size(), h=h)
    g_buf = None

    def make_g(v0: int, v1: int, x_op, w_op) -> torch.Tensor:
        nonlocal g_buf
        if g_buf is None:
            g_buf = torch.empty((bt, cv), dtype=x.dtype, device=x.device)
        n = v1 - v0
        g = g_buf[:, :n]
        grid = (triton.cdiv(bt, tile.BLOCK_M), triton.cdiv(n, tile.BLOCK_N))
        _logits_grad_kernel[grid](
            x, weight, b, saved, grad, target, lmax, lsum, prob_scale, hot, cw, inv_t, ent, g,
            bt, h, v0, n,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
            s_strides[0], s_strides[1], stride_grad, stride_ps, g.stride(0), g.stride(1),
            on_target, float(terms.smooth), cap,
            **meta,
        )  # fmt: skip
        return g

    bias_dtype = x.dtype if logits.bias is None else logits.bias.dtype
    return gradient_products(
        x, weight, cv, make_g, out, g_reads_operands=False, bias_grad_dtype=bias_dtype
    )
