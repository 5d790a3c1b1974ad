"""Gradient filtering: the gradient products without the entries of ``G`` that are negligible.

Off by default (``filter_eps=None``: exact). With ``filter_eps`` set, a tile of a chunk of
``G`` (``docs/design.md``, "Gradient filtering"): one vocabulary column over a block of
``TILE_ROWS`` tokens, is *negligible* when every entry of it is below ``eps`` per unit of
upstream gradient,

    |G_ij| < eps * |g_i|         for every row i of the block (g_i: row i's upstream gradient),

that is ``|d loss_i / d z_ij| < eps``: for the plain cross entropy ``|softmax - onehot| <
eps``, the test of Cut Cross-Entropy (Wijmans et al., 2025). ``"auto"`` is
``eps(input dtype) / 32`` (2^-12 for bf16, 2^-28 for fp32): below the input dtype's own
rounding of the gradient. Negligible tiles are left out of the products that
``filter_grads`` names (``"both"``, ``"weight"``: ``grad_weight = G.T @ x``,
``"input"``: ``grad_input = G @ W``); the loss, the statistics and ``grad_bias`` stay
exact. Each left-out entry changes a gradient by less than ``eps |g_i|`` times an operand,
so

    |grad_input_i - exact|  <= eps |g_i| n_i max_j |W_j|    (n_i: entries left out of row i)
    |grad_weight_j - exact| <= eps sum_i |g_i| |x_i|        (the rows left out of column j)

elementwise (the tests check these against float64). The first bound is the one to
watch: a row leaves out thousands of small probabilities, and where their rows of ``W``
point the same way (a trained head's unused tokens) the errors add up; ``"weight"`` keeps
``grad_input`` exact.

Why one column wide: Cut Cross-Entropy's Triton kernel skips whole MMA tiles of ``G``
(``BLOCK_B x BLOCK_V``, autotuned from 64 to 256 a side), and sorts the vocabulary by
average logit so that negligible entries cluster into whole tiles. The products here are
GEMMs over gathered operands, so each row block gathers exactly its kept columns
(``G[rows, kept]``, ``W[kept]``) and adds ``G[rows, kept].T @ x[rows]`` back into
``grad_weight[kept]``: whatever the vocabulary order, every negligible column of a row
block is left out, with no sort and no permutation of the weight per call. A row block
keeping most of its columns (``DENSE_ABOVE``) multiplies whole, as gathering nearly
everything costs more than it saves. Row blocks run in order and each ``index_add_`` has
distinct indices, so results are bitwise deterministic; a chunk whose tiles are all kept
runs the unfiltered products unchanged.

What is left out is counted (:func:`gradient_filter_stats`): tiles seen and tiles skipped
per product since the last reset, on this process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vocab_parallel.engine import precision

# Tile of G that is kept or left out whole: rows (tokens) x columns (vocabulary). One
# column wide: the products gather a row block's kept columns, so any set of columns
# can be left out, wherever the vocabulary order puts them (docs/design.md, "Gradient
# filtering": no column sorting needed).
TILE_ROWS = 128  # on CPUs; on GPUs a tile is a column of the whole chunk (tile_rows)
TILE_COLS = 1
# A row block keeping at least this share of its columns runs whole (measured: the
# gathers cost more than the columns they leave out; benchmarks/bench_filter.py).
DENSE_ABOVE = 0.75


def tile_rows(device_type: str, rows: int) -> int:
    """Rows of a tile: ``TILE_ROWS`` on CPUs; on GPUs every row of the chunk (a column is
    left out of the whole chunk's products, by one gather and two GEMMs: a loop over
    128-row blocks, thousands of small GEMMs and gathers per call, made filtering 3.6x
    slower than exact on the first GPU run)."""
    return TILE_ROWS if device_type == "cpu" else max(1, rows)


def resolve_eps(filter_eps: float | str | None, dtype: torch.dtype) -> float | None:
    """The threshold a call uses: None (exact), ``"auto"`` -> ``eps(dtype) / 32``, else
    the float given."""
    if filter_eps is None:
        return None
    if filter_eps == "auto":
        return torch.finfo(dtype).eps / 32
    return float(filter_eps)


@dataclass(frozen=True, eq=False)
class GradientFilter:
    """What the chunk loop leaves out: tiles with ``|G_ij| < eps |grad_i|`` throughout,
    from the products named by ``input`` / ``weight``. ``grad``: fp32 ``[BT]`` or ``[1]``,
    the upstream gradient of each row (``GradTerms.grad``)."""

    eps: float
    grad: torch.Tensor
    input: bool = True
    weight: bool = True

    @staticmethod
    def of(filter_eps, filter_grads: str, dtype, grad: torch.Tensor) -> GradientFilter | None:
        """The filter of a call's options, or None when nothing is filtered."""
        eps = resolve_eps(filter_eps, dtype)
        if eps is None:
            return None
        return GradientFilter(
            eps, grad, input=filter_grads in ("both", "input"),
            weight=filter_grads in ("both", "weight"),
        )  # fmt: skip

    def rows(self, r0: int, r1: int) -> GradientFilter:
        """The filter of rows ``r0:r1`` (a broadcast gradient stays as it is)."""
        g = self.grad if self.grad.numel() == 1 else self.grad[r0:r1]
        return GradientFilter(self.eps, g, self.input, self.weight)


