"""Per-token statistics of a vocabulary-parallel head for RL: log-probs, entropy, top-k.

Policy-gradient trainers (PPO, GRPO and their variants) need, per token and over the
GLOBAL vocabulary, the log-prob of the sampled token, the entropy, sometimes
``sum_j p_j^2``, the top-k and the argmax, of ``z = softcap(hidden @ W.T + bias) / T``.
:func:`vocab_parallel_token_stats` computes them from the statistics the loss already
makes (``docs/design.md``, "Token statistics"), never materialising the logits:

    local       m, s = sum_j e_j, p = z_y (if here), q = sum_j e_j (z_j - m), s2 = sum_j e_j^2
                (e_j = exp(z_j - m); q and s2 kept online in the backends' forward pass)
    all-reduce  M = MAX m; one SUM of s e^(m-M), p, e^(m-M) (q + (m - M) s), e^(2(m-M)) s2
    per token   lse = M + log S,  logprob = P - lse,  H = log S - Q / S,  sum p^2 = S2 / S^2

so log-probs and entropy cost no collective beyond the loss's two (the extra sums ride in
its SUM all-reduce); top-k adds one all-gather of k candidates per rank
(``vocab_parallel.objectives.topk``). The backward takes the upstream gradients of the log-probs
(``a``) and of the entropy (``b``) together, per token, in the one fused epilogue:

    dL/dz_j = a [j = y] - p_j (a + b (H - log S) + b (z_j - M))

which is the backends' ``G`` (``vocab_parallel.backends.interface``) with ``prob_scale = -(a + b
(H - log S))``, ``entropy = -b`` and ``on_target = -a``; then the same two gradient GEMMs
and one fp32 all-reduce of ``grad_input`` as the loss. Nothing ``[tokens, V_local]`` is
kept between forward and backward in the default (memory-saving) mode.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from vocab_parallel.backends.interface import GradTerms, Outputs
from vocab_parallel.backends.registry import get_backend
from vocab_parallel.engine import precision
from vocab_parallel.engine.autograd import guarded_backward, no_autocast, sum_grad_input
from vocab_parallel.engine.entry import prepare_call
from vocab_parallel.engine.functions import ChunkedLoss
from vocab_parallel.engine.objective import Call, Objective
from vocab_parallel.objectives.cross_entropy import (
    forward_stats,
    local_targets,
    reduce_statistics,
)
from vocab_parallel.objectives.sampling import PARAMETERS, Truncated, check_sampling, check_values
from vocab_parallel.objectives.topk import exchange_candidates, shard_candidates
from vocab_parallel.options import LossOptions, PendingOptions, StatsRequest, documented, made
from vocab_parallel.parallel import sequence_parallel as _sp
from vocab_parallel.parallel.agreement import checksum_fields
from vocab_parallel.parallel.collectives import world_size

TOKEN_STATS_MODES = ("auto", "memory_saving", "high_performance")


class TokenStats(NamedTuple):
    """Per-token results of :func:`vocab_parallel_token_stats` (shaped like ``target``;
    top-k ``[..., k]``), fp32 (float64 for float64 inputs); None where not asked for.
    ``logprobs`` and ``entropy`` are differentiable; the others are not. At ignored
    positions every value is 0 and every id -1."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    sum_p_squared: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    argmax: torch.Tensor | None = None
    # Under a sampler's truncation: log of the kept probability mass (<= 0; no gradient)
    kept_logmass: torch.Tensor | None = None


