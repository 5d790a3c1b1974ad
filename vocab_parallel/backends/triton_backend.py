"""The Triton backend: the launchers of the kernels in ``vocab_parallel.kernels``.

It implements :class:`vocab_parallel.backends.interface.Backend` on CUDA tensors, or on CPU tensors
under Triton's interpreter (``TRITON_INTERPRET=1``; the registry,
``vocab_parallel.backends.registry``, refuses anything else). Each launcher takes its inputs
validated (the public operator validates), picks its kernel's tile for the device
(``vocab_parallel.kernels.common.tile_config``) and the grid, allocates, launches, and
merges the kernel's partial results; it knows nothing of torch.distributed. The kernels
(``kernels/src/``, installed as ``vocab_parallel.kernels``) import nothing of the library.

:func:`fused_backward` launches one chunk of ``G`` at a time (``CV`` columns), or, where
the caller lets ``G`` overwrite its saved fp32 logits (grad_in_forward's token chunk), one
launch for ``G`` of the whole chunk written over them (one chunk of ``V`` columns, no
buffer of its own: per token chunk one kernel and the two GEMMs once each); the two
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
from dataclasses import dataclass, replace

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


def _one(device: torch.device) -> torch.Tensor:
    """A read-only fp32 ``[1]`` tensor of 1.0 on ``device``, made once a process (no
    launch a call); while a CUDA graph is being captured, the graph's own (a tensor made
    in its pool must not outlive it)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.ones(1, dtype=torch.float32, device=device)
    return _made_once(device)


