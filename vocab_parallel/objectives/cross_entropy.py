"""The loss's math across ranks: per-token statistics, their all-reduces, the loss, G's terms.

Per rank, per token i (``docs/design.md``, "The forward statistics"), with this rank's
rows ``[start, start + V)``, temperature ``T_i`` and class weights ``w_j`` (1 without):

    logits        z_ij = cap(x_i @ W_j + b_j) / T_i
    local stats   m_i = max_j z_ij,  s_i = sum_j exp(z_ij - m_i),  p_i = z_i[t_i] (if here),
                  a_i = sum_j w_j z_ij (label smoothing only),  u_i = w[t_i] (if here)
    M_i           = allreduce_MAX(m_i)
    S, P, A, U, W = allreduce_SUM(s_i exp(m_i - M_i), p_i, a_i, u_i; sum_j w_j)  (one call)
    lse_i         = log(S_i) + M_i
    loss_i        = lse_i - (1 - eps) P_i - eps A_i / Vg + zl lse_i^2          (no weights)
    loss_i        = (1 - eps) U_i (lse_i - P_i) + eps / Vg (W lse_i - A_i) + zl lse_i^2

(0 for ignored tokens), which is ``F.cross_entropy(z, t, weight=w, label_smoothing=eps,
reduction="none") + zl * lse^2``. ``U_i`` (the target's class weight, 1 without) is what a
weighted mean divides by (``vocab_parallel.engine.reduction``). The gradient of ``loss_i`` with
respect to ``z_ij`` is, per unit upstream gradient,

    p_ij ((1 - eps) U_i + eps W / Vg + 2 zl lse_i) - (1 - eps) U_i [j == t_i] - eps/Vg w_j

(without weights the factor of ``p`` is ``1 + 2 zl lse_i``): the :class:`GradTerms` of
``vocab_parallel.backends.registry``, whose backends add the chain rule through the temperature and
the softcap.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from vocab_parallel.backends.interface import GradTerms, LocalStats
from vocab_parallel.backends.registry import get_backend
from vocab_parallel.engine.objective import Call
from vocab_parallel.parallel.collectives import all_reduce, world_size
from vocab_parallel.parallel.layout import ShardLayout


@dataclass(frozen=True, eq=False)
class RowStats:
    """Per-token results of the all-reduces (``[BT]``, fp32; float64 for float64 inputs),
    ignored tokens not yet masked. ``target_weight``: ``U`` (None without class weights);
    ``weight_sum``: ``W``, a 0-d tensor (None without class weights). ``shifted_sum``
    and ``exp2_sum``: the global ``sum_j exp(z_j - M) (z_j - M)`` and ``sum_j exp(2 (z_j -
    M))`` (``M`` = ``logits_max``), when the local statistics carry them (token
    statistics), else None. ``predicted``, ``logit_sum``: the global target logit and
    (class-weighted) logit sum the loss is made of. ``loss`` and ``lse`` are None until
    :func:`with_losses` makes them (``reduce_statistics(..., losses=False)``)."""

    loss: torch.Tensor | None
    lse: torch.Tensor | None
    logits_max: torch.Tensor
    sum_exp: torch.Tensor
    target_weight: torch.Tensor | None = None
    weight_sum: torch.Tensor | None = None
    shifted_sum: torch.Tensor | None = None
    exp2_sum: torch.Tensor | None = None
    predicted: torch.Tensor | None = None
    logit_sum: torch.Tensor | None = None


def local_targets(
    target: torch.Tensor, layout: ShardLayout, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local_target, ignored)``: each token's column in this rank's shard (int64, -1
    where its target is elsewhere or ignored) and whether it is ignored."""
    ignored = target == ignore_index
    return layout.columns(target).masked_fill(ignored, -1), ignored


def forward_stats(
    call: Call, hidden, weight, bias, local_target, logits_out=None, extra_stats=False
) -> LocalStats:
    """This rank's :class:`LocalStats` of ``hidden`` (the backend of ``call``)."""
    return get_backend(call.backend).forward_stats(
        hidden,
        weight,
        local_target,
        call.logits(bias),
        logits_out=logits_out,
        logit_sum=call.opts.label_smoothing > 0,
        class_weight=call.class_weight,
        extra_stats=extra_stats,
    )