@documented
def vocab_parallel_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    process_group: dist.ProcessGroup | None = None,
    vocab_start_index: int | None = None,
    global_vocab_size: int | None = None,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    entropy: bool = False,
    sum_p_squared: bool = False,
    top_k: int = 0,
    argmax: bool = False,
    sample_top_k: int | torch.Tensor | None = None,
    sample_top_p: float | torch.Tensor | None = None,
    sample_min_p: float | torch.Tensor | None = None,
    sequence_parallel: bool = False,
    mode: str = "auto",
    backend: str = "auto",
    check_inputs: bool = True,
) -> TokenStats:
    """Log-probs of ``target`` (and entropy, sum of squared probabilities, top-k, argmax)
    under ``softmax(softcap(hidden @ W.T + bias) / temperature)`` over the global
    vocabulary, ``weight`` being this rank's shard of ``W``; no logits are materialised.

    Args:
        {shared: hidden, weight}
        target: ``[...]`` integer global ids (the sampled tokens); ``ignore_index`` for
            none.
        {shared: process_group, vocab_start_index, global_vocab_size, softcap, bias}
        {shared: ignore_index, sequence_parallel, backend, check_inputs}
        temperature: ``T > 0``, a float or a tensor shaped like ``target`` (rollout
            temperatures per token); no gradient reaches it.
        entropy: also the entropy ``-sum_j p_j log p_j`` (differentiable).
        sum_p_squared: also ``sum_j p_j^2`` (no gradient).
        top_k: also the ``k`` largest log-probs and their global ids (``[..., k]``,
            descending, ties to the lower id; no gradient).
        argmax: also the global id of the largest logit (ties to the lower id); token
            accuracy is ``argmax == target``.
        sample_top_k, sample_top_p, sample_min_p: the statistics of the distribution a
            rollout engine samples from (vLLM's V1 sampler: temperature, then min-p, then
            top-k, then top-p; ``docs/design.md``, "Sampling replay"): each None (off), a
            number or a tensor shaped like ``target`` (per token). Off: top-k None or <= 0,
            top-p None or 1, min-p None or 0. When one truncates, ``logprobs`` and
            ``entropy`` are those of the kept set ``K`` (``-inf`` for a target outside it,
            which takes no gradient) and ``kept_logmass`` is ``log sum_{K} p``; not with
            ``sum_p_squared``, ``top_k`` or ``argmax``.
        mode: ``"auto"`` / ``"memory_saving"`` (recompute the logits in the backward, no
            ``[tokens, V_local]`` tensor kept) or ``"high_performance"`` (keep the fp32
            logits shard for the backward). ``"grad_in_forward"`` does not apply: the
            upstream gradients of per-token outputs are only known in the backward.

    Returns:
        :class:`TokenStats`; fields not asked for are None.

    Raises:
        TypeError, ValueError: naming the parameter, on every rank of the group alike.
    """
    opts = PendingOptions(  # made in the guarded step of prepare_call, like the request
        ignore_index=ignore_index, reduction="none", softcap=softcap, temperature=temperature,
        bias=bias, mode=mode, backend=backend, check_inputs=check_inputs,
        sequence_parallel=sequence_parallel, vocab_start_index=vocab_start_index,
        global_vocab_size=global_vocab_size,
    )  # fmt: skip
    request = functools.partial(StatsRequest, entropy, sum_p_squared, top_k, argmax)
    sampling = dict(sample_top_k=sample_top_k, sample_top_p=sample_top_p,
                    sample_min_p=sample_min_p)  # fmt: skip
    return run_token_stats(hidden, weight, target, opts, request, process_group, sampling=sampling)


class Statistics(Objective):
    """The token statistics, as the engine's entry sees them: the request made (and
    validated) in the entry's guarded step, its entries of the ranks' agreement (ranks
    asking for different outputs would make different collectives), top-k within the
    global vocabulary, and the modes that allow per-token outputs."""

    name = "token statistics"

    def __init__(self, request, sampling: dict | None = None, hidden=None):
        self.given, self.request = request, None
        self.given_sampling, self.hidden = sampling or {}, hidden
        self.sampling: dict | None = None  # the sampler's parameters when one truncates
        self.sequence_parallel = False

    def check(self, opts: LossOptions) -> None:
        self.request = made(self.given)
        _check_options(opts)
        self.sequence_parallel = opts.sequence_parallel
        self.sampling = check_sampling(self.given_sampling, self.hidden, opts.sequence_parallel)
        r = self.request
        if self.sampling is not None and (r.sum_p_squared or r.top_k or r.argmax):
            on = next(n for n in PARAMETERS if self.given_sampling.get(n) is not None)
            raise ValueError(
                f"{on}: the sampler's statistics are log-probs and entropy; not with "
                "sum_p_squared, top_k or argmax"
            )

    def fields(self) -> list[tuple[str, str, object]]:
        r = self.request
        f = [
            ("entropy", "entropy", float(r.entropy)),
            ("sum_p_squared", "sum_p_squared", float(r.sum_p_squared)),
            ("top_k", "top_k", float(r.top_k)),
            ("argmax", "argmax", float(r.argmax)),
        ]
        for name, v in (self.sampling or {}).items():
            if not isinstance(v, torch.Tensor):
                f.append((name, name, float(v)))
            elif not self.sequence_parallel:  # (each rank brings its own tokens)
                f += checksum_fields(name, v.reshape(-1, 1))
            else:
                f.append((f"{name} as a tensor", name, 1.0))
        return f

    def prepared(self, call: Call, target, slices) -> None:
        vg = call.layout.global_size
        if self.request.candidates > vg:
            raise ValueError(
                f"top_k: expected at most the global vocabulary size {vg}, got {self.request.top_k}"
            )
        if self.sampling is None:
            return
        for name, v in self.sampling.items():  # per token, as the call's tokens
            if isinstance(v, torch.Tensor):
                v = v.detach().reshape(-1, 1)
                v = (v if slices is None else _sp.all_gather_rows(v, slices, name))[:, 0]
                check_values(name, v)
                self.sampling[name] = v

    def epilogue(self, call: Call, target: torch.Tensor, dtype) -> Truncated:
        """The sampler's truncation on this rank's shard (``target``: the call's tokens)."""
        ignored = target == call.opts.ignore_index
        local = call.layout.columns(target).masked_fill(ignored, -1)
        accum = precision.accumulate_dtype(dtype)
        n, f = target.shape[0], dict(device=target.device)

        def per_token(name, dt):
            v = self.sampling[name]
            return v.to(dt) if isinstance(v, torch.Tensor) else torch.full((n,), v, dtype=dt, **f)

        k = per_token("sample_top_k", torch.int64)
        p, min_p = per_token("sample_top_p", accum), per_token("sample_min_p", accum)
        group, v = call.process_group, call.layout.size
        return Truncated(local, ignored, call.inv_temperature, k, p, min_p, group, v, accum)

    def mode(self, opts: LossOptions, track: bool, dtype: torch.dtype) -> str:
        return "high_performance" if opts.mode == "high_performance" else "memory_saving"


