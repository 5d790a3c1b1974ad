"""The Triton backend: the launchers of the kernels in ``vocab_parallel.kernels``.

It implements :class:`vocab_parallel.backends.interface.Backend` on CUDA tensors, or on CPU tensors
under Triton's interpreter (``TRITON_INTERPRET=1``; the registry,
``vocab_parallel.backends.registry``, refuses anything else). Each launcher takes its inputs
validated (the public operator validates), picks its kernel's tile for the device
(``vocab_parallel.kernels.common.tile_config``) and the grid, allocates, launches, and
merges the kernel's partial results; it knows nothing of torch.distributed. The kernels
(``kernels/src/``, installed as ``vocab_parallel.kernels``) import nothing of the library.

:func:`fused_backward` launches one chunk of ``G`` at a time (``CV`` columns); the two
gradient GEMMs are what cuBLAS does best: they go through torch (fp32 outputs,
``vocab_parallel.engine.precision``) in the chunk loop shared with the torch backend
(``vocab_parallel.engine.chunking.gradient_products``): ``grad_input`` accumulates each chunk's
``G_c @ W_c`` in fp32, ``grad_weight[v0:v0+CV] = G_c.T @ x``. Under Triton's interpreter
the same loop runs the same torch calls on CPU tensors. Chunks are visited in a fixed
order and the statistics' splits merged in a fixed order: results are bitwise
deterministic. Memory beyond inputs and outputs is one ``[BT, CV]`` chunk, the ``[BT, H]``
fp32 accumulator, and (half inputs) the fp32 products of one chunk; none grows with V.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton

from vocab_parallel.backends import torch_backend
from vocab_parallel.backends.interface import PLAIN, Grads, GradTerms, LocalStats, Logits, Outputs
from vocab_parallel.engine import memory_policy as memory
from vocab_parallel.engine import precision
from vocab_parallel.engine.chunking import gradient_products
from vocab_parallel.kernels import backward, forward
from vocab_parallel.kernels.common import interpreting, tile_config

# ---------------------------------------------------------------------------------------
# The device: queried lazily, once per device, never at import time
# ---------------------------------------------------------------------------------------


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """Compute capability of ``device`` (queried once per device); None when interpreting."""
    if interpreting() or device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_splits(n_row_blocks: int, n_tiles: int, device: torch.device) -> int:
    """Vocabulary splits of a statistics kernel (each writes ``[splits, BT]`` partials
    that its launcher merges) so that the grid fills the device (few when interpreting)."""
    if interpreting() or device.type != "cuda":
        return min(n_tiles, 2)  # two splits still exercise the merge
    index = device.index if device.index is not None else torch.cuda.current_device()
    programs = 4 * _multiprocessors(index)
    return max(1, min(n_tiles, triton.cdiv(programs, n_row_blocks)))


def full_vector(t: torch.Tensor | float | None, n: int, device) -> torch.Tensor:
    """An fp32 contiguous ``[n]`` vector for a kernel: ``t`` (``n`` values, or one value
    broadcast), or ones for None."""
    if t is None:
        return torch.ones(n, dtype=torch.float32, device=device)
    t = torch.as_tensor(t, dtype=torch.float32, device=device)
    return t.reshape(-1).expand(n).contiguous()


# ---------------------------------------------------------------------------------------
# The backend's primitives
# ---------------------------------------------------------------------------------------


def _gemm_with_fp32_output(x: torch.Tensor) -> bool:
    """Whether the logits of ``x``'s rows are one GEMM with fp32 output without an fp32
    copy of the weight: fp32 inputs, half inputs where ``torch.mm(..., out_dtype=)`` runs
    (CUDA on a recent torch), and the interpreter's CPU tensors (small, for tests)."""
    fp32_output = precision.mm_out_dtype_supported(x.device.type)
    return x.dtype == torch.float32 or fp32_output or x.device.type == "cpu"


