"""Every rank agrees, or every rank fails alike: the fingerprint of a call.

The ranks of the tensor-parallel group must pass the same options, the same tokens and
targets, the same dtypes and the same gradient needs; where they do not, the loss is
silently wrong (a label smoothing on one rank only), or the ranks enter collectives of
different sizes and gloo aborts one process while the other waits (a different token
count, hidden size or mode). So before any collective whose size depends on the inputs,
each rank puts what must agree into one small float64 vector ``f`` and the group makes one
SUM all-reduce of a ``[ranks, fields]`` table in which each rank fills its own row (a few
hundred bytes). Every rank then reads every rank's values and raises the same
``ValueError`` naming the parameter that differs and each rank's value
(``docs/design.md``, "Collectives and agreement"). A rank whose own arguments were
refused takes part too (with its flag set), so the others raise instead of waiting.

What is compared: the options of the math and of execution, the dtypes and sizes, grad
mode and ``requires_grad`` flags, and (without sequence parallelism, where each rank
brings its own tokens) the token count and checksums of the targets and of ``hidden``.
``check_inputs=False`` skips it (one small collective and a host sync per call).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from vocab_parallel.options import (
    BACKENDS,
    FILTER_GRADS,
    MODES,
    OPTION_NAMES,
    REDUCTIONS,
    LossOptions,
)
from vocab_parallel.parallel.collectives import all_reduce, group_ranks, world_size

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# The objectives (``vocab_parallel.engine.objective``), in the order of their code in the
# table, and the most entries one adds (each rank's row is padded to it).
OBJECTIVES = ("cross entropy", "token statistics", "distillation")
MAX_FIELDS = 12
# Entries whose difference means another rank refused its arguments.
REFUSED = "arguments refused on this rank"
# The parameters a refusal's message can start with. The refusing rank puts which one (and
# whether it raised a TypeError) in its REFUSED entry, so that every rank's error names it
# without another collective. Every rank runs this code: one order everywhere.
REFUSABLE = OPTION_NAMES + (
    "process_group", "hidden", "weight", "target", "num_items_in_batch",
    "entropy", "sum_p_squared", "top_k", "argmax",
    "teacher_head", "teacher_hidden", "teacher_weight", "teacher_bias", "teacher_topk_ids",
    "teacher_topk_logprobs", "divergence", "beta", "hard_label_weight", "options",
)  # fmt: skip


def _code(value, choices) -> float:
    return float(choices.index(value)) if value in choices else -1.0


def _filter_code(filter_eps) -> float:
    """``filter_eps`` as a number: -1 for None, -2 for ``"auto"``, else its value."""
    return -1.0 if filter_eps is None else -2.0 if filter_eps == "auto" else filter_eps


def _items_code(n) -> object:
    """``num_items_in_batch`` as an entry: -1 for None (a count is never negative), a
    tensor's value as a 0-d float64 tensor (not read here)."""
    if n is None:
        return -1.0
    if isinstance(n, torch.Tensor):
        return n.detach().reshape(()).to(torch.float64)
    return float(n)


def _checksum(t: torch.Tensor) -> list:
    """Two float64 checksums of ``t`` (``[N, ...]``): the sum of its per-row sums and their
    position-weighted sum (a change of a value or an order of rows changes them). One read
    of ``t``, no copy of it; NaN and infinities map to fixed values, so equal tensors give
    equal checksums."""
    if t.numel() == 0:
        return [0.0, 0.0]
    rows = t.detach().reshape(t.shape[0], -1) if t.dim() > 1 else t.detach().reshape(-1, 1)
    per_row = torch.nan_to_num(
        rows.sum(dim=1, dtype=torch.float64), nan=7e10, posinf=5e10, neginf=-3e10
    )  # the sums stay finite
    ramp = torch.arange(1, per_row.numel() + 1, device=per_row.device, dtype=torch.float64)
    ramp = torch.remainder(ramp, 1021.0) + 1.0
    return [per_row.sum(), (per_row * ramp).sum()]


def checksum_fields(parameter: str, t: torch.Tensor) -> list[tuple[str, str, object]]:
    """An objective's agreement entries of a tensor every rank must hold alike: its two
    checksums (:func:`_checksum`), named by ``parameter``."""
    sums = _checksum(t)
    return [
        ("values (checksum)", parameter, sums[0]),
        ("values (position checksum)", parameter, sums[1]),
    ]


