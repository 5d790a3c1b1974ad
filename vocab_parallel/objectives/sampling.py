"""The statistics of the distribution a rollout engine samples from (top-k, top-p, min-p),
over the global vocabulary, without logits: an epilogue of the engine.

vLLM's V1 sampler applies the temperature, then min-p, then top-k, then top-p. Each step
keeps an upper set of the tempered logits ``u``, so the kept set of a token is ``K = {j :
u_j >= T}`` for one threshold ``T`` per token (``docs/design.md``, "Sampling replay"):

    min-p    t1 = M + log(min_p)                 (p_j >= min_p max p  <=>  u_j >= t1)
    top-k    t2 = the k-th largest u (ties at it all kept; k beyond the kept: all)
    top-p    T  = the smallest u_j >= max(t1, t2) whose kept mass strictly above it
                  (u > u_j) is below top_p of the kept mass (so at least one stays)

``T`` comes from candidates: every rank's ``C`` largest ``u`` and its ``C``-th (the bound
below which its list may miss columns), one all-gather of ``[N, C + 1]``; above the largest
bound ``b`` the union is complete, so a threshold found there is exact. A token whose
threshold falls at or below ``b`` is decided exactly by a radix select over the bits of
``u`` (:func:`radix_select`: one walk of those tokens and one SUM of ``[n, 256]`` per
byte). The sums of ``e^(u - M)`` and ``e^(u - M) (u - M)`` over ``K`` (and over the set top-p
renormalises on) come from the candidates where the set lies above the bound, else from
one walk of those tokens (one SUM): log-probs, entropy and ``log`` of the kept mass follow.
``G`` is that of the truncated distribution with ``K`` held fixed.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from vocab_parallel.engine.entry import token_tensor
from vocab_parallel.engine.epilogue import Epilogue, Local, add_at, cut, pick
from vocab_parallel.engine.online import Online
from vocab_parallel.parallel.collectives import all_gather, all_reduce

# Candidates per rank and token at most (a larger top-k, or a top-p set reaching below
# every rank's candidates, takes the radix select).
MAX_CANDIDATES = 1024
MIN_CANDIDATES = 64
# With top-p on: a nucleus of up to this many columns per rank needs no radix select
# (whose walks cost a GEMM each where the logits are not kept).
TOP_P_CANDIDATES = 512


class Terms(NamedTuple):
    """Per token: the max ``m`` and ``log S`` of all of ``u``, the threshold, ``log S_K``,
    the entropy over ``K``, whether the target is kept, and the outputs."""

    m: torch.Tensor
    log_s: torch.Tensor
    threshold: torch.Tensor
    log_sk: torch.Tensor
    entropy: torch.Tensor
    kept: torch.Tensor
    outputs: torch.Tensor  # [N, 3]: log-probs, entropy, kept log-mass


class Truncated(Epilogue):
    """Token statistics under the sampler's truncation on this rank's shard. Per token
    (``[N]``): ``target`` local columns (-1 elsewhere), ``ignored``, ``inv_t`` (fp32 or
    None), ``top_k`` (int64, <= 0 off), ``top_p`` (1 off), ``min_p`` (0 off); ``group``
    the tensor-parallel group; ``v`` this shard's columns; ``entropy`` whether it is
    asked for."""

    sums_name = "sampling sums"

    def __init__(self, target, ignored, inv_t, top_k, top_p, min_p, group, v, accum):
        self.target, self.ignored, self.inv_t = target, ignored, inv_t
        self.top_k, self.top_p, self.min_p = top_k, top_p, min_p
        self.group, self.v, self.accum = group, v, accum
        k_max = int(top_k.max()) if top_k.numel() else 0
        top_p_on = bool((top_p < 1.0).any()) if top_p.numel() else False
        least = max(MIN_CANDIDATES, TOP_P_CANDIDATES if top_p_on else 0)
        # The same on every rank (the parameters agree): a fixed width for the all-gather.
        self.c = min(MAX_CANDIDATES, max(least, k_max))
        self.candidates = None

    def operands(self, x, weight, bias):
        return [(x, weight, bias)]

    def rows(self, r0, r1):
        args = [cut(t, r0, r1) for t in (self.target, self.ignored, self.inv_t, self.top_k)]
        args += [cut(t, r0, r1) for t in (self.top_p, self.min_p)]
        return Truncated(*args, self.group, self.v, self.accum)

    def _u(self, z):
        return z if self.inv_t is None else z * self.inv_t[:, None]

    def local(self, chunks) -> Local:
        n = self.ignored.shape[0]
        online = Online(n, 0, self.accum, self.ignored.device)
        predicted = torch.zeros(n, dtype=self.accum, device=self.ignored.device)
        best = torch.full((n, 0), -math.inf, dtype=self.accum, device=self.ignored.device)
        for v0, v1, (z,) in chunks:
            u = self._u(z)
            online.add(u)
            predicted += pick(u, self.target, v0, v1)
            best = torch.cat([best, u], dim=1).topk(min(self.c, best.shape[1] + u.shape[1]), 1)[0]
        pad = self.c - best.shape[1]
        if pad > 0:
            best = torch.cat([best, best.new_full((n, pad), -math.inf)], dim=1)
        # The bound: below the C-th value this rank's list may miss columns.
        bound = best[:, -1] if self.v > self.c else best.new_full((n,), -math.inf)
        self.candidates = torch.cat([best, bound[:, None]], dim=1)
        return Local([online], [predicted])

    def terms(self, maxima, sums):
        m = maxima[0]
        return m, torch.log(sums[0]), sums[1]

    def refine(self, chunks, terms) -> Terms:
        """The thresholds (candidates, then the radix select where they cannot decide),
        and the sums over ``K`` (from the candidates where ``K`` lies above every rank's
        bound, else one walk of those rows)."""
        m, log_s, u_target = terms
        gathered = all_gather(self.candidates, self.group, "sampling candidates")
        values = gathered[:, :, :-1].permute(1, 0, 2).reshape(m.shape[0], -1)
        bound = gathered[:, :, -1].amax(dim=0)
        ordered = values.sort(dim=1, descending=True).values
        threshold = self._threshold(chunks, ordered, bound, m, log_s)
        s_k, e_k = self._sums(chunks, ordered, bound, threshold, m)
        log_sk = torch.log(s_k)
        entropy = log_sk - e_k / s_k
        kept = (u_target >= threshold) & ~self.ignored
        logprobs = torch.where(kept, u_target - m - log_sk, -math.inf)
        out = torch.stack([logprobs, entropy, log_sk - log_s], dim=1)
        out = out.masked_fill(self.ignored[:, None], 0.0)
        return Terms(m, log_s, threshold, log_sk, entropy, kept, out)

    def _threshold(self, chunks, ordered, bound, m, log_s):
        """``T`` per token (the module docstring)."""
        lowest = torch.full_like(m, -math.inf)
        t1 = torch.where(self.min_p > 0, m + torch.log(self.min_p.clamp_min(1e-45)), lowest)
        t12, open_k = _top_k(ordered, bound, self.top_k, t1)
        if bool(open_k.any()):
            rows = open_k.nonzero()[:, 0]
            k = self.top_k[rows].to(torch.float64)
            t12[rows] = torch.maximum(t1[rows], self._radix(chunks, rows, m, k, None))
        on_p = self.top_p < 1.0
        if not bool(on_p.any()):
            return t12
        s_k2, _ = self._sums(chunks, ordered, bound, t12, m, whole=torch.exp(log_s))
        t, open_p = _top_p(ordered, bound, self.top_p * s_k2, t12, m)
        t = torch.where(on_p, t, t12)
        open_p &= on_p
        if bool(open_p.any()):
            rows = open_p.nonzero()[:, 0]
            target = (self.top_p * s_k2)[rows].to(torch.float64)
            found = self._radix(chunks, rows, m, target, t12[rows])
            t[rows] = torch.maximum(t12[rows], found)
        return t

    def _sums(self, chunks, ordered, bound, threshold, m, whole=None):
        """``sum e^(u - M)`` and ``sum e^(u - M) (u - M)`` over ``u >= threshold``: from
        the candidates where the threshold is above every rank's bound (all those ``u``
        are among them), ``whole`` (the full sum, when given) where it is ``-inf``, else
        one walk of those rows and one SUM (the same rows on every rank)."""
        d = ordered - m[:, None]
        e = torch.where(ordered >= threshold[:, None], torch.exp(d), 0.0)
        sums = torch.stack([e.sum(dim=1), torch.where(e > 0, e * d, 0.0).sum(dim=1)])
        walk = threshold <= bound
        if whole is not None:
            everything = threshold == -math.inf
            sums[0] = torch.where(everything, whole, sums[0])
            walk &= ~everything
        if bool(walk.any()):
            rows = walk.nonzero()[:, 0]
            part = torch.zeros((2, rows.shape[0]), dtype=self.accum, device=m.device)
            mr, tr = m[rows], threshold[rows]
            for _, _, u in self._rows_walk(chunks, rows):
                du = u - mr[:, None]
                eu = torch.exp(du).masked_fill_(du < (tr - mr)[:, None], 0.0)
                part[0] += eu.sum(dim=1)
                part[1] += torch.where(eu > 0, eu * du, 0.0).sum(dim=1)
            sums[:, rows] = all_reduce(part, "SUM", self.group, self.sums_name)
        return sums[0], sums[1]

    def _rows_walk(self, chunks, rows):
        """``(v0, v1, u)`` of the tokens ``rows`` alone (their own products, or their rows of
        kept logits)."""
        inv_t = None if self.inv_t is None else self.inv_t[rows, None]
        for v0, v1, (z,) in chunks.walk_rows(rows):
            yield v0, v1, z if inv_t is None else z * inv_t

    def _radix(self, chunks, rows, m, target, floor):
        """The exact threshold of the tokens ``rows``: top-k (``floor`` None) the largest
        ``u`` with ``count(u' >= u) >= target``; top-p the smallest ``u >= floor`` with
        ``mass(u' > u, u' >= floor) < target``."""
        walk = lambda: self._rows_walk(chunks, rows)  # noqa: E731
        return radix_select(walk, m[rows], target, floor, self.group, self.accum)

    def losses(self, terms: Terms):
        return terms.outputs

    def gradient(self, terms: Terms, v0, v1, logits, grad):
        """``G`` of ``a logprob + b entropy`` over ``K`` (``grad``: ``[N, 3]``, its third
        column ignored): ``a ([j = t] - q_j) - b q_j (log q_j + H)``, times ``1 / T``;
        a token whose target is not kept takes no gradient of its log-prob."""
        u = self._u(logits[0])
        a = torch.where(terms.kept, grad[:, 0], 0.0)
        b = grad[:, 1]
        log_q = u - (terms.m + terms.log_sk)[:, None]
        q = torch.exp(log_q).masked_fill_(u < terms.threshold[:, None], 0.0)
        g = q * (-(a[:, None]) - b[:, None] * (log_q + terms.entropy[:, None]))
        g = torch.where(q > 0, g, 0.0)
        add_at(g, self.target, a, v0, v1)
        return g if self.inv_t is None else g.mul_(self.inv_t[:, None])


def _top_k(ordered, bound, k, t1):
    """``(max(t1, k-th largest), open)``: from the sorted candidates where they decide."""
    n, width = ordered.shape
    on = k > 0
    idx = (k - 1).clamp(0, width - 1)
    kth = ordered.gather(1, idx[:, None])[:, 0]
    n_above = (ordered > bound[:, None]).sum(dim=1)
    n_at = (ordered >= bound[:, None]).sum(dim=1)
    lowest = torch.full_like(kth, -math.inf)
    # Exact from the candidates where the k-th lies above the bound, or at it; where the
    # min-p threshold is above the bound and keeps fewer than k, every kept one stays.
    kth = torch.where(k <= n_above, kth, torch.where(k <= n_at, bound, lowest))
    decided = (k <= n_at) | (t1 > bound) | ~on
    kth = torch.where(on & decided, kth, lowest)
    return torch.maximum(t1, kth), on & ~decided


def _top_p(ordered, bound, target, floor, m):
    """``(T, open)`` of top-p from the sorted candidates: ``T`` the smallest candidate
    ``>= floor`` whose mass strictly above it (among ``>= floor``) is below ``target``;
    decided where a candidate above the bound breaks the condition, or where everything
    kept is above the bound."""
    valid = ordered >= floor[:, None]
    mass = torch.where(valid, torch.exp(ordered - m[:, None]), 0.0)
    ascending = ordered.flip(1)
    prefix = torch.cat([mass.new_zeros(mass.shape[0], 1), mass.flip(1).cumsum(1)], dim=1)
    total = prefix[:, -1:]
    # Mass strictly above each candidate: everything minus the mass of values <= it.
    at_or_below = prefix.gather(1, torch.searchsorted(ascending, ordered, right=True))
    above = total - at_or_below
    keep = valid & (above < target[:, None])
    t = torch.where(keep, ordered, math.inf).amin(dim=1)
    breaks = (valid & ~keep & (ordered >= bound[:, None])).any(dim=1)
    return t, ~(breaks | (floor > bound))


def _ordered(u: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(keys, width)``: int64 keys in the order of the floats ``u`` read as unsigned
    ``width``-bit integers (fp32: 32, in ``[0, 2^32)``; float64: 64, the bit pattern of
    the unsigned key in an int64), so that their bytes from the top sort like ``u``."""
    width = 32 if u.dtype == torch.float32 else 64
    bits = u.view(torch.int32 if width == 32 else torch.int64).to(torch.int64)
    mask = (1 << (width - 1)) - 1
    keys = torch.where(bits < 0, bits ^ mask, bits)  # signed keys in the floats' order
    if width == 32:
        return (keys + (1 << 31)) & 0xFFFFFFFF, 32
    return keys ^ -(1 << 63), 64  # the sign bit flipped: the unsigned order


def _from_ordered(keys: torch.Tensor, width: int) -> torch.Tensor:
    """The floats of :func:`_ordered`'s keys."""
    if width == 32:
        signed = keys - (1 << 31)
        bits = torch.where(signed < 0, signed ^ ((1 << 31) - 1), signed)
        return bits.to(torch.int32).view(torch.float32)
    signed = keys ^ -(1 << 63)
    bits = torch.where(signed < 0, signed ^ ((1 << 63) - 1), signed)
    return bits.view(torch.float64)


def _histogram(walk, n, level, width, prefix, m, floor, device):
    """This rank's ``[n, 256]`` histogram of the next byte (counts, or masses ``e^(u -
    m)`` of ``u >= floor``) among each row's keys that start with ``prefix``."""
    hist = torch.zeros((n, 256), dtype=torch.float64, device=device)
    top = width - 8 * level  # the bits known: above this one
    for _, _, u in walk():
        keys, _ = _ordered(u)
        byte = (keys >> (top - 8)) & 255
        same = (keys >> top) == (prefix >> top)[:, None] if level else None
        if floor is None:
            w = torch.ones_like(u, dtype=torch.float64)
        else:
            w = torch.where(u >= floor[:, None], torch.exp(u - m[:, None]), 0.0)
            w = w.to(torch.float64)
        if same is not None:
            w = w.masked_fill_(~same, 0.0)
        hist.scatter_add_(1, byte, w)
    return hist


def radix_select(walk, m, target, floor, group, dtype) -> torch.Tensor:
    """The exact threshold of each row, one byte of the float's bits per walk (4 for
    fp32, 8 for float64), each walk's ``[n, 256]`` histogram summed over the group.

    ``walk()`` yields ``(v0, v1, u)`` of these rows (``dtype``). Top-k (``floor``
    None): the largest ``u`` with ``count(u' >= u) >= target``. Top-p: the smallest ``u
    >= floor`` with ``sum e^(u' - m) [u' > u, u' >= floor] < target``. A row without
    such a value gets ``-inf`` (top-k: fewer values than ``target``) or ``+inf``."""
    n, device = m.shape[0], m.device
    width = 32 if dtype == torch.float32 else 64
    prefix = torch.zeros(n, dtype=torch.int64, device=device)  # the bytes found so far
    above = torch.zeros(n, dtype=torch.float64, device=device)  # count or mass above them
    found = torch.ones(n, dtype=torch.bool, device=device)
    buckets = torch.arange(256, device=device)
    for level in range(width // 8):
        hist = _histogram(walk, n, level, width, prefix, m, floor, device)
        hist = all_reduce(hist, "SUM", group, "sampling histogram")
        strictly = hist.flip(1).cumsum(1).flip(1) - hist  # in the buckets above each
        if floor is None:  # the highest bucket where the count reaches the target
            ok = above[:, None] + strictly + hist >= target[:, None]
            j = torch.where(ok, buckets, -1).amax(dim=1)
        else:  # the lowest non-empty bucket whose mass strictly above is below it
            ok = (hist > 0) & (above[:, None] + strictly < target[:, None])
            j = torch.where(ok, buckets, 256).amin(dim=1)
        found &= (j >= 0) & (j < 256)
        j = j.clamp(0, 255)
        above += strictly.gather(1, j[:, None])[:, 0]
        shift = width - 8 * (level + 1)
        if width == 64 and level == 0:  # the top byte of an int64: signed
            j = torch.where(j >= 128, j - 256, j)
        prefix = prefix + j * (1 << shift)
    t = _from_ordered(prefix, width)
    missing = torch.full_like(t, -math.inf if floor is None else math.inf)
    return torch.where(found, t, missing)


# ---------------------------------------------------------------------------------------
# The request: sample_top_k, sample_top_p, sample_min_p
# ---------------------------------------------------------------------------------------

PARAMETERS = ("sample_top_k", "sample_top_p", "sample_min_p")
_OFF = {"sample_top_k": 0, "sample_top_p": 1.0, "sample_min_p": 0.0}


def check_sampling(values: dict, hidden, sequence_parallel: bool) -> dict | None:
    """The sampler's parameters by name (each None, a number or a per-token tensor),
    checked (``TypeError`` / ``ValueError`` naming the parameter); None when none
    truncates. Numbers are checked here, tensors' shapes and devices here and their
    values once gathered (:func:`check_values`)."""
    out, on = {}, False
    for name in PARAMETERS:
        v = values.get(name)
        if v is None:
            out[name] = _OFF[name]
            continue
        if isinstance(v, torch.Tensor):
            kind = "integer" if name == "sample_top_k" else "floating"
            out[name], on = token_tensor(name, v, hidden, sequence_parallel, kind), True
            continue
        out[name] = _number(name, v)
        on |= out[name] != _OFF[name] and not (name == "sample_top_k" and out[name] <= 0)
    return out if on else None


def _number(name: str, v) -> float | int:
    integer = name == "sample_top_k"
    if isinstance(v, bool) or not isinstance(v, int if integer else int | float):
        what = "an int (<= 0: off)" if integer else "a float"
        raise TypeError(f"{name}: expected None, {what} or a tensor, got {type(v).__name__}")
    if integer:
        return int(v)
    ok = 0.0 < v <= 1.0 if name == "sample_top_p" else 0.0 <= v <= 1.0
    if not ok:  # (NaN is not ok either)
        bounds = "0 < sample_top_p <= 1" if name == "sample_top_p" else "0 <= sample_min_p <= 1"
        raise ValueError(f"{name}: expected {bounds}, got {v}")
    return float(v)


def check_values(name: str, t: torch.Tensor) -> None:
    """A per-token parameter's values (the same tensor on every rank: the same error)."""
    if name == "sample_top_p":
        bad = ~((t > 0) & (t <= 1))
    elif name == "sample_min_p":
        bad = ~((t >= 0) & (t <= 1))
    else:
        return
    if bool(bad.any()):
        where = int(bad.nonzero()[0, 0])
        bounds = "(0, 1]" if name == "sample_top_p" else "[0, 1]"
        raise ValueError(f"{name}: expected values in {bounds}, got {float(t[where])} at {where}")
