"""Checks of the sharded loss against the unsharded float64 reference, rank by rank.

Used by ``launch/verify.py`` (under torchrun) and by the multi-rank tests. Every rank
builds the same full problem from a seed, keeps its own shard of the weight, runs
:func:`vocab_parallel_linear_cross_entropy` forward and backward with a random upstream
gradient, and compares the loss, ``hidden.grad`` and its ``weight.grad`` shard with
``F.cross_entropy(F.linear(x, W_full), y)`` computed in float64 (with the options of the
case: bias, softcap, z-loss, and the returned lse; ``vocab_parallel.reference``).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vocab_parallel.loss import vocab_parallel_linear_cross_entropy
from vocab_parallel.parallel.layout import shard_bounds
from vocab_parallel.reference import linear_cross_entropy_reference

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Relative (to the reference's largest magnitude) error allowed per input dtype. Half
# precision is bounded by rounding G to the input dtype before the products
# (docs/design.md, "Precision").
TOLERANCE = {"float32": 2e-5, "bfloat16": 3e-2, "float16": 5e-3}
# The loss itself accumulates exact products in fp32 whatever the input dtype and device.
LOSS_TOLERANCE = 1e-5


def loss_tolerance(dtype: str, device: torch.device) -> float:
    """The loss's (and lse's) tolerance: fp32's, for inputs of any ``dtype`` on any
    ``device`` (no product is rounded to the input dtype: ``vocab_parallel.engine.precision``)."""
    del dtype, device
    return LOSS_TOLERANCE


@dataclass(frozen=True)
class Case:
    """One configuration to check."""

    tokens: int = 37
    hidden: int = 33
    vocab: int = 389
    dtype: str = "float32"
    mode: str = "memory_saving"
    reduction: str = "mean"
    label_smoothing: float = 0.0
    backend: str = "auto"
    layout: str = "contiguous"  # or "reversed": rank r holds shard n-1-r via vocab_start_index
    all_ignored: bool = False
    seed: int = 0
    softcap: float | None = None
    z_loss: float = 0.0
    bias: bool = False  # a [V] bias, this rank's rows passed with the shard
    return_lse: bool = False  # also compare the returned lse
    class_weight: bool = False  # [V] class weights in [0.5, 2], this rank's rows passed
    temperature: str | None = None  # None, "scalar" (0.7) or "tensor" (one per token)


def grid(
    *,
    tokens=(37,),
    hidden=(33,),
    vocab=(389,),
    dtypes=("float32", "bfloat16"),
    modes=("grad_in_forward", "memory_saving", "high_performance"),
    reductions=("none", "sum", "mean"),
    label_smoothing=(0.0, 0.1),
    backends=("auto",),
    layouts=("contiguous",),
    softcaps=(None,),
    z_losses=(0.0,),
    biases=(False,),
) -> list[Case]:
    """Cartesian product of the options, as Cases (the loss options last: by default
    off, the grid of before). ``grad_in_forward`` is left out with ``reduction="none"``
    (where it runs as memory-saving mode)."""
    combos = itertools.product(
        tokens, hidden, vocab, dtypes, modes, reductions, label_smoothing, backends, layouts
    )
    options = list(itertools.product(softcaps, z_losses, biases))
    return [
        Case(*c, softcap=softcap, z_loss=z_loss, bias=bias)
        for c in combos
        for softcap, z_loss, bias in options
        if not (c[4] == "grad_in_forward" and c[5] == "none")
    ]


def _problem(case: Case, device: torch.device):
    g = torch.Generator().manual_seed(case.seed)
    bt, h, v = case.tokens, case.hidden, case.vocab
    x = torch.randn(bt, h, generator=g)
    w = torch.randn(v, h, generator=g) / h**0.5 * 4.0  # logits of a few units
    y = torch.randint(0, v, (bt,), generator=g)
    y[torch.rand(bt, generator=g) < 0.2] = -100  # some ignored tokens
    if case.all_ignored:
        y.fill_(-100)
    upstream = torch.rand(bt, generator=g) + 0.5  # per-token, never all ones
    scalar = float(torch.rand((), generator=g) + 0.5)
    dt = DTYPES[case.dtype]
    return x.to(dt).to(device), w.to(dt).to(device), y.to(device), upstream.to(device), scalar


def _bias(case: Case, device: torch.device) -> torch.Tensor | None:
    """The case's full ``[V]`` bias (its own generator: ``_problem`` is unchanged by it)."""
    if not case.bias:
        return None
    g = torch.Generator().manual_seed(case.seed + 7919)
    return torch.randn(case.vocab, generator=g).to(DTYPES[case.dtype]).to(device)


