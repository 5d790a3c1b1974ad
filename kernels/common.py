"""Pieces shared by the forward and backward kernels: the logits tile, launch settings."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def tile_config(dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for operands of ``dtype``."""
    if interpreting():
        return 32, 32, 32, 4  # each program is numpy work: big enough, still cheap
    if dtype == torch.float32:
        return 64, 64, 32, 4
    return 128, 128, 64, 8


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Cast tl.dot operands to fp32: for fp32 inputs (exact "ieee" products) and in the
    interpreter, whose tl.dot multiplies the raw bit patterns of bf16 operands."""
    return interpreting() or dtype == torch.float32


@triton.jit
def logits_tile(
    x_ptr,  # [BT, H] input
    w_ptr,  # [V, H] weight rows
    rows,  # [BLOCK_M] row indices
    cols,  # [BLOCK_N] weight-row (vocabulary) indices
    row_ok,  # [BLOCK_M] rows < BT
    col_ok,  # [BLOCK_N] cols < V
    H,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``x[rows] @ W[cols].T`` as an fp32 ``[BLOCK_M, BLOCK_N]`` tile, masked at every edge."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    return acc