def _check_options(opts: LossOptions) -> None:
    """Only the options of the logits apply; the mode must allow per-token outputs."""
    loss_only = {
        "label_smoothing": opts.label_smoothing != 0.0,
        "z_loss": opts.z_loss != 0.0,
        "class_weight": opts.class_weight is not None,
    }
    for name, given in loss_only.items():
        if given:
            raise ValueError(f"{name}: an option of the loss, not of the token statistics")
    if opts.mode not in TOKEN_STATS_MODES:
        raise ValueError(
            f"mode: expected one of {TOKEN_STATS_MODES} for per-token statistics, got "
            f"{opts.mode!r} (their upstream gradients are only known in the backward)"
        )


def run_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    opts: LossOptions | PendingOptions,
    request: StatsRequest | Callable[[], StatsRequest],
    process_group: dist.ProcessGroup | None = None,
    *,
    partial_grad_input: bool = False,
    sampling: dict | None = None,
) -> TokenStats:
    """:func:`vocab_parallel_token_stats` for options already made (the LM head's entry),
    or pending, and a request or a function that makes it (both made where a refused
    value raises on every rank alike: ``prepare_call``). Only the options of the logits
    apply (``reduction``, ``label_smoothing``, ``z_loss``, ``class_weight`` and
    ``return_lse`` must be their defaults). ``partial_grad_input``: ``hidden``'s
    gradient is this rank's share, not summed over the group (for a caller that sums it
    itself; not with sequence parallelism). ``sampling``: the sampler's parameters by
    their keyword names (``vocab_parallel.objectives.sampling``)."""
    opts = opts.replace(reduction="none", return_lse=False)
    objective = Statistics(request, sampling, hidden)
    call, h2, weight, bias, t1, slices, shape = prepare_call(
        hidden, weight, target, opts, process_group, objective
    )
    request = objective.request
    if objective.sampling is not None:  # the sampler's truncation: an epilogue of the engine
        out, _ = ChunkedLoss.apply(h2, weight, bias, call, objective, t1)
        out = _sp.own_tokens(out, slices)
        return TokenStats(
            logprobs=out[:, 0].reshape(shape),
            entropy=out[:, 1].reshape(shape) if request.entropy else None,
            kept_logmass=out[:, 2].detach().reshape(shape),
        )
    if partial_grad_input:
        if call.opts.sequence_parallel:
            raise ValueError("sequence_parallel: not with a rank-local (partial) grad_input")
        call = dataclasses.replace(call, partial_grad_input=True)
    k = request.candidates
    outs = TokenStatsFunction.apply(h2, weight, bias, t1, call, request)
    # This rank's tokens (sequence parallelism); an output not asked for is empty.
    lp, ent, sp2, top_lp, top_ids = (
        _sp.own_tokens(t, slices) if t.numel() or t.dim() > 1 else t for t in outs
    )
    top = request.top_k > 0
    return TokenStats(
        logprobs=lp.reshape(shape),
        entropy=ent.reshape(shape) if request.entropy else None,
        sum_p_squared=sp2.reshape(shape) if request.sum_p_squared else None,
        topk_logprobs=top_lp.reshape(*shape, k) if top else None,
        topk_ids=top_ids.reshape(*shape, k) if top else None,
        argmax=top_ids[:, 0].reshape(shape) if request.argmax else None,
    )