def _weights(case: Case, device: torch.device):
    """The case's full ``[V]`` class weights and its temperature (a float or ``[BT]``), from
    their own generator (``_problem`` is unchanged by them)."""
    g = torch.Generator().manual_seed(case.seed + 104729)
    cw = torch.rand(case.vocab, generator=g) * 1.5 + 0.5
    temp = torch.rand(case.tokens, generator=g) * 1.5 + 0.5
    class_weight = cw.to(device) if case.class_weight else None
    if case.temperature is None:
        return class_weight, 1.0
    if case.temperature == "scalar":
        return class_weight, 0.7
    return class_weight, temp.to(device)


def _sliced(temperature, rows):
    return temperature[rows] if isinstance(temperature, torch.Tensor) else temperature


def check_case(case: Case, process_group: dist.ProcessGroup | None, device: torch.device) -> dict:
    """Run one case on this rank; returns its errors and verdict (no collectives but the loss's)."""
    world = 1 if process_group is None else dist.get_world_size(process_group)
    rank = 0 if process_group is None else dist.get_rank(process_group)
    x, w_full, y, upstream, scalar = _problem(case, device)
    b_full = _bias(case, device)
    cw_full, temperature = _weights(case, device)
    shard = rank if case.layout == "contiguous" else world - 1 - rank
    lo, hi = shard_bounds(case.vocab, world)[shard]
    # The reversed layout also states the global size: the path without the layout collective.
    start, global_size = (None, None) if case.layout == "contiguous" else (lo, case.vocab)

    hidden = x.clone().requires_grad_(True)
    weight = w_full[lo:hi].clone().requires_grad_(True)
    bias = None if b_full is None else b_full[lo:hi].clone().requires_grad_(True)
    options = {"bias": bias} if bias is not None else {}
    if case.softcap is not None:
        options["softcap"] = case.softcap
    if case.z_loss:
        options["z_loss"] = case.z_loss
    if case.return_lse:
        options["return_lse"] = True
    if cw_full is not None:
        options["class_weight"] = cw_full[lo:hi]
    out = vocab_parallel_linear_cross_entropy(
        hidden,
        weight,
        y,
        process_group=process_group,
        vocab_start_index=start,
        global_vocab_size=global_size,
        reduction=case.reduction,
        label_smoothing=case.label_smoothing,
        mode=case.mode,
        backend=case.backend,
        temperature=temperature,
        **options,
    )
    loss, lse = out if case.return_lse else (out, None)
    up = upstream if case.reduction == "none" else torch.tensor(scalar, device=device)
    loss.backward(up)

    x64 = x.double().requires_grad_(True)
    w64 = w_full.double().requires_grad_(True)
    b64 = None if b_full is None else b_full.double().requires_grad_(True)
    ref, ref_lse = linear_cross_entropy_reference(
        x64,
        w64,
        y,
        bias=b64,
        softcap=case.softcap,
        z_loss=case.z_loss,
        reduction=case.reduction,
        label_smoothing=case.label_smoothing,
        class_weight=cw_full,
        temperature=temperature,
    )
    if case.reduction == "mean" and case.all_ignored:  # torch gives NaN; we promise 0
        ref = (F.linear(x64, w64, b64).sum() * 0.0).reshape(())
    ref.backward(up.double())

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        if not torch.isfinite(a).all():
            return float("inf")
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-6)) if b.numel() else 0.0

    errors = {
        "loss": rel(loss, ref),
        "grad_hidden": rel(hidden.grad, x64.grad),
        "grad_weight": rel(weight.grad, w64.grad[lo:hi]),
    }
    if bias is not None:
        grad_bias = bias.grad if bias.grad is not None else torch.zeros_like(bias)
        errors["grad_bias"] = rel(grad_bias, b64.grad[lo:hi])
    if lse is not None:
        shape_ok = lse.shape == y.shape and not lse.requires_grad
        errors["lse"] = rel(lse, ref_lse) if shape_ok else float("inf")
    tol = TOLERANCE[case.dtype]
    exact = ("loss", "lse")  # fp32 whatever the input dtype
    ok = all(e <= loss_tolerance(case.dtype, device) for k, e in errors.items() if k in exact)
    ok = ok and max(errors.values()) <= tol
    return {**asdict(case), "world": world, "rank": rank, **errors, "ok": bool(ok)}


