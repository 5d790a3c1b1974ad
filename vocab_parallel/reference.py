"""Float64 references: the formulas of docs/design.md written as plainly as possible.

Tests and benchmarks compare every backend against these. They materialise ``[BT, V]``
on purpose; they are for checking, not for training.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    class_weight: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss with every option, in plain torch ops: ``(loss, lse)``.

    ``z = softcap * tanh(F.linear(hidden, weight, bias) / softcap) / temperature`` (no cap
    without ``softcap``; ``temperature`` a float or shaped like ``target``);
    ``loss_i = F.cross_entropy(z_i, target_i, weight=class_weight) + z_loss *
    logsumexp(z_i)^2`` for non-ignored tokens, 0 for ignored ones; ``"mean"`` divides by
    the targets' class weights summed over non-ignored tokens (their count without class
    weights; 0 when all are ignored, where torch gives NaN). ``lse`` is ``logsumexp(z)``
    (0 where ignored), detached. Computed in the tensors' dtype: pass float64 leaves
    (requiring grad) to read the reference gradients with ``backward``.
    """
    z = F.linear(hidden, weight, bias)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if isinstance(temperature, torch.Tensor):
        z = z / temperature.to(z.dtype)[..., None]
    elif temperature != 1.0:
        z = z / temperature
    z2 = z.reshape(-1, z.shape[-1])
    t = target.reshape(-1)
    valid = t != ignore_index
    cw = None if class_weight is None else class_weight.to(z2.dtype)
    per = F.cross_entropy(
        z2, t, weight=cw, ignore_index=ignore_index, label_smoothing=label_smoothing,
        reduction="none",
    )  # fmt: skip
    lse = torch.logsumexp(z2, dim=-1)
    if z_loss:
        per = per + z_loss * torch.where(valid, lse.square(), 0.0)
    lse = torch.where(valid, lse, 0.0).detach().reshape(target.shape)
    if reduction == "none":
        return per.reshape(target.shape), lse
    if reduction == "sum":
        return per.sum(), lse
    if cw is None:
        return per.sum() / valid.sum().clamp(min=1), lse
    total = cw[t.clamp(min=0)].masked_fill(~valid, 0.0).sum()
    return per.sum() / torch.where(total != 0, total, torch.ones_like(total)), lse


def loss_grad_reference(
    grad: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    not_here: torch.Tensor,
    masked_target: torch.Tensor,
    label_smoothing: float = 0.0,
    logits_max: torch.Tensor | None = None,
    sum_exp_logits: torch.Tensor | None = None,
    softmax: torch.Tensor | None = None,
    global_vocab_size: int | None = None,
    *,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    logits: torch.Tensor | None = None,
    z_loss: float = 0.0,
    lse: torch.Tensor | None = None,
    return_bias_grad: bool = False,
) -> tuple[torch.Tensor, ...]:
    """The backward operator in float64; ``not_here`` is the unpacked bool mask.

    ``G`` is rounded to ``input.dtype`` before the two products, as the contract says, so
    the only differences left to a backend are its fp32 accumulation order. The options
    are the operator's (``vocab_parallel.ops``): ``r = x @ W.T + bias``, ``z = c *
    tanh(r / c)``; the softmax from ``softmax``, the saved ``logits`` (z) or ``z``; times
    ``1 + 2 z_loss lse``; ``G`` times ``1 - tanh(r / c)^2``; ``grad_bias = G.sum(0)``.
    """
    f64 = torch.float64
    x, w = input.to(f64), weight.to(f64)
    bt, v = x.shape[0], w.shape[0]
    vg = v if global_vocab_size is None else global_vocab_size
    r = x @ w.T
    if bias is not None:
        r = r + bias.to(f64)
    z = r if softcap is None else softcap * torch.tanh(r / softcap)
    if softmax is not None:
        g = softmax.to(f64).clone()
    else:
        source = z if logits is None else logits.to(f64)
        g = torch.exp(source - logits_max.to(f64)[:, None]) / sum_exp_logits.to(f64)[:, None]
    if z_loss:
        if lse is None:
            lse = torch.log(sum_exp_logits.to(f64)) + logits_max.to(f64)
        g = g * (1.0 + 2.0 * z_loss * lse.to(f64))[:, None]
    if v > 0:
        g -= label_smoothing / vg
        t = masked_target.long().clamp(0, v - 1)
        rows = torch.arange(bt)
        g[rows, t] -= (1.0 - label_smoothing) * (~not_here).to(f64)
    g = g * grad.to(f64).reshape(-1, 1)
    if softcap is not None:
        tanh = torch.tanh(r / softcap) if logits is None else logits.to(f64) / softcap
        g = g * (1.0 - tanh.square())
    g = g.to(input.dtype).to(f64)
    out = (g @ w).to(input.dtype), (g.T @ x).to(input.dtype)
    if return_bias_grad:
        out += (g.sum(0).to(input.dtype if bias is None else bias.dtype),)
    return out


