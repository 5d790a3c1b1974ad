"""Float64 references: the formulas of SPEC.md written as plainly as possible.

Tests and benchmarks compare every backend against these. They materialise ``[BT, V]``
on purpose; they are for checking, not for training.
"""

from __future__ import annotations

import torch


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward operator in float64; ``not_here`` is the unpacked bool mask.

    ``G`` is rounded to ``input.dtype`` before the two products, as the contract says, so
    the only differences left to a backend are its fp32 accumulation order.
    """
    f64 = torch.float64
    x, w = input.to(f64), weight.to(f64)
    bt, v = x.shape[0], w.shape[0]
    vg = v if global_vocab_size is None else global_vocab_size
    if softmax is not None:
        g = softmax.to(f64).clone()
    else:
        g = torch.exp(x @ w.T - logits_max.to(f64)[:, None]) / sum_exp_logits.to(f64)[:, None]
    if v > 0:
        g -= label_smoothing / vg
        t = masked_target.long().clamp(0, v - 1)
        rows = torch.arange(bt)
        g[rows, t] -= (1.0 - label_smoothing) * (~not_here).to(f64)
    g = g * grad.to(f64).reshape(-1, 1)
    g = g.to(input.dtype).to(f64)
    return (g @ w).to(input.dtype), (g.T @ x).to(input.dtype)


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
