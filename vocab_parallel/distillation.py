"""Knowledge distillation between two vocabulary-sharded heads, neither's logits kept.

    loss = vocab_parallel_distillation_loss(hidden, weight, teacher_hidden=h_t,
                                            teacher_weight=w_t, target=labels,
                                            hard_label_weight=0.1)

With ``z_s = softcap(hidden @ W.T + b)``, ``p_s = softmax(z_s / T)`` over the GLOBAL
vocabulary and the teacher's ``p_t`` (``softmax(softcap(teacher_hidden @ W_t.T + b_t) /
T)``, ``W_t`` the same vocabulary rows as ``W``; or its top-k log-probs and the tail bin),
each token's loss is ``(1 - a) D(p_t, p_s) + a CE(z_s, target)`` (``docs/design.md``,
"Distillation": the formulas, the collectives). Every rank walks its own columns in
chunks (``vocab_parallel.objectives.distill``); the normalisers of both heads and the
divergence's sums are per-token scalars in one MAX and one SUM all-reduce (the JSD adds a
second pass and one more SUM of two). Gradients reach the student's hidden, weight and
bias only.

Modes: ``"memory_saving"`` recomputes both heads' logits in the backward (nothing
``[tokens, V_local]`` kept); ``"high_performance"`` keeps both heads' fp32 logits shard;
``"grad_in_forward"`` (``"auto"`` for a scalar loss that will be differentiated, not fp16
nor float64) walks token chunks in the forward, keeps one chunk of both heads' logits,
and computes the gradients there, so the logits of each head are made once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from vocab_parallel.backends.interface import Outputs
from vocab_parallel.engine import precision
from vocab_parallel.engine.autograd import guarded_backward, no_autocast, sum_grad_input
from vocab_parallel.engine.chunking import gradient_products
from vocab_parallel.engine.entry import autocast_inputs, prepare_call
from vocab_parallel.engine.grad_in_forward import hand_out, outputs, walk_token_chunks
from vocab_parallel.engine.objective import Call, Objective
from vocab_parallel.engine.reduction import mean_denominator, reduce_losses
from vocab_parallel.objectives.distill import (
    DIVERGENCES,
    Columns,
    HeadLogits,
    KeptForwardKL,
    RowTerms,
    Spec,
    Teacher,
    chunk_columns,
    fused_gradient,
    gradient_chunk,
    jsd_sums,
    local_statistics,
    reduce_statistics,
)
from vocab_parallel.options import LossOptions, PendingOptions, documented
from vocab_parallel.parallel import sequence_parallel as _sp
from vocab_parallel.parallel.agreement import _checksum
from vocab_parallel.parallel.collectives import world_size
from vocab_parallel.parallel.dtensor import is_dtensor

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
        hidden: ``[..., H]`` the student's hidden states (fp32/fp16/bf16; float64: torch
            backend), identical on every rank (this rank's tokens with
            ``sequence_parallel``).
        weight: ``[V_local, H]`` the student's rows (a ``Shard(0)`` DTensor too); ``bias``
            its ``[V_local]`` rows.
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
        {shared: softcap, sequence_parallel, backend, check_inputs}
        mode: ``"auto"``, ``"grad_in_forward"``, ``"memory_saving"`` or
            ``"high_performance"`` (the module docstring).

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


def _number(name: str, value: Any, lo: float, hi: float, open_ends: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    ok = lo < value < hi if open_ends else lo <= value <= hi
    if not ok:
        sign = "<" if open_ends else "<="
        raise ValueError(f"{name}: expected {lo:g} {sign} {name} {sign} {hi:g}, got {value}")
    return float(value)


def _token_shape(hidden, sequence_parallel: bool) -> tuple:
    """The token dims of ``hidden`` as the loss will see them (a DTensor's local tokens
    under sequence parallelism, else its global ones)."""
    if is_dtensor(hidden) and sequence_parallel:
        from vocab_parallel.parallel.dtensor import _is_replicate

        if not _is_replicate(hidden.placements[0]):
            return tuple(hidden.to_local().shape[:-1])
    return tuple(hidden.shape[:-1])


def _local(t, name: str, sequence_parallel: bool = False, rows: bool = False):
    """A teacher DTensor as a plain tensor: a weight or bias (``rows``) placed Shard(0)
    gives its local rows; hidden states their local tokens under sequence parallelism
    (else all of them)."""
    if not is_dtensor(t):
        return t
    from vocab_parallel.parallel.dtensor import _is_replicate, _is_shard

    p = t.placements[0]
    if rows:
        if t.device_mesh.ndim != 1 or not _is_shard(p, 0, t.dim()):
            raise ValueError(f"{name}: a DTensor placed {p!r}; expected Shard(0) on a 1-D mesh")
        return t.to_local()
    if _is_replicate(p) or sequence_parallel:
        return t.to_local()
    return t.full_tensor()


def _check_teacher(hidden, weight, given: dict, target, opts: LossOptions, spec: Spec) -> dict:
    """The teacher's tensors checked against the student's (messages name the
    parameter), DTensors unwrapped: the plain tensors by the names of ``given``."""
    dense = given["hidden"] is not None or given["weight"] is not None
    sparse = given["ids"] is not None or given["logprobs"] is not None
    if dense == sparse:
        raise ValueError(
            "teacher_hidden: give the dense teacher (teacher_hidden and teacher_weight) or "
            "the sparse one (teacher_topk_ids and teacher_topk_logprobs), exactly one"
        )
    sp = opts.sequence_parallel
    tokens = _token_shape(hidden, sp) if isinstance(hidden, torch.Tensor) else None
    out = {}
    if dense:
        for name in ("hidden", "weight"):
            if not isinstance(given[name], torch.Tensor):
                other = "teacher_weight" if name == "hidden" else "teacher_hidden"
                raise TypeError(
                    f"teacher_{name}: expected a torch.Tensor (with {other}), got "
                    f"{type(given[name]).__name__}"
                )
        th = _local(given["hidden"], "teacher_hidden", sp)
        tw = _local(given["weight"], "teacher_weight", rows=True)
        tb = given["bias"]
        if tb is not None and not isinstance(tb, torch.Tensor):
            raise TypeError(f"teacher_bias: expected None or a tensor, got {type(tb).__name__}")
        tb = _local(tb, "teacher_bias", rows=True)
        if not th.is_floating_point() or th.dim() < 1:
            raise TypeError(
                f"teacher_hidden: expected a floating tensor [..., H_t], got {th.dtype}"
            )
        if tw.dim() != 2 or tw.dtype != th.dtype:
            raise TypeError(
                f"teacher_weight: expected a 2-D tensor [V_local, H_t] of teacher_hidden's "
                f"dtype {th.dtype}, got shape {tuple(tw.shape)} and {tw.dtype}"
            )
        if tokens is not None and tuple(th.shape[:-1]) != tokens:
            raise ValueError(
                f"teacher_hidden: expected the tokens of hidden {tokens} (then H_t), got "
                f"shape {tuple(th.shape)}"
            )
        rows = weight.to_local().shape[0] if is_dtensor(weight) else weight.shape[0]
        if tuple(tw.shape) != (rows, th.shape[-1]):
            raise ValueError(
                f"teacher_weight: expected shape [{rows}, {th.shape[-1]}] (the vocabulary "
                f"rows of weight, teacher_hidden's size), got {tuple(tw.shape)}"
            )
        if tb is not None and (tuple(tb.shape) != (rows,) or tb.dtype != tw.dtype):
            raise ValueError(
                f"teacher_bias: expected shape [{rows}] and dtype {tw.dtype}, got "
                f"{tuple(tb.shape)} and {tb.dtype}"
            )
        out = dict(hidden=th, weight=tw, bias=tb)
    else:
        if given["bias"] is not None:
            raise ValueError("teacher_bias: only with the dense teacher (teacher_weight)")
        ids, lps = given["ids"], given["logprobs"]
        for name, t in (("teacher_topk_ids", ids), ("teacher_topk_logprobs", lps)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        ids = _local(ids, "teacher_topk_ids", sp)
        lps = _local(lps, "teacher_topk_logprobs", sp)
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"teacher_topk_ids: expected an integer dtype, got {ids.dtype}")
        if not lps.is_floating_point():
            raise TypeError(f"teacher_topk_logprobs: expected a float dtype, got {lps.dtype}")
        if ids.dim() < 1 or ids.shape[-1] < 1 or (tokens is not None and ids.shape[:-1] != tokens):
            raise ValueError(
                f"teacher_topk_ids: expected shape [*{tokens}, k] with k >= 1, got "
                f"{tuple(ids.shape)}"
            )
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
        out = dict(ids=ids, logprobs=lps)
    device = hidden.device if isinstance(hidden, torch.Tensor) else None
    for name, t in out.items():
        if t is not None and device is not None and t.device != device:
            raise ValueError(f"teacher_{name}: on device {t.device}, but hidden is on {device}")
    if spec.ce and target is None:
        raise ValueError("target: hard_label_weight > 0 needs the hard labels (target)")
    return out


def run_distillation(
    hidden, weight, given: dict, target, opts: LossOptions | PendingOptions, process_group,
    divergence, beta, hard_label_weight,
) -> torch.Tensor:  # fmt: skip
    """:func:`vocab_parallel_distillation_loss` for options already made or pending (made,
    like the other arguments checked, where a refusal raises on every rank alike:
    ``prepare_call``); ``given``: the teacher's tensors by name (``hidden``, ``weight``,
    ``bias``, ``ids``, ``logprobs``)."""
    objective = Distillation(hidden, weight, given, target, divergence, beta, hard_label_weight)
    # target None (no hard labels): every token counts, the engine's checks see zeros
    prep = prepare_call(hidden, weight, target, opts, process_group, objective)
    call, h2, weight, bias, t1, slices, shape = prep
    opts, mode, spec, teacher = call.opts, call.mode, objective.spec, objective.teacher
    if mode == "grad_in_forward":
        needs = tuple(t is not None and t.requires_grad for t in (h2, weight, bias))
        return GradInForwardDistillation.apply(h2, weight, bias, t1, call, spec, teacher, needs)
    losses, weights = DistillationFunction.apply(h2, weight, bias, t1, call, spec, teacher)
    if opts.reduction == "none":
        losses = _sp.own_tokens(losses, slices).reshape(shape)
    return reduce_losses(losses, weights, opts.reduction)


class Distillation(Objective):
    """Distillation, as the engine's entry sees it: its own arguments checked in the
    entry's guarded step (the divergence, ``beta``, ``hard_label_weight``, the teacher's
    tensors: kept as ``spec`` and ``checked``), its entries of the ranks' agreement, its
    mode."""

    name = "distillation"

    def __init__(self, hidden, weight, given: dict, target, divergence, beta, hard_label_weight):
        self.args = (hidden, weight, given, target, divergence, beta, hard_label_weight)
        self.spec: Spec | None = None
        self.checked: dict = {}
        self.teacher: Teacher | None = None
        self.sequence_parallel = False

    def check(self, opts: LossOptions) -> None:
        hidden, weight, given, target, divergence, beta, hard_label_weight = self.args
        if divergence not in DIVERGENCES:
            raise ValueError(f"divergence: expected one of {DIVERGENCES}, got {divergence!r}")
        b = _number("beta", beta, 0.0, 1.0, open_ends=True)
        a = _number("hard_label_weight", hard_label_weight, 0.0, 1.0, open_ends=False)
        sparse = given["ids"] is not None or given["logprobs"] is not None
        spec = Spec(divergence, b, a, sparse, target is not None)
        if opts.label_smoothing or opts.z_loss or opts.class_weight is not None or opts.return_lse:
            raise ValueError("options: label_smoothing, z_loss, class_weight and return_lse "
                             "are options of the cross entropy, not of distillation")  # fmt: skip
        self.checked = _check_teacher(hidden, weight, given, target, opts, spec)
        self.spec, self.sequence_parallel = spec, opts.sequence_parallel

    def fields(self) -> list[tuple[str, str, object]]:
        spec, checked, sp = self.spec, self.checked, self.sequence_parallel
        f = [
            ("divergence", "divergence", float(DIVERGENCES.index(spec.divergence))),
            ("beta", "beta", spec.beta),
            ("hard_label_weight", "hard_label_weight", spec.hard_label_weight),
            ("target given", "target", float(spec.has_target)),
        ]
        if spec.sparse:
            ids, lps = checked["ids"], checked["logprobs"]
            f += [("teacher form (dense, top-k)", "teacher_topk_ids", 2.0)]
            f += [("teacher size (k)", "teacher_topk_ids", float(ids.shape[-1]))]
            if not sp:  # each rank brings its own tokens under sequence parallelism
                f += [("values (checksum)", "teacher_topk_logprobs", _checksum(lps)[1])]
                f += [("values (checksum)", "teacher_topk_ids", _checksum(ids)[1])]
            return f
        th = checked["hidden"]
        f += [("teacher form (dense, top-k)", "teacher_hidden", 1.0)]
        f += [("teacher hidden size", "teacher_hidden", float(th.shape[-1]))]
        f += [("teacher_bias given", "teacher_bias", float(checked["bias"] is not None))]
        if not sp:
            sums = _checksum(th.reshape(-1, th.shape[-1]))
            f += [("values (checksum)", "teacher_hidden", sums[0])]
            f += [("values (position checksum)", "teacher_hidden", sums[1])]
        return f

    def prepared(self, call: Call, target: torch.Tensor, slices) -> None:
        """The teacher's tokens gathered like the student's, its top-k checked."""
        accum = precision.accumulate_dtype(self.args[0].dtype)
        self.teacher = _gather_teacher(self.checked, self.spec, slices, accum)
        if call.opts.check_inputs and self.spec.sparse:
            _check_topk(self.teacher, target, self.spec, call)

    def mode(self, opts: LossOptions, track: bool, dtype: torch.dtype) -> str:
        mode = opts.mode
        if mode in ("memory_saving", "high_performance"):
            return mode
        if mode == "auto" and dtype in (torch.float16, torch.float64):
            return "memory_saving"  # as the loss (vocab_parallel.loss.resolve_mode)
        if opts.reduction != "none" and track:
            return "grad_in_forward"
        return "memory_saving"


def _gather_teacher(checked: dict, spec: Spec, slices, accum) -> Teacher:
    """The teacher's tensors flattened to the call's tokens (gathered under sequence
    parallelism), autocast like the student's, detached; top-k log-probs in ``accum``."""

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
    """Top-k ids in the global vocabulary and distinct, log-probs not NaN nor above 0 by
    more than rounding, per token (ignored tokens are not read); the same tensors on every
    rank (replicated, or gathered), so the same error everywhere."""
    ids, lps = teacher.ids, teacher.logprobs
    keep = target != call.opts.ignore_index if spec.has_target else None
    if keep is not None:
        ids, lps = ids[keep], lps[keep]
    vg = call.layout.global_size
    if ids.numel() == 0:
        return
    if bool(((ids < 0) | (ids >= vg)).any()):
        raise ValueError(f"teacher_topk_ids: expected ids in [0, {vg}) (the global vocabulary)")
    if ids.shape[1] > 1:
        s = ids.sort(dim=1).values
        if bool((s[:, 1:] == s[:, :-1]).any()):
            raise ValueError("teacher_topk_ids: expected distinct ids per token")
    if bool(torch.isnan(lps).any()) or bool((torch.exp(lps).sum(dim=1) > 1.01).any()):
        raise ValueError(
            "teacher_topk_logprobs: expected log-probs (no NaN, exp summing to at most 1)"
        )


