"""Gradient filtering: the gradient products without the tiles of ``G`` that are negligible.

Off by default (``filter_eps=None``: exact). With ``filter_eps`` set, a tile of
``TILE_ROWS x TILE_COLS`` entries of a chunk of ``G`` (``docs/design.md``, "Gradient
filtering") is *negligible* when every entry of it is below ``eps`` per unit of upstream
gradient,

    |G_ij| < eps * |g_i|         for every (i, j) of the tile (g_i: row i's upstream gradient),

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

elementwise (the tests check these against float64). Both products walk the chunk in
a fixed order (row blocks for ``grad_input``, column blocks for ``grad_weight``), so
results are bitwise deterministic; a chunk whose tiles are all kept runs the unfiltered
products unchanged.

What is left out is counted (:func:`gradient_filter_stats`): tiles seen and tiles skipped
per product since the last reset, on this process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vocab_parallel import precision

# Tile of G that is kept or left out whole: rows (tokens) x columns (vocabulary).
TILE_ROWS = 128
TILE_COLS = 128


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
    """``[ceil(BT / TILE_ROWS), ceil(n / TILE_COLS)]`` bool: which tiles of the chunk
    ``g [BT, n]`` are kept (some entry at or above ``eps |grad_i|``). Two reductions over
    ``g`` in place (max and min per row and tile of columns, on a view: no copy of the
    chunk), then the small ``[BT, tiles]`` maxima scaled per row and reduced per row block."""
    bt, n = g.shape
    n_cb = -(-n // TILE_COLS)
    n_rb = -(-bt // TILE_ROWS)
    if f.eps <= 0:  # |G_ij| < 0 never holds: every tile is kept
        return torch.ones((n_rb, n_cb), dtype=torch.bool, device=g.device)
    full = n // TILE_COLS * TILE_COLS
    parts = []
    if full:
        tiles = g[:, :full].unflatten(1, (full // TILE_COLS, TILE_COLS))
        parts.append(torch.maximum(tiles.amax(dim=2), tiles.amin(dim=2).neg()))
    if full < n:  # the last, narrower tile of columns
        tail = g[:, full:]
        parts.append(torch.maximum(tail.amax(dim=1), tail.amin(dim=1).neg())[:, None])
    row_max = torch.cat(parts, dim=1).to(torch.float32)  # [BT, n_cb] max |G| per row, tile
    scale = f.grad.to(torch.float32).abs()
    # Rows of zero upstream gradient have G = 0: left out (inv 0) whatever eps.
    inv = torch.where(scale > 0, 1.0 / (f.eps * scale), 0.0)
    row_max.mul_(inv if inv.numel() == 1 else inv[:, None])
    pad = n_rb * TILE_ROWS - bt
    if pad:
        row_max = torch.nn.functional.pad(row_max, (0, 0, 0, pad))
    tile_max = row_max.view(n_rb, TILE_ROWS, n_cb).amax(dim=1)
    # Kept unless below 1: a NaN or infinite G keeps its tile (nothing hides it).
    return ~(tile_max < 1.0)


def _runs(keys: list) -> list[tuple[int, int]]:
    """``[(start, stop)]`` of the runs of equal consecutive entries of ``keys``."""
    runs, start = [], 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            runs.append((start, i))
            start = i
    return runs


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


def input_product(acc, g, w_op, mask, first: bool, scratch) -> None:
    """``acc (+)= G @ W`` of one chunk without its left-out tiles: row block by row block
    (runs of row blocks with the same kept columns share one GEMM), over the kept columns
    gathered. ``first``: ``acc`` holds nothing yet (written, not added to)."""
    bt, n = g.shape
    if first:
        acc.zero_()
    cols = _expand(mask, TILE_COLS, n)  # [n_rb, n] kept columns of each row block
    keys = [tuple(m) for m in mask.tolist()]
    for b0, b1 in _runs(keys):
        r0, r1 = b0 * TILE_ROWS, min(bt, b1 * TILE_ROWS)
        kept = cols[b0]
        if not bool(kept.any()):
            continue
        g_rows, w_rows = g[r0:r1], w_op
        if not bool(kept.all()):
            idx = kept.nonzero().squeeze(1)
            g_rows, w_rows = g_rows.index_select(1, idx), w_op.index_select(0, idx)
        out = acc[r0:r1]
        tmp = None if scratch is None else scratch[: out.numel()].view_as(out)
        precision.addmm_fp32_(out, g_rows, w_rows, scratch=tmp)


def weight_product(rows_out, g, x_op, mask, write: bool, scratch) -> None:
    """``grad_weight[chunk] (+)= G.T @ x`` without the left-out tiles: column block by
    column block (runs with the same kept rows share one GEMM), over the kept rows
    gathered. ``write``: the rows are written (left-out columns get 0), else added to.
    ``rows_out``: ``[n, H]`` (fp32 or the gradient's dtype), ``scratch``: fp32 ``[n*H]`` or
    None when ``rows_out`` is fp32 and the operands too."""
    bt, n = g.shape
    rows = _expand(mask.t(), TILE_ROWS, bt)  # [n_cb, bt] kept rows of each column block
    keys = [tuple(m) for m in mask.t().tolist()]
    for b0, b1 in _runs(keys):
        c0, c1 = b0 * TILE_COLS, min(n, b1 * TILE_COLS)
        kept, out = rows[b0], rows_out[c0:c1]
        if not bool(kept.any()):
            if write:
                out.zero_()
            continue
        g_cols, x_rows = g[:, c0:c1], x_op
        if not bool(kept.all()):
            idx = kept.nonzero().squeeze(1)
            g_cols, x_rows = g_cols.index_select(0, idx), x_op.index_select(0, idx)
        accum = precision.accumulate_dtype(g.dtype)
        tmp = None if scratch is None else scratch[: out.numel()].view_as(out)
        if not write:
            precision.addmm_fp32_(out, g_cols.t(), x_rows, scratch=tmp)
        elif out.dtype == accum:
            precision.mm_fp32(g_cols.t(), x_rows, out=out)
        else:
            out.copy_(precision.mm_fp32(g_cols.t(), x_rows, out=tmp))


def _expand(mask: torch.Tensor, size: int, n: int) -> torch.Tensor:
    """A ``[blocks_a, blocks_b]`` tile mask as ``[blocks_a, n]``: each tile repeated
    ``size`` times along its second axis, cut at ``n``."""
    return mask.repeat_interleave(size, dim=1)[:, :n]
