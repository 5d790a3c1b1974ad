"""The one online-softmax helper: running maxima and sums of exponentials, and their
merge (``docs/design.md``, "The engine").

A pass over vocabulary columns keeps, per row, a running maximum ``m`` and ``s = sum_j
e^(y_j - m)`` (and sums ``sum_j e^(y_j - m) t_j`` of terms ``t``), rescaled by ``e^(m -
m')`` when the maximum grows to ``m'`` (:class:`Online`); parts made apart (column
chunks, blocks, a kernel's vocabulary splits, ranks) merge by the same rule
(:func:`merge`). Running maxima start at the most negative finite value, never ``-inf``: a
part whose values are all ``-inf`` (a masking bias) adds 0 and rescales by 1, never
``exp(-inf + inf)``.
"""

from __future__ import annotations

import torch


def merge(maxima: torch.Tensor, *sums: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Per-part maxima ``[P, N]`` and sums ``[P, N]`` (each of ``e^(y - m_p)``, times a term)
    as the rows': ``(M, [sum_p s_p e^(m_p - M), ...])``, ``M = max_p m_p``, in part order
    (every ``m_p`` finite: no NaN)."""
    top = maxima.amax(dim=0)
    decay = torch.exp(maxima - top)
    return top, [(t * decay).sum(dim=0) for t in sums]


class Online:
    """A running max ``m``, ``s = sum_j e^(y_j - m)`` and sums ``sum_j e^(y_j - m) t_j``
    over chunks; the max starts at the most negative finite value (a chunk of ``-inf``
    adds 0 and rescales by 1, as in the backends)."""

    def __init__(self, rows: int, extras: int, accum, device):
        self.m = torch.full((rows,), torch.finfo(accum).min, dtype=accum, device=device)
        self.s = torch.zeros(rows, dtype=accum, device=device)
        self.extra = [torch.zeros_like(self.s) for _ in range(extras)]

    def add(self, y: torch.Tensor, *terms: torch.Tensor, out: torch.Tensor | None = None) -> None:
        """Add the columns ``y`` (and sums of ``e^(y - m)`` times each term); ``out``: a
        buffer shaped like ``y`` for the exponentials (else a new one)."""
        new = torch.maximum(self.m, y.amax(dim=1))
        decay = torch.exp(self.m - new)
        e = torch.sub(y, new[:, None], out=out).exp_()
        self.s = self.s * decay + e.sum(dim=1)
        for i, t in enumerate(terms):
            self.extra[i] = self.extra[i] * decay + weighted_sum(e, t)
        self.m = new

    @classmethod
    def of(cls, m: torch.Tensor, s: torch.Tensor, *extra: torch.Tensor) -> Online:
        """The running statistics as already made elsewhere (the Triton kernel's)."""
        online = cls.__new__(cls)
        online.m, online.s, online.extra = m, s, list(extra)
        return online

    @classmethod
    def merged(cls, parts: list[Online]) -> Online:
        """One running statistic of column chunks' ``parts`` (made apart, each over its own
        columns): the max over them, each part's sums moved to it and added in order,
        vectorised over the parts (a handful of launches, however many parts)."""
        if len(parts) == 1:
            return parts[0]
        m = torch.stack([p.m for p in parts])
        top = m.amax(dim=0)
        decay = torch.exp(m - top)  # the parts' maxima are finite: no NaN

        def added(rows: list[torch.Tensor]) -> torch.Tensor:
            return (torch.stack(rows) * decay).sum(dim=0)

        extras = [added([p.extra[i] for p in parts]) for i in range(len(parts[0].extra))]
        return cls.of(top, added([p.s for p in parts]), *extras)

    def rescaled(self, shift: torch.Tensor) -> list[torch.Tensor]:
        decay = torch.exp(self.m - shift)
        return [self.s * decay] + [t * decay for t in self.extra]


def weighted_sum(e: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``sum_j e_j t_j`` per row, where ``e_j = 0`` adds 0 even if ``t_j`` is infinite (a
    ``-inf`` logit). ``t`` is a fresh term of the caller's and becomes the products (no
    temporary: an ``einsum`` here grew with the vocabulary); the products of ``e_j = 0``
    are set to 0 before the sum (no host sync, no test of the result)."""
    return t.mul_(e).masked_fill_(e == 0, 0.0).sum(dim=1)