# ---------------------------------------------------------------------------------------
# The autograd Functions
# ---------------------------------------------------------------------------------------


def _columns(call: Call, spec: Spec, target, teacher: Teacher):
    """``(Columns, ignored)`` of these tokens on this rank's shard."""
    start, size = call.layout.start, call.layout.size
    if spec.has_target:
        ignored = target == call.opts.ignore_index
    else:
        ignored = torch.zeros(target.shape, dtype=torch.bool, device=target.device)
    local_target = None
    if spec.ce:
        local = target - start
        here = (local >= 0) & (local < size) & ~ignored
        local_target = torch.where(here, local, -1)
    local_ids = None
    if spec.sparse:
        local = teacher.ids - start
        local_ids = torch.where((local >= 0) & (local < size), local, -1)
    return Columns(local_target, local_ids), ignored


def _heads(call, spec, hidden, weight, bias, teacher, saved=(None, None), fill=False):
    accum = precision.accumulate_dtype(hidden.dtype)
    cap = call.opts.softcap
    student = HeadLogits(call.backend, hidden, weight, bias, cap, accum, saved[0], fill)
    if spec.sparse:
        return student, None
    tea = HeadLogits(
        call.backend, teacher.hidden, teacher.weight, teacher.bias, cap, accum, saved[1], fill
    )
    return student, tea


