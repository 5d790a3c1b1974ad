"""Distillation's math on one vocabulary shard, one chunk of columns at a time.

Per token (``docs/design.md``, "Distillation"), with the student's capped logits ``z``,
tempered ``u = z / T``, the teacher's tempered logits ``v`` (dense teacher) and this rank's
columns walked in chunks, :func:`local_statistics` keeps online (rescaled when a running
maximum grows, as the loss's sum-exp is):

    student   m_s, s_s = sum e^(u - m_s)              reverse KL: a_s = sum e^(u - m_s) (u - v)
    teacher   m_t, s_t = sum e^(v - m_t)              forward KL: a_t = sum e^(v - m_t) (v - u)
    CE        z at the target; m_c, s_c of z when T != 1 (the CE is at T = 1)
    top-k     u at the teacher's ids that are on this shard (0 elsewhere)

:func:`reduce_statistics` makes one MAX all-reduce of ``[m_s, m_t, m_c]`` and one SUM
all-reduce of the rescaled sums (the ``[N, k]`` logits at the ids ride in it), and the
divergence follows per token; the JSD needs the normalisers first, so it walks the chunks
a second time (:func:`jsd_sums`, one more SUM of two per-token sums). :func:`gradient_chunk`
is ``d loss_i / d z_ij`` of one chunk (then ``G`` of the backends' two products,
``vocab_parallel.engine.chunking``). The logits of a chunk come from :class:`HeadLogits`:
recomputed by the backend (its ``chunk_logits``: the torch backend's chunked fp32 GEMM, or
the Triton forward-statistics kernel writing them), or read from saved ones. On a backend
with fused distillation kernels (its ``distill``: the Triton backend's
``vocab_parallel.backends.triton_distill``) the dense teacher's first pass is one kernel instead
(:func:`fused_statistics`): both heads' tiles and these sums in registers, no chunk of
logits made (high-performance mode: written to the kept ones); and so are, from
recomputed logits, the JSD's second pass (:func:`jsd_sums`) and the dense teacher's
``G`` (:func:`fused_gradient`). The top-k teacher, and ``G`` from kept logits, stay on
the chunks.
Nothing here is larger than a few ``[rows, chunk]`` tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vocab_parallel.backends.interface import Backend, Logits
from vocab_parallel.backends.registry import get_backend
from vocab_parallel.engine import memory_policy as memory
from vocab_parallel.engine.online import Online, merge, weighted_sum
from vocab_parallel.parallel.collectives import all_reduce

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


@dataclass(frozen=True)
class Spec:
    """What a distillation call computes besides the logits' options (``LossOptions``)."""

    divergence: str = "forward_kl"
    beta: float = 0.5
    hard_label_weight: float = 0.0
    sparse: bool = False  # the teacher as top-k ids and log-probs
    has_target: bool = False

    @property
    def ce(self) -> bool:
        return self.hard_label_weight > 0.0


@dataclass(frozen=True, eq=False)
class Teacher:
    """The teacher of the call's (gathered) tokens: dense (``hidden [N, Ht]``, ``weight
    [V_local, Ht]``, ``bias``) or sparse (``ids [N, k]`` global int64, ``logprobs [N, k]``
    in the statistics' dtype). No gradient reaches any of them."""

    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None

    def rows(self, r0: int, r1: int) -> Teacher:
        def cut(t):
            return None if t is None else t[r0:r1]

        return Teacher(cut(self.hidden), self.weight, self.bias, cut(self.ids), cut(self.logprobs))


def chunk_columns(rows: int, v: int, device_type: str) -> int:
    """Columns per chunk of both heads' logits (``vocab_parallel.engine.memory_policy``,
    "distill")."""
    return memory.columns(rows, v, device_type, "distill")