def token_split(tokens: int, world: int, split: str = "uneven") -> list[int]:
    """Tokens of each rank for a sequence-parallel check, in rank order, summing to ``tokens``.

    ``"even"``: as :func:`shard_bounds` cuts (sizes differ by at most one); ``"uneven"``:
    rank r gets about ``r + 1`` parts; ``"empty"``: rank 1 gets none, the others split the
    rest evenly.
    """
    if split == "even":
        return [hi - lo for lo, hi in shard_bounds(tokens, world)]
    if split == "uneven":
        parts = world * (world + 1) // 2
        sizes = [tokens * (r + 1) // parts for r in range(world)]
        sizes[-1] += tokens - sum(sizes)
        return sizes
    if split == "empty":
        if world < 2:
            return [tokens]
        rest = [hi - lo for lo, hi in shard_bounds(tokens, world - 1)]
        return rest[:1] + [0] + rest[1:]
    raise ValueError(f"split: expected 'even', 'uneven' or 'empty', got {split!r}")


def _rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to ``b``'s largest magnitude (inf if ``a`` is not finite)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-6)) if b.numel() else 0.0


def _plain_options_only(case: Case) -> None:
    """The layout checks below compare with the cross entropy with class weights and
    temperature only: refuse a case with softcap, z_loss, bias or return_lse (its
    reference is :func:`check_case`'s)."""
    on = [n for n in ("softcap", "z_loss", "bias", "return_lse") if getattr(case, n, None)]
    if on:
        raise ValueError(f"case: {', '.join(on)} not supported by this check (use check_case)")


def _plain_reference(case: Case, x, w_full, y, upstream, scalar_up):
    """The unsharded float64 loss (class weights and temperature the only options) and its
    gradients: ``(ref, x64, w64)``."""
    x64 = x.double().requires_grad_(True)
    w64 = w_full.double().requires_grad_(True)
    cw_full, temperature = _weights(case, x.device)
    ref, _ = linear_cross_entropy_reference(
        x64,
        w64,
        y,
        reduction=case.reduction,
        label_smoothing=case.label_smoothing,
        class_weight=cw_full,
        temperature=temperature,
    )
    if case.reduction == "mean" and case.all_ignored:
        ref = (F.linear(x64, w64).sum() * 0.0).reshape(())  # torch gives NaN; we promise 0
    ref.backward(upstream.double() if case.reduction == "none" else scalar_up.double())
    return ref, x64, w64


def check_sequence_parallel_case(
    case: Case, process_group: dist.ProcessGroup | None, device: torch.device, split: str = "uneven"
) -> dict:
    """:func:`check_case` with ``sequence_parallel=True``: this rank passes its slice of the
    tokens (:func:`token_split`), and its loss (its tokens' for ``"none"``), ``hidden.grad``
    (its slice) and ``weight.grad`` shard are compared with the unsharded float64 reference
    over all tokens."""
    _plain_options_only(case)
    world = 1 if process_group is None else dist.get_world_size(process_group)
    rank = 0 if process_group is None else dist.get_rank(process_group)
    x, w_full, y, upstream, scalar = _problem(case, device)
    sizes = token_split(case.tokens, world, split)
    off = sum(sizes[:rank])
    mine = slice(off, off + sizes[rank])
    shard = rank if case.layout == "contiguous" else world - 1 - rank
    lo, hi = shard_bounds(case.vocab, world)[shard]
    start, global_size = (None, None) if case.layout == "contiguous" else (lo, case.vocab)

    hidden = x[mine].clone().requires_grad_(True)
    weight = w_full[lo:hi].clone().requires_grad_(True)
    cw_full, temperature = _weights(case, device)
    loss = vocab_parallel_linear_cross_entropy(
        hidden,
        weight,
        y[mine],
        class_weight=None if cw_full is None else cw_full[lo:hi],
        temperature=_sliced(temperature, mine),
        process_group=process_group,
        vocab_start_index=start,
        global_vocab_size=global_size,
        reduction=case.reduction,
        label_smoothing=case.label_smoothing,
        mode=case.mode,
        backend=case.backend,
        sequence_parallel=True,
    )
    scalar_up = torch.tensor(scalar, device=device)
    loss.backward(upstream[mine] if case.reduction == "none" else scalar_up)

    ref, x64, w64 = _plain_reference(case, x, w_full, y, upstream, scalar_up)

    errors = {
        "loss": _rel_error(loss, ref[mine] if case.reduction == "none" else ref),
        "grad_hidden": _rel_error(hidden.grad, x64.grad[mine]),
        "grad_weight": _rel_error(weight.grad, w64.grad[lo:hi]),
    }
    tol = TOLERANCE[case.dtype]
    ok = errors["loss"] <= loss_tolerance(case.dtype, device) and max(errors.values()) <= tol
    ok = ok and tuple(loss.shape) == ((sizes[rank],) if case.reduction == "none" else ())
    info = {"world": world, "rank": rank, "split": split, "tokens_here": sizes[rank]}
    return {**asdict(case), **info, **errors, "ok": bool(ok)}


DTENSOR_HIDDEN = ("plain", "replicate", "shard", "shard_sp", "shard_sp_dtarget")


def check_dtensor_case(case: Case, mesh, hidden_as: str = "plain") -> dict:
    """:func:`check_case` with a DTensor weight: ``[V, H]`` placed ``Shard(0)`` on the 1-D
    ``mesh`` (DTensor's own uneven chunking), passed without process group or layout.

    ``hidden_as``: ``"plain"`` (a tensor), ``"replicate"`` (a ``Replicate()`` DTensor),
    ``"shard"`` (``Shard(0)`` over the tokens: gathered by the loss), ``"shard_sp"`` (the
    same with ``sequence_parallel=True`` and the full plain target) or
    ``"shard_sp_dtarget"`` (the target a ``Shard(0)`` DTensor too). Checks the loss,
    ``hidden.grad`` (and its placement) and that ``weight.grad`` is a ``Shard(0)`` DTensor
    whose local rows equal the reference's.
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _plain_options_only(case)
    if hidden_as not in DTENSOR_HIDDEN:
        raise ValueError(f"hidden_as: expected one of {DTENSOR_HIDDEN}, got {hidden_as!r}")
    device = torch.device(mesh.device_type)
    x, w_full, y, upstream, scalar = _problem(case, device)
    weight = torch.nn.Parameter(distribute_tensor(w_full, mesh, [Shard(0)]))
    (rows, _), (lo, _) = compute_local_shape_and_global_offset(w_full.shape, mesh, [Shard(0)])
    sp = hidden_as.startswith("shard_sp")
    hidden_rows = slice(0, case.tokens)  # the rows of hidden.grad (local) here
    target = y
    if hidden_as == "plain":
        hidden = x.clone().requires_grad_(True)
    elif hidden_as == "replicate":
        hidden = distribute_tensor(x, mesh, [Replicate()]).requires_grad_(True)
    else:
        hidden = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_(True)
        (n, _), (off, _) = compute_local_shape_and_global_offset(x.shape, mesh, [Shard(0)])
        hidden_rows = slice(off, off + n)
        if hidden_as == "shard_sp_dtarget":
            target = distribute_tensor(y, mesh, [Shard(0)])
    mine = hidden_rows if sp else slice(0, case.tokens)  # the tokens of the loss here
    cw_full, temperature = _weights(case, device)
    class_weight = None if cw_full is None else distribute_tensor(cw_full, mesh, [Shard(0)])
    loss = vocab_parallel_linear_cross_entropy(
        hidden,
        weight,
        target,
        class_weight=class_weight,
        temperature=_sliced(temperature, mine),
        reduction=case.reduction,
        label_smoothing=case.label_smoothing,
        mode=case.mode,
        backend=case.backend,
        sequence_parallel=sp,
    )
    scalar_up = torch.tensor(scalar, device=device)
    loss.backward(upstream[mine] if case.reduction == "none" else scalar_up)

    ref, x64, w64 = _plain_reference(case, x, w_full, y, upstream, scalar_up)

    grad_hidden, placement_ok = hidden.grad, True
    if hidden_as != "plain":
        placement_ok = tuple(grad_hidden.placements) == tuple(hidden.placements)
        grad_hidden = grad_hidden.to_local()
    weight_ok = tuple(getattr(weight.grad, "placements", ())) == (Shard(0),)
    errors = {
        "loss": _rel_error(loss, ref[mine] if case.reduction == "none" else ref),
        "grad_hidden": _rel_error(grad_hidden, x64.grad[hidden_rows]),
        "grad_weight": _rel_error(weight.grad.to_local(), w64.grad[lo : lo + rows]),
    }
    tol = TOLERANCE[case.dtype]
    ok = errors["loss"] <= loss_tolerance(case.dtype, device) and max(errors.values()) <= tol
    ok = ok and placement_ok and weight_ok and type(loss) is torch.Tensor
    info = {"world": mesh.size(), "rank": mesh.get_local_rank(), "hidden_as": hidden_as}
    info |= {"rows": rows, "placements_ok": placement_ok and weight_ok}
    return {**asdict(case), **info, **errors, "ok": bool(ok)}