def _forward_terms(call, spec, student, tea, teacher, cols, inv_t, rows, v) -> RowTerms:
    """The per-row terms of these tokens: the first pass (filling saved logits, if any),
    the all-reduces, and the JSD's second pass (reading them)."""
    accum, device = student.accum, student.x.device
    stats = local_statistics(spec, student, tea, inv_t, cols, v, rows, accum, device)
    for head in (student, tea):
        if head is not None:
            head.fill = False
    terms = reduce_statistics(spec, stats, teacher, call.process_group)
    if spec.divergence == "jsd":
        terms = jsd_sums(spec, student, tea, inv_t, terms, v, rows, call.process_group)
    return terms


def _token_losses(spec: Spec, terms: RowTerms, ignored) -> torch.Tensor:
    a = spec.hard_label_weight
    loss = terms.d if a == 0.0 else (1.0 - a) * terms.d + a * terms.ce
    return loss.masked_fill(ignored, 0.0)


def _products(call, spec, hidden, weight, bias, student, tea, terms, cols, inv_t, grad, out,
              kept: KeptForwardKL | None = None):  # fmt: skip
    """The student's gradients of these tokens: ``G`` chunk by chunk
    (:func:`~vocab_parallel.objectives.distill.gradient_chunk`, or ``kept``'s blocks) through
    the shared products."""
    a = spec.hard_label_weight
    scale_d = grad * (1.0 - a)
    scale_ce = grad * a if spec.ce else None
    cap = call.opts.softcap

    def make_g(v0, v1, x_op, w_op):
        z = student.chunk(v0, v1)
        t = None if tea is None else tea.chunk(v0, v1)
        return gradient_chunk(spec, terms, z, t, inv_t, scale_d, scale_ce, cols, v0, v1, cap)

    cv = chunk_columns(hidden.shape[0], weight.shape[0], hidden.device.type)
    if kept is not None:
        make_g, cv = kept.gradient(terms, scale_d, scale_ce, cols), kept.cv
    else:  # the Triton kernel of a dense teacher's G, where it applies
        fused = fused_gradient(spec, terms, student, tea, inv_t, scale_d, scale_ce, cols, cv)
        make_g = make_g if fused is None else fused
    bias_dtype = hidden.dtype if bias is None else bias.dtype
    with precision.cpu_bf16_math(hidden.dtype, hidden.device.type):
        return gradient_products(
            hidden, weight, cv, make_g, out, g_reads_operands=False, bias_grad_dtype=bias_dtype
        )


