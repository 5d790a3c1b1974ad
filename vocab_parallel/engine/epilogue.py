"""An objective at the math level, and the engine's passes that run it (``docs/design.md``,
"The engine": the objective interface).

An :class:`Epilogue` says only what its objective adds to a chunk of logits; the engine
walks the chunks, makes the collectives and the gradient products, alike for every
objective (``vocab_parallel.engine.functions``):

    heads      how many heads' logits it reads (1: the student; 2: a dense teacher too),
               and their operands (:meth:`Epilogue.operands`)
    local      per column chunk of the heads' fp32 logits, its online maxima and sums
               (:class:`~vocab_parallel.engine.online.Online`), plain per-token sums and
               per-token wide sums ``[N, k]``: :class:`Local`
    MAX        one all-reduce of every online maximum              ``[P, N]``
    SUM        one all-reduce of the sums rescaled to those maxima, the plain rows and
               the wide columns                                      ``[Q, N]``
    terms      its per-token terms from the reduced rows (:meth:`Epilogue.terms`); an
               objective that needs the normalisers first makes a second pass and one
               more SUM (:meth:`Epilogue.second`)
    losses     per token; ``G`` per column chunk from the terms and the chunk's logits
               (:meth:`Epilogue.gradient`), handed to the engine's gradient products

:class:`HeadChunks` is the one column walker: the heads' logits of some token rows over
this shard's columns, chunk by chunk (widths from ``vocab_parallel.engine.memory_policy``),
recomputed by the backend (its ``chunk_logits``) or written once into kept fp32 blocks and
read from them afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import NamedTuple

import torch

from vocab_parallel.backends.interface import Logits
from vocab_parallel.backends.registry import get_backend
from vocab_parallel.engine import memory_policy as memory
from vocab_parallel.engine.online import Online
from vocab_parallel.parallel.collectives import all_reduce, world_size

Operands = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]  # x, weight, bias


class Local(NamedTuple):
    """One rank's per-token statistics of an epilogue's first pass."""

    online: list[Online]  # running maxima and sums (extras included), in a fixed order
    rows: list[torch.Tensor]  # plain per-token sums [N]
    wide: torch.Tensor | None = None  # per-token sums of several columns [N, k]


class HeadChunks:
    """The heads' logits as ``logits`` makes them from each head's operands (its bias
    each head's own; untempered: the epilogue divides by the temperature) of ``rows``
    tokens over this shard's ``v`` columns, chunk by chunk, in ``accum`` (fp32; float64
    for float64 inputs). ``kept``: one contiguous block of ``rows * v`` values per head
    (e.g. ``[rows, v]``, laid out by :meth:`_kept`), written by the first walk and read
    by every later one (else recomputed each time)."""

    def __init__(self, backend, heads: list[Operands], logits: Logits, accum, kept=None):
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.heads, self.logits, self.accum = heads, logits, accum
        self.kept, self.filled = kept, False
        self.rows, self.v = heads[0][0].shape[0], heads[0][1].shape[0]
        self.width = memory.columns(self.rows, self.v, heads[0][0].device.type, "epilogue")
        self._make = None

    def _kept(self, v0: int, v1: int) -> list[torch.Tensor]:
        """The kept blocks' storage of columns ``[v0, v1)``: each chunk a contiguous
        ``[rows, v1 - v0]`` run of the block (the block is only ever read through here),
        so that a GEMM writes it directly."""
        n = self.rows
        return [k.view(-1)[n * v0 : n * v1].view(n, v1 - v0) for k in self.kept]

    def chunk(self, v0: int, v1: int) -> list[torch.Tensor]:
        """Every head's logits of columns ``[v0, v1)`` (kept ones are views: read them only)."""
        if self.kept is not None and self.filled:
            return self._kept(v0, v1)
        if self._make is None:
            make, logits = self.backend.chunk_logits, self.logits
            self._make = [
                make(x, w, replace(logits, bias=b), dtype=self.accum) for x, w, b in self.heads
            ]
        outs = [None] * len(self.heads) if self.kept is None else self._kept(v0, v1)
        return [m(v0, v1, o) for m, o in zip(self._make, outs, strict=True)]

    def whole(self) -> list[torch.Tensor]:
        """Every head's logits of all ``v`` columns at once (a fused epilogue's blocks):
        the kept blocks, filled by one GEMM per head the first time."""
        zs = self.chunk(0, self.v)
        self.filled = self.kept is not None
        return zs

    def walk_rows(self, rows: torch.Tensor) -> Iterator[tuple[int, int, list[torch.Tensor]]]:
        """``(v0, v1, logits)`` of the token ``rows`` alone, cut from the whole chunks: the
        same values, bit for bit, as every other walk gives them (a GEMM of other rows
        may round differently: a threshold found on them would not be one here)."""
        for v0, v1, zs in self.walk():
            yield v0, v1, [z[rows] for z in zs]

    def walk(self, width: int | None = None) -> Iterator[tuple[int, int, list[torch.Tensor]]]:
        """``(v0, v1, logits)`` of every chunk in column order, ``width`` columns each (by
        default the walker's; the first walk fills kept blocks)."""
        width = width or self.width
        if self.rows and self.v:
            for v0 in range(0, self.v, width):
                v1 = min(self.v, v0 + width)
                yield v0, v1, self.chunk(v0, v1)
        self.filled = self.kept is not None