class TokenStatsFunction(torch.autograd.Function):
    """``(logprobs, entropy, sum_p_squared, topk_logprobs, topk_ids)`` of ``hidden [BT,
    H]`` against this rank's shard (``[BT]`` each, top-k ``[BT, k]``; an output not asked
    for is an empty tensor). Only ``logprobs`` and ``entropy`` are differentiable."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, call: Call, request: StatsRequest):
        with no_autocast(hidden.device.type):
            return TokenStatsFunction._forward(ctx, hidden, weight, bias, target, call, request)

    @staticmethod
    def _forward(ctx, hidden, weight, bias, target, call: Call, request: StatsRequest):
        local_target, ignored = local_targets(target, call.layout, call.opts.ignore_index)
        bt, v = hidden.shape[0], weight.shape[0]
        accum = precision.accumulate_dtype(hidden.dtype)
        saved = None  # high-performance mode keeps the fp32 logits z for the backward
        if call.track and call.mode == "high_performance":
            saved = torch.empty((bt, v), dtype=accum, device=hidden.device)
        k = request.candidates
        extra = request.extra_stats
        if k:
            stats, values, ids = shard_candidates(
                call.backend, hidden, weight, local_target, call.logits(bias), k,
                call.layout.start, extra_stats=extra, logits_out=saved,
            )  # fmt: skip
        else:
            stats = forward_stats(call, hidden, weight, bias, local_target, saved, extra)
        token = reduce_statistics(stats, local_target, call)

        def empty():  # an output not asked for (each its own: their autograd flags differ)
            return hidden.new_empty(0, dtype=accum)

        logprobs = (-token.loss).masked_fill(ignored, 0.0)  # the loss is lse - z_y
        log_s = torch.log(token.sum_exp)
        ent = empty()
        if request.entropy:
            ent = (log_s - token.shifted_sum / token.sum_exp).masked_fill(ignored, 0.0)
        sp2 = empty()
        if request.sum_p_squared:
            sp2 = (token.exp2_sum / token.sum_exp.square()).masked_fill(ignored, 0.0)
        top_lp, top_ids = empty(), empty()
        if k:
            values, ids = exchange_candidates(values, ids, k, call.process_group)
            top_lp = (values - token.lse[:, None]).masked_fill(ignored[:, None], 0.0)
            top_ids = ids.masked_fill(ignored[:, None], -1)
        ctx.mark_non_differentiable(sp2, top_lp, top_ids)
        ctx.set_materialize_grads(False)
        if call.track:
            ctx.save_for_backward(
                hidden, weight, bias, local_target, ignored, saved,
                token.logits_max, token.sum_exp, log_s, ent,
            )  # fmt: skip
        ctx.call, ctx.device_type, ctx.request = call, hidden.device.type, request
        return logprobs, ent, sp2, top_lp, top_ids

    @staticmethod
    def backward(ctx, grad_lp, grad_ent, *unused):
        if not ctx.request.entropy:
            grad_ent = None
        if grad_lp is None and grad_ent is None:
            return (None,) * 6
        anchor = grad_lp if grad_lp is not None else grad_ent
        grads = guarded_backward(
            ctx, anchor, lambda need: TokenStatsFunction._gradients(ctx, grad_lp, grad_ent, need)
        )
        return (*grads, None, None, None)

    @staticmethod
    def _gradients(ctx, grad_lp, grad_ent, need):
        """``(grad_hidden, grad_weight, grad_bias)`` of ``sum(a * logprobs + b * entropy)``
        for the upstream ``a``, ``b`` (module docstring)."""
        hidden, weight, bias, local_target, ignored, saved, lmax, sum_exp, log_s, ent = (
            ctx.saved_tensors
        )
        call = ctx.call
        accum = precision.accumulate_dtype(hidden.dtype)

        def upstream(g):
            return None if g is None else g.to(accum).masked_fill(ignored, 0.0)

        a, b = upstream(grad_lp), upstream(grad_ent)
        if b is None:  # log-probs only: G = -a (p - onehot), the loss's plain G
            terms = GradTerms(grad=-a, logits_max=lmax, sum_exp=sum_exp, logits=saved)
        else:
            a = torch.zeros_like(b) if a is None else a
            terms = GradTerms(
                grad=torch.ones(1, dtype=accum, device=hidden.device),
                on_target=-a,
                prob_scale=-(a + b * (ent - log_s)).masked_fill(ignored, 0.0),
                entropy=-b,
                logits_max=lmax,
                sum_exp=sum_exp,
                logits=saved,
            )
        tp = world_size(call.process_group) > 1 and not call.partial_grad_input
        out = Outputs(
            need_input=need[0],
            need_weight=need[1],
            need_bias=need[2],
            grad_input_dtype=accum if tp else None,
        )
        grads = get_backend(call.backend).fused_backward(
            hidden, weight, local_target, call.logits(bias), terms, out
        )
        if call.partial_grad_input:  # the caller sums it over the group
            return grads.input, grads.weight, grads.bias
        grad_input = sum_grad_input(grads.input, call.process_group, hidden.dtype)
        return grad_input, grads.weight, grads.bias