class DistillationFunction(torch.autograd.Function):
    """``(losses, weights)`` ``[N]`` of memory-saving and high-performance modes: each
    token's ``(1 - a) D + a CE`` (0 where ignored) and whether it counts (what a mean
    divides by; not differentiable). Only ``hidden``, ``weight`` and ``bias`` get
    gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, call: Call, spec: Spec, teacher: Teacher):
        with no_autocast(hidden.device.type):
            return DistillationFunction._forward(
                ctx, hidden, weight, bias, target, call, spec, teacher
            )

    @staticmethod
    def _forward(ctx, hidden, weight, bias, target, call, spec, teacher):
        cols, ignored = _columns(call, spec, target, teacher)
        n, v = hidden.shape[0], weight.shape[0]
        accum = precision.accumulate_dtype(hidden.dtype)
        saved = (None, None)
        keep = call.track and call.mode == "high_performance"
        if keep:
            kept = [torch.empty((n, v), dtype=accum, device=hidden.device)]
            kept.append(None if spec.sparse else torch.empty_like(kept[0]))
            saved = tuple(kept)
        student, tea = _heads(call, spec, hidden, weight, bias, teacher, saved, fill=keep)
        terms = _forward_terms(call, spec, student, tea, teacher, cols, call.inv_temperature, n, v)
        losses = _token_losses(spec, terms, ignored)
        weights = (~ignored).to(accum)
        ctx.mark_non_differentiable(weights)
        ctx.set_materialize_grads(False)
        if call.track:
            ctx.save_for_backward(hidden, weight, bias, target, ignored, *saved)
            ctx.terms, ctx.teacher, ctx.cols = terms, teacher, cols
        ctx.call, ctx.spec, ctx.device_type = call, spec, hidden.device.type
        return losses, weights

    @staticmethod
    def backward(ctx, grad_loss, grad_weights):
        grads = guarded_backward(
            ctx, grad_loss, lambda need: DistillationFunction._gradients(ctx, grad_loss, need)
        )
        return (*grads, None, None, None, None)

    @staticmethod
    def _gradients(ctx, grad_loss, need):
        hidden, weight, bias, target, ignored, s_student, s_teacher = ctx.saved_tensors
        call, spec = ctx.call, ctx.spec
        accum = precision.accumulate_dtype(hidden.dtype)
        grad = grad_loss.to(accum).masked_fill(ignored, 0.0)
        student, tea = _heads(call, spec, hidden, weight, bias, ctx.teacher, (s_student, s_teacher))
        tp = world_size(call.process_group) > 1
        out = Outputs(need[0], need[1], need[2], grad_input_dtype=accum if tp else None)
        grads = _products(call, spec, hidden, weight, bias, student, tea, ctx.terms, ctx.cols,
                          call.inv_temperature, grad, out)  # fmt: skip
        grad_input = sum_grad_input(grads.input, call.process_group, hidden.dtype)
        return grad_input, grads.weight, grads.bias


class GradInForwardDistillation(torch.autograd.Function):
    """The loss (a 0-d sum or mean), the student's gradients computed on the way by the
    engine's token-chunk walker (``vocab_parallel.engine.grad_in_forward``): chunks whose two
    heads' logits are made once, kept for the chunk's statistics, the JSD's second pass
    and ``G``. The backward scales the saved gradients by the upstream scalar."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, call, spec, teacher, needs):
        with no_autocast(hidden.device.type):
            return GradInForwardDistillation._forward(
                ctx, hidden, weight, bias, target, call, spec, teacher, needs
            )

    @staticmethod
    def _forward(ctx, hidden, weight, bias, target, call, spec, teacher, needs):
        cols, ignored = _columns(call, spec, target, teacher)
        accum = precision.accumulate_dtype(hidden.dtype)
        weights = (~ignored).to(accum)
        token_grad = weights.clone()
        if call.opts.reduction == "mean":
            token_grad = token_grad / mean_denominator(weights)
        losses = torch.zeros(hidden.shape[0], dtype=accum, device=hidden.device)
        parts: list[RowTerms] = []
        walk = _ChunkWalk(call, spec, hidden, weight, bias, teacher, cols, token_grad, needs)
        grads = walk.run(losses=losses, ignored=ignored, parts=parts)
        loss = losses.sum()
        if call.opts.reduction == "mean":
            loss = loss / mean_denominator(weights)
        ctx.set_materialize_grads(False)
        ctx.grads = grads
        ctx.dtypes = (hidden.dtype, hidden.dtype if bias is None else bias.dtype)
        ctx.device_type = hidden.device.type
        # What a second backward (retain_graph=True) recomputes the gradients from.
        ctx.save_for_backward(hidden, weight, bias, token_grad)
        ctx.call, ctx.spec, ctx.teacher, ctx.cols = call, spec, teacher, cols
        ctx.terms = _concat_terms(parts, hidden.shape[0], accum, hidden.device)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grads = hand_out(ctx, grad_loss, GradInForwardDistillation._recompute)
        return (*grads, None, None, None, None, None)

    @staticmethod
    def _recompute(ctx, grad_loss, need):
        hidden, weight, bias, token_grad = ctx.saved_tensors
        call, spec = ctx.call, ctx.spec
        accum = precision.accumulate_dtype(hidden.dtype)
        grad = token_grad * grad_loss.to(accum)
        if _kept(spec):  # the forward's walk again (its blocks: the same G)
            walk = _ChunkWalk(call, spec, hidden, weight, bias, ctx.teacher, ctx.cols, grad, need)
            grads = walk.run(terms=ctx.terms)
            dtypes = (hidden.dtype, *ctx.dtypes)
            pairs = zip(grads, dtypes, strict=True)
            return tuple(None if g is None else g.to(dt) for g, dt in pairs)
        student, tea = _heads(call, spec, hidden, weight, bias, ctx.teacher)
        tp = world_size(call.process_group) > 1
        out = Outputs(need[0], need[1], need[2], grad_input_dtype=accum if tp else None)
        grads = _products(call, spec, hidden, weight, bias, student, tea, ctx.terms, ctx.cols,
                          call.inv_temperature, grad, out)  # fmt: skip
        return sum_grad_input(grads.input, call.process_group, hidden.dtype), *grads[1:]