class HeadLogits:
    """One head's capped, untempered logits ``cap(x @ W.T + b)``, chunk by chunk, in the
    statistics' dtype: recomputed by ``backend`` (a
    :class:`~vocab_parallel.backends.interface.Backend` or its name; its
    ``chunk_logits``) or, with ``saved`` (``[N, V_local]``), read from it (``fill=True``:
    computed into it, high-performance mode)."""

    def __init__(self, backend, x, weight, bias, softcap, accum, saved=None, fill=False):
        self.backend: Backend = get_backend(backend) if isinstance(backend, str) else backend
        self.x, self.weight, self.bias = x, weight, bias
        self.softcap, self.accum, self.saved, self.fill = softcap, accum, saved, fill
        self._make = None

    def chunk(self, v0: int, v1: int) -> torch.Tensor:
        if self.saved is not None and not self.fill:
            return self.saved[:, v0:v1]
        if self._make is None:
            logits = Logits(self.bias, self.softcap)
            self._make = self.backend.chunk_logits(self.x, self.weight, logits, dtype=self.accum)
        return self._make(v0, v1, None if self.saved is None else self.saved[:, v0:v1])


class Columns(NamedTuple):
    """Where each row's columns of interest are on this shard: ``target`` ``[N]`` and the
    teacher's top-k ``ids`` ``[N, k]`` (local columns, -1 elsewhere)."""

    target: torch.Tensor | None
    ids: torch.Tensor | None


def _in_chunk(cols: torch.Tensor, v0: int, v1: int):
    """``(here, index)``: which of ``cols`` fall in ``[v0, v1)``, and their chunk column
    (clamped, for a gather or scatter masked by ``here``)."""
    here = (cols >= v0) & (cols < v1)
    return here, (cols - v0).clamp(0, v1 - v0 - 1)


class LocalStats(NamedTuple):
    student: Online
    teacher: Online | None
    ce: Online | None
    predicted: torch.Tensor | None
    at_ids: torch.Tensor | None
    # Top-k teacher: the student's ``u`` off the teacher's ids (the tail bin's columns),
    # and how many columns that is per row.
    outside: Online | None = None
    outside_columns: torch.Tensor | None = None


def _id_columns(ids: torch.Tensor, v0: int, v1: int) -> torch.Tensor:
    """``[rows, v1 - v0]`` bool: which columns of the chunk are one of the row's ``ids``
    (local columns, -1 elsewhere). Ids off the chunk write into one extra column, cut
    off, so every write is ``True`` (no clamped index overwrites a real one)."""
    here = (ids >= v0) & (ids < v1)
    pos = torch.where(here, ids - v0, v1 - v0)
    mask = torch.zeros((ids.shape[0], v1 - v0 + 1), dtype=torch.bool, device=ids.device)
    return mask.scatter_(1, pos, True)[:, :-1]


def local_statistics(
    spec: Spec,
    student: HeadLogits,
    teacher: HeadLogits | None,
    inv_t: torch.Tensor | None,
    cols: Columns,
    v: int,
    rows: int,
    accum,
    device,
) -> LocalStats:
    """This rank's per-row statistics (the module docstring), one pass over its columns."""
    div = spec.divergence
    stu = Online(rows, 1 if (div == "reverse_kl" and not spec.sparse) else 0, accum, device)
    tea = None
    if not spec.sparse:
        tea = Online(rows, 1 if div == "forward_kl" else 0, accum, device)
    scaled = inv_t is not None
    ce = Online(rows, 0, accum, device) if spec.ce and scaled else None
    predicted = torch.zeros(rows, dtype=accum, device=device) if spec.ce else None
    at_ids = outside = count = None
    if spec.sparse:
        at_ids = torch.zeros(cols.ids.shape, dtype=accum, device=device)
        outside = Online(rows, 0, accum, device)
        count = (v - (cols.ids >= 0).sum(dim=1)).to(accum)
    if rows == 0 or v == 0:
        return LocalStats(stu, tea, ce, predicted, at_ids, outside, count)
    if fused_statistics(spec, student, teacher):
        return _fused_statistics(spec, student, teacher, inv_t, cols)
    it = None if inv_t is None else inv_t[:, None]
    cv = chunk_columns(rows, v, device.type)
    for v0 in range(0, v, cv):
        v1 = min(v, v0 + cv)
        z = student.chunk(v0, v1)
        u = z if it is None else z * it
        if spec.sparse:
            stu.add(u)
            here, idx = _in_chunk(cols.ids, v0, v1)
            at_ids += torch.where(here, u.gather(1, idx), 0.0)
            outside.add(u.masked_fill(_id_columns(cols.ids, v0, v1), -math.inf))
        else:
            t = teacher.chunk(v0, v1)
            vt = t if it is None else t * it
            if div == "forward_kl":
                stu.add(u)
                tea.add(vt, vt - u)
            elif div == "reverse_kl":
                stu.add(u, u - vt)
                tea.add(vt)
            else:
                stu.add(u)
                tea.add(vt)
        if spec.ce:
            here, idx = _in_chunk(cols.target, v0, v1)
            predicted += torch.where(here, z.gather(1, idx[:, None]).squeeze(1), 0.0)
            if ce is not None:
                ce.add(z)
    return LocalStats(stu, tea, ce, predicted, at_ids, outside, count)


