"""Knowledge distillation between two vocabulary-sharded heads, neither's logits kept.

    loss = vocab_parallel_distillation_loss(hidden, weight, teacher_hidden=h_t,
                                            teacher_weight=w_t, target=labels,
                                            hard_label_weight=0.1)

This module is the public call: its arguments checked (where a refusal raises on every
rank alike), its entries of the ranks' agreement, the teacher gathered like the student's
tokens. The math is :class:`vocab_parallel.objectives.distill.Divergence`, an epilogue of
the engine, whose Functions run every mode (``vocab_parallel.engine.functions``;
``docs/design.md``, "Distillation": the formulas, the collectives).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vocab_parallel.engine import precision
from vocab_parallel.engine.entry import autocast_inputs, check_head, prepare_call, token_tensor
from vocab_parallel.engine.functions import ChunkedLoss, GradInForwardLoss
from vocab_parallel.engine.objective import Call, Objective
from vocab_parallel.engine.reduction import reduce_losses
from vocab_parallel.objectives.distill import DIVERGENCES, Divergence, Spec, Teacher
from vocab_parallel.options import LossOptions, PendingOptions, check_number_in, documented
from vocab_parallel.parallel import sequence_parallel as _sp
from vocab_parallel.parallel.agreement import checksum_fields
from vocab_parallel.parallel.dtensor import is_dtensor, local_tensor

__all__ = ["DIVERGENCES", "vocab_parallel_distillation_loss"]


@documented
def vocab_parallel_distillation_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    teacher_topk_ids: torch.Tensor | None = None,
    teacher_topk_logprobs: torch.Tensor | None = None,
    target: torch.Tensor | None = None,
    process_group: dist.ProcessGroup | None = None,
    divergence: str = "forward_kl",
    beta: float = 0.5,
    temperature: float | torch.Tensor = 1.0,
    hard_label_weight: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    vocab_start_index: int | None = None,
    global_vocab_size: int | None = None,
    sequence_parallel: bool = False,
    mode: str = "auto",
    backend: str = "auto",
    check_inputs: bool = True,
) -> torch.Tensor:
    """The divergence between a teacher and the student head ``hidden @ weight.T`` (this
    rank's vocabulary shard), per token, over the global vocabulary; no logits kept.

    Args:
        {shared: hidden, weight}
        teacher_hidden, teacher_weight, teacher_bias: the dense teacher: ``[..., H_t]``
            (replicated like ``hidden``; ``H_t`` may differ from ``H``), ``[V_local, H_t]``
            (the same vocabulary rows as ``weight``), ``[V_local]``. Any float dtype
            (hidden and weight alike); its logits are ``softcap(teacher_hidden @
            teacher_weight.T + teacher_bias) / temperature``.
        teacher_topk_ids, teacher_topk_logprobs: the sparse teacher (a rollout engine's):
            ``[..., k]`` distinct global ids and the teacher's log-probs at them
            (temperature already applied); the tail ``r = 1 - sum exp(logprobs)`` is one
            more bin. ``forward_kl`` only.
        target: ``[...]`` hard labels (``ignore_index``: a token with no loss at all);
            needed when ``hard_label_weight > 0``.
        divergence: ``"forward_kl"`` ``KL(p_t || p_s)``, ``"reverse_kl"`` ``KL(p_s ||
            p_t)`` or ``"jsd"`` ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)``, ``m = beta
            p_t + (1 - beta) p_s``, ``0 < beta < 1``.
        temperature: ``T > 0`` (a float or per token): both heads' logits are divided by
            it. No ``T^2`` factor is applied (multiply the loss yourself if you want one).
        hard_label_weight: ``a`` in ``(1 - a) D + a CE``, ``0 <= a <= 1``; the cross
            entropy is of the untempered student logits (``T = 1``).
        reduction: ``"mean"`` (over non-ignored tokens), ``"sum"`` or ``"none"`` (shape of
            the tokens; this rank's tokens with ``sequence_parallel``).
        {shared: process_group, vocab_start_index, global_vocab_size}
        {shared: bias, softcap, sequence_parallel, backend, check_inputs}
        mode: ``"auto"`` (grad-in-forward for a scalar loss that a backward will follow,
            not fp16 nor float64; else memory-saving), ``"grad_in_forward"`` (token chunks
            whose two heads' logits are made once, the gradients computed in the forward),
            ``"memory_saving"`` (both heads' logits recomputed in the backward) or
            ``"high_performance"`` (both heads' fp32 logits shards kept).

    Returns:
        The fp32 loss (float64 for float64 inputs): a scalar, or per token.

    Raises:
        TypeError, ValueError: naming the parameter, on every rank of the group alike.
    """
    opts = PendingOptions(  # made in the guarded step of prepare_call
        ignore_index=ignore_index, reduction=reduction, softcap=softcap,
        temperature=temperature, bias=bias, mode=mode, backend=backend,
        check_inputs=check_inputs, sequence_parallel=sequence_parallel,
        vocab_start_index=vocab_start_index, global_vocab_size=global_vocab_size,
    )  # fmt: skip
    given = dict(
        hidden=teacher_hidden, weight=teacher_weight, bias=teacher_bias,
        ids=teacher_topk_ids, logprobs=teacher_topk_logprobs,
    )  # fmt: skip
    return run_distillation(
        hidden, weight, given, target, opts, process_group, divergence, beta, hard_label_weight
    )


def _check_teacher(hidden, weight, given: dict, target, opts: LossOptions, spec: Spec) -> dict:
    """The teacher's tensors checked against the student's (messages name the
    parameter), DTensors unwrapped: the plain tensors by the names of ``given``."""
    dense = given["hidden"] is not None or given["weight"] is not None
    if dense == (given["ids"] is not None or given["logprobs"] is not None):
        raise ValueError(
            "teacher_hidden: give the dense teacher (teacher_hidden and teacher_weight) or "
            "the sparse one (teacher_topk_ids and teacher_topk_logprobs), exactly one"
        )
    if spec.ce and target is None:
        raise ValueError("target: hard_label_weight > 0 needs the hard labels (target)")
    sp = opts.sequence_parallel
    if not dense:
        return _sparse_teacher(given, hidden, sp, spec)
    if not isinstance(given["weight"], torch.Tensor):
        what = type(given["weight"]).__name__
        raise TypeError(
            f"teacher_weight: expected a torch.Tensor (with teacher_hidden), got {what}"
        )
    th = token_tensor("teacher_hidden", given["hidden"], hidden, sp, "floating", 1)
    tw = local_tensor(given["weight"], "teacher_weight", rows=True)
    tb = local_tensor(given["bias"], "teacher_bias", rows=True)
    rows = weight.to_local().shape[0] if is_dtensor(weight) else weight.shape[0]
    check_head(th, tw, tb, ("teacher_hidden", "teacher_weight", "teacher_bias"), rows)
    if tw.device != th.device or (tb is not None and tb.device != th.device):
        raise ValueError(f"teacher_weight: on device {tw.device}, but hidden is on {th.device}")
    return dict(hidden=th, weight=tw, bias=tb)


def _sparse_teacher(given: dict, hidden, sp: bool, spec: Spec) -> dict:
    if given["bias"] is not None:
        raise ValueError("teacher_bias: only with the dense teacher (teacher_weight)")
    ids = token_tensor("teacher_topk_ids", given["ids"], hidden, sp, "integer", 1)
    lps = token_tensor("teacher_topk_logprobs", given["logprobs"], hidden, sp, "floating", 1)
    if ids.shape[-1] < 1:
        raise ValueError(f"teacher_topk_ids: expected k >= 1 ids per token, got {tuple(ids.shape)}")
    if tuple(lps.shape) != tuple(ids.shape):
        raise ValueError(
            f"teacher_topk_logprobs: expected the shape of teacher_topk_ids "
            f"{tuple(ids.shape)}, got {tuple(lps.shape)}"
        )
    if spec.divergence != "forward_kl":
        raise ValueError(
            f"divergence: {spec.divergence!r} needs the dense teacher; the top-k teacher "
            "gives forward_kl (its tail is one bin)"
        )
    return dict(ids=ids, logprobs=lps)


def run_distillation(
    hidden, weight, given: dict, target, opts: LossOptions | PendingOptions, process_group,
    divergence, beta, hard_label_weight,
) -> torch.Tensor:  # fmt: skip
    """:func:`vocab_parallel_distillation_loss` for pending options (made where a refusal
    raises on every rank alike); ``given``: the teacher's tensors by name."""
    objective = Distillation(hidden, weight, given, target, divergence, beta, hard_label_weight)
    # target None (no hard labels): every token counts, the engine's checks see zeros
    prep = prepare_call(hidden, weight, target, opts, process_group, objective)
    (call, h2, weight, bias, t1, slices, shape), opts = prep, prep.call.opts
    if call.mode == "grad_in_forward":
        needs = tuple(t is not None and t.requires_grad for t in (h2, weight, bias))
        return GradInForwardLoss.apply(h2, weight, bias, call, objective, t1, needs)
    losses, weights = ChunkedLoss.apply(h2, weight, bias, call, objective, t1)
    if opts.reduction == "none":
        losses = _sp.own_tokens(losses, slices).reshape(shape)
    return reduce_losses(losses, weights, opts.reduction)


class Distillation(Objective):
    """Distillation, as the engine's entry sees it: its own arguments checked in the
    entry's guarded step (kept as ``spec`` and ``checked``), its agreement entries, the
    teacher gathered, its epilogue."""

    name = "distillation"

    def __init__(self, hidden, weight, given: dict, target, divergence, beta, hard_label_weight):
        self.args = (hidden, weight, given, target, divergence, beta, hard_label_weight)
        self.spec, self.checked, self.teacher, self.sequence_parallel = None, {}, None, False

    def check(self, opts: LossOptions) -> None:
        hidden, weight, given, target, divergence, beta, hard_label_weight = self.args
        if divergence not in DIVERGENCES:
            raise ValueError(f"divergence: expected one of {DIVERGENCES}, got {divergence!r}")
        b = check_number_in("beta", beta, 0.0, 1.0, open_ends=True)
        a = check_number_in("hard_label_weight", hard_label_weight, 0.0, 1.0, open_ends=False)
        sparse = given["ids"] is not None or given["logprobs"] is not None
        spec = Spec(divergence, b, a, sparse, target is not None)
        self.checked = _check_teacher(hidden, weight, given, target, opts, spec)
        self.spec, self.sequence_parallel = spec, opts.sequence_parallel

    def fields(self) -> list[tuple[str, str, object]]:
        spec, c = self.spec, self.checked
        f = [("divergence", "divergence", float(DIVERGENCES.index(spec.divergence)))]
        f += [(name, name, getattr(spec, name)) for name in ("beta", "hard_label_weight")]
        f += [("target given", "target", float(spec.has_target))]
        if spec.sparse:
            f += [("teacher form (dense, top-k)", "teacher_topk_ids", 2.0)]
            f += [("teacher size (k)", "teacher_topk_ids", float(c["ids"].shape[-1]))]
            alike = [("teacher_topk_logprobs", c["logprobs"]), ("teacher_topk_ids", c["ids"])]
        else:
            th = c["hidden"]
            f += [("teacher form (dense, top-k)", "teacher_hidden", 1.0)]
            f += [("teacher hidden size", "teacher_hidden", float(th.shape[-1]))]
            f += [("teacher_bias given", "teacher_bias", float(c["bias"] is not None))]
            alike = [("teacher_hidden", th.reshape(-1, th.shape[-1]))]
        if not self.sequence_parallel:  # (else each rank brings its own tokens)
            f += [e for name, t in alike for e in checksum_fields(name, t)]
        return f

    def prepared(self, call: Call, target: torch.Tensor, slices) -> None:
        """The teacher's tokens gathered like the student's, its top-k checked."""
        accum = precision.accumulate_dtype(self.args[0].dtype)
        self.teacher = _gather_teacher(self.checked, self.spec, slices, accum)
        if call.opts.check_inputs and self.spec.sparse:
            _check_topk(self.teacher, target, self.spec, call)

    def epilogue(self, call: Call, target: torch.Tensor, dtype) -> Divergence:
        spec, layout, opts = self.spec, call.layout, call.opts
        ignored = target == opts.ignore_index if spec.has_target else torch.zeros_like(target) > 0
        local_target = layout.columns(target).masked_fill(ignored, -1) if spec.ce else None
        ids = layout.columns(self.teacher.ids) if spec.sparse else None
        accum, inv_t = precision.accumulate_dtype(dtype), call.inv_temperature
        args = (local_target, ids, inv_t, ignored, layout.size, accum)
        return Divergence(spec, self.teacher, *args)


def _gather_teacher(checked: dict, spec: Spec, slices, accum) -> Teacher:
    """The teacher's tensors as the call's flat (gathered) tokens, autocast, detached."""

    def rows(t, width):
        t = t.detach().reshape(-1, width)
        return t if slices is None else _sp.all_gather_rows(t, slices, "teacher")

    if spec.sparse:
        k = checked["ids"].shape[-1]
        ids = rows(checked["ids"].to(torch.int64), k)
        return Teacher(ids=ids, logprobs=rows(checked["logprobs"], k).to(accum))
    th, tw, tb = autocast_inputs(checked["hidden"], checked["weight"], checked["bias"])
    th = rows(th, th.shape[-1])
    return Teacher(th, tw.detach(), None if tb is None else tb.detach())


def _check_topk(teacher: Teacher, target: torch.Tensor, spec: Spec, call: Call) -> None:
    """Top-k ids in the global vocabulary and distinct, log-probs not NaN nor summing
    above 1, per non-ignored token: the same tensors (so errors) on every rank."""
    ids, lps, vg = teacher.ids, teacher.logprobs, call.layout.global_size
    if spec.has_target:
        ids, lps = ids[target != call.opts.ignore_index], lps[target != call.opts.ignore_index]
    if ids.numel() == 0:
        return
    if bool(((ids < 0) | (ids >= vg)).any()):
        raise ValueError(f"teacher_topk_ids: expected ids in [0, {vg}) (the global vocabulary)")
    s = ids.sort(dim=1).values
    if bool((s[:, 1:] == s[:, :-1]).any()):
        raise ValueError("teacher_topk_ids: expected distinct ids per token")
    if bool(torch.isnan(lps).any()) or bool((torch.exp(lps).sum(dim=1) > 1.01).any()):
        raise ValueError(
            "teacher_topk_logprobs: expected log-probs (no NaN, exp summing to at most 1)"
        )