# What is compared, in the order of the row every rank sends (the same length on every
# rank: entries that do not apply are 0 on every rank), and the parameter an error names.
FIELDS = (
    (REFUSED, "process_group"),
    ("reduction", "reduction"),
    ("mode", "mode"),
    ("backend", "backend"),
    ("ignore_index", "ignore_index"),
    ("label_smoothing", "label_smoothing"),
    ("softcap", "softcap"),
    ("z_loss", "z_loss"),
    ("return_lse", "return_lse"),
    ("sequence_parallel", "sequence_parallel"),
    ("bias given", "bias"),
    ("class_weight given", "class_weight"),
    ("temperature as a tensor", "temperature"),
    ("temperature", "temperature"),
    ("dtype", "hidden"),
    ("dtype", "weight"),
    ("hidden size (last dim)", "hidden"),
    ("grad mode (torch.is_grad_enabled())", "hidden"),
    ("requires_grad", "hidden"),
    ("requires_grad", "weight"),
    ("requires_grad", "bias"),
    ("filter_eps", "filter_eps"),
    ("filter_grads", "filter_grads"),
    ("num_items_in_batch", "num_items_in_batch"),
    ("numbers of tokens", "hidden"),
    ("values (checksum)", "target"),
    ("values (position checksum)", "target"),
    ("values (checksum)", "hidden"),
    ("values (position checksum)", "hidden"),
    ("values (checksum)", "temperature"),
)
# Then each rank's objective (its code in OBJECTIVES) and the objective's own entries
# (``Objective.fields``), padded to MAX_FIELDS.
OBJECTIVE = len(FIELDS)


def fingerprint(
    opts: LossOptions,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    num_items_in_batch: object = None,
) -> list[object]:
    """What must agree across the ranks for this call (``hidden [N, H]``, ``target [N]``
    flattened, before any gathering; ``num_items_in_batch``: the loss's, checked
    already), in the order of :data:`FIELDS`; floats or 0-d tensors (the checksums and a
    tensor count stay on the device until the one collective). :func:`objective_row`
    follows it."""
    temp = opts.temperature
    grad = torch.is_grad_enabled()
    bias = opts.bias
    # Under sequence parallelism the token exchange checks hidden's size, dtype and
    # gradient need itself (vocab_parallel.parallel.sequence_parallel): 0 here on every rank.
    sp = 0.0 if opts.sequence_parallel else 1.0
    f = [
        0.0,
        _code(opts.reduction, REDUCTIONS),
        _code(opts.mode, MODES),
        _code(opts.backend, BACKENDS),
        float(opts.ignore_index),
        opts.label_smoothing,
        -1.0 if opts.softcap is None else opts.softcap,
        opts.z_loss,
        float(opts.return_lse),
        float(opts.sequence_parallel),
        float(bias is not None),
        float(opts.class_weight is not None),
        float(isinstance(temp, torch.Tensor)),
        0.0 if isinstance(temp, torch.Tensor) else float(temp),
        sp * _code(hidden.dtype, _DTYPES),
        _code(weight.dtype, _DTYPES),
        sp * hidden.shape[-1],
        sp * grad,
        sp * (grad and hidden.requires_grad),
        float(grad and weight.requires_grad),
        float(grad and bias is not None and bias.requires_grad),
        _filter_code(opts.filter_eps),
        _code(opts.filter_grads, FILTER_GRADS),
        _items_code(num_items_in_batch),
    ]
    if opts.sequence_parallel:  # each rank brings its own tokens: nothing to compare
        return f + [0.0] * 6
    f.append(float(target.shape[0]))
    f += _checksum(target) + _checksum(hidden)
    f.append(_checksum(temp)[1] if isinstance(temp, torch.Tensor) else 0.0)
    return f


def objective_row(name: str, own: list[tuple[str, str, object]]) -> list[object]:
    """What follows :func:`fingerprint`: the objective's code in
    :data:`~vocab_parallel.engine.objective.OBJECTIVES` and its own entries ``own`` (``(what,
    parameter, value)``, from ``Objective.fields``), padded to
    :data:`~vocab_parallel.engine.objective.MAX_FIELDS`."""
    if len(own) > MAX_FIELDS:
        raise RuntimeError(f"an objective adds at most {MAX_FIELDS} agreement entries")
    values = [value for _, _, value in own]
    return [float(OBJECTIVES.index(name)), *values, *[0.0] * (MAX_FIELDS - len(values))]