def fused_statistics(spec: Spec, student: HeadLogits, teacher: HeadLogits | None) -> bool:
    """Whether :func:`local_statistics` runs in the backend's fused kernel of both heads
    (its ``distill``, ``vocab_parallel.backends.triton_distill.distill_stats``): a backend that has
    one (Triton), a dense teacher of the student's dtype (its tile products are of one
    type; fp32 statistics), logits recomputed or filled (high-performance mode,
    grad-in-forward's chunks), not read from saved ones."""
    if student.backend.distill is None or spec.sparse or teacher is None:
        return False
    if student.accum != torch.float32 or teacher.x.dtype != student.x.dtype:
        return False
    return all(h.saved is None or h.fill for h in (student, teacher))


def recomputed_in_kernels(spec: Spec, student: HeadLogits, teacher: HeadLogits | None) -> bool:
    """Whether the passes after the statistics (the JSD's second, ``G``) recompute both
    heads' tiles in the backend's fused kernels: :func:`fused_statistics` applies and no logits are
    kept (memory-saving mode; kept ones are read in torch instead)."""
    return student.saved is None and fused_statistics(spec, student, teacher)


def _fused_statistics(spec, student, teacher, inv_t, cols) -> LocalStats:
    """:func:`local_statistics` by the backend's fused kernel: both heads' tiles, the
    online sums of ``spec``'s divergence and the CE's in registers
    (``vocab_parallel.backends.triton_distill.distill_stats``); with ``fill``, both heads' capped
    logits written into their ``saved`` buffers."""
    fill = student.saved is not None
    r = student.backend.distill.distill_stats(
        student.x, student.weight, student.bias, teacher.x, teacher.weight, teacher.bias,
        divergence=spec.divergence, softcap=student.softcap, inv_temperature=inv_t,
        local_target=cols.target if spec.ce else None, ce_sums=spec.ce and inv_t is not None,
        logits_out=(student.saved, teacher.saved) if fill else None,
    )  # fmt: skip
    div = spec.divergence
    stu = Online.of(r.m_s, r.s_s, *([r.a] if div == "reverse_kl" else []))
    tea = Online.of(r.m_t, r.s_t, *([r.a] if div == "forward_kl" else []))
    ce = None if r.m_c is None else Online.of(r.m_c, r.s_c)
    return LocalStats(stu, tea, ce, r.predicted if spec.ce else None, None)


class RowTerms(NamedTuple):
    """Per-row results of the all-reduces: the divergence ``d`` and cross entropy ``ce``
    (None without), the student's (tempered) and the teacher's log-normalisers ``ls``,
    ``lt``, the untempered one ``l1`` (CE, T != 1), and the divergence's constant of
    its gradient ``coef`` (reverse KL: ``lt - ls - d``; JSD: ``KL(p_s || m)``; top-k:
    ``log(r / (1 - P))``, the tail bin's pull off the ids), top-k: the teacher's ``q =
    exp(lp)``."""

    d: torch.Tensor
    ce: torch.Tensor | None
    ls: torch.Tensor
    lt: torch.Tensor | None
    l1: torch.Tensor | None
    coef: torch.Tensor | None
    q: torch.Tensor | None