@functools.cache
def _made_once(device: torch.device) -> torch.Tensor:
    return torch.ones(1, dtype=torch.float32, device=device)


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
    The products are GEMMs with fp32 output (cuBLAS on CUDA,
    ``vocab_parallel.engine.precision.mm_fp32``) and the kernel is their epilogue (bias,
    cap, temperature and statistics): ``logits_out``, if given, an fp32 ``[BT, V]``
    buffer, receives the products of one GEMM and leaves with ``z`` (written back in
    place); without it the GEMMs make column chunks of the products into one fp32
    ``[BT, CV]`` buffer (``CV`` from the memory policy's "logits" share) whose statistics
    are merged with the others' and nothing is kept. Where a half GEMM has no fp32 output
    (an older torch: :func:`_gemm_with_fp32_output`) the kernel makes the products tile
    by tile instead (and stores ``z`` into ``logits_out``, if given).
    A shard without columns gives max -inf and zero sums. ``logit_sum=False`` skips the
    logit sum (only label smoothing needs it) and returns zeros for it. ``extra_stats``:
    also the shifted and squared sums (``LocalStats``), merged over the splits and chunks
    as over shards.
    """
    bt, h = x.shape
    v = weight.shape[0]
    f32 = dict(dtype=torch.float32, device=x.device)
    if bt == 0 or v == 0:
        zeros = [torch.zeros(bt, **f32) for _ in range(5 if extra_stats else 3)]
        return LocalStats(torch.full((bt,), float("-inf"), **f32), *zeros)
    # A temperature or class weights: the SCALED variant, with both vectors in full.
    scaled = logits.inv_temperature is not None or class_weight is not None
    inv_t = cw = None
    if scaled:
        inv_t = full_vector(logits.inv_temperature, bt, x.device)
        cw = full_vector(class_weight, v, x.device)
    args = (logit_sum, extra_stats, inv_t)  # the statistics asked for, and the temperature
    target = local_target.contiguous()
    if logits_out is not None or not _gemm_with_fp32_output(x):
        gemm = logits_out is not None and _gemm_with_fp32_output(x)
        if gemm:  # the products by one GEMM with fp32 output, the kernel their epilogue
            precision.mm_fp32(x, weight.t(), out=logits_out)
        # z is written back unless it is the GEMM's products unchanged (no bias, cap or
        # temperature): one pass over the block less
        changes = logits.bias is not None or logits.softcap is not None
        changes = changes or logits.inv_temperature is not None
        keep = logits_out is not None and (changes or not gemm)
        part = _stats_partials(x, weight, target, logits, cw, logits_out, gemm, keep, *args)
    else:  # column chunks of the products, the kernel their epilogue; nothing kept
        cv = memory.columns(bt, v, x.device.type, "logits")
        buf = torch.empty(bt * cv, **f32)
        parts = []
        # each chunk's targets (off the chunk: never a column of it), in one launch
        targets = target[None, :]
        if v > cv:
            targets = targets - torch.arange(0, v, cv, device=target.device)[:, None]
        for i, v0 in enumerate(range(0, v, cv)):
            v1 = min(v, v0 + cv)
            z = buf[: bt * (v1 - v0)].view(bt, v1 - v0)  # contiguous: the GEMM writes it
            precision.mm_fp32(x, weight[v0:v1].t(), out=z)
            chunk = replace(logits, bias=None if logits.bias is None else logits.bias[v0:v1])
            t_c = targets[i]
            cw_c = None if cw is None else cw[v0:v1]
            # z written back only with the extra sums: that variant of the kernel is the
            # one that fits every target's registers (scripts/aot_compile.py)
            w_c = weight[v0:v1]
            parts.append(_stats_partials(x, w_c, t_c, chunk, cw_c, z, True, extra_stats, *args))
        part = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return LocalStats(*merge_splits(part, extra_stats))


def merge_splits(part: torch.Tensor, extra_stats: bool) -> torch.Tensor:
    """The statistics ``[K, BT]`` of the splits' partials ``[K, S, BT]`` (fp32, K = 4 or 6
    with ``extra_stats``): each row's max over the splits, the sums moved to it and added
    in split order (``forward.stats_merge_kernel``, one launch); one split's are its own
    (views, no launch)."""
    k, splits, bt = part.shape
    if splits == 1:
        return part[:, 0]
    part = part.contiguous()
    out = torch.empty((k, bt), dtype=torch.float32, device=part.device)
    if bt:
        meta = forward.merge_meta(torch.float32, extra_stats)
        grid = (triton.cdiv(bt, meta["BLOCK"]),)
        forward.stats_merge_kernel[grid](part, out, bt, splits, **meta)
    return out


def _stats_partials(
    x, weight, target, logits: Logits, cw, z, from_logits: bool, keep: bool,
    logit_sum: bool, extra_stats: bool, inv_t,
) -> torch.Tensor:  # fmt: skip
    """One launch of the statistics kernel over ``weight``'s columns: its per-split
    partials ``[4 or 6, splits, BT]``. ``z``: an fp32 ``[BT, V]`` buffer, holding the
    products on entry with ``from_logits`` (else the kernel's tile GEMM makes them), that
    leaves with ``z`` when ``keep``; None: nothing kept. ``cw``, ``inv_t``: the SCALED
    variant's full vectors, or None."""
    bt, h = x.shape
    v = weight.shape[0]
    capability = device_capability(x.device)
    tile = tile_config("forward_stats", x.dtype, capability, bt, heavy_epilogue=extra_stats)
    if from_logits:
        tile = forward.epilogue_tile(tile)
    n_tiles = triton.cdiv(v, tile.BLOCK_N)
    n_row_blocks = triton.cdiv(bt, tile.BLOCK_M)
    splits = num_splits(n_row_blocks, n_tiles, x.device)
    tiles_per_split = triton.cdiv(n_tiles, splits)
    splits = triton.cdiv(n_tiles, tiles_per_split)
    part = torch.empty((6 if extra_stats else 4, splits, bt), dtype=torch.float32, device=x.device)
    out = part if z is None else z
    bias, softcap = logits.bias, logits.softcap
    has_bias = bias is not None
    scaled = inv_t is not None
    forward.forward_stats_kernel[(n_row_blocks, splits)](
        x, weight, target, bias.contiguous() if has_bias else x,
        inv_t if scaled else part, cw if scaled else part,
        out, part[0], part[1], part[2], part[3], part[-2], part[-1],
        bt, h, v, tiles_per_split,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        0 if z is None else z.stride(0), 0 if z is None else z.stride(1),
        1.0 if softcap is None else float(softcap),
        **forward.meta(x.dtype, keep, logit_sum, has_bias, softcap is not None, scaled, tile,
                       extra_stats, from_logits),
    )  # fmt: skip
    return part


def fused_backward(
    x: torch.Tensor,
    weight: torch.Tensor,
    local_target: torch.Tensor,
    logits: Logits,
    terms: GradTerms,
    out: Outputs,
) -> Grads:
    """:class:`Grads` of ``G`` (``vocab_parallel.backends.interface.Backend.fused_backward``);
    inputs are already validated. Where ``G`` comes from:

    recompute        column chunks of the products by a GEMM with fp32 output into one
                     fp32 ``[BT, CV]`` buffer, ``G`` of each written over it by the row
                     kernel (bias, cap, temperature as the forward made them); where a half
                     GEMM has no fp32 output (an older torch) the chunk kernel's tile GEMM
                     makes them and ``G`` into a buffer of its own
    kept logits      with ``terms.reuse_logits`` (:func:`_g_in_place`) ``G`` in one piece
                     over them (one launch, no buffer, each GEMM once); else the chunk
                     kernel reads them, ``G`` into a buffer of its own
    saved softmax    the chunk kernel reads it"""
    bt, h = x.shape
    v = weight.shape[0]
    a = _g_args(x, weight, local_target, logits, terms)
    bias_dtype = x.dtype if logits.bias is None else logits.bias.dtype
    products = functools.partial(
        gradient_products, x, weight, out=out, g_reads_operands=False, bias_grad_dtype=bias_dtype
    )
    if _g_in_place(a.source, terms, x, v):  # the kept logits, one piece
        return products(v, lambda *_: _rows_g(a, x, terms.logits, 0, out.g_out))
    if a.source == "recompute" and _gemm_with_fp32_output(x):
        # Column chunks of the products by a GEMM with fp32 output, G over each.
        cv = memory.columns(bt, v, x.device.type, "logits", h=h)
        buf = torch.empty(bt * cv, dtype=torch.float32, device=x.device)

        def make_g_over(v0: int, v1: int, x_op, w_op) -> torch.Tensor:
            z = buf[: bt * (v1 - v0)].view(bt, v1 - v0)  # contiguous: the GEMM writes it
            precision.mm_fp32(x, weight[v0:v1].t(), out=z)
            return _rows_g(a, x, z, v0, raw=True)

        return products(cv, make_g_over)
    cv = memory.columns(bt, v, x.device.type, "logits", itemsize=x.element_size(), h=h)
    g_buf = []

    def make_g(v0: int, v1: int, x_op, w_op) -> torch.Tensor:
        if not g_buf:
            g_buf.append(torch.empty((bt, cv), dtype=x.dtype, device=x.device))
        return _chunk_g(a, x, weight, g_buf[0][:, : v1 - v0], v0)

    return products(cv, make_g)


@dataclass(frozen=True)
class _GArgs:
    """The per-row and per-column operands of a G kernel launch (dummies where the
    variant never reads them) and its variant's flags."""

    source: str  # "recompute", "softmax" or "logits"
    saved: torch.Tensor  # the saved softmax or logits (a dummy when recomputing)
    b: torch.Tensor  # the bias (recompute) or a dummy
    grad: torch.Tensor
    target: torch.Tensor
    lmax: torch.Tensor
    lsum: torch.Tensor
    prob_scale: torch.Tensor
    hot: torch.Tensor
    cw: torch.Tensor
    inv_t: torch.Tensor
    ent: torch.Tensor
    stride_grad: int
    stride_ps: int
    on_target: float
    smooth: float
    cap: float
    has_bias: bool
    softcap: bool
    scaled: bool
    entropy: bool


def _g_args(x, weight, local_target, logits: Logits, terms: GradTerms) -> _GArgs:
    bt, v = x.shape[0], weight.shape[0]
    softmax, saved_logits = terms.softmax, terms.logits
    source = (
        "softmax" if softmax is not None else "logits" if saved_logits is not None else "recompute"
    )
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
    grad = terms.grad.float().contiguous()
    dummy = grad  # stands in for pointers the chosen mode never reads
    has_bias = logits.bias is not None and source == "recompute"
    prob_scale = terms.prob_scale
    if prob_scale is None:  # one factor 1.0 for every row
        prob_scale = _one(x.device)
    prob_scale = prob_scale.to(torch.float32).contiguous()
    hot = inv_t = cw = dummy  # the SCALED variant's vectors, in full
    if scaled:
        hot = full_vector(terms.on_target if per_row_hot else float(terms.on_target), bt, x.device)
        inv_t = full_vector(logits.inv_temperature, bt, x.device)
        cw = full_vector(terms.class_weight, v, x.device)
    return _GArgs(
        source=source,
        saved={"softmax": softmax, "logits": saved_logits}.get(source, dummy),
        b=logits.bias.contiguous() if has_bias else x,
        grad=grad,
        target=local_target.contiguous(),
        lmax=dummy if source == "softmax" else terms.logits_max.contiguous(),
        lsum=dummy if source == "softmax" else terms.sum_exp.contiguous(),
        prob_scale=prob_scale,
        hot=hot,
        cw=cw,
        inv_t=inv_t,
        ent=full_vector(terms.entropy, bt, x.device) if entropy else dummy,
        stride_grad=grad.stride(0) if grad.shape[0] == bt else 0,
        stride_ps=prob_scale.stride(0) if prob_scale.shape[0] == bt else 0,
        on_target=1.0 if per_row_hot else float(terms.on_target),
        smooth=float(terms.smooth),
        cap=1.0 if logits.softcap is None else float(logits.softcap),
        has_bias=has_bias,
        softcap=logits.softcap is not None,
        scaled=scaled,
        entropy=entropy,
    )


def _rows_g(a: _GArgs, x, z, v0: int, g=None, raw: bool = False) -> torch.Tensor:
    """``G`` of ``z``'s rows (the shard's columns ``[v0, v0 + z.shape[1])``; with ``raw``
    the GEMM's products) by the row kernel, written over them, or into ``g`` (the inputs'
    dtype, rows of contiguous columns)."""
    if g is None:
        g = z.view(x.dtype)[:, : z.shape[1]] if x.element_size() < 4 else z
    kw = backward.rows_meta(x.dtype, a.softcap, a.scaled, a.entropy, raw, a.has_bias)
    backward.logits_grad_rows_kernel[(triton.cdiv(z.shape[0], kw["BLOCK_M"]),)](
        z, g, a.b, a.grad, a.target, a.lmax, a.lsum, a.prob_scale, a.hot, a.cw, a.inv_t, a.ent,
        z.shape[0], z.shape[1], v0, z.stride(0), g.stride(0), a.stride_grad, a.stride_ps,
        a.on_target, a.smooth, a.cap,
        **kw,
    )  # fmt: skip
    return g


def _chunk_g(a: _GArgs, x, weight, g, v0: int) -> torch.Tensor:
    """``G`` of the shard's columns ``[v0, v0 + g.shape[1])`` into ``g`` by the chunk
    kernel (its tile GEMM when recomputing, else reading the saved tensor)."""
    bt, h = x.shape
    n = g.shape[1]
    heavy = a.has_bias or a.softcap or a.scaled  # see tile_config
    tile = tile_config(backward.kernel_name(a.source), x.dtype, device_capability(x.device), bt,
                       heavy)  # fmt: skip
    tile = backward.entropy_tile(tile, a.entropy, a.softcap)
    meta = backward.meta(x.dtype, a.source, a.has_bias, a.softcap, a.scaled, tile, a.entropy)
    saved = a.saved
    s_strides = (0, 0) if saved is a.grad else (saved.stride(0), saved.stride(1))
    grid = (triton.cdiv(bt, tile.BLOCK_M), triton.cdiv(n, tile.BLOCK_N))
    backward.logits_grad_kernel[grid](
        x, weight, a.b, saved, a.grad, a.target, a.lmax, a.lsum, a.prob_scale, a.hot, a.cw,
        a.inv_t, a.ent, g,
        bt, h, v0, n,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        s_strides[0], s_strides[1], a.stride_grad, a.stride_ps, g.stride(0), g.stride(1),
        a.on_target, a.smooth, a.cap,
        **meta,
    )  # fmt: skip
    return g


def _g_in_place(source: str, terms: GradTerms, x: torch.Tensor, v: int) -> bool:
    """Whether ``G`` is made whole, over the saved logits (:data:`logits_grad_rows_kernel`):
    the caller lets it overwrite them (``terms.reuse_logits``: grad_in_forward's token
    chunk, whose objective is the cross entropy: no entropy term) and they are fp32 rows
    of contiguous columns."""
    z = terms.logits
    return (
        source == "logits"
        and terms.reuse_logits
        and terms.entropy is None
        and z.dtype == torch.float32
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and z.shape[0] * v > 0
        and z.shape[1] == v
        and z.stride(1) == 1
        and z.stride(0) >= v
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
