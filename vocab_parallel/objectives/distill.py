"""Distillation's math: what it adds to the engine's chunks, an
:class:`~vocab_parallel.engine.epilogue.Epilogue` (the formulas, sums and collectives:
``docs/design.md``, "Distillation"). Per token: online sums of both heads' tempered
logits and the divergence's own sums, the CE's target logit, a top-k teacher's ids and
tail bin; the JSD's second walk; ``(1 - a) D + a CE``; ``G`` per chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vocab_parallel.engine import memory_policy as memory
from vocab_parallel.engine.epilogue import Epilogue, Local, Scratch, add_at, chunk_mask, cut, pick
from vocab_parallel.engine.online import Online, weighted_sum

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


@dataclass(frozen=True)
class Spec:
    """What a distillation call computes besides the logits' options."""

    divergence: str = "forward_kl"
    beta: float = 0.5
    hard_label_weight: float = 0.0
    sparse: bool = False  # the teacher as top-k ids and log-probs
    has_target: bool = False

    @property
    def ce(self) -> bool:
        return self.hard_label_weight > 0.0


class Teacher(NamedTuple):
    """The teacher of the call's tokens: dense (``hidden [N, Ht]``, ``weight [V_local,
    Ht]``, ``bias``) or top-k (``ids [N, k]`` global, ``logprobs [N, k]``); no gradient."""

    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None


class Terms(NamedTuple):
    """Per token: divergence ``d``, cross entropy ``ce``, log-normalisers ``ls`` (student,
    tempered), ``lt`` (teacher), ``l1`` (student at T = 1, for the CE at T != 1), the
    gradient's constant ``coef`` (reverse KL ``lt - ls - d``; JSD ``K_s``; top-k ``log(r /
    (1 - P))``), the top-k teacher's ``q = exp(logprobs)``."""

    d: torch.Tensor
    ce: torch.Tensor | None
    ls: torch.Tensor
    lt: torch.Tensor | None
    l1: torch.Tensor | None
    coef: torch.Tensor | None
    q: torch.Tensor | None


