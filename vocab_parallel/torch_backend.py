"""Chunked pure-PyTorch backend: the fast path on CPUs, same semantics as the kernels.

It walks the vocabulary in chunks exactly like the Triton launcher, so its extra memory
is one ``[BT, CV]`` chunk and a ``[BT, H]`` fp32 accumulator, never ``[BT, V]``.

Products are computed in a "compute dtype": fp32 on CPUs (most CPUs have no native
bf16/fp16 matrix units; half-precision GEMMs there are hundreds of times slower), the
input dtype on GPUs (tensor cores accumulate in fp32 anyway). ``G`` is always rounded to
the input dtype first, as the operator's contract says, so the results match the Triton
path whichever compute dtype is used.
"""

from __future__ import annotations

import torch

# Target bytes of one fp32 [BT, CV] chunk of logits.
CHUNK_BYTES = 64 * 1024 * 1024


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype chunk products run in: fp32 on CPUs, ``dtype`` elsewhere."""
    return torch.float32 if device.type == "cpu" else dtype


def chunk_columns(bt: int, v: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Columns per vocabulary chunk so that an fp32 ``[bt, cols]`` fits ``chunk_bytes``."""
    cols = chunk_bytes // max(1, bt * 4)
    cols = max(256, cols // 64 * 64)
    return max(1, min(v, cols))


def fused_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    not_here: torch.Tensor,
    target: torch.Tensor,
    logits_max: torch.Tensor | None,
    sum_exp_logits: torch.Tensor | None,
    softmax: torch.Tensor | None,
    on_target: float,
    smooth_all: float,
    grad_input_dtype: torch.dtype | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward over vocabulary chunks; inputs already validated.

    ``not_here`` is a bool ``[BT]`` (True: no one-hot on this shard), ``target`` an int64
    ``[BT]`` already clamped into ``[0, V-1]``, ``grad`` ``[BT]`` or ``[1]`` fp32.
    """
    bt, h = x.shape
    v = weight.shape[0]
    dtype = x.dtype
    grad_weight = torch.empty((v, h), dtype=dtype, device=x.device)
    if bt == 0 or h == 0 or v == 0:
        grad_weight.zero_()
        return torch.zeros((bt, h), dtype=grad_input_dtype or dtype, device=x.device), grad_weight

    cdt = compute_dtype(dtype, x.device)
    xc = x.to(cdt)
    scale = grad.to(torch.float32).reshape(-1, 1)  # [BT, 1] or [1, 1]
    # Amount subtracted at the target column: (1 - eps) where the target is on this shard.
    onehot_val = (~not_here).to(torch.float32) * on_target
    rows = torch.arange(bt, device=x.device)
    acc_input = torch.zeros((bt, h), dtype=torch.float32, device=x.device)
    cv = chunk_columns(bt, v, chunk_bytes)
    for v0 in range(0, v, cv):
        v1 = min(v, v0 + cv)
        wc = weight[v0:v1].to(cdt)
        if softmax is not None:
            g = softmax[:, v0:v1].to(torch.float32, copy=True)
        else:
            g = torch.mm(xc, wc.t()).float()
            g.sub_(logits_max[:, None]).exp_().div_(sum_exp_logits[:, None])
        if smooth_all != 0.0:
            g.sub_(smooth_all)
        # One-hot: subtract where the (clamped) target falls into this chunk.
        in_chunk = (target >= v0) & (target < v1)
        cols = (target - v0).clamp(0, v1 - v0 - 1)
        g[rows, cols] -= torch.where(in_chunk, onehot_val, 0.0)
        g.mul_(scale)
        if dtype != torch.float32:  # round to the input dtype, as the contract says
            rounded = g.to(dtype)
            g = g.copy_(rounded) if cdt == torch.float32 else rounded  # fp32: reuse g's buffer
            del rounded
        acc_input.addmm_(g, wc) if cdt == torch.float32 else acc_input.add_(g @ wc)
        if cdt == dtype:  # straight into the output rows, no [CV, H] temporary
            torch.mm(g.t(), xc, out=grad_weight[v0:v1])
        else:
            grad_weight[v0:v1] = torch.mm(g.t(), xc)
        del g  # free this chunk before the next one is allocated
    return acc_input.to(grad_input_dtype or dtype), grad_weight


def forward_stats(
    x: torch.Tensor,
    weight: torch.Tensor,
    local_target: torch.Tensor,
    logits_out: torch.Tensor | None = None,
    with_logit_sum: bool = True,
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local ``(max, sum_exp, predicted, logit_sum)`` of ``x @ weight.T``, fp32 ``[BT]``.

    One online pass over vocabulary chunks (same contract as the Triton launcher
    ``vocab_parallel.kernels.forward.forward_stats``): ``local_target`` is int64, -1 where
    the target is not on this shard; ``logits_out`` (fp32 ``[BT, V]``) receives the raw
    logits when given, and then the chunk products are written straight into it.
    ``with_logit_sum=False`` skips the logit sum (only label smoothing needs it): zeros.
    """
    bt = x.shape[0]
    v = weight.shape[0]
    f32 = dict(dtype=torch.float32, device=x.device)
    row_max = torch.full((bt,), float("-inf"), **f32)
    row_sum = torch.zeros(bt, **f32)
    pred = torch.zeros(bt, **f32)
    lsum = torch.zeros(bt, **f32)
    if bt == 0 or v == 0:
        return row_max, row_sum, pred, lsum
    cdt = compute_dtype(x.dtype, x.device)
    xc = x.to(cdt)
    here = local_target >= 0
    cv = chunk_columns(bt, v, chunk_bytes)
    for v0 in range(0, v, cv):
        v1 = min(v, v0 + cv)
        wc = weight[v0:v1].to(cdt)
        if logits_out is not None and cdt == torch.float32:
            logits = torch.mm(xc, wc.t(), out=logits_out[:, v0:v1])
        else:
            logits = torch.mm(xc, wc.t()).float()
            if logits_out is not None:
                logits_out[:, v0:v1] = logits
        in_chunk = here & (local_target >= v0) & (local_target < v1)
        cols = (local_target - v0).clamp(0, v1 - v0 - 1)
        pred += torch.where(in_chunk, logits.gather(1, cols[:, None]).squeeze(1), 0.0)
        if with_logit_sum:  # only label smoothing needs it: skip the pass otherwise
            lsum += logits.sum(dim=1)
        new_max = torch.maximum(row_max, logits.max(dim=1).values)
        row_sum.mul_(torch.exp(row_max - new_max))
        # exp in place unless the raw logits must be kept (high-performance mode).
        shifted = (
            logits.sub(new_max[:, None])
            if logits_out is not None
            else logits.sub_(new_max[:, None])
        )
        row_sum.add_(shifted.exp_().sum(dim=1))
        row_max = new_max
        del logits, shifted  # free this chunk before the next one is allocated
    return row_max, row_sum, pred, lsum