def reduce_statistics(spec: Spec, stats: LocalStats, teacher: Teacher, group) -> RowTerms:
    """The MAX and the SUM all-reduce of the local statistics, and the per-row terms
    (top-k divergence included; the JSD's needs :func:`jsd_sums` next)."""
    heads = [stats.student, stats.teacher, stats.ce, stats.outside]
    heads = [h for h in heads if h is not None]
    maxes = all_reduce(torch.stack([h.m for h in heads]), "MAX", group, "logits maxima")
    parts = [r for h, m in zip(heads, maxes, strict=True) for r in h.rescaled(m)]
    parts += [t for t in (stats.predicted, stats.outside_columns) if t is not None]
    rows = [p[None, :] for p in parts]
    if stats.at_ids is not None:
        rows.append(stats.at_ids.t())
    sums = all_reduce(torch.cat(rows), "SUM", group, "distillation sums")
    it = iter(sums)
    s_s = next(it)
    a_s = next(it) if stats.student.extra else None
    ls = maxes[0] + torch.log(s_s)
    lt = d = coef = q = None
    if stats.teacher is not None:
        s_t = next(it)
        a_t = next(it) if stats.teacher.extra else None
        lt = maxes[1] + torch.log(s_t)
        if spec.divergence == "forward_kl":
            d = a_t / s_t - lt + ls
        elif spec.divergence == "reverse_kl":
            d = a_s / s_s - ls + lt
            coef = lt - ls - d
    l1 = None
    if stats.ce is not None:
        l1 = maxes[1 + (stats.teacher is not None)] + torch.log(next(it))
    s_out = None if stats.outside is None else next(it)
    ce = None
    if stats.predicted is not None:
        ce = (ls if l1 is None else l1) - next(it)
    if spec.sparse:
        outside_columns = next(it)
        at_ids = sums[-stats.at_ids.shape[1] :].t() if stats.at_ids.shape[1] else stats.at_ids
        # Relative to the student's maximum (its logits' own rounding, not that of ls).
        log_s = torch.log(s_s)
        ls_ids = (at_ids - maxes[0][:, None]) - log_s[:, None]
        log_out = (maxes[-1] - maxes[0]) + (torch.log(s_out) - log_s)
        d, coef, q = _topk_divergence(teacher.logprobs, ls_ids, log_out, outside_columns > 0)
    return RowTerms(d, ce, ls, lt, l1, coef, q)


def _topk_divergence(lp, ls_ids, log_out, has_outside):
    """``(d, coef, q)`` of the forward KL against a top-k teacher (``lp``: its log-probs,
    ``ls_ids``: the student's at the same ids, ``log_out``: the log of the student's mass
    off the ids from a log-sum-exp over those columns): the k bins and the tail bin ``r
    (log r - log(1 - P))``, ``r = 1 - sum q``, ``P = sum p_s`` at the ids. ``log(1 - P)``
    is ``log1p(-P)`` where ``P <= 1/2`` (its rounding then cancels that of ``ls_ids``
    where the student is near the teacher) and ``log_out`` above (``1 - P`` would cancel
    there); ``r`` is summed in float64 (``[N, k]``). The tail bin is 0 where ``r <= 0``
    (the k log-probs sum to 1, up to rounding) or where it has no columns (``has_outside``
    False: k = V), so that k = V is the dense forward KL. ``coef = log(r / (1 - P))``
    (``-inf`` without the tail bin): off the ids the gradient is ``p_s - e^(log p_s +
    coef)``."""
    q = torch.exp(lp)
    d = (q * torch.where(q > 0, lp - ls_ids, 0.0)).sum(dim=1)
    # r in float64: 1 - sum q cancels (a tail of 1e-4 in fp32 is off by 6e-4 of itself,
    # and the gradient off the ids is r times p_s / (1 - P)).
    r = (1.0 - torch.exp(lp.to(torch.float64)).sum(dim=1)).to(lp.dtype)
    tail = (r > 0) & has_outside
    p = torch.exp(ls_ids).sum(dim=1)
    log_out = torch.where(p <= 0.5, torch.log1p(-p.clamp(max=0.5)), log_out)
    log_r = torch.log(torch.where(tail, r, 1.0))
    d = d + torch.where(tail, r * (log_r - log_out), 0.0)
    # Where the student has no mass off the ids (-inf logits) the loss is inf, as it is
    # exactly; the gradient stays p_s - q (finite).
    coef = torch.where(tail & (log_out > -math.inf), log_r - log_out, -math.inf)
    return d, coef, q