def reduce_statistics(
    stats: LocalStats, local_target: torch.Tensor, call: Call, losses: bool = True
) -> RowStats:
    """:class:`RowStats` from this rank's statistics: the MAX and the SUM all-reduce of
    the group and (``losses``) the loss formula of the module docstring (else later, by
    :func:`with_losses`, e.g. once for every chunk's rows). ``local_target`` (of these
    rows) picks the target's class weight where it is here."""
    cw = call.class_weight
    m, s, p, a = stats[:4]
    group = call.process_group
    extras = [] if stats.shifted_sum is None else [stats.shifted_sum, stats.exp2_sum]
    picked = None
    if cw is not None:
        here = local_target >= 0
        picked = torch.where(here, cw.to(s.dtype)[local_target.clamp(min=0)], 0.0)
    if world_size(group) == 1:
        # Alone, this rank's statistics are the group's: moved to their own max they are
        # unchanged (e^0 = 1; a shard of no columns has zero sums), so no pass moves them.
        logits_max, sum_exp, predicted, logit_sum = m, s, p, a
        target_weight = picked
        weight_sum = None if cw is None else cw.to(s.dtype).sum()
    else:
        logits_max = all_reduce(m.clone(), "MAX", group, "logits_max")
        # a row of -inf only (no columns anywhere) shifts by 0: e^(-inf) = 0, never NaN
        shift = torch.nan_to_num(logits_max, nan=float("nan"), posinf=float("inf"), neginf=0.0)
        extras = stats.rescaled_extras(shift)  # ride along in the one SUM all-reduce
        rows = [s * torch.exp(m - shift), p, a, *extras]
        if cw is not None:
            rows.append(picked)
        sums = torch.stack(rows)
        if cw is not None:  # the global sum of the class weights rides along: one more column
            total = cw.to(s.dtype).sum().expand(sums.shape[0], 1)
            sums = torch.cat([sums, total], dim=1)
        all_reduce(sums, "SUM", group, "sum_exp_logits and predicted logits")
        weight_sum = None
        if cw is not None:
            weight_sum, sums = sums[0, -1], sums[:, :-1]
        sum_exp, predicted, logit_sum = sums[0], sums[1], sums[2]
        target_weight = sums[3 + len(extras)] if cw is not None else None
        extras = list(sums[3 : 3 + len(extras)])
    shifted_sum, exp2_sum = extras if extras else (None, None)
    token = RowStats(
        None, None, logits_max, sum_exp, target_weight, weight_sum, shifted_sum, exp2_sum,
        predicted, logit_sum,
    )  # fmt: skip
    return with_losses(token, call) if losses else token


def with_losses(token: RowStats, call: Call) -> RowStats:
    """``token`` with its log-normalisers ``lse`` and losses (the module docstring's
    formula; elementwise, so the same for any cut of the rows)."""
    opts, cw = call.opts, call.class_weight
    eps, vg = opts.label_smoothing, call.layout.global_size
    logits_max, predicted, logit_sum = token.logits_max, token.predicted, token.logit_sum
    target_weight, weight_sum = token.target_weight, token.weight_sum
    lse = torch.log(token.sum_exp) + logits_max
    if cw is None:
        loss = lse - predicted if not eps else lse - (1.0 - eps) * predicted
        if eps:
            loss = loss - eps * logit_sum / vg
    else:
        loss = (1.0 - eps) * target_weight * (lse - predicted)
        if eps:
            loss = loss + (eps / vg) * (weight_sum * lse - logit_sum)
    if opts.z_loss:
        loss = loss + opts.z_loss * lse.square()
    return replace(token, loss=loss, lse=lse)


def grad_terms(call: Call, lse: torch.Tensor, target_weight, weight_sum):
    """``(prob_scale, on_target, smooth)`` of ``G`` for these tokens per unit upstream
    gradient (module docstring); None / floats where a term is the same for all."""
    opts = call.opts
    eps, vg = opts.label_smoothing, call.layout.global_size
    prob_scale = None
    if target_weight is None:
        on_target = 1.0 - eps
        if opts.z_loss:
            prob_scale = 1.0 + (2.0 * opts.z_loss) * lse
    else:
        on_target = (1.0 - eps) * target_weight
        prob_scale = on_target + eps * weight_sum / vg
        if opts.z_loss:
            prob_scale = prob_scale + (2.0 * opts.z_loss) * lse
    return prob_scale, on_target, eps / vg


def gradient_terms(call: Call, grad, token: RowStats, **source) -> GradTerms:
    """:class:`GradTerms` of these tokens: the upstream ``grad`` (``[BT]`` or ``[1]``),
    ``token``'s statistics, and ``source`` (``softmax=``, ``logits=``, ``reuse_logits=``)."""
    prob_scale, on_target, smooth = grad_terms(
        call, token.lse, token.target_weight, token.weight_sum
    )
    return GradTerms(
        grad=grad,
        on_target=on_target,
        smooth=smooth,
        prob_scale=prob_scale,
        class_weight=call.class_weight if smooth else None,
        logits_max=token.logits_max,
        sum_exp=token.sum_exp,
        **source,
    )
