"""Launchers of the Triton backend's fused objective epilogues (``vocab_parallel.kernels``):
validate, allocate, launch. Today the distillation against a dense teacher
(``vocab_parallel.kernels.divergence``): its statistics, the JSD's second sums and ``G``
over both heads' fp32 logits (whole kept token chunks, or column chunks), one launch
each per chunk, where the torch epilogue issues some forty ops per column chunk.

Each takes the heads' untempered fp32 logits ``s`` (the student's) and ``t`` ``[N, V]``
(rows of contiguous columns) and the per-row inverse temperature (None: 1). Knows nothing
of torch.distributed: the all-reduces between the launches are the engine's.
"""

from __future__ import annotations

import math

import torch

from vocab_parallel.kernels import divergence


def _check(s: torch.Tensor, t: torch.Tensor) -> None:
    if s.dtype != torch.float32 or t.dtype != torch.float32:
        raise TypeError(f"logits: fp32 blocks expected, got {s.dtype} and {t.dtype}")
    if s.shape != t.shape or s.dim() != 2:
        raise ValueError(f"logits: two [N, V] blocks of one shape, got {s.shape} and {t.shape}")
    if s.stride(1) != 1 or t.stride(1) != 1:
        raise ValueError("logits: rows of contiguous columns expected")


def _inv_t(inv_t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like if inv_t is None else inv_t.to(torch.float32).contiguous()


def divergence_stats(kind: str, s, t, inv_t=None) -> list[torch.Tensor]:
    """``[m_s, S_s, A_s, m_t, S_t, A_t]``, each fp32 ``[N]``: the heads' running maxima
    and sums over the columns (``A_s``: reverse KL's, ``A_t``: forward KL's; zeros
    otherwise)."""
    _check(s, t)
    n, v = s.shape
    out = torch.empty((6, n), dtype=torch.float32, device=s.device)
    if n:
        divergence.divergence_stats_kernel[(n,)](
            s, t, _inv_t(inv_t, out), out, n, v, s.stride(0), t.stride(0),
            **divergence.stats_meta(torch.bfloat16, kind, inv_t is not None),
        )  # fmt: skip
    return list(out)


def divergence_second(s, t, inv_t, ls: torch.Tensor, lt: torch.Tensor, beta: float):
    """The JSD's second sums ``[2, N]``: ``K_t``, ``K_s`` (given the global
    log-normalisers ``ls``, ``lt``)."""
    _check(s, t)
    n, v = s.shape
    out = torch.empty((2, n), dtype=torch.float32, device=s.device)
    if n:
        kw = divergence.second_meta(torch.bfloat16, inv_t is not None)
        divergence.divergence_second_kernel[(n,)](
            s, t, _inv_t(inv_t, out), ls.float().contiguous(), lt.float().contiguous(), out,
            n, v, s.stride(0), t.stride(0), math.log(beta), math.log1p(-beta),
            **kw,
        )  # fmt: skip
    return out


def divergence_grad(
    kind: str, s, t, inv_t, ls, lt, coef, c: torch.Tensor, beta: float, dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``G`` ``[N, V]`` in ``dtype``: ``c`` (per row: the upstream gradient times the
    inverse temperature, 0 where ignored) times ``dD/du`` (the kernel module's table);
    into ``out`` where given and usable (``[N, V]``, ``dtype``, unit column stride),
    else a new tensor."""
    _check(s, t)
    n, v = s.shape
    usable = out is not None and out.shape == (n, v) and out.dtype == dtype
    usable = usable and out.device == s.device and (v <= 1 or out.stride(1) == 1)
    g = out if usable else torch.empty((n, v), dtype=dtype, device=s.device)
    if n and v:
        f = lambda x: x.float().contiguous()  # noqa: E731
        c = f(c)
        divergence.divergence_grad_kernel[(n,)](
            s, t, g, _inv_t(inv_t, c), f(ls), f(lt), f(ls if coef is None else coef), c,
            n, v, s.stride(0), t.stride(0), g.stride(0),
            float(beta), math.log(beta), math.log1p(-beta),
            **divergence.grad_meta(dtype, kind, inv_t is not None),
        )  # fmt: skip
    return g