def jsd_sums(
    spec: Spec,
    student: HeadLogits,
    teacher: HeadLogits,
    inv_t,
    terms: RowTerms,
    v: int,
    rows: int,
    group,
) -> RowTerms:
    """The JSD's second pass: ``K_t = sum p_t log(p_t / m)`` and ``K_s = sum p_s log(p_s /
    m)``, ``m = beta p_t + (1 - beta) p_s``, one SUM all-reduce of both; ``d = beta K_t +
    (1 - beta) K_s``, ``coef = K_s``. Where :func:`fused_statistics` applies and the
    logits are recomputed (memory-saving mode), both sums are one kernel of the backend's
    (``vocab_parallel.backends.triton_distill.jsd_sums``), no chunk of logits made."""
    k = torch.zeros((2, rows), dtype=terms.ls.dtype, device=terms.ls.device)
    it = None if inv_t is None else inv_t[:, None]
    lb, l1b = math.log(spec.beta), math.log1p(-spec.beta)
    if rows and v and recomputed_in_kernels(spec, student, teacher):
        k[0], k[1] = student.backend.distill.jsd_sums(
            student.x, student.weight, student.bias, teacher.x, teacher.weight, teacher.bias,
            softcap=student.softcap, inv_temperature=inv_t, ls=terms.ls, lt=terms.lt,
            beta=spec.beta,
        )  # fmt: skip
    elif rows and v:
        cv = chunk_columns(rows, v, student.x.device.type)
        for v0 in range(0, v, cv):
            v1 = min(v, v0 + cv)
            z, t = student.chunk(v0, v1), teacher.chunk(v0, v1)
            ls = (z if it is None else z * it) - terms.ls[:, None]
            lt = (t if it is None else t * it) - terms.lt[:, None]
            lm = torch.logaddexp(lt + lb, ls + l1b)
            for row, lp in ((0, lt), (1, ls)):
                k[row] += weighted_sum(torch.exp(lp), lp - lm)
    all_reduce(k, "SUM", group, "JSD sums")
    d = spec.beta * k[0] + (1.0 - spec.beta) * k[1]
    return terms._replace(d=d, coef=k[1])