def _kept(spec: Spec) -> bool:
    """Whether grad-in-forward walks the kept blocks of
    :class:`~vocab_parallel.objectives.distill.KeptForwardKL` (the dense forward KL)."""
    return spec.divergence == "forward_kl" and not spec.sparse


class _ChunkWalk:
    """Distillation's step of the engine's token-chunk walker
    (``vocab_parallel.engine.grad_in_forward.walk_token_chunks``): per chunk, both heads' logits
    into the walker's blocks, the statistics and terms (or, for a second backward, the
    forward's ``terms``), the token losses, and ``G``'s products, each token's ``G``
    scaled by ``token_grad``."""

    def __init__(self, call, spec, hidden, weight, bias, teacher, cols, token_grad, needs):
        self.call, self.spec, self.hidden, self.weight = call, spec, hidden, weight
        self.bias, self.teacher, self.cols = bias, teacher, cols
        self.token_grad, self.needs = token_grad, needs

    def run(self, *, losses=None, ignored=None, parts=None, terms: RowTerms | None = None):
        """The walker's gradients; with ``terms`` no statistics are reduced and no losses
        made (a second backward), else ``losses`` and ``parts`` receive them."""
        call, spec = self.call, self.spec

        def step(r0, r1, blocks, buffers):
            x_c, t_c = self.hidden[r0:r1], self.teacher.rows(r0, r1)
            cols = Columns(*(None if c is None else c[r0:r1] for c in self.cols))
            inv_t = None if call.inv_temperature is None else call.inv_temperature[r0:r1]
            saved = (blocks[0], blocks[1] if len(blocks) > 1 else None)
            student, tea = _heads(call, spec, x_c, self.weight, self.bias, t_c, saved, fill=True)
            kept = None
            if _kept(spec):
                kept = KeptForwardKL(spec, student, tea, inv_t, call.opts.softcap)
                stats = kept.statistics(cols)
                if terms is None:
                    c_terms = reduce_statistics(spec, stats, t_c, call.process_group)
            elif terms is None:
                c_terms = _forward_terms(call, spec, student, tea, t_c, cols, inv_t, r1 - r0,
                                         self.weight.shape[0])  # fmt: skip
            if terms is None:
                losses[r0:r1] = _token_losses(spec, c_terms, ignored[r0:r1])
                parts.append(c_terms)
            else:
                c_terms = RowTerms(*(None if t is None else t[r0:r1] for t in terms))
            if buffers is not None:
                out, grad = outputs(self.needs, buffers), self.token_grad[r0:r1]
                _products(call, spec, x_c, self.weight, self.bias, student, tea, c_terms, cols,
                          inv_t, grad, out, kept)  # fmt: skip

        heads = 1 if spec.sparse else 2
        return walk_token_chunks(self.hidden, self.weight, call, self.needs, step, heads)


def _concat_terms(parts: list[RowTerms], n: int, dtype, device) -> RowTerms:
    """The per-row terms of every chunk as those of all rows."""
    if not parts:
        empty = torch.zeros(n, dtype=dtype, device=device)
        return RowTerms(empty, None, empty, None, None, None, None)
    fields = []
    for column in zip(*parts, strict=True):
        fields.append(None if column[0] is None else torch.cat(column))
    return RowTerms(*fields)