class Divergence(Epilogue):
    """Distillation on this rank's shard: ``target`` ``[N]`` local target columns (-1
    elsewhere; None without the CE), ``ids`` the teacher's local top-k columns ``[N, k]``
    (-1 elsewhere), ``inv_t`` fp32 ``[N]`` or None, ``ignored`` ``[N]``, ``v`` the shard's
    columns, ``accum`` the statistics' dtype."""

    sums_name = "distillation sums"

    def __init__(self, spec: Spec, teacher: Teacher, target, ids, inv_t, ignored, v, accum):
        self.spec, self.teacher, self.target, self.ids = spec, teacher, target, ids
        self.inv_t, self.ignored, self.v = inv_t, ignored, v
        self.accum = accum
        self.heads, self.tmp = 1 if spec.sparse else 2, Scratch()

    fused = False  # set by local_of: this epilogue's kernels run (:meth:`_fusable`)

    def _fusable(self, chunks) -> bool:
        """Whether the backend's fused epilogue runs (the Triton backend's:
        ``docs/design.md``, "Distillation"): a dense teacher, no hard-label term, no
        softcap; over kept fp32 blocks of both heads (grad_in_forward's token chunk,
        high-performance mode) or both heads' column chunks (memory-saving mode)."""
        spec = self.spec
        return (
            chunks.backend.epilogues is not None
            and not spec.sparse
            and not spec.ce
            and chunks.logits.softcap is None
            and self.accum == torch.float32
            and chunks.rows > 0
            and chunks.v > 0
        )

    def _blocks(self, chunks):
        """The fused kernels' blocks: ``[(s, t)]`` of the kept blocks (each head's logits
        by one GEMM), else each column chunk's, both heads' fp32 blocks within the
        workspace's "logits" share (the kernels need no temporaries)."""
        if chunks.kept is not None:
            return [chunks.whole()]
        return (zs for _, _, zs in chunks.walk(self._fused_width(chunks)))

    def _fused_width(self, chunks) -> int:
        if chunks.kept is not None:
            return chunks.v
        x = chunks.heads[0][0]  # both heads' fp32 blocks, and grad_weight's fp32 rows
        return memory.columns(chunks.rows, chunks.v, x.device.type, "logits", h=x.shape[1],
                              blocks=2)  # fmt: skip

    def local_of(self, chunks) -> Local:
        self.fused = self._fusable(chunks)
        if not self.fused:
            return super().local_of(chunks)
        self.dtype = chunks.heads[0][0].dtype  # G's: the student's inputs
        self.kernels = chunks.backend.epilogues
        div, stu, tea = self.spec.divergence, [], []
        for s, t in self._blocks(chunks):
            m_s, s_s, a_s, m_t, s_t, a_t = self.kernels.divergence_stats(div, s, t, self.inv_t)
            stu.append(Online.of(m_s, s_s, *([a_s] if div == "reverse_kl" else [])))
            tea.append(Online.of(m_t, s_t, *([a_t] if div == "forward_kl" else [])))
        return Local([Online.merged(stu), Online.merged(tea)], [], None)

    def second_of(self, chunks, terms):
        if not (self.fused and self.spec.divergence == "jsd"):
            return super().second_of(chunks, terms)
        out = None
        for s, t in self._blocks(chunks):
            k = self.kernels.divergence_second(s, t, self.inv_t, terms.ls, terms.lt, self.spec.beta)
            out = k if out is None else out.add_(k)
        return out

    def gradient_width(self, chunks) -> int:
        return self._fused_width(chunks) if self.fused else chunks.width

    def operands(self, x, weight, bias):
        t = self.teacher
        return [(x, weight, bias)] + ([] if self.spec.sparse else [(t.hidden, t.weight, t.bias)])

    def rows(self, r0, r1):
        t = self.teacher
        teacher = Teacher(cut(t.hidden, r0, r1), t.weight, t.bias, *(cut(x, r0, r1) for x in t[3:]))
        rows = [cut(x, r0, r1) for x in (self.target, self.ids, self.inv_t, self.ignored)]
        return Divergence(self.spec, teacher, *rows, self.v, self.accum)

    def _tempered(self, y):
        return y if self.inv_t is None else y * self.inv_t[:, None]

    def local(self, chunks) -> Local:
        spec, div, n = self.spec, self.spec.divergence, self.ignored.shape[0]
        f = (self.accum, self.ignored.device)
        stu = Online(n, int(div == "reverse_kl" and not spec.sparse), *f)
        tea = None if spec.sparse else Online(n, int(div == "forward_kl"), *f)
        ce = Online(n, 0, *f) if spec.ce and self.inv_t is not None else None
        out = Online(n, 0, *f) if spec.sparse else None
        predicted = torch.zeros(n, dtype=f[0], device=f[1]) if spec.ce else None
        at_ids = torch.zeros(self.ids.shape, dtype=f[0], device=f[1]) if spec.sparse else None
        for v0, v1, zs in chunks:
            z, u = zs[0], self._tempered(zs[0])
            if spec.sparse:
                stu.add(u)
                at_ids += pick(u, self.ids, v0, v1)
                out.add(u.masked_fill(chunk_mask(self.ids, v0, v1), -math.inf))
            else:  # the KLs' sums of e^(y - m) times the log-ratio of their own side
                vt, tmp = self._tempered(zs[1]), self.tmp
                ratio = [torch.sub(u, vt, out=tmp(1, u))] if div == "reverse_kl" else []
                stu.add(u, *ratio, out=tmp(0, u))
                ratio = [torch.sub(vt, u, out=tmp(1, u))] if div == "forward_kl" else []
                tea.add(vt, *ratio, out=tmp(0, u))
            if spec.ce:
                predicted += pick(z, self.target, v0, v1)
                if ce is not None:
                    ce.add(z)
        count = (self.v - (self.ids >= 0).sum(dim=1)).to(self.accum) if spec.sparse else None
        online = [h for h in (stu, tea, ce, out) if h is not None]
        return Local(online, [r for r in (predicted, count) if r is not None], at_ids)

    def terms(self, maxima, sums) -> Terms:
        spec, it = self.spec, iter(sums)
        s_s = next(it)
        a_s = next(it) if spec.divergence == "reverse_kl" and not spec.sparse else None
        ls = maxima[0] + torch.log(s_s)
        lt = d = coef = q = l1 = ce = None
        if not spec.sparse:
            s_t = next(it)
            a_t = next(it) if spec.divergence == "forward_kl" else None
            lt = maxima[1] + torch.log(s_t)
            if spec.divergence == "forward_kl":
                d = a_t / s_t - lt + ls
            elif spec.divergence == "reverse_kl":
                d = a_s / s_s - ls + lt
                coef = lt - ls - d
        if spec.ce and self.inv_t is not None:
            l1 = maxima[1 + (not spec.sparse)] + torch.log(next(it))
        s_out = next(it) if spec.sparse else None
        if spec.ce:
            ce = (ls if l1 is None else l1) - next(it)
        if spec.sparse:
            has_outside = next(it) > 0
            k = self.ids.shape[1]
            at_ids = sums[sums.shape[0] - k :].t()
            log_s = torch.log(s_s)  # relative to the student's maximum (its own rounding)
            ls_ids = (at_ids - maxima[0][:, None]) - log_s[:, None]
            log_out = (maxima[-1] - maxima[0]) + (torch.log(s_out) - log_s)
            d, coef, q = _topk(self.teacher.logprobs, ls_ids, log_out, has_outside)
        return Terms(d, ce, ls, lt, l1, coef, q)

    def second(self, chunks, terms: Terms):
        if self.spec.divergence != "jsd":
            return None
        k = torch.zeros((2, self.ignored.shape[0]), dtype=terms.ls.dtype, device=terms.ls.device)
        lb, l1b = math.log(self.spec.beta), math.log1p(-self.spec.beta)
        for _, _, (z, t) in chunks:
            ls = self._tempered(z) - terms.ls[:, None]
            lt = self._tempered(t) - terms.lt[:, None]
            lm = torch.logaddexp(lt + lb, ls + l1b)
            for row, lp in ((0, lt), (1, ls)):
                k[row] += weighted_sum(torch.exp(lp), lp - lm)
        return k

    def after_second(self, terms: Terms, k) -> Terms:
        d = self.spec.beta * k[0] + (1.0 - self.spec.beta) * k[1]
        return terms._replace(d=d, coef=k[1])

    def losses(self, terms: Terms):
        a = self.spec.hard_label_weight
        return terms.d if a == 0.0 else (1.0 - a) * terms.d + a * terms.ce

    def gradient_into(self, terms: Terms, v0, v1, logits, grad, out):
        if self.fused:  # the kernel writes the kept G's columns
            return self._fused_gradient(terms, logits, grad, out)
        return self.gradient(terms, v0, v1, logits, grad)

    def _fused_gradient(self, terms: Terms, logits, grad, out=None):
        """``G`` of the chunk's columns (``logits``: both heads' blocks) by one kernel (no
        hard-label term, no cap), into ``out`` where given."""
        c = grad if self.inv_t is None else grad * self.inv_t
        beta = self.spec.beta if self.spec.divergence == "jsd" else 0.5
        return self.kernels.divergence_grad(
            self.spec.divergence, logits[0], logits[1], self.inv_t, terms.ls, terms.lt,
            terms.coef, c, beta, self.dtype, out=out,
        )  # fmt: skip

    def gradient(self, terms: Terms, v0, v1, logits, grad):
        """``G = (1 - a) g / T dD/du + a g (p1 - onehot)``: ``dD/du``
        forward KL ``p_s - p_t``; reverse KL ``p_s (u - v + coef)``; JSD ``(1 - beta) p_s
        (log p_s - log m - coef)``; top-k ``p_s - q`` at the ids, ``p_s - e^(log p_s +
        coef)`` off them; ``p1 = softmax(z)`` (``p_s`` without a temperature)."""
        if self.fused:  # the whole block: one kernel (no hard-label term, no cap)
            return self._fused_gradient(terms, logits, grad)
        spec, z = self.spec, logits[0]
        a, u = spec.hard_label_weight, self._tempered(z)
        c_d = (grad * (1.0 - a) if self.inv_t is None else grad * (1.0 - a) * self.inv_t)[:, None]
        c_ce = grad * a if spec.ce else None
        one_p = c_ce is not None and terms.l1 is None  # p1 = p_s
        if spec.divergence == "forward_kl" and not spec.sparse:  # in place, two blocks
            g = torch.sub(u, terms.ls[:, None], out=self.tmp(0, u)).exp_()
            pt = torch.sub(self._tempered(logits[1]), terms.lt[:, None], out=self.tmp(1, u)).exp_()
            if one_p:
                g.mul_(c_d + c_ce[:, None]).sub_(pt.mul_(c_d))
            else:
                g.sub_(pt).mul_(c_d)
        else:
            g = self._divergence(terms, u, logits, v0, v1).mul_(c_d)
            if one_p:
                g.add_(torch.sub(u, terms.ls[:, None]).exp_().mul_(c_ce[:, None]))
        if c_ce is not None and not one_p:
            g.add_(torch.sub(z, terms.l1[:, None]).exp_().mul_(c_ce[:, None]))
        if c_ce is not None:
            add_at(g, self.target, -c_ce, v0, v1)
        return g

    def _divergence(self, terms: Terms, u, logits, v0, v1):
        """``dD/du`` of the reverse KL, the JSD and the top-k teacher."""
        spec = self.spec
        ls = u - terms.ls[:, None]
        ps = torch.exp(ls)
        if spec.sparse:  # off the ids: e^(log p_s + coef) (p_s may underflow where 1 - P does)
            off = ls.add_(terms.coef[:, None]).exp_().masked_fill_(chunk_mask(self.ids, v0, v1), 0)
            return add_at(torch.sub(ps, off, out=off), self.ids, -terms.q, v0, v1)
        vt = self._tempered(logits[1])
        if spec.divergence == "reverse_kl":
            return ps * torch.where(ps > 0, (u - vt) + terms.coef[:, None], 0.0)
        lm = torch.logaddexp(
            vt - terms.lt[:, None] + math.log(spec.beta), ls + math.log1p(-spec.beta)
        )
        return (1.0 - spec.beta) * ps * torch.where(ps > 0, ls - lm - terms.coef[:, None], 0.0)


def _topk(lp, ls_ids, log_out, has_outside):
    """``(d, coef, q)`` of the forward KL against a top-k teacher: its log-probs ``lp``,
    the student's ``ls_ids`` at the ids and ``log_out`` of its mass off them
    (``docs/design.md``, "Distillation": the tail bin, ``coef = log(r / (1 - P))``)."""
    q = torch.exp(lp)
    d = (q * torch.where(q > 0, lp - ls_ids, 0.0)).sum(dim=1)
    r = (1.0 - torch.exp(lp.to(torch.float64)).sum(dim=1)).to(lp.dtype)
    tail = (r > 0) & has_outside
    p = torch.exp(ls_ids).sum(dim=1)
    log_out = torch.where(p <= 0.5, torch.log1p(-p.clamp(max=0.5)), log_out)
    log_r = torch.log(torch.where(tail, r, 1.0))
    d = d + torch.where(tail, r * (log_r - log_out), 0.0)
    # No student mass off the ids (-inf logits): the loss is inf, the gradient p_s - q.
    coef = torch.where(tail & (log_out > -math.inf), log_r - log_out, -math.inf)
    return d, coef, q