def forward_stats(
    x: torch.Tensor,
    weight: torch.Tensor,
    local_target: torch.Tensor,
    logits: Logits = PLAIN,
    *,
    logits_out: torch.Tensor | None = None,
    logit_sum: bool = False,
    class_weight: torch.Tensor | None = None,
    extra_stats: bool = False,
) -> LocalStats:
    """:class:`LocalStats` of ``z = cap(x @ W.T + bias) / T``, each fp32 ``[BT]``
    (``vocab_parallel.backends.interface.Backend.forward_stats``).

    ``local_target`` is int64 ``[BT]``, -1 where the row's target is not on this shard.
    ``logits_out``, if given, is an fp32 ``[BT, V]`` buffer that receives ``z``: then the
    products are one GEMM with fp32 output into it (cuBLAS on CUDA,
    ``vocab_parallel.engine.precision.mm_fp32``) and the kernel is their epilogue (the
    bias, cap, temperature and statistics, ``z`` written back in place); without it the
    kernel makes the products tile by tile and stores nothing (and so it does where a half
    GEMM has no fp32 output, an older torch: :func:`_gemm_with_fp32_output`).
    A shard without columns gives max -inf and zero sums. ``logit_sum=False`` skips the
    logit sum (only label smoothing needs it) and returns zeros for it. ``extra_stats``:
    also the shifted and squared sums (``LocalStats``), merged over the splits as over
    shards.
    """
    bt, h = x.shape
    v = weight.shape[0]
    f32 = dict(dtype=torch.float32, device=x.device)
    if bt == 0 or v == 0:
        zeros = [torch.zeros(bt, **f32) for _ in range(5 if extra_stats else 3)]
        return LocalStats(torch.full((bt,), float("-inf"), **f32), *zeros)
    capability = device_capability(x.device)
    tile = tile_config("forward_stats", x.dtype, capability, bt, heavy_epilogue=extra_stats)
    from_logits = logits_out is not None and _gemm_with_fp32_output(x)
    if from_logits:
        tile = forward.epilogue_tile(tile)
    n_tiles = triton.cdiv(v, tile.BLOCK_N)
    n_row_blocks = triton.cdiv(bt, tile.BLOCK_M)
    splits = num_splits(n_row_blocks, n_tiles, x.device)
    tiles_per_split = triton.cdiv(n_tiles, splits)
    splits = triton.cdiv(n_tiles, tiles_per_split)
    part = torch.empty((6 if extra_stats else 4, splits, bt), **f32)
    store = logits_out is not None
    out = logits_out if store else part
    if from_logits:  # the products by one GEMM with fp32 output, the kernel their epilogue
        precision.mm_fp32(x, weight.t(), out=logits_out)
    bias, softcap = logits.bias, logits.softcap
    has_bias = bias is not None
    # A temperature or class weights: the SCALED variant, with both vectors in full.
    scaled = logits.inv_temperature is not None or class_weight is not None
    inv_t = cw = part  # stand-ins for pointers the plain variant never reads
    if scaled:
        inv_t = full_vector(logits.inv_temperature, bt, x.device)
        cw = full_vector(class_weight, v, x.device)
    forward.forward_stats_kernel[(n_row_blocks, splits)](
        x, weight, local_target.contiguous(), bias.contiguous() if has_bias else x, inv_t, cw,
        out, part[0], part[1], part[2], part[3], part[-2], part[-1],
        bt, h, v, tiles_per_split,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        out.stride(0) if store else 0, out.stride(1) if store else 0,
        1.0 if softcap is None else float(softcap),
        **forward.meta(x.dtype, store, logit_sum, has_bias, softcap is not None, scaled, tile,
                       extra_stats, from_logits),
    )  # fmt: skip
    p_max, p_sum, p_pred, p_lsum = part[:4]
    row_max = p_max.max(dim=0).values
    row_sum = (p_sum * torch.exp(p_max - row_max)).sum(dim=0)  # p_max is finite: no NaN
    extras = []
    if extra_stats:  # each split's sums moved to the row max, added in split order
        splits_stats = LocalStats(p_max, p_sum, p_pred, p_lsum, part[4], part[5])
        extras = [t.sum(dim=0) for t in splits_stats.rescaled_extras(row_max[None, :])]
    return LocalStats(row_max, row_sum, p_pred.sum(dim=0), p_lsum.sum(dim=0), *extras)


def fused_backward(
    x: torch.Tensor,
    weight: torch.Tensor,
    local_target: torch.Tensor,
    logits: Logits,
    terms: GradTerms,
    out: Outputs,
) -> Grads:
    """:class:`Grads` of ``G`` (``vocab_parallel.backends.interface.Backend.fused_backward``) over
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
    tile = tile_config(backward.kernel_name(source), x.dtype, capability, bt, heavy)
    tile = backward.entropy_tile(tile, entropy, softcap is not None)
    meta = backward.meta(x.dtype, source, has_bias, softcap is not None, scaled, tile, entropy)
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
        backward.logits_grad_kernel[grid](
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


def chunk_logits(
    x: torch.Tensor,
    weight: torch.Tensor,
    logits: Logits = PLAIN,
    *,
    dtype: torch.dtype | None = None,
) -> Callable[..., torch.Tensor]:
    """``make(v0, v1, out=None)``: ``z`` of the shard's columns ``[v0, v1)``
    (``vocab_parallel.backends.interface.Backend.chunk_logits``), fp32, into ``out`` (fp32
    ``[BT, v1 - v0]``) when given: one GEMM with fp32 output per chunk (cuBLAS on CUDA:
    ``vocab_parallel.backends.torch_backend.chunk_logits``), then the bias, cap and
    temperature. The first GPU run measured this backend's tile GEMM (its forward
    statistics' kernel) at half of cuBLAS's rate for the same logits."""
    if dtype not in (None, torch.float32):
        raise TypeError(f"dtype: the Triton backend's logits are fp32, got {dtype}")
    return torch_backend.chunk_logits(x, weight, logits, dtype=torch.float32)