class Scratch:
    """Temporaries reused from chunk to chunk of a walk (on a CPU a fresh block of
    several MiB costs its page faults every time): ``scratch(i, like)`` is buffer ``i``
    shaped like ``like`` (made at the first, widest, chunk)."""

    def __init__(self):
        self.buffers: dict[int, torch.Tensor] = {}

    def __call__(self, i: int, like: torch.Tensor) -> torch.Tensor:
        b = self.buffers.get(i)
        rows, cols = like.shape
        if b is None or b.shape[0] != rows or b.shape[1] < cols or b.dtype != like.dtype:
            b = self.buffers[i] = torch.empty_like(like, memory_format=torch.contiguous_format)
        return b[:, :cols]


class Epilogue:
    """What an objective adds to the engine's chunks (the module docstring). Subclasses
    set :attr:`heads`, :attr:`sums_name` and implement the methods; ``ignored`` (``[N]``
    bool): the tokens with no loss and no gradient."""

    heads: int = 1
    sums_name: str = "sums"  # the SUM all-reduce's name in errors
    ignored: torch.Tensor

    def operands(self, x, weight, bias) -> list[Operands]:
        """The heads' operands, the student's (``x``, ``weight``, ``bias``) first."""
        raise NotImplementedError

    def rows(self, r0: int, r1: int) -> Epilogue:
        """The same objective on the token rows ``[r0, r1)``."""
        raise NotImplementedError

    def local(self, chunks: Iterator) -> Local:
        """This rank's statistics, one walk over ``chunks`` (:meth:`HeadChunks.walk`)."""
        raise NotImplementedError

    def terms(self, maxima: torch.Tensor, sums: torch.Tensor) -> NamedTuple:
        """Per-token terms from the reduced rows, in :meth:`local`'s order (each online
        part's sum and extras rescaled to the global maxima, the plain rows, the wide
        columns)."""
        raise NotImplementedError

    def second(self, chunks: Iterator, terms) -> torch.Tensor | None:
        """Per-token sums ``[Q, N]`` of a second walk that needs ``terms`` (None: none)."""
        return None

    # An objective with a fused epilogue of its own (its kernels over kept blocks or
    # column chunks) overrides these three; by default they walk the chunks with the
    # methods above.

    def local_of(self, chunks: HeadChunks) -> Local:
        """This rank's statistics of ``chunks``: :meth:`local` over its walk."""
        return self.local(chunks.walk())

    def second_of(self, chunks: HeadChunks, terms) -> torch.Tensor | None:
        """The second walk's sums: :meth:`second` over ``chunks``' walk."""
        return self.second(chunks.walk(), terms)

    def gradient_width(self, chunks: HeadChunks) -> int:
        """The columns of each ``G`` the engine asks :meth:`gradient` for: the walker's."""
        return chunks.width

    def after_second(self, terms, sums: torch.Tensor):
        """The terms once the second walk's sums are reduced."""
        return terms

    def refine(self, chunks: HeadChunks, terms):
        """The terms after any further walks of the objective's own (``chunks.walk()``,
        ``chunks.walk_rows(rows)``) and collectives (a threshold search); by default
        the terms."""
        return terms

    def losses(self, terms) -> torch.Tensor:
        """Per-token losses (ignored tokens: any value, the engine zeroes them)."""
        raise NotImplementedError

    def gradient(self, terms, v0: int, v1: int, logits: list[torch.Tensor], grad: torch.Tensor):
        """``G`` of columns ``[v0, v1)``: ``d loss_i / d z_ij`` (``z``: the student's capped
        logits, ``logits[0]``; the engine chains it through the cap) times ``grad`` (per
        token, 0 where ignored), a tensor the engine may overwrite; ``logits`` are read
        only."""
        raise NotImplementedError

    def gradient_into(self, terms, v0: int, v1: int, logits, grad, out: torch.Tensor):
        """:meth:`gradient`, where the engine keeps ``G``: ``out`` is the kept G's columns
        ``[v0, v1)`` (the inputs' dtype). An epilogue that can write ``G`` there returns
        ``out`` (no copy); by default :meth:`gradient`'s result, which the engine copies."""
        return self.gradient(terms, v0, v1, logits, grad)