def _shown(name: str, value: float) -> str:
    """A fingerprint entry as the user knows it (codes back to names)."""
    if name == "objective" and 0 <= value < len(OBJECTIVES):
        return OBJECTIVES[int(value)]
    if name == "dtype":
        return str(_DTYPES[int(value)]).removeprefix("torch.") if value >= 0 else "other"
    for n, choices in (("reduction", REDUCTIONS), ("mode", MODES), ("backend", BACKENDS)):
        if name == n and 0 <= value < len(choices):
            return repr(choices[int(value)])
    if name == "filter_grads" and 0 <= value < len(FILTER_GRADS):
        return repr(FILTER_GRADS[int(value)])
    if name in ("softcap", "filter_eps", "num_items_in_batch") and value == -1.0:
        return "None"
    if name == "filter_eps" and value == -2.0:
        return "'auto'"
    return f"{value:.10g}" if "checksum" in name else f"{value:g}"


def _refusal_code(err: BaseException | None) -> float:
    """A refusing rank's REFUSED entry: ``1 + 2 i + t``, ``i`` the index in
    :data:`REFUSABLE` of the parameter its message starts with (``len(REFUSABLE)`` for
    another, or no error), ``t`` 1 for a ``TypeError``, 0 for a ``ValueError``."""
    name = "" if err is None else str(err).split(":", 1)[0].split(",", 1)[0].strip()
    i = REFUSABLE.index(name) if name in REFUSABLE else len(REFUSABLE)
    return 1.0 + 2.0 * i + float(isinstance(err, TypeError))


def _refused(code: float, refused_by: list[str]) -> Exception:
    """What a rank whose arguments were accepted raises when ``refused_by`` refused theirs,
    from the first one's REFUSED entry ``code``: its exception type, and a message
    starting with the parameter it named."""
    i, t = divmod(int(code) - 1, 2)
    kind = TypeError if t else ValueError
    who = f"{', '.join(refused_by)} of the group"
    rest = (
        "; every rank of the tensor-parallel group must pass valid arguments, the same "
        "options and the same tokens"
    )
    if i < len(REFUSABLE):
        return kind(
            f"{REFUSABLE[i]}: {who} refused its argument (a {kind.__name__} there, whose "
            f"message says why){rest}"
        )
    return kind(
        f"process_group: {who} refused its arguments (a {kind.__name__} there, whose message "
        f"names the parameter){rest}"
    )


def check_agreement(
    values: list[object] | None,
    process_group: dist.ProcessGroup | None,
    device: torch.device,
    own_error: BaseException | None = None,
    own: tuple[tuple[str, str], ...] = (),
) -> None:
    """One SUM all-reduce of a ``[ranks, fields]`` table (each rank fills its row): every
    rank then reads every rank's fingerprint and raises the same ``ValueError`` when they
    differ, naming the parameter and each rank's value. ``own_error``: this rank's refusal
    of its arguments (``values`` is then None), raised here after the collective; the
    other ranks raise an error of its type naming its parameter and the rank that
    refused. ``own``: ``(what, parameter)`` of the objective's own entries (the call's;
    the ranks compare the objective first, so theirs have the same names)."""
    n = world_size(process_group)
    if n == 1:
        if own_error is not None:
            raise own_error
        return
    rank, k = dist.get_rank(process_group), OBJECTIVE + 1 + MAX_FIELDS
    table = torch.zeros((n, k), dtype=torch.float64, device=device)
    if values is None:
        table[rank, 0] = _refusal_code(own_error)
    else:
        table[rank] = torch.stack(
            [torch.as_tensor(v, dtype=torch.float64).to(device) for v in values]
        )
    all_reduce(table, "SUM", process_group, "agreement of the ranks (options, inputs)")
    rows = table.tolist()
    names = [f"rank {r}" for r in group_ranks(process_group)]
    refused_by = [name for name, row in zip(names, rows, strict=True) if row[0] != 0.0]
    if refused_by:
        if own_error is not None:
            raise own_error
        raise _refused(next(row[0] for row in rows if row[0] != 0.0), refused_by)
    for field, (what, param) in enumerate([*FIELDS, ("objective", "process_group"), *own]):
        # NaN (a tensor's count, not read before) is one value: math.nan, one object
        column = [v if v == v else math.nan for v in (row[field] for row in rows)]
        if len(set(column)) == 1:
            continue
        per_rank = ", ".join(
            f"{name}: {_shown(what, v)}" for name, v in zip(names, column, strict=True)
        )
        raise ValueError(
            f"{param}: the ranks of process_group pass different {what} ({per_rank}); every "
            "rank of the tensor-parallel group must pass the same options, dtypes, gradient "
            "needs, tokens, targets and hidden states"
        )
