"""What every public entry does before its autograd Function: :func:`prepare_call`.

The loss, its module, the LM head, the integrations and the token statistics all take
their tensors through here: DTensor inputs unwrapped (``vocab_parallel.parallel.dtensor``), the
tensors cast as ``F.linear`` would under autocast, validated (every message starts with
the parameter's name), the ranks' agreement checked
(``vocab_parallel.parallel.agreement``), the tokens of the group gathered under sequence
parallelism, the shard layout resolved and the target ids checked
(``vocab_parallel.parallel.layout``, ``vocab_parallel.parallel.checks``). What comes out
is one :class:`~vocab_parallel.engine.objective.Call` and the flattened tensors
(``docs/design.md``, "One seam").
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from vocab_parallel.backends.registry import resolve_backend
from vocab_parallel.engine import precision
from vocab_parallel.engine.objective import Call, Objective
from vocab_parallel.engine.reduction import check_items_counted, check_num_items_in_batch
from vocab_parallel.options import LossOptions, PendingOptions, given_option, made
from vocab_parallel.parallel import sequence_parallel as _sp
from vocab_parallel.parallel.agreement import check_agreement, fingerprint, objective_row
from vocab_parallel.parallel.checks import ASYNC_CHECKS, check_member, check_targets
from vocab_parallel.parallel.collectives import world_size
from vocab_parallel.parallel.dtensor import local_tensor, token_shape
from vocab_parallel.parallel.layout import resolve_layout
from vocab_parallel.parallel.sharded import check_gathered


class Prepared(NamedTuple):
    """A call ready for its autograd Function: ``hidden [N, H]``, ``target [N]`` (int64;
    all tokens of the group under sequence parallelism, ``slices`` then says which are
    this rank's), the cast ``weight`` and ``bias``, and the shape of per-token results."""

    call: Call
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    target: torch.Tensor
    slices: _sp.TokenSlices | None
    shape: tuple[int, ...]  # of this rank's target (a DTensor's local one): the outputs'


def autocast_inputs(*tensors):
    """``tensors`` cast as ``F.linear`` casts its inputs under autocast: when autocast is on
    for their device type, floating tensors on that device (not float64 ones) go to
    ``torch.get_autocast_dtype``. The casts are ordinary autograd ops, so gradients
    reach fp32 master weights in their dtype. Anything else is returned as it is."""
    first = tensors[0]
    if not isinstance(first, torch.Tensor):
        return tensors
    device_type = first.device.type
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except (RuntimeError, ValueError, TypeError):  # a device type without autocast
        return tensors
    if not enabled:
        return tensors
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t):
        eligible = (
            isinstance(t, torch.Tensor)
            and t.is_floating_point()
            and t.dtype != torch.float64
            and t.device.type == device_type
        )
        return t.to(dtype) if eligible else t

    return tuple(cast(t) for t in tensors)


FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_head(hidden, weight, bias, names=("hidden", "weight", "bias"), rows=None, tokens=None):
    """A head's tensors against each other (messages name the parameters ``names``): a
    float ``hidden [..., H]`` (of ``tokens``, when given), ``weight [V_local, H]`` of its
    dtype (``rows`` rows, when given), ``bias`` None or ``[V_local]`` of that dtype."""
    nh, nw, nb = names
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"{nh}: expected a torch.Tensor, got {type(hidden).__name__}")
    if hidden.dtype not in FLOATS:
        raise TypeError(
            f"{nh}: expected dtype float16, bfloat16, float32 or float64, got {hidden.dtype}"
        )
    if hidden.dim() < 1:
        raise ValueError(f"{nh}: expected a tensor of shape [..., H], got a 0-d tensor")
    if tokens is not None and tuple(hidden.shape[:-1]) != tokens:
        raise ValueError(f"{nh}: expected the tokens {tokens} (then H), got {tuple(hidden.shape)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{nw}: expected a 2-D torch.Tensor [V_local, H]")
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"{nw}: dtype {weight.dtype} differs from {nh} dtype {hidden.dtype}; they must be equal"
        )
    if weight.shape[1] != hidden.shape[-1] or weight.shape[0] != (rows or weight.shape[0]):
        want = f"[{rows or 'V_local'}, {hidden.shape[-1]}]"
        raise ValueError(f"{nw}: expected shape {want}, got {tuple(weight.shape)}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"{nb}: expected None or a tensor, got {type(bias).__name__}")
    if bias is not None and bias.dtype != weight.dtype:
        raise TypeError(
            f"{nb}: dtype {bias.dtype} differs from {nw} dtype {weight.dtype}; they must be equal"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"{nb}: expected shape [{weight.shape[0]}] (the rows of {nw}), got {tuple(bias.shape)}"
        )


def token_tensor(name: str, t, hidden, sequence_parallel: bool, kind: str, dims: int = 0):
    """An objective's own tensor of per-token values, checked (messages name ``name``):
    a tensor of ``kind`` (``"integer"`` or ``"floating"``) shaped like ``hidden``'s tokens
    then ``dims`` more dims, on its device; a DTensor unwrapped as ``hidden``'s tokens are
    (:func:`~vocab_parallel.parallel.dtensor.local_tensor`). ``hidden`` is read only where
    it is a tensor (else its own check raises)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    t = local_tensor(t, name, sequence_parallel)
    integer = not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)
    if integer != (kind == "integer") or (kind == "floating" and not t.is_floating_point()):
        what = "an integer" if kind == "integer" else "a floating-point"
        raise TypeError(f"{name}: expected {what} dtype, got {t.dtype}")
    if not isinstance(hidden, torch.Tensor):
        return t
    tokens = token_shape(hidden, sequence_parallel)
    if t.dim() != len(tokens) + dims or tuple(t.shape[: len(tokens)]) != tokens:
        more = "".join(f", d{i}" for i in range(dims))
        raise ValueError(f"{name}: expected shape [*{tokens}{more}], got {tuple(t.shape)}")
    if t.device != hidden.device:
        raise ValueError(f"{name}: on device {t.device}, but hidden is on {hidden.device}")
    return t


def _check_tensors(hidden, weight, target, opts: LossOptions) -> None:
    """The tensors of a call, against each other (messages name the parameter)."""
    bias, cw, temp = opts.bias, opts.class_weight, opts.temperature
    check_head(hidden, weight, bias)
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target: expected a torch.Tensor, got {type(target).__name__}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target: expected an integer dtype, got {target.dtype}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"target: expected shape {tuple(hidden.shape[:-1])} (hidden without its last "
            f"dim), got {tuple(target.shape)}"
        )
    if cw is not None and tuple(cw.shape) != (weight.shape[0],):
        raise ValueError(
            f"class_weight: expected shape [{weight.shape[0]}] (the rows of weight), got "
            f"{tuple(cw.shape)}"
        )
    if cw is not None and not cw.is_floating_point():
        raise TypeError(f"class_weight: expected a floating-point tensor, got {cw.dtype}")
    if isinstance(temp, torch.Tensor) and tuple(temp.shape) != tuple(target.shape):
        raise ValueError(
            f"temperature: expected a float or a tensor of the shape of target "
            f"{tuple(target.shape)}, got shape {tuple(temp.shape)}"
        )
    tensors = (("weight", weight), ("target", target), ("bias", bias), ("class_weight", cw))
    tensors += (("temperature", temp if isinstance(temp, torch.Tensor) else None),)
    for name, t in tensors:
        if t is not None and t.device != hidden.device:
            raise ValueError(
                f"{name}: on device {t.device}, but hidden is on {hidden.device}; "
                "all tensors must be on one device"
            )


def _inverse_temperature(opts: LossOptions, tokens: torch.Tensor, dtype, check: bool):
    """``[N]`` inverse temperature of the call's (gathered) tokens in ``dtype`` (fp32, or
    float64 for float64 inputs), or None for 1."""
    temp = opts.temperature
    if not opts.scaled:
        return None
    if not isinstance(temp, torch.Tensor):
        return torch.full(tokens.shape, 1.0 / temp, dtype=dtype, device=tokens.device)
    temp = temp.detach().reshape(-1).to(dtype)
    if check:
        bad = ~((temp > 0) & torch.isfinite(temp))
        message = "temperature: expected finite values > 0"
        if temp.device.type in ASYNC_CHECKS:
            torch._assert_async(~bad.any(), message)
        elif bad.any():
            where = int(bad.nonzero()[0, 0])
            raise ValueError(f"{message}, got {float(temp[where])} at position {where}")
    return temp.reciprocal()


def _not_traceable(fn):
    """``fn`` kept out of ``torch.compile`` graphs, with the reason ``fullgraph=True``
    reports: the agreement of the ranks reads its collective's result on the host."""
    reason = (
        "vocab_parallel: the ranks' agreement check (check_inputs=True under tensor "
        "parallelism) reads its collective's result on the host and cannot be traced; "
        "pass check_inputs=False to compile the loss with fullgraph=True"
    )
    try:
        return torch.compiler.disable(fn, reason=reason)
    except TypeError:  # a torch without the reason argument
        return torch.compiler.disable(fn)


_agree = _not_traceable(check_agreement)


