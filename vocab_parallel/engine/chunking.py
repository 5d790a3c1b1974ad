"""The chunk loop of the backward shared by both backends: the two gradient GEMMs.

Both backends produce ``G`` one vocabulary chunk at a time (the torch backend with torch
ops, the Triton backend with its fused kernel) and hand each chunk to
:func:`gradient_products`, which multiplies it out: ``grad_input += G_c @ W_c`` and
``grad_weight[v0:v1] = G_c.T @ x``, every product through ``vocab_parallel.engine.precision``
(fp32 accumulation and fp32 results on every device; float64 for float64 inputs). A
fixed chunk order and plain GEMMs make the results bitwise deterministic
(``docs/design.md``, "Backends").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vocab_parallel.backends.interface import Grads, Outputs
from vocab_parallel.engine import filtering, precision

# make_g(v0, v1, x_op, w_op) -> G[:, v0:v1], fp32 or x.dtype (rounded by the loop).
MakeG = Callable[[int, int, "torch.Tensor | None", "torch.Tensor | None"], torch.Tensor]


def gradient_products(
    x: torch.Tensor,
    weight: torch.Tensor,
    cv: int,
    make_g: MakeG,
    out: Outputs,
    *,
    g_reads_operands: bool,
    bias_grad_dtype: torch.dtype | None = None,
) -> Grads:
    """``grad_input = G @ weight`` and ``grad_weight = G.T @ x`` over vocabulary chunks.

    For each chunk of ``cv`` columns (in order), ``make_g(v0, v1, x_op, w_op)`` gives
    ``G[:, v0:v1]`` (``x_op``, ``w_op``: ``x`` and ``weight[v0:v1]`` in the GEMM operand
    dtype, for a ``make_g`` that ``g_reads_operands``; else None unless a product needs
    them). Its
    values are rounded to ``x.dtype`` here, then ``grad_input`` accumulates ``G_c @ W_c``
    in fp32 and ``grad_weight[v0:v1] = G_c.T @ x`` (fp32, rounded once). A fixed chunk
    order and plain GEMMs: bitwise deterministic. A gradient that is not needed costs no
    GEMM and no memory and comes back as None.

    With ``out.need_bias``: ``grad_bias = G.sum(0)`` ``[V]``, the same rounded ``G``
    summed in fp32, in ``bias_grad_dtype`` (default the input dtype).

    ``out`` (:class:`vocab_parallel.backends.interface.Outputs`) says which gradients are wanted and
    holds the caller's buffers (``grad_input`` written into ``grad_input_out``; products
    added to ``grad_weight_acc`` / ``grad_bias_acc``, or written when not
    ``accumulate``), each returned in place of the gradient it holds.

    With ``out.filter`` the products leave out the chunk's negligible tiles of ``G``
    (``vocab_parallel.engine.filtering``); ``grad_bias`` is never filtered.
    """
    bt, h = x.shape
    v = weight.shape[0]
    dtype, device = x.dtype, x.device
    need_input_grad, need_weight_grad = out.need_input, out.need_weight
    need_bias_grad = out.need_bias
    if need_bias_grad and bias_grad_dtype is None:
        bias_grad_dtype = dtype
    grad_input_out = out.grad_input_out
    if not (need_input_grad or need_weight_grad or need_bias_grad):
        return Grads(None, None, None)
    gi_dtype = out.grad_input_dtype or dtype
    if out.g_out is not None:
        if bt and v:
            _keep_g(x, weight, cv, make_g, out.g_out, g_reads_operands)
        return Grads(None, None, None)
    # H = 0: empty products, but the bias alone still makes logits (and a bias gradient).
    if bt == 0 or v == 0 or (h == 0 and not need_bias_grad):
        return _no_products(x, weight, out, gi_dtype, bias_grad_dtype)

    operand = precision.operand_dtype(dtype, device.type)
    x_op = x.to(operand) if (need_weight_grad or g_reads_operands) else None
    plan = _plan(x, x_op, v, out, bias_grad_dtype, cv)
    for v0 in range(0, v, cv):
        v1 = min(v, v0 + cv)
        w_op = weight[v0:v1].to(operand) if (need_input_grad or g_reads_operands) else None
        _chunk_products(plan, make_g(v0, v1, x_op, w_op), v0, v1, w_op)
    grad_input = None
    if need_input_grad:
        grad_input = plan.acc if grad_input_out is not None else plan.acc.to(gi_dtype)
    return Grads(grad_input, plan.grad_weight, plan.grad_bias)


def _keep_g(x, weight, cv: int, make_g: MakeG, g_out: torch.Tensor, g_reads_operands: bool):
    """``G`` chunk by chunk into ``g_out`` (the inputs' dtype), rounded as the products
    would see it; a chunk ``make_g`` wrote there already is left as it is."""
    v = weight.shape[0]
    operand = precision.operand_dtype(x.dtype, x.device.type)
    x_op = x.to(operand) if g_reads_operands else None
    for v0 in range(0, v, cv):
        v1 = min(v, v0 + cv)
        w_op = weight[v0:v1].to(operand) if g_reads_operands else None
        g, dst = make_g(v0, v1, x_op, w_op), g_out[:, v0:v1]
        if g.data_ptr() != dst.data_ptr() or g.dtype != dst.dtype:
            dst.copy_(precision.round_to(g, x.dtype, operand))


@dataclass
class _Plan:
    """The buffers and decisions of one :func:`gradient_products` call."""

    out: Outputs
    x_op: torch.Tensor | None
    dtype: torch.dtype  # the inputs'
    operand: torch.dtype  # of the GEMMs' operands
    accum: torch.dtype  # of their accumulation and outputs
    acc: torch.Tensor | None  # fp32 grad_input, accumulated over the chunks
    grad_weight: torch.Tensor | None
    acc_w: torch.Tensor | None  # the caller's grad_weight accumulator (else rows are written)
    grad_bias: torch.Tensor | None
    acc_b: torch.Tensor | None
    scratch: torch.Tensor | None  # fp32 products that are not written in place
    flt: object | None  # the GradientFilter, where a product is made
    defer_rounding: bool
    out_h: int  # the hidden size


def _plan(x, x_op, v: int, out: Outputs, bias_grad_dtype, cv: int) -> _Plan:
    """The buffers of :func:`gradient_products` (the caller's where ``out`` has them)."""
    bt, h = x.shape
    dtype, device = x.dtype, x.device
    operand = precision.operand_dtype(dtype, device.type)
    accum = precision.accumulate_dtype(dtype)
    need_input_grad, need_weight_grad = out.need_input, out.need_weight
    grad_weight = acc_w = None
    if need_weight_grad:
        acc_w = out.grad_weight_acc
        grad_weight = (
            acc_w if acc_w is not None else torch.empty((v, h), dtype=dtype, device=device)
        )
    acc = None
    if need_input_grad:
        acc = out.grad_input_out
        acc = torch.empty((bt, h), dtype=accum, device=device) if acc is None else acc
    grad_bias = acc_b = None
    if out.need_bias:
        acc_b = out.grad_bias_acc
        grad_bias = (
            acc_b if acc_b is not None else torch.empty(v, dtype=bias_grad_dtype, device=device)
        )
    # fp32 products that are not written in place: one buffer, used by both products.
    sizes = [bt * h] if need_input_grad and operand != accum else []
    sizes += [cv * h] if need_weight_grad and (dtype != accum or operand != accum) else []
    scratch = torch.empty(max(sizes), dtype=accum, device=device) if sizes else None
    flt = out.filter if (need_input_grad or need_weight_grad) and h > 0 else None
    # Filtering every product that is made (and no bias gradient to sum): G is rounded to
    # the input dtype only where a product reads it (the kept columns), not whole; the
    # tile test reads G before the rounding.
    defer_rounding = (
        flt is not None and not out.need_bias
        and (flt.input or not need_input_grad) and (flt.weight or not need_weight_grad)
    )  # fmt: skip
    return _Plan(
        out, x_op, dtype, operand, accum, acc, grad_weight, acc_w, grad_bias, acc_b,
        scratch, flt, defer_rounding, h,
    )  # fmt: skip


def _chunk_products(p: _Plan, g: torch.Tensor, v0: int, v1: int, w_op) -> None:
    """One chunk ``G[:, v0:v1]`` of :func:`gradient_products`: rounded, summed into the bias
    gradient, tested by the filter, multiplied into grad_input and grad_weight's rows."""
    out, accum, operand, dtype = p.out, p.accum, p.operand, p.dtype
    need_input_grad, need_weight_grad, accumulate = out.need_input, out.need_weight, out.accumulate
    bt, h = g.shape[0], p.out_h
    if not p.defer_rounding:
        g = precision.round_to(g, dtype, operand)
    if out.need_bias:  # the rounded G the products see, summed in fp32
        if p.acc_b is None or not accumulate:
            p.grad_bias[v0:v1] = g.sum(dim=0, dtype=accum)
        else:
            p.acc_b[v0:v1] += g.sum(dim=0, dtype=accum)
    flt, mask = p.flt, None
    if flt is not None:
        mask = filtering.tile_mask(g, flt)
        filtering.count(mask, flt)
        if bool(mask.all()):
            mask = None  # nothing to leave out: the exact products below
            if p.defer_rounding:
                g = precision.round_to(g, dtype, operand)
    f_in = need_input_grad and mask is not None and flt.input
    f_w = need_weight_grad and mask is not None and flt.weight
    if f_in or f_w:
        filtering.filtered_products(
            g, mask, grad_input=p.acc if f_in else None, w_op=w_op, first=v0 == 0,
            grad_weight=p.grad_weight[v0:v1] if f_w else None, x_op=p.x_op,
            write=p.acc_w is None or not accumulate,
            rounding=(dtype, operand) if p.defer_rounding else None, scratch=p.scratch,
        )  # fmt: skip
    if need_input_grad and not f_in:
        if v0 == 0:
            precision.mm_fp32(g, w_op, out=p.acc)
        else:
            tmp = None if operand == accum else p.scratch[: bt * h].view(bt, h)
            precision.addmm_fp32_(p.acc, g, w_op, scratch=tmp)
    if f_w or not need_weight_grad:
        return  # done above, or not wanted
    n = v1 - v0
    if p.acc_w is not None and accumulate:
        tmp = None if operand == accum else p.scratch[: n * h].view(n, h)
        precision.addmm_fp32_(p.acc_w[v0:v1], g.t(), p.x_op, scratch=tmp)
    else:
        rows = p.grad_weight[v0:v1]
        if p.grad_weight.dtype == accum:
            precision.mm_fp32(g.t(), p.x_op, out=rows)
        else:
            rows.copy_(precision.mm_fp32(g.t(), p.x_op, out=p.scratch[: n * h].view(n, h)))


def _no_products(x, weight, out: Outputs, gi_dtype, bias_grad_dtype) -> Grads:
    """The gradients when there is nothing to multiply (no rows, columns or hidden size):
    zeros, in the caller's buffers where it gave them (a written ``grad_input``, fresh
    accumulators; accumulators being added to stay as they are)."""
    bt, h = x.shape
    v = weight.shape[0]

    def zeros(buf, add, shape, dt):
        if buf is None:
            return torch.zeros(shape, dtype=dt, device=x.device)
        return buf if add else buf.zero_()

    add = out.accumulate
    gi = zeros(out.grad_input_out, False, (bt, h), gi_dtype) if out.need_input else None
    gw = zeros(out.grad_weight_acc, add, (v, h), x.dtype) if out.need_weight else None
    gb = zeros(out.grad_bias_acc, add, v, bias_grad_dtype) if out.need_bias else None
    return Grads(gi, gw, gb)