def statistics(ep: Epilogue, chunks: HeadChunks, group):
    """The epilogue's terms: its first walk, the MAX and the SUM all-reduce of its
    statistics, and its second walk with one more SUM where it has one."""
    local = ep.local_of(chunks)
    maxima = torch.stack([o.m for o in local.online])
    if world_size(group) == 1:
        # Alone, the maxima are this rank's own (finite: Online starts at the smallest
        # finite value): the sums moved to them are unchanged (e^0 = 1), no pass moves them.
        rows = [r[None] for o in local.online for r in (o.s, *o.extra)]
    else:
        maxima = all_reduce(maxima, "MAX", group, "logits maxima")
        rows = [r[None] for o, m in zip(local.online, maxima, strict=True) for r in o.rescaled(m)]
    rows += [r[None] for r in local.rows]
    if local.wide is not None:
        rows.append(local.wide.t())
    terms = ep.terms(maxima, all_reduce(torch.cat(rows), "SUM", group, ep.sums_name))
    more = ep.second_of(chunks, terms)
    if more is not None:
        terms = ep.after_second(terms, all_reduce(more, "SUM", group, ep.sums_name))
    return ep.refine(chunks, terms)


def in_chunk(cols: torch.Tensor, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(here, index)``: which of the shard columns ``cols`` (any shape; -1: none) fall in
    the chunk ``[v0, v1)``, and their chunk column (clamped: mask by ``here``)."""
    return (cols >= v0) & (cols < v1), (cols - v0).clamp(0, v1 - v0 - 1)


def pick(z: torch.Tensor, cols: torch.Tensor, v0: int, v1: int) -> torch.Tensor:
    """Each row's value of the chunk ``z`` (columns ``[v0, v1)``) at its columns ``cols``
    (``[N]`` or ``[N, k]``), 0 where a column is not in the chunk."""
    here, idx = in_chunk(cols, v0, v1)
    if cols.dim() == 1:
        return torch.where(here, z.gather(1, idx[:, None])[:, 0], 0.0)
    return torch.where(here, z.gather(1, idx), 0.0)


def add_at(g: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, v0: int, v1: int):
    """``g[i, cols[i] - v0] += values[i]`` where ``cols[i]`` is in the chunk ``[v0, v1)``
    (``cols``, ``values``: ``[N]`` or ``[N, k]``), in place."""
    here, idx = in_chunk(cols, v0, v1)
    values = torch.where(here, values, 0.0)
    if cols.dim() == 1:
        idx, values = idx[:, None], values[:, None]
    return g.scatter_add_(1, idx, values)


def chunk_mask(cols: torch.Tensor, v0: int, v1: int) -> torch.Tensor:
    """``[N, v1 - v0]`` bool: the chunk's columns that are one of each row's ``cols``
    (``[N, k]``; those off the chunk write into one extra column, cut off)."""
    pos = torch.where((cols >= v0) & (cols < v1), cols - v0, v1 - v0)
    mask = torch.zeros((cols.shape[0], v1 - v0 + 1), dtype=torch.bool, device=cols.device)
    return mask.scatter_(1, pos, True)[:, :-1]


def cut(t: torch.Tensor | None, r0: int, r1: int) -> torch.Tensor | None:
    """Rows ``[r0, r1)`` of a per-token tensor (None stays None)."""
    return None if t is None else t[r0:r1]


def cat_terms(parts: list, empty):
    """The per-token terms of consecutive row chunks as those of all rows (``empty``:
    the terms of no rows)."""
    if not parts:
        return empty
    columns = zip(*parts, strict=True)
    return type(parts[0])(*(None if c[0] is None else torch.cat(c) for c in columns))