def _prepare(hidden, weight, target, opts: LossOptions, process_group, num_items_in_batch):
    """The call's tensors unwrapped (DTensors), cast (autocast) and validated, and the
    backend that runs them: ``(hidden, weight, target, bias, opts, process_group, which)``."""
    if num_items_in_batch is not None:
        check_num_items_in_batch(num_items_in_batch, read=opts.check_inputs)
        if opts.reduction != "sum":
            raise ValueError(
                f"reduction: {opts.reduction!r} cannot be combined with num_items_in_batch "
                "(the loss is then the sum divided by num_items_in_batch); pass 'sum'"
            )
    # DTensor inputs (vocab_parallel.parallel.dtensor)
    if "torch.distributed.tensor" in sys.modules:
        from vocab_parallel.parallel.dtensor import unwrap_inputs

        hidden, weight, target, opts, process_group = unwrap_inputs(
            hidden, weight, target, opts, process_group
        )
        check_member(process_group)
    if target is None and isinstance(hidden, torch.Tensor) and hidden.dim() >= 1:
        # no targets (distillation without hard labels): every token counts
        target = torch.zeros(hidden.shape[:-1], dtype=torch.int64, device=hidden.device)
    check_gathered("weight", weight)  # an empty ZeRO-3 partition (before any cast): the fix
    check_gathered("bias", opts.bias)
    hidden, weight, bias = autocast_inputs(hidden, weight, opts.bias)
    opts = opts if bias is opts.bias else opts.replace(bias=bias)
    _check_tensors(hidden, weight, target, opts)
    which = resolve_backend(opts.backend, hidden.device, hidden.dtype, "hidden")
    return hidden, weight, target, bias, opts, process_group, which


def _told(process_group, weight):
    """The group told of a refusal: ``process_group``, else the mesh's group of a DTensor
    ``weight`` on a 1-D mesh (the group its call uses: ``vocab_parallel.parallel.dtensor``)."""
    if process_group is None and "torch.distributed.tensor" in sys.modules:
        from vocab_parallel.parallel.dtensor import is_dtensor

        if is_dtensor(weight) and weight.device_mesh.ndim == 1:
            return weight.device_mesh.get_group()
    return process_group


def prepare_call(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    opts: LossOptions | PendingOptions,
    process_group: dist.ProcessGroup | None,
    objective: Objective,
    *,
    num_items_in_batch: Any = None,
) -> Prepared:
    """The :class:`Prepared` call of an entry.

    ``opts``: the options, or :class:`~vocab_parallel.options.PendingOptions` made here, in
    the guarded step below (an entry that builds its options from the user's values passes
    them so). ``objective`` (:class:`~vocab_parallel.engine.objective.Objective`): its own
    checks, run in the guarded step like the others (what it validates it keeps), its own
    entries of the ranks' agreement, its checks once the layout is known, its mode. With
    ``check_inputs`` the ranks of the group first compare what must agree
    (``vocab_parallel.parallel.agreement``): a difference, or arguments refused on one rank, raise
    on every rank alike before any collective whose size depends on the inputs."""
    check_member(process_group)
    # Known before the options are made: any value but False tells the others of a refusal
    # (an invalid check_inputs is itself refused when they are made).
    guarded = given_option(opts, "check_inputs") is not False
    try:
        opts = made(opts)
        objective.check(opts)
        hidden, weight, target, bias, opts, process_group, which = _prepare(
            hidden, weight, target, opts, process_group, num_items_in_batch
        )
    except (TypeError, ValueError) as err:
        group = _told(process_group, weight)
        if guarded and world_size(group) > 1:  # the others must not wait
            device = hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")
            _agree(None, group, device, own_error=err)
        raise
    shape = tuple(target.shape)
    t1 = target.reshape(-1).to(torch.int64)
    h2 = hidden.reshape(t1.shape[0], hidden.shape[-1])  # not (-1, H): H may be 0
    if opts.check_inputs and world_size(process_group) > 1:
        own = objective.fields()
        values = fingerprint(opts, h2, weight, t1, num_items_in_batch)
        values += objective_row(objective.name, own)
        _agree(values, process_group, hidden.device, own=tuple((w, p) for w, p, _ in own))
    temp, accum = opts.temperature, precision.accumulate_dtype(hidden.dtype)
    slices = None  # sequence_parallel: all tokens of the group, gathered
    if opts.sequence_parallel:
        extra = temp.reshape(-1).to(accum) if isinstance(temp, torch.Tensor) else None
        h2, t1, slices, extra = _sp.gather_tokens(h2, t1, process_group, extra=extra)
        if extra is not None:
            opts = opts.replace(temperature=extra)
    layout = resolve_layout(
        weight.shape[0],
        process_group,
        opts.vocab_start_index,
        opts.global_vocab_size,
        t1.shape[0],
        hidden.device,
        recheck=opts.check_inputs and hidden.device.type == "cpu",
        trust=not opts.check_inputs,
    )
    if opts.check_inputs:
        check_targets(t1, opts.ignore_index, layout.global_size)
        if num_items_in_batch is not None:  # the same count and targets on every rank
            check_items_counted(num_items_in_batch, t1, opts.ignore_index)
    inputs = (h2, weight) if bias is None else (h2, weight, bias)
    track = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    cw = opts.class_weight
    call = Call(
        opts=opts,
        process_group=process_group,
        layout=layout,
        backend=which,
        mode=objective.mode(opts, track, h2.dtype),
        track=track,
        class_weight=None if cw is None else cw.detach().to(accum),
        inv_temperature=_inverse_temperature(opts, t1, accum, opts.check_inputs),
    )
    objective.prepared(call, t1, slices)
    return Prepared(call, h2, weight, bias, t1, slices, shape)