def gradient_chunk(
    spec: Spec,
    terms: RowTerms,
    z: torch.Tensor,
    t: torch.Tensor | None,
    inv_t,
    scale_d: torch.Tensor,
    scale_ce: torch.Tensor | None,
    cols: Columns,
    v0: int,
    v1: int,
    softcap: float | None,
) -> torch.Tensor:
    """``d loss / d r`` of one chunk (``r``: the student's raw logits ``x W^T + b``):

        G = scale_d / T * dD/du + scale_ce (p1 - onehot), then times cap'(r)

    with ``dD/du`` of the divergence (``docs/design.md``, "Distillation"): forward KL
    ``p_s - p_t``; reverse KL ``p_s (u - v + coef)``; JSD ``(1 - beta) p_s (log p_s -
    log m - coef)``; top-k ``p_s - q`` at the ids, ``p_s - e^(log p_s + coef)`` off them
    (``coef = log(r / (1 - P))``, :func:`_topk_divergence`).
    ``scale_d``, ``scale_ce``: per row, the upstream gradient times ``1 - a`` and ``a``
    (0 for ignored rows). ``z`` is read, never written (it may be saved logits)."""
    it = None if inv_t is None else inv_t[:, None]
    u = z if it is None else z * it
    div = spec.divergence
    if div == "forward_kl" and not spec.sparse:
        return _forward_kl_chunk(terms, z, u, t, it, scale_d, scale_ce, cols, v0, v1, softcap)
    ls = u - terms.ls[:, None]
    ps = torch.exp(ls)
    if spec.sparse:
        # Off the ids: p_s - e^(log p_s + coef) (no p_s r / (1 - P): p_s may underflow
        # where 1 - P does; its share of 1 - P does not). ``ls`` becomes that term.
        off = ls.add_(terms.coef[:, None]).exp_().masked_fill_(_id_columns(cols.ids, v0, v1), 0)
        g = torch.sub(ps, off, out=off)
        here, idx = _in_chunk(cols.ids, v0, v1)
        g.scatter_add_(1, idx, torch.where(here, -terms.q, 0.0))
    else:
        vt = t if it is None else t * it
        lt = vt - terms.lt[:, None]
        if div == "forward_kl":
            g = ps - torch.exp(lt)
        elif div == "reverse_kl":
            g = ps * torch.where(ps > 0, (u - vt) + terms.coef[:, None], 0.0)
        else:
            lm = torch.logaddexp(lt + math.log(spec.beta), ls + math.log1p(-spec.beta))
            g = (1.0 - spec.beta) * ps * torch.where(ps > 0, ls - lm - terms.coef[:, None], 0.0)
    scale = scale_d if it is None else scale_d * inv_t
    g.mul_(scale[:, None])
    if scale_ce is not None:
        p1 = ps if terms.l1 is None else torch.exp(z - terms.l1[:, None])
        here, idx = _in_chunk(cols.target, v0, v1)
        p1.mul_(scale_ce[:, None])
        p1.scatter_add_(1, idx[:, None], torch.where(here, -scale_ce, 0.0)[:, None])
        g.add_(p1)
    return _through_cap(g, z, softcap)


def fused_gradient(spec, terms, student, teacher, inv_t, scale_d, scale_ce, cols, cv):
    """``make_g`` of a dense teacher's ``G`` by the backend's fused kernel
    (``vocab_parallel.backends.triton_distill.divergence_gradient``: both heads' tiles
    recomputed, :func:`gradient_chunk`'s formula in registers, ``G`` written in the input
    dtype), or None where :func:`gradient_chunk` forms it: the top-k teacher, saved
    logits (high-performance mode reads them), or where :func:`fused_statistics` does not
    apply."""
    if not recomputed_in_kernels(spec, student, teacher):
        return None
    c_d = scale_d if inv_t is None else scale_d * inv_t
    return student.backend.distill.divergence_gradient(
        student.x, student.weight, student.bias, teacher.x, teacher.weight, teacher.bias,
        divergence=spec.divergence, softcap=student.softcap, inv_temperature=inv_t,
        ls=terms.ls, lt=terms.lt, c_d=c_d, coef=terms.coef, beta=spec.beta, c_ce=scale_ce,
        l1=terms.l1 if scale_ce is not None else None,
        local_target=cols.target if scale_ce is not None else None, chunk_columns=cv,
    )  # fmt: skip


