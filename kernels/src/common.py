"""Pieces shared by the kernels: the logits tile, ``tanh``, and the tile choices.

Addresses: Triton passes an int argument below 2^31 as i32, and ``program_id`` and
``arange`` are i32, so ``rows * stride`` wraps once an offset passes 2^31 (a [BT, V]
fp32 softmax of 16,744 x 128,256 does). Every row and column index is therefore widened
to int64 before it meets a stride.

Tiles: :func:`tile_config` picks the tile of each kernel from (compute capability,
dtype, rows) out of a small table whose every entry fits the target's shared memory
(``tests/test_gpu_compile.py`` compiles each of them ahead of time for sm_80, sm_90 and
sm_100 and checks shared memory and registers). Nothing here queries a device: the
launchers (``vocab_parallel.backends.triton_backend``) pass the capability, or None under the
interpreter.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

KIB = 1024
# Largest shared memory one block may use (the opt-in limit), by compute capability.
SMEM_LIMIT = {
    (8, 0): 163 * KIB,  # A100 (164 KiB per SM)
    (8, 6): 99 * KIB,
    (8, 7): 163 * KIB,
    (8, 9): 99 * KIB,
    (9, 0): 227 * KIB,  # H100, H200
    (10, 0): 227 * KIB,  # B200
    (10, 3): 227 * KIB,
    (12, 0): 99 * KIB,
}
# The targets the ahead-of-time compile test covers.
AOT_TARGETS = ((8, 0), (9, 0), (10, 0))

# Kernels with a tile table: those that multiply (logits recompute in the backward, the
# forward statistics) and the backward from a saved softmax (streams, no product).
MATMUL_KERNELS = ("forward_stats", "logits_grad")
STREAM_KERNELS = ("softmax_grad",)


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def smem_limit(capability: tuple[int, int]) -> int:
    """Shared memory per block on ``capability``; unknown parts get the smallest (99 KiB)."""
    return SMEM_LIMIT.get(tuple(capability), 99 * KIB)


@dataclass(frozen=True)
class TileConfig:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int
    # PTX's .maxnreg (Triton's launch option), or None: ptxas's own choice.
    maxnreg: int | None = None

    def meta(self) -> dict:
        """Keyword arguments of a launch: the block constexprs and the launch options."""
        meta = dict(
            BLOCK_M=self.BLOCK_M,
            BLOCK_N=self.BLOCK_N,
            BLOCK_K=self.BLOCK_K,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )
        if self.maxnreg is not None:
            meta["maxnreg"] = self.maxnreg
        return meta

    def smem_bound(self, itemsize: int) -> int:
        """Upper bound of the pipelined operand buffers of a matmul tile: ``num_stages``
        copies of an ``[M, K]`` and a ``[K, N]`` tile (Triton allocates at most that)."""
        return self.num_stages * (self.BLOCK_M + self.BLOCK_N) * self.BLOCK_K * itemsize


INTERPRETER_TILE = TileConfig(32, 32, 32, 4, 1)  # each program is numpy work: cheap, not tiny
# Rows at or below which the backward uses 64-row tiles (fewer wasted rows).
SMALL_ROWS = 64

# Half-precision tiles (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, deepest pipeline) by kernel
# and architecture family (8: Ampere/Ada, 9: Hopper, 10: Blackwell and later). The
# forward keeps an online max/sum-exp beside each tile and may store it: wider tiles make
# ptxas spill there (scripts/aot_compile.py shows it), so its tiles are narrower. The
# backward's 128x128 tile runs 16 warps on sm_90: with 8, its epilogue (scalar stores
# and masks at odd sizes) needs 255 registers on triton 3.6; with 16 it needs 128 at most
# on 3.6 and 3.9. Its 64-row tile has half the warps.
_HALF_TILES = {
    ("forward_stats", 8): (64, 64, 32, 8, 3),
    ("forward_stats", 9): (64, 64, 64, 8, 4),
    ("forward_stats", 10): (128, 32, 64, 8, 4),  # triton >= 3.9; before: _OLD_TRITON_TILES
    ("logits_grad", 8): (128, 128, 64, 8, 4),  # triton >= 3.9; before: _OLD_TRITON_TILES
    ("logits_grad", 9): (128, 128, 64, 16, 4),
    ("logits_grad", 10): (128, 128, 64, 8, 4),
}
# Triton before 3.9 (3.6 is the oldest supported) allocates registers differently
# (scripts/aot_compile.py on both): on sm_100 the forward tile above spills there (8-16
# bytes, at an 80-register cap) while 64x64 with a 3-deep pipeline fits, and on 3.9 the
# reverse; on sm_80 the backward's 8 warps need 255 registers at odd sizes there, while
# 16 warps spill on 3.9 (at their 128-register cap). Everything else is one table.
_TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])
_OLD_TRITON_TILES = {
    ("forward_stats", 10): (64, 64, 64, 8, 3),
    ("logits_grad", 8): (128, 128, 64, 16, 4),
}
if _TRITON_VERSION < (3, 9):
    _HALF_TILES.update(_OLD_TRITON_TILES)
# Exact fp32 products ("ieee": FMA, no tensor cores): small tiles, every architecture.
_FP32_TILES = {
    "forward_stats": TileConfig(32, 32, 32, 8, 3),
    "logits_grad": TileConfig(64, 64, 32, 4, 3),
}


def _family(capability: tuple[int, int]) -> int:
    return min(max(capability[0], 8), 10)


def _matmul_tile(
    kernel: str, dtype: torch.dtype, capability: tuple[int, int], small: bool
) -> TileConfig:
    if dtype == torch.float32:
        return _FP32_TILES[kernel]
    bm, bn, bk, warps, stages = _HALF_TILES[kernel, _family(capability)]
    if small and kernel == "logits_grad":
        bm, warps = 64, max(4, warps // 2)
    # The deepest pipeline whose operand buffers leave room for the epilogue's scratch.
    for depth in range(stages, 1, -1):
        cfg = TileConfig(bm, bn, bk, warps, depth)
        if cfg.smem_bound(2) + 32 * KIB <= smem_limit(capability):
            return cfg
    return TileConfig(bm, bn, bk // 2, warps, 2)


def _lighter(tile: TileConfig) -> TileConfig:
    """The backward's tile when its epilogue holds more than the softmax tile (the
    softcap's ``tanh`` beside it; the bias): half as many columns per program, else ptxas
    reaches 255 registers and spills (``scripts/aot_compile.py`` shows it), and at most
    one warp per 16 rows, 4 at least (the 16 warps of the 128x128 tile leave ptxas a register cap
    that spills the softcap's epilogue on sm_80 with triton 3.6)."""
    warps = min(tile.num_warps, max(4, tile.BLOCK_M // 16))
    return dataclasses.replace(tile, BLOCK_N=max(32, tile.BLOCK_N // 2), num_warps=warps)


def tile_config(
    kernel: str,
    dtype: torch.dtype,
    capability: tuple[int, int] | None,
    rows: int = 1 << 20,
    heavy_epilogue: bool = False,
) -> TileConfig:
    """The tile of ``kernel`` for inputs of ``dtype`` and ``rows`` rows on a device of
    compute ``capability`` (None: Triton's interpreter).

    ``heavy_epilogue``: a backward variant that holds more than the softmax tile (with a
    softcap: ``tanh`` for the cap's derivative; with a bias: its rows); it gets a lighter
    tile (:func:`_lighter`). The forward's bias and softcap fit its tiles as they are; its
    heavy variant is the token statistics' (two more online sums and the shifted logits
    beside the tile): half the BLOCK_K (fewer operand registers), else ptxas
    spills (``scripts/aot_compile.py --match EXTRA_STATS``).
    """
    if capability is None:
        return INTERPRETER_TILE
    if kernel in STREAM_KERNELS:  # fp32 softmax in, G out: bandwidth only
        tile = TileConfig(32, 128, 16, 8, 1)
    elif kernel in MATMUL_KERNELS:
        tile = _matmul_tile(kernel, dtype, tuple(capability), rows <= SMALL_ROWS)
    else:
        raise ValueError(f"kernel: unknown kernel {kernel!r}")
    if not heavy_epilogue:
        return tile
    if kernel == "forward_stats":  # half the depth of each product step
        return dataclasses.replace(tile, BLOCK_K=tile.BLOCK_K // 2)
    tile = _lighter(tile)
    if dtype == torch.float32 and _TRITON_VERSION < (3, 9):  # FMA tiles: BLOCK_K 32 spills
        tile = dataclasses.replace(tile, BLOCK_K=16)  # the heavy epilogue on sm_100 there
    return tile


def tile_configs(
    kernel: str, dtype: torch.dtype, capability: tuple[int, int], heavy_epilogue: bool = False
) -> list[TileConfig]:
    """Every tile :func:`tile_config` can choose for ``kernel`` on ``capability``."""
    configs = [
        tile_config(kernel, dtype, capability, rows, heavy_epilogue)
        for rows in (SMALL_ROWS, 1 << 20)
    ]
    return list(dict.fromkeys(configs))


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Cast tl.dot operands to fp32: for fp32 inputs (exact "ieee" products) and in the
    interpreter, whose tl.dot multiplies the raw bit patterns of bf16 operands."""
    return interpreting() or dtype == torch.float32


# tl.fdiv(..., approx=True) exists from some triton after 3.6 on (3.9 has it): a
# compile-time branch, so the older triton never sees the keyword.
HAS_APPROX_DIV = tl.constexpr("approx" in inspect.signature(tl.fdiv).parameters)


@triton.jit
def tanh(y):
    """``tanh(y)`` in fp32 from one ``exp`` (libdevice's tanh does not run under the
    interpreter): ``sign(y) * (1 - e) / (1 + e)`` with ``e = exp(-2|y|)``, which never
    overflows, is exactly +-1 at +-inf and keeps NaN. Its error is below 1e-7 absolute:
    a softcapped logit ``c * tanh(r / c)`` is then off by at most ``c * 1e-7``.

    The division is the approximate one where Triton has it (``approx=True``: PTX
    ``div.approx.f32``, 2 ulp; the denominator is in [1, 2]), else ``tl.fdiv`` without
    ``ieee_rounding`` (``div.full.f32``, as precise; triton 3.6 has no ``approx``). The
    IEEE one has a slow path that ptxas compiles to a call, whose saved registers show
    as spills; ``div.full`` costs a few registers more than ``div.approx``, which on
    triton 3.9 makes sm_100's softcap backward spill (``scripts/aot_compile.py``).
    """
    e = tl.exp(-2.0 * tl.abs(y))
    if HAS_APPROX_DIV:  # noqa: SIM108 (a statement: the other branch is never compiled)
        t = tl.fdiv(1.0 - e, 1.0 + e, approx=True)
    else:
        t = tl.fdiv(1.0 - e, 1.0 + e)
    return tl.where(y < 0.0, -t, t)


@triton.jit
def round_bf16_rtne(v):
    """Round fp32 to the nearest bf16 (ties to even), still held as fp32.

    Triton's interpreter converts fp32 to bf16 by truncation; rounding first makes that
    truncation exact, so interpreted results match the GPU's round-to-nearest-even.
    """
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
    return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))


@triton.jit
def logits_tile(
    x_ptr,  # [BT, H] input
    w_ptr,  # [V, H] weight rows
    b_ptr,  # [V] bias of the weight rows, input dtype, contiguous (read when HAS_BIAS)
    rows,  # [BLOCK_M] row indices (int64)
    cols,  # [BLOCK_N] weight-row (vocabulary) indices
    row_ok,  # [BLOCK_M] rows < BT
    col_ok,  # [BLOCK_N] cols < V
    H,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``x[rows] @ W[cols].T (+ bias[cols])`` as an fp32 ``[BLOCK_M, BLOCK_N]`` tile, masked
    at every edge.

    Offsets are int64: ``rows * stride_xm`` passes 2^31 for a big input, ``cols *
    stride_wn`` for a shard of more than 2^31 weight elements (V x H), ``k * stride`` for
    transposed operands. The bias (``[V]``: int32 offsets) is where the accumulator
    starts, so no second tile is live after the products (ptxas spilled when it was
    added afterwards).
    """
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols.to(tl.int32), mask=col_ok, other=0.0).to(tl.float32)
        acc += bias[None, :]
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        ks64 = ks.to(tl.int64)
        x = tl.load(
            x_rows + ks64[None, :] * stride_xk,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_cols + ks64[:, None] * stride_wk,
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    return acc