@dataclass
class GradientFilterStats:
    """Tiles of ``G`` seen and left out by each filtered product, since the last reset."""

    tiles: int = 0
    skipped_input: int = 0
    skipped_weight: int = 0
    input_tiles: int = 0
    weight_tiles: int = 0

    @property
    def skipped(self) -> int:
        return self.skipped_input + self.skipped_weight

    @property
    def skipped_fraction(self) -> float:
        """Left-out share of the filtered products' tiles (0 when none were filtered)."""
        seen = self.input_tiles + self.weight_tiles
        return self.skipped / seen if seen else 0.0


_STATS = GradientFilterStats()


def gradient_filter_stats(reset: bool = False) -> GradientFilterStats:
    """This process's counter of filtered tiles (a copy; ``reset=True`` zeroes the live
    counter after copying it). ``skipped_fraction`` is what was left out of the products
    that were filtered: log it beside the loss."""
    snapshot = GradientFilterStats(**vars(_STATS))
    if reset:
        # The live counter only: a snapshot has no reset of its own that could do nothing.
        vars(_STATS).update(vars(GradientFilterStats()))
    return snapshot


def tile_mask(g: torch.Tensor, f: GradientFilter) -> torch.Tensor:
    """``[ceil(BT / rows), n]`` bool: which tiles of the chunk ``g [BT, n]`` are kept
    (some entry at or above ``eps |grad_i|``); a tile is one column of one block of
    ``rows`` rows (:func:`tile_rows`: 128 on CPUs, the chunk's on GPUs). A row block
    keeping at least ``DENSE_ABOVE`` of its columns keeps them all (its products run
    whole: gathering would cost more than it leaves out).

    One pass over ``g``, a block of rows at a time: where every row with a gradient has
    the same one (a mean; :func:`_uniform`), each column's max and min, then the maxima
    scaled by ``1 / (eps |g|)``; else ``|G_ij|`` scaled by its row's ``1 / (eps |g_i|)``
    into a ``[TILE_ROWS, n]`` buffer, then its maximum per column."""
    bt, n = g.shape
    tr = tile_rows(g.device.type, bt)
    n_rb = -(-bt // tr)
    if f.eps <= 0:  # |G_ij| < 0 never holds: every tile is kept
        return torch.ones((n_rb, n), dtype=torch.bool, device=g.device)
    scale = f.grad.to(torch.float32).abs()
    # Rows of zero upstream gradient have G = 0: left out (inv 0) whatever eps.
    inv = torch.where(scale > 0, 1.0 / (f.eps * scale), 0.0)
    cdt = torch.float64 if g.dtype == torch.float64 else torch.float32
    col_max = torch.empty((n_rb, n), dtype=cdt, device=g.device)
    uniform = _uniform(inv)
    if uniform is not None:  # one gradient for every row: scale the maxima, not the entries
        for b in range(n_rb):  # max |G| as max(max G, -min G): two reads, no temporary
            blk = g[b * tr : (b + 1) * tr]
            col_max[b] = torch.maximum(blk.amax(dim=0), blk.amin(dim=0).neg())
        col_max.mul_(uniform.to(cdt))
    else:  # |G_ij| / (eps |g_i|) a buffer of at most TILE_ROWS rows at a time
        inv = inv.to(cdt)
        step = min(bt, TILE_ROWS)
        buf = torch.empty((step, n), dtype=cdt, device=g.device)
        for b in range(n_rb):
            for r0 in range(b * tr, min(bt, (b + 1) * tr), step):
                r1 = min(bt, (b + 1) * tr, r0 + step)
                scaled = torch.mul(g[r0:r1], inv[r0:r1, None], out=buf[: r1 - r0]).abs_()
                part = scaled.amax(dim=0)
                col_max[b] = part if r0 == b * tr else torch.maximum(col_max[b], part)
    # Kept unless below 1: a NaN or infinite G keeps its tile (nothing hides it).
    kept = ~(col_max < 1.0)
    dense = kept.sum(dim=1) >= DENSE_ABOVE * n
    kept[dense] = True
    return kept


def _uniform(inv: torch.Tensor) -> torch.Tensor | None:
    """The one nonzero value of ``inv`` (a 0-d tensor), or None where rows differ. Rows of
    ``inv = 0`` (no upstream gradient: their ``G`` is 0) scale nothing and are ignored, so
    a mean over the kept tokens is uniform; one device sync per call."""
    if inv.numel() == 1:
        return inv.reshape(())
    hi = inv.amax()
    lo = torch.where(inv > 0, inv, hi).amin()
    return hi if bool(lo == hi) else None


def count(mask: torch.Tensor, f: GradientFilter) -> None:
    """Adds a chunk's tiles to the counter."""
    total = mask.numel()
    skipped = total - int(mask.sum())
    _STATS.tiles += total
    if f.input:
        _STATS.input_tiles += total
        _STATS.skipped_input += skipped
    if f.weight:
        _STATS.weight_tiles += total
        _STATS.skipped_weight += skipped


def filtered_products(g, mask, *, grad_input=None, w_op=None, first=False,
                      grad_weight=None, x_op=None, write=False, rounding=None,
                      scratch=None) -> None:  # fmt: skip
    """The chunk's products without its left-out tiles, row block by row block in order
    (bitwise deterministic): the block's kept columns of ``g`` gathered once, then

    - ``grad_input[rows] (+)= G[rows, kept] @ W[kept]`` (``grad_input``: the fp32
      ``[BT, H]`` accumulator, None when that product is not filtered; ``first``: it
      holds nothing yet, written, not added to);
    - ``grad_weight[kept] += G[rows, kept].T @ x[rows]``, into an fp32 sum of the chunk's
      rows (``grad_weight``: the chunk's ``[n, H]`` rows, None when not filtered; written
      with left-out columns 0 when ``write``, else added to, rounded once).

    A row block whose columns are all kept multiplies whole; one with none kept adds
    nothing. ``w_op`` / ``x_op``: the operands in the GEMM dtype. ``rounding``: ``(dtype,
    operand)`` when ``g`` is not rounded yet (``precision.round_to``): each block's kept
    columns are, once gathered, so a left-out column costs no rounding. ``scratch``: an
    fp32 buffer the chunk's weight sum may live in (the loop's, free while this runs)."""
    bt, n = g.shape
    accum = precision.accumulate_dtype(g.dtype)
    gw = None
    if grad_weight is not None:
        direct = grad_weight.dtype == accum  # the sum goes straight into the rows
        if direct and write:
            gw = grad_weight.zero_()
        elif direct:
            gw = grad_weight
        elif scratch is not None and scratch.numel() >= grad_weight.numel():
            gw = scratch[: grad_weight.numel()].view(grad_weight.shape).zero_()
        else:
            gw = torch.zeros(grad_weight.shape, dtype=accum, device=g.device)
    # Every row block's kept columns at once (one device sync, not one per block).
    counts = mask.sum(dim=1).tolist()
    kept_cols = mask.nonzero()[:, 1].split(counts)
    tr = tile_rows(g.device.type, bt)
    for b, (k, idx) in enumerate(zip(counts, kept_cols, strict=True)):
        r0, r1 = b * tr, min(bt, (b + 1) * tr)
        if k == 0:
            if grad_input is not None and first:
                grad_input[r0:r1].zero_()
            continue
        g_blk, w_blk = g[r0:r1], w_op
        if k == n:
            idx = None
        else:
            g_blk = g_blk.index_select(1, idx)
            w_blk = None if w_op is None else w_op.index_select(0, idx)
        if rounding is not None:
            g_blk = precision.round_to(g_blk, *rounding)
        if grad_input is not None:
            out = grad_input[r0:r1]
            if first:
                precision.mm_fp32(g_blk, w_blk, out=out)
            else:
                precision.addmm_fp32_(out, g_blk, w_blk)
        if gw is not None:
            if idx is None:
                precision.addmm_fp32_(gw, g_blk.t(), x_op[r0:r1])
            else:
                gw.index_add_(0, idx, precision.mm_fp32(g_blk.t(), x_op[r0:r1]))
    if gw is not None and gw is not grad_weight:
        if write:
            grad_weight.copy_(gw)
        else:
            grad_weight.add_(gw)