def _through_cap(g: torch.Tensor, z: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``g`` times the cap's derivative ``1 - (z / c)^2`` (in place)."""
    if softcap is not None:
        g.mul_(torch.div(z, softcap).square_().neg_().add_(1.0))
    return g


def _forward_kl_chunk(terms, z, u, t, it, scale_d, scale_ce, cols, v0, v1, softcap):
    """:func:`gradient_chunk` of the forward KL, formed in place: ``G = c_d (p_s - p_t) +
    c_ce (p1 - onehot)``; without a temperature ``p1 = p_s``, so ``G = (c_d + c_ce) p_s -
    c_d p_t - c_ce onehot`` and no third tensor is made."""
    c_d = (scale_d if it is None else scale_d * it[:, 0])[:, None]
    ps = torch.sub(u, terms.ls[:, None]).exp_()
    pt = (t if it is None else t * it).sub(terms.lt[:, None]).exp_()
    if scale_ce is None:
        g = ps.sub_(pt).mul_(c_d)
    elif terms.l1 is None:
        g = ps.mul_(c_d + scale_ce[:, None]).sub_(pt.mul_(c_d))
    else:
        g = ps.sub_(pt).mul_(c_d)
        g.add_(torch.sub(z, terms.l1[:, None]).exp_().mul_(scale_ce[:, None]))
    if scale_ce is not None:
        here, idx = _in_chunk(cols.target, v0, v1)
        g.scatter_add_(1, idx[:, None], torch.where(here, -scale_ce, 0.0)[:, None])
    return _through_cap(g, z, softcap)


# ---------------------------------------------------------------------------------------
# Forward KL of a dense teacher on kept chunks (grad_in_forward): the exps made once
# ---------------------------------------------------------------------------------------


def kept_block_columns(rows: int, v: int, device_type: str) -> int:
    """Columns per block of :class:`KeptForwardKL` (``vocab_parallel.engine.memory_policy``,
    "kept_block": both heads' blocks and the scratch stay in cache through the elementwise
    passes, wide enough for full-rate CPU GEMMs)."""
    return memory.columns(rows, v, device_type, "kept_block")


class KeptForwardKL:
    """The dense forward KL of one token chunk whose two heads' logits are kept
    (``student.saved``, ``teacher.saved``: ``[rows, V_local]`` buffers, ``fill=True``),
    with each exponential made once.

    :meth:`statistics` walks blocks of ``cv`` columns: each head's GEMM into its buffer,
    then per block and row its maximum ``m_b`` (at least the most negative finite value,
    as :class:`Online`'s start), the exponentials ``E = e^(y - m_b)`` written over the
    logits and their sums (``s``, and ``A_t``'s ``sum E_t (v - u)``), kept per block; after
    the walk the sums are rescaled to the row's maximum (what :func:`local_statistics`'
    online rescaling gives). After the all-reduces ``p = E e^(m_b - L)`` exactly (``m_b
    <= L``), so :meth:`gradient` forms ``G`` with two products per element and no exp.
    The student's logits stay where ``G`` needs them (a softcap's derivative, or the CE's
    ``softmax(z)`` when ``T != 1``): then ``p_s`` is ``e^(u - L_s)`` again. ``G`` is
    formed in the teacher's block (its logits are not needed after their exps)."""

    def __init__(self, spec: Spec, student: HeadLogits, teacher: HeadLogits, inv_t, softcap):
        self.spec, self.student, self.teacher = spec, student, teacher
        self.it = None if inv_t is None else inv_t[:, None]
        self.softcap = softcap
        # Whether the student's logits are needed by G (else its exps replace them).
        self.keep_z = softcap is not None or (spec.ce and inv_t is not None)
        rows, v = student.saved.shape
        self.rows, self.v = rows, v
        self.cv = kept_block_columns(rows, v, student.x.device.type)
        blocks = -(-v // self.cv) if (v and rows) else 0
        f = dict(dtype=student.accum, device=student.x.device)
        # Per block (first index) and row: the maxima and sums of both heads.
        self.m_s, self.m_t = torch.empty((blocks, rows), **f), torch.empty((blocks, rows), **f)
        self.sums = torch.empty((3, blocks, rows), **f)  # s_s, s_t, A_t
        self.scratch = torch.empty((rows, min(self.cv, v)), **f)

    def statistics(self, cols: Columns) -> LocalStats:
        """This rank's statistics of the chunk (as :func:`local_statistics`)."""
        spec, rows, v, it = self.spec, self.rows, self.v, self.it
        accum, device = self.student.accum, self.student.x.device
        lowest = torch.finfo(accum).min
        ce = Online(rows, 0, accum, device) if spec.ce and it is not None else None
        predicted = torch.zeros(rows, dtype=accum, device=device) if spec.ce else None
        s_s, s_t, a_t = self.sums
        for b in range(self.m_s.shape[0]):
            v0, v1 = b * self.cv, min(v, (b + 1) * self.cv)
            z, t = self.student.chunk(v0, v1), self.teacher.chunk(v0, v1)
            if spec.ce:
                here, idx = _in_chunk(cols.target, v0, v1)
                predicted += torch.where(here, z.gather(1, idx[:, None]).squeeze(1), 0.0)
                if ce is not None:
                    ce.add(z)
            diff = torch.sub(t, z, out=self.scratch[:, : v1 - v0])  # v - u, times 1/T
            if it is not None:
                diff.mul_(it)
                t.mul_(it)
            if self.keep_z:
                u = z if it is None else torch.mul(z, it)
                e_s = torch.sub(u, _block_max(u, self.m_s[b], lowest)[:, None]).exp_()
            else:
                u = z if it is None else z.mul_(it)
                e_s = u.sub_(_block_max(u, self.m_s[b], lowest)[:, None]).exp_()
            torch.sum(e_s, dim=1, out=s_s[b])
            e_t = t.sub_(_block_max(t, self.m_t[b], lowest)[:, None]).exp_()
            torch.sum(e_t, dim=1, out=s_t[b])
            a_t[b] = weighted_sum(e_t, diff)
        for head in (self.student, self.teacher):
            head.fill = False
        stu, tea = Online(rows, 0, accum, device), Online(rows, 1, accum, device)
        if self.m_s.shape[0]:
            stu.m, (stu.s,) = merge(self.m_s, s_s)
            tea.m, (tea.s, tea.extra[0]) = merge(self.m_t, s_t, a_t)
        return LocalStats(stu, tea, ce, predicted, None)

    def gradient(self, terms: RowTerms, scale_d, scale_ce, cols: Columns):
        """``make_g`` of :func:`~vocab_parallel.engine.chunking.gradient_products` over the same
        blocks (``cv`` columns): :func:`gradient_chunk` of the forward KL."""
        it = self.it
        c_d = scale_d if it is None else scale_d * it[:, 0]
        f_t = torch.exp(self.m_t - terms.lt).mul_(c_d).neg_()  # [blocks, rows]
        one_p = scale_ce is not None and terms.l1 is None  # p1 = p_s: one coefficient
        c_s = c_d + scale_ce if one_p else c_d
        f_s = None if self.keep_z else torch.exp(self.m_s - terms.ls).mul_(c_s)
        cap = self.softcap

        def make_g(v0, v1, x_op, w_op):
            b = v0 // self.cv
            g = self.teacher.saved[:, v0:v1].mul_(f_t[b, :, None])  # -c_d p_t
            z = self.student.saved[:, v0:v1]
            if f_s is not None:
                g.addcmul_(z, f_s[b, :, None])
            else:
                tmp = self.scratch[:, : v1 - v0]
                u = torch.mul(z, it, out=tmp) if it is not None else tmp.copy_(z)
                g.addcmul_(u.sub_(terms.ls[:, None]).exp_(), c_s[:, None])
                if scale_ce is not None and not one_p:
                    p1 = torch.sub(z, terms.l1[:, None], out=tmp).exp_()
                    g.addcmul_(p1, scale_ce[:, None])
            if scale_ce is not None:
                here, idx = _in_chunk(cols.target, v0, v1)
                g.scatter_add_(1, idx[:, None], torch.where(here, -scale_ce, 0.0)[:, None])
            if cap is not None:
                tmp = self.scratch[:, : v1 - v0]
                g.mul_(torch.div(z, cap, out=tmp).square_().neg_().add_(1.0))
            return g

        return make_g


def _block_max(y: torch.Tensor, out: torch.Tensor, lowest: float) -> torch.Tensor:
    """``out = max(lowest, max_j y_j)`` per row of a block (a block of ``-inf`` gives
    ``E = 0``, not NaN)."""
    return torch.amax(y, dim=1, out=out).clamp_(min=lowest)