def global_statistics(input: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(logits_max, sum_exp_logits, softmax)`` of ``input @ weight.T`` in float64."""
    logits = input.double() @ weight.double().T
    lmax = logits.max(dim=1).values
    e = torch.exp(logits - lmax[:, None])
    s = e.sum(dim=1)
    return lmax, s, e / s[:, None]


def naive_loss_grad(grad, x, w, not_here, target, lmax, sumexp, softmax):
    """The operator written naively, the baseline of the demo and the benchmark: full
    ``[BT, V]`` logits, softmax, a materialised one-hot, two matmuls (no label smoothing).

    On CPU the products run in fp32 (bf16/fp16 GEMMs are far slower on most CPUs); on
    CUDA in the input dtype. ``G`` is rounded to the input dtype as the contract says.
    """
    cdt = torch.float32 if x.device.type == "cpu" else x.dtype
    xc, wc = x.to(cdt), w.to(cdt)
    if softmax is None:
        logits = (xc @ wc.T).float()
        probs = torch.exp(logits - lmax[:, None]) / sumexp[:, None]
    else:
        probs = softmax
    here = (~not_here).float()[:, None]
    onehot = torch.zeros_like(probs).scatter_(1, target.long()[:, None], here)
    g = ((probs - onehot) * grad[:, None]).to(x.dtype).to(cdt)
    return (g @ wc).to(x.dtype), (g.T @ xc).to(x.dtype)


def scaled_logits_reference(hidden, weight, bias=None, softcap=None, temperature=1.0):
    """``softcap(hidden @ W.T + b) / T`` in float64 (``T`` a float or one per row)."""
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if isinstance(temperature, torch.Tensor):
        return z / temperature.double().reshape(z.shape[:-1])[..., None]
    return z / temperature


def token_stats_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    top_k: int = 0,
) -> dict[str, torch.Tensor]:
    """The token statistics on materialised float64 logits ``z = softcap(hidden @ W.T +
    b) / T`` (``weight``: the full ``[V, H]``), as differentiable functions of the inputs:
    ``logprobs``, ``entropy``, ``sum_p_squared``, ``topk_logprobs``/``topk_ids`` (ties to
    the lower id: a stable sort) and ``argmax``; 0 (ids -1) where ``target`` is ignored."""
    z = scaled_logits_reference(hidden, weight, bias, softcap, temperature)
    ignored = target == ignore_index
    lp = torch.log_softmax(z, dim=-1)
    p = lp.exp()
    picked = lp.gather(-1, target.clamp(min=0)[..., None]).squeeze(-1)
    order = z.detach().sort(dim=-1, descending=True, stable=True).indices
    out = {
        "logprobs": picked.masked_fill(ignored, 0.0),
        "entropy": -(p * lp).sum(-1).masked_fill(ignored, 0.0),
        "sum_p_squared": (p * p).sum(-1).masked_fill(ignored, 0.0),
        "argmax": order[..., 0].masked_fill(ignored, -1),
    }
    if top_k:
        ids = order[..., :top_k]
        out["topk_logprobs"] = lp.gather(-1, ids).masked_fill(ignored[..., None], 0.0)
        out["topk_ids"] = ids.masked_fill(ignored[..., None], -1)
    return out


def distillation_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    teacher_topk_ids: torch.Tensor | None = None,
    teacher_topk_logprobs: torch.Tensor | None = None,
    target: torch.Tensor | None = None,
    divergence: str = "forward_kl",
    beta: float = 0.5,
    temperature: float | torch.Tensor = 1.0,
    hard_label_weight: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The distillation loss on materialised logits, as its formulas read
    (``docs/design.md``, "Distillation"): ``F.kl_div`` for the dense KLs, the mixture
    for the JSD, the k bins and the tail bin for a top-k teacher; ``(1 - a) D + a CE``
    per token (CE of the untempered student logits), 0 where ignored, the mean over the
    others. Computed in the tensors' dtype (pass float64 leaves)."""

    def capped(x, w, b):
        z = F.linear(x, w, b)
        return z if softcap is None else softcap * torch.tanh(z / softcap)

    z = capped(hidden, weight, bias)
    z = z.reshape(-1, z.shape[-1])
    temp = temperature
    if isinstance(temp, torch.Tensor):
        temp = temp.reshape(-1, 1).to(z.dtype)
    ls = torch.log_softmax(z / temp, dim=-1)
    if teacher_topk_ids is None:
        zt = capped(teacher_hidden.to(z.dtype), teacher_weight.to(z.dtype),
                    None if teacher_bias is None else teacher_bias.to(z.dtype))  # fmt: skip
        lt = torch.log_softmax(zt.reshape(-1, zt.shape[-1]) / temp, dim=-1)
        if divergence == "forward_kl":
            d = F.kl_div(ls, lt, reduction="none", log_target=True).sum(-1)
        elif divergence == "reverse_kl":
            d = F.kl_div(lt, ls, reduction="none", log_target=True).sum(-1)
        else:
            lm = torch.logsumexp(torch.stack([lt + math.log(beta), ls + math.log1p(-beta)]), dim=0)
            d = beta * F.kl_div(lm, lt, reduction="none", log_target=True).sum(-1) + (
                1 - beta
            ) * F.kl_div(lm, ls, reduction="none", log_target=True).sum(-1)
    else:
        ids = teacher_topk_ids.reshape(-1, teacher_topk_ids.shape[-1])
        lp = teacher_topk_logprobs.reshape(ids.shape).to(z.dtype)
        q = lp.exp()
        ls_ids = ls.gather(1, ids)
        d = torch.where(q > 0, q * (lp - ls_ids), 0.0).sum(-1)
        r = (1 - q.sum(-1)).clamp(min=0)
        # log(1 - P), the student's mass off the ids, as a log-sum-exp over those columns
        # (1 - P cancels even in float64); no tail bin where there are none (k = V).
        off = torch.ones_like(ls, dtype=torch.bool).scatter_(1, ids, False)
        some = off.any(-1)
        tail = torch.logsumexp(ls.masked_fill(~off, -math.inf).masked_fill(~some[:, None], 0.0), -1)
        live = (r > 0) & some
        d = d + torch.where(live, r * (torch.log(torch.where(live, r, 1.0)) - tail), 0.0)
    loss = d
    if hard_label_weight:
        ce = F.cross_entropy(z, target.reshape(-1), ignore_index=ignore_index, reduction="none")
        loss = (1 - hard_label_weight) * d + hard_label_weight * ce
    valid = torch.ones_like(loss, dtype=torch.bool)
    if target is not None:
        valid = target.reshape(-1) != ignore_index
    loss = torch.where(valid, loss, 0.0)
    if reduction == "none":
        return loss.reshape(hidden.shape[:-1])
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum().clamp(min=1)


def sampled_token_stats_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    sample_top_k=0,
    sample_top_p=1.0,
    sample_min_p=0.0,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> dict[str, torch.Tensor]:
    """The statistics of the distribution vLLM's V1 sampler draws from, on materialised
    float64 logits (``docs/design.md``, "Sampling replay"): min-p, then top-k (ties at
    the k-th all kept), then top-p (a token stays iff the kept mass strictly above it is
    below ``top_p``), each a number or one per token (off: 0 / 1 / 0). ``logprobs``
    (``-inf`` outside the kept set), ``entropy`` and ``kept_logmass``, differentiable
    with the kept set held fixed; 0 where ``target`` is ignored."""
    z = scaled_logits_reference(hidden, weight, bias, softcap, temperature)
    shape = z.shape[:-1]

    def per_token(v, dtype):
        return torch.as_tensor(v, dtype=dtype).expand(shape).reshape(*shape, 1)

    k, p, min_p = (per_token(sample_top_k, torch.int64), per_token(sample_top_p, z.dtype),
                   per_token(sample_min_p, z.dtype))  # fmt: skip
    with torch.no_grad():
        zd = z.detach()
        keep = zd >= zd.amax(-1, keepdim=True) + torch.log(min_p.clamp(min=1e-300))
        keep |= min_p <= 0
        masked = zd.masked_fill(~keep, -math.inf)
        ordered = masked.sort(-1, descending=True).values
        kth = ordered.gather(-1, (k - 1).clamp(0, zd.shape[-1] - 1))
        keep &= (k <= 0) | (zd >= kth)
        e = torch.exp(zd - zd.amax(-1, keepdim=True)) * keep
        # mass strictly above each token, among the kept
        above = torch.stack(
            [(e * (zd > zd[..., j : j + 1])).sum(-1) for j in range(zd.shape[-1])], -1
        )
        keep &= (p >= 1) | (above < p * e.sum(-1, keepdim=True))
    ignored = target == ignore_index
    logq = torch.log_softmax(z.masked_fill(~keep, -math.inf), -1)
    lp = logq.gather(-1, target.clamp(min=0)[..., None]).squeeze(-1)
    ent = -(torch.exp(logq) * torch.where(keep, logq, 0.0)).sum(-1)
    kept = torch.logsumexp(z.masked_fill(~keep, -math.inf), -1) - torch.logsumexp(z, -1)
    return {
        "logprobs": lp.masked_fill(ignored, 0.0),
        "entropy": ent.masked_fill(ignored, 0.0),
        "kept_logmass": kept.masked_fill(ignored, 0.0),
        "kept": keep,
    }
