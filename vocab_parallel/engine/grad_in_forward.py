"""The token-chunk walker of ``mode="grad_in_forward"``, for every objective.

When an objective's loss is a scalar and a backward will follow, the gradient of each
token is known in the forward up to the one upstream scalar ``g`` (``docs/design.md``,
"Modes"), so the forward walks the tokens in chunks (:func:`walk_token_chunks`: the
objective's step per chunk, its logits in the walker's kept fp32 blocks) and makes each
chunk's ``G``. What becomes of ``G`` is the memory policy's choice
(``vocab_parallel.engine.memory_policy.keeps_g``), the same on every rank:

    accumulated   (CPUs; GPUs where G would be larger) the two gradient products of each
                  chunk into the walker's fp32 accumulators, in the forward; the backward
                  multiplies them by ``g`` and rounds them once (:class:`Accumulated`)
    kept G        (GPUs, half inputs, where G is at most twice those accumulators) G of
                  every token kept in the inputs' dtype; the backward makes the two
                  products of the whole G once, times ``g`` (:class:`KeptG`): no fp32
                  ``[V, H]`` accumulator read and written by every chunk's GEMM

The all-reduces of ``grad_input`` are the same collectives whether they overlap the next
chunk or not (:data:`OVERLAP`), over disjoint rows, so the result is bitwise identical
either way; every other sum runs in a fixed order too.

A second backward through the same graph (``retain_graph=True``) cannot reuse
accumulated gradients already handed out: the objective recomputes them (``hand_out``'s
``recompute``); a kept G is still there and makes them again.

Token chunks are sized from quantities every rank of the group shares (tokens, global
vocabulary, world size, hidden size, dtype: an even share of the vocabulary per rank;
``vocab_parallel.engine.memory_policy.token_rows``), so every rank issues the same
collectives in the same order; a rank with a much larger shard than the even share holds
a proportionally larger chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vocab_parallel.backends.interface import Outputs
from vocab_parallel.engine import filtering, precision
from vocab_parallel.engine import memory_policy as memory
from vocab_parallel.engine.autograd import (
    guarded_backward,
)
from vocab_parallel.engine.filtering import GradientFilter
from vocab_parallel.engine.objective import Call
from vocab_parallel.parallel.collectives import all_reduce, all_reduce_async, world_size

# Overlap each chunk's grad_input all-reduce with the next chunk (same result either way).
OVERLAP = True


# ---------------------------------------------------------------------------------------
# The one token-chunk walker (every objective's grad_in_forward)
# ---------------------------------------------------------------------------------------

# step(r0, r1, blocks, buffers): an objective's work on the token rows [r0, r1): its
# statistics of the chunk (``blocks``: the walker's fp32 [r1 - r0, V_local] logits
# buffers, one per head), its per-token results, and, when ``buffers`` is not None, its
# G and the two gradient products into them (the accumulate-into fields of Outputs).
ChunkStep = Callable[[int, int, list, "dict | None"], None]


def walk_token_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    call: Call,
    needs: tuple[bool, bool, bool],
    step: ChunkStep,
    heads: int = 1,
    g_filter: GradientFilter | None = None,
) -> Accumulated | KeptG:
    """The token-chunk walker of ``mode="grad_in_forward"``, written once for every
    objective: the gradients of ``hidden``, ``weight`` and the bias (``needs``: which are
    wanted), as :class:`Accumulated` fp32 (float64) sums or as a :class:`KeptG` (the
    memory policy's choice, the module docstring; ``g_filter``: the call's gradient
    filter over every token, for a kept G's products; the accumulated plan's chunks
    filter their own).

    Token chunks are as tall as the memory policy allows for ``heads`` kept fp32 blocks
    (``vocab_parallel.engine.memory_policy.token_rows``: the same on every rank). Per
    chunk, ``step`` does the objective's work (:data:`ChunkStep`): its statistics (the
    blocking MAX and SUM all-reduces are its own), its results, and its ``G``: into the
    kept G's rows, or its products into this walker's accumulators (written by the
    first chunk: no zero-fill pass), after which the chunk's ``grad_input`` rows start
    their SUM all-reduce asynchronously (:data:`OVERLAP`: it overlaps the next chunk's
    GEMMs); the walker waits for all of them at the end."""
    bt, h = hidden.shape
    v = weight.shape[0]
    accum = precision.accumulate_dtype(hidden.dtype)
    f = dict(dtype=accum, device=hidden.device)
    group = call.process_group
    world = world_size(group)
    vg, device_type, itemsize = call.layout.global_size, hidden.device.type, hidden.element_size()
    rows = memory.token_rows(bt, vg, world, device_type, heads, h, itemsize)
    blocks = [torch.empty((min(rows, bt), v), **f) for _ in range(heads)]
    if any(needs) and memory.keeps_g(bt, vg, world, h, itemsize, device_type):
        g = torch.empty((bt, v), dtype=hidden.dtype, device=hidden.device)
        for r0 in range(0, bt, rows):
            r1 = min(bt, r0 + rows)
            step(r0, r1, [b[: r1 - r0] for b in blocks], dict(g_out=g[r0:r1]))
        return KeptG(g, hidden, weight, needs, group, g_filter)
    grad_input = torch.empty((bt, h), **f) if needs[0] else None
    fill = torch.zeros if bt == 0 else torch.empty  # zeros when there are no tokens
    grad_weight = fill(weight.shape, **f) if needs[1] else None
    grad_bias = fill(v, **f) if needs[2] else None
    waits = []  # the grad_input all-reduces in flight
    for r0 in range(0, bt, rows):
        r1 = min(bt, r0 + rows)
        buffers = None
        if any(needs):
            buffers = dict(
                grad_input_dtype=accum,
                grad_input_out=None if grad_input is None else grad_input[r0:r1],
                grad_weight_acc=grad_weight,
                grad_bias_acc=grad_bias,
                accumulate=r0 > 0,  # the first chunk writes the (empty) accumulators
            )
        step(r0, r1, [b[: r1 - r0] for b in blocks], buffers)
        if buffers is not None and world > 1 and needs[0]:
            rows_gi = grad_input[r0:r1]
            if OVERLAP and not torch.compiler.is_compiling():  # dynamo: no async_op
                waits.append(all_reduce_async(rows_gi, "SUM", group, "grad_input"))
            else:
                all_reduce(rows_gi, "SUM", group, "grad_input")
    del blocks
    for wait in waits:
        wait()
    return Accumulated([grad_input, grad_weight, grad_bias])


class Accumulated:
    """The gradients as fp32 (float64) sums made in the forward: ``[grad_input,
    grad_weight, grad_bias]`` (None where not needed), ``grad_input`` summed over the
    group."""

    def __init__(self, grads: list):
        self.grads = grads

    def divide_(self, denominator: torch.Tensor) -> None:
        """Every gradient divided by ``denominator`` (a 0-d tensor), in place."""
        for g in self.grads:
            if g is not None:
                g.div_(denominator)

    def hand_out(self, grad_loss, dtypes, need) -> tuple:
        """The gradients times the upstream scalar, each rounded once into its dtype
        (``dtypes``: hidden's, bias'), in place where that is the same dtype. Once."""
        grads, self.grads = self.grads, None  # ours alone now: scaled in place
        dtype, bias_dtype = dtypes
        out = []
        for g, dt, wanted in zip(grads, (dtype, dtype, bias_dtype), need, strict=True):
            if g is None or not wanted:
                out.append(None)
                continue
            out.append(_times(g, grad_loss, dt))
        return tuple(out)

    @property
    def spent(self) -> bool:
        return self.grads is None


class KeptG:
    """The gradients as ``G`` of every token (``[N, V_local]``, the inputs' dtype, made
    with the walker's per-token gradients), their products still to make: ``grad_input =
    G @ W`` (fp32, summed over the group) and ``grad_weight = G.T @ x`` (vocabulary
    chunks of fp32 products), each times the upstream scalar and rounded once; ``grad_bias
    = G.sum(0)`` likewise. The Function saves ``G`` for its backward (:func:`save`), so
    that autograd frees it after a backward that does not retain the graph."""

    def __init__(self, g, hidden, weight, needs, group, g_filter=None):
        self.g, self.hidden, self.weight, self.needs = g, hidden, weight, needs
        self.group, self.filter = group, g_filter
        self.denominator = None  # what every gradient is divided by (a mean's count)

    def divide_(self, denominator: torch.Tensor) -> None:
        """Every gradient divided by ``denominator`` (a 0-d tensor), when it is made."""
        self.denominator = denominator

    def hand_out(self, grad_loss, dtypes, need, g: torch.Tensor) -> tuple:
        x, w = self.hidden, self.weight
        dtype = x.dtype
        accum = precision.accumulate_dtype(dtype)
        scale = grad_loss.to(accum)
        if self.denominator is not None:
            scale = scale / self.denominator.to(accum)
        want = [a and b for a, b in zip(self.needs, need, strict=True)]
        operand = precision.operand_dtype(dtype, x.device.type)
        bt, h = x.shape
        v = w.shape[0]
        cv = memory.columns(1, v, x.device.type, "logits", h=h)  # fp32 [cv, H] rows
        kept = self._kept(g, want, cv)  # per vocabulary chunk: its kept columns (None: all)
        grad_input = wait = None
        if want[0] and (kept is None or not self.filter.input):
            # one GEMM; its all-reduce overlaps grad_weight's GEMMs
            grad_input = precision.mm_fp32(g.to(operand), w.to(operand))
        elif want[0]:  # the kept columns of each vocabulary chunk
            grad_input = torch.zeros((bt, h), dtype=accum, device=x.device)
            for v0, idx in zip(range(0, v, cv), kept, strict=True):
                cols = idx + v0
                g_c, w_c = g.index_select(1, cols).to(operand), w.index_select(0, cols).to(operand)
                precision.addmm_fp32_(grad_input, g_c, w_c)
        if want[0] and torch.compiler.is_compiling():  # dynamo: no async_op
            grad_input = all_reduce(grad_input, "SUM", self.group, "grad_input")
            wait = lambda: grad_input  # noqa: E731
        elif want[0]:
            wait = all_reduce_async(grad_input, "SUM", self.group, "grad_input")
        grad_weight = grad_bias = None
        if want[1]:
            grad_weight = torch.empty_like(w, dtype=dtype)
            scratch = torch.empty((min(cv, v), h), dtype=accum, device=x.device)
            x_op = x.to(operand)
            for i, v0 in enumerate(range(0, v, cv)):
                v1 = min(v, v0 + cv)
                if kept is None or not self.filter.weight:
                    rows = precision.mm_fp32(g[:, v0:v1].t(), x_op, out=scratch[: v1 - v0])
                    torch.mul(rows, scale, out=grad_weight[v0:v1])
                else:  # the kept columns' rows; the others 0
                    g_c = g.index_select(1, kept[i] + v0).to(operand)
                    rows = precision.mm_fp32(g_c.t(), x_op, out=scratch[: g_c.shape[1]])
                    out = grad_weight[v0:v1].zero_()
                    out.index_copy_(0, kept[i], _times(rows, scale, dtype))
        if want[2]:
            grad_bias = _times(g.sum(dim=0, dtype=accum), scale, dtypes[1])
        if wait is not None:
            grad_input = _times(wait(), scale, dtype)
        return grad_input, grad_weight, grad_bias

    def _kept(self, g: torch.Tensor, want, cv: int) -> list[torch.Tensor] | None:
        """The columns a filtered product keeps, per vocabulary chunk of ``cv`` columns
        (indices within it), or None when the call filters nothing or nothing can be left
        out: a column is left out of every token's products where each token's entry is
        negligible (``vocab_parallel.engine.filtering``; on GPUs a tile is the column over
        all the tokens). Two host syncs: whether anything is left out, and the chunks' counts."""
        f = self.filter
        if f is None or not ((want[0] and f.input) or (want[1] and f.weight)):
            return None
        mask = filtering.tile_mask(g, f)
        filtering.count(mask, f)
        cols = mask.any(dim=0)
        if bool(cols.all()):
            return None
        v = g.shape[1]
        idx = cols.nonzero()[:, 0]
        starts = torch.arange(0, v + cv, cv, device=idx.device)[: -(-v // cv) + 1]
        counts = torch.searchsorted(idx, starts).diff().tolist()
        starts = range(0, v, cv)
        return [p - v0 for p, v0 in zip(idx.split(counts), starts, strict=True)]


def _times(g: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``g * scale`` (``g`` fp32 or float64) in ``dtype``: in place where that is ``g``'s
    dtype, else one pass, the product rounded once."""
    scale = scale.to(g.dtype)
    if g.dtype == dtype:
        return g.mul_(scale)
    return torch.mul(g, scale, out=torch.empty_like(g, dtype=dtype))


def outputs(needs: tuple[bool, bool, bool], buffers: dict, **extra) -> Outputs:
    """The :class:`~vocab_parallel.backends.interface.Outputs` of a chunk step's products."""
    return Outputs(
        need_input=needs[0], need_weight=needs[1], need_bias=needs[2], **buffers, **extra
    )


def save(ctx, grads: Accumulated | KeptG, *tensors) -> None:
    """``ctx.save_for_backward(*tensors, G)`` (``G``: the kept G, or None) and
    ``ctx.grads = grads``: what :func:`hand_out` reads. A kept G is then autograd's to
    free (after a backward without ``retain_graph``); the Function's own saved tensors
    are ``ctx.saved_tensors[:-1]``."""
    g = None
    if isinstance(grads, KeptG):
        g, grads.g = grads.g, None
    ctx.save_for_backward(*tensors, g)
    ctx.grads = grads


def hand_out(ctx, grad_loss, recompute: Callable) -> tuple:
    """The backward of a grad_in_forward Function whose first inputs are hidden, weight,
    bias: the walker's gradients in ``ctx.grads`` times the upstream scalar, each rounded
    once into ``ctx.dtypes`` (hidden's, bias'); accumulated gradients already handed out
    (a second backward of the graph, ``retain_graph=True``) are made again by
    ``recompute(ctx, grad_loss, need)``."""

    def compute(need):
        if isinstance(ctx.grads, KeptG):  # (saved_tensors raises once the graph is freed)
            return ctx.grads.hand_out(grad_loss, ctx.dtypes, need, ctx.saved_tensors[-1])
        if ctx.grads.spent:
            return recompute(ctx, grad_loss, need)
        return ctx.grads.hand_out(grad_loss, ctx.dtypes, need)

    return guarded_backward(ctx, grad_loss, compute)
