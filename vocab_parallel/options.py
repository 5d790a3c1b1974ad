"""The loss's options as one value: :class:`LossOptions`, built and validated once.

Every public entry (the loss function, its module, the LM head, the integrations) turns
its keyword options into one frozen :class:`LossOptions`; everything below the entry (the
autograd Functions, the backends) reads that value and nothing else, so an option is added
in one place (``docs/design.md``, "One options value"). Scalars are validated when the
value is made (``__post_init__``); the tensor options (``bias``, ``class_weight``, a
per-token ``temperature``) are validated against the call's tensors by the loss entry.

Every error is a ``TypeError`` or ``ValueError`` whose message starts with the parameter's
name.
"""

from __future__ import annotations

import dataclasses
import math
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

MODES = ("auto", "grad_in_forward", "memory_saving", "high_performance")
REDUCTIONS = ("none", "sum", "mean")
BACKENDS = ("auto", "torch", "triton")
FILTER_GRADS = ("both", "weight", "input")


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


def _number(name: str, value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}: expected {what}, got {type(value).__name__}")
    return float(value)


def check_number_in(name: str, value: object, lo: float, hi: float, open_ends: bool) -> float:
    """``value`` as a float in ``(lo, hi)`` (``open_ends``) or ``[lo, hi]``, else a
    ``TypeError`` / ``ValueError`` naming ``name``."""
    number = _number(name, value, "a float")
    if not (lo < number < hi if open_ends else lo <= number <= hi):
        sign = "<" if open_ends else "<="
        raise ValueError(f"{name}: expected {lo:g} {sign} {name} {sign} {hi:g}, got {value}")
    return number


def check_label_smoothing(label_smoothing: object) -> float:
    eps = _number("label_smoothing", label_smoothing, "a float")
    if not (0.0 <= eps < 1.0):
        raise ValueError(f"label_smoothing: expected 0 <= label_smoothing < 1, got {eps}")
    return eps


def check_softcap(softcap: object) -> float | None:
    """``softcap``: None, or a finite number > 0 (the ``c`` of ``c * tanh(z / c)``)."""
    if softcap is None:
        return None
    c = _number("softcap", softcap, "None or a float > 0")
    if not (0.0 < c < math.inf):
        raise ValueError(f"softcap: expected None or a finite float > 0, got {c}")
    return c


def check_z_loss(z_loss: object) -> float:
    """``z_loss``: a finite number >= 0 (the coefficient of ``lse^2``)."""
    w = _number("z_loss", z_loss, "a float >= 0")
    if not (0.0 <= w < math.inf):
        raise ValueError(f"z_loss: expected a finite float >= 0, got {w}")
    return w


def check_temperature(temperature: object) -> float | torch.Tensor:
    """``temperature``: a finite float > 0, or a floating tensor (one per token; its values
    are checked by the loss entry, which knows the device)."""
    if isinstance(temperature, torch.Tensor):
        if not temperature.is_floating_point():
            raise TypeError(
                f"temperature: expected a floating-point tensor, got {temperature.dtype}"
            )
        return temperature
    t = _number("temperature", temperature, "a float > 0 or a tensor shaped like target")
    if not (0.0 < t < math.inf):
        raise ValueError(f"temperature: expected a finite float > 0, got {t}")
    return t


def check_filter_eps(filter_eps: object) -> float | str | None:
    """``filter_eps``: None (exact, the default), ``"auto"`` (``eps(input dtype) / 32``,
    resolved per call by :func:`vocab_parallel.engine.filtering.resolve_eps`) or a finite float
    >= 0 (``docs/design.md``, "Gradient filtering")."""
    if filter_eps is None or filter_eps == "auto":
        return filter_eps
    if isinstance(filter_eps, str):
        raise ValueError(f"filter_eps: expected None, 'auto' or a float >= 0, got {filter_eps!r}")
    e = _number("filter_eps", filter_eps, "None, 'auto' or a float >= 0")
    if not (0.0 <= e < math.inf):
        raise ValueError(f"filter_eps: expected None, 'auto' or a finite float >= 0, got {e}")
    return e


def check_backend_name(backend: object) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    return backend


def _optional_int(name: str, value: object, least: int) -> int | None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or value < least
    ):
        raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")
    return value


def _optional_tensor(name: str, value: object) -> torch.Tensor | None:
    if value is not None and not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected None or a torch.Tensor, got {type(value).__name__}")
    return value


@dataclass(frozen=True, eq=False)
class LossOptions:
    """Every option of the vocabulary-parallel loss, validated (``docs/design.md``).

    Math: ``ignore_index``, ``reduction``, ``label_smoothing``, ``softcap``, ``z_loss``,
    ``temperature`` (a float, or a tensor shaped like the target: one per token),
    ``class_weight`` (this rank's ``[V_local]`` rows, sharded like the weight), ``bias``
    (this rank's ``[V_local]`` rows). Outputs and execution: ``return_lse``, ``mode``,
    ``backend``, ``check_inputs``, ``sequence_parallel``. Layout: ``vocab_start_index``,
    ``global_vocab_size``. Speed, off by default because it changes results:
    ``filter_eps`` and ``filter_grads`` (gradient filtering, ``vocab_parallel.engine.filtering``).

    ``eq=False``: options holding tensors compare by identity, never element-wise.
    """

    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    softcap: float | None = None
    z_loss: float = 0.0
    temperature: float | torch.Tensor = 1.0
    class_weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    return_lse: bool = False
    mode: str = "auto"
    backend: str = "auto"
    check_inputs: bool = True
    sequence_parallel: bool = False
    vocab_start_index: int | None = None
    global_vocab_size: int | None = None
    filter_eps: float | str | None = None
    filter_grads: str = "both"

    def __post_init__(self) -> None:
        ignore = self.ignore_index
        if isinstance(ignore, bool) or not isinstance(ignore, int):
            raise TypeError(f"ignore_index: expected an int, got {type(ignore).__name__}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {self.reduction!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {self.mode!r}")
        check_backend_name(self.backend)
        if self.filter_grads not in FILTER_GRADS:
            raise ValueError(
                f"filter_grads: expected one of {FILTER_GRADS}, got {self.filter_grads!r}"
            )
        for name in ("return_lse", "check_inputs", "sequence_parallel"):
            check_flag(name, getattr(self, name))
        _optional_int("vocab_start_index", self.vocab_start_index, 0)
        _optional_int("global_vocab_size", self.global_vocab_size, 1)
        _optional_tensor("class_weight", self.class_weight)
        _optional_tensor("bias", self.bias)
        # Normalised values (an int softcap becomes a float, and so on).
        set_ = object.__setattr__
        set_(self, "label_smoothing", check_label_smoothing(self.label_smoothing))
        set_(self, "softcap", check_softcap(self.softcap))
        set_(self, "z_loss", check_z_loss(self.z_loss))
        set_(self, "temperature", check_temperature(self.temperature))
        set_(self, "filter_eps", check_filter_eps(self.filter_eps))

    def replace(self, **changes: Any) -> LossOptions:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def scaled(self) -> bool:
        """Whether the logits are divided by a temperature other than the float 1."""
        return isinstance(self.temperature, torch.Tensor) or self.temperature != 1.0


@dataclass(frozen=True)
class StatsRequest:
    """Which per-token outputs :func:`~vocab_parallel.token_stats.vocab_parallel_token_stats`
    computes beside the log-probs (``docs/design.md``, "Token statistics"): they change
    what is computed and exchanged, not the math of the logits (that is
    :class:`LossOptions`)."""

    entropy: bool = False
    sum_p_squared: bool = False
    top_k: int = 0
    argmax: bool = False

    def __post_init__(self) -> None:
        for name in ("entropy", "sum_p_squared", "argmax"):
            check_flag(name, getattr(self, name))
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"top_k: expected an int >= 0, got {type(k).__name__}")
        if k < 0:
            raise ValueError(f"top_k: expected an int >= 0, got {k}")

    @property
    def extra_stats(self) -> bool:
        """Whether the local statistics carry the shifted and squared sums."""
        return self.entropy or self.sum_p_squared

    @property
    def candidates(self) -> int:
        """Candidates per token each rank brings to the top-k exchange (argmax: 1)."""
        return max(self.top_k, 1 if self.argmax else 0)


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(LossOptions))


class PendingOptions:
    """A call's options as the user gave them, not validated yet: :class:`LossOptions`
    made by :meth:`make` inside the entry's guarded step
    (:func:`vocab_parallel.engine.entry.prepare_call`), so that a value refused on one rank raises
    on every rank of the group alike, instead of leaving the others waiting in the ranks'
    agreement (``docs/design.md``, "Collectives and agreement").

    ``PendingOptions(base, check=None, **given)``: ``base`` (a :class:`LossOptions`, or None
    for the defaults) with the options ``given`` this call; ``check()``: more checks of the
    call's arguments, run first by :meth:`make` (messages naming the parameter)."""

    def __init__(
        self,
        base: LossOptions | None = None,
        check: Callable[[], None] | None = None,
        **given: Any,
    ) -> None:
        self.base, self.check, self.given = base, check, given

    def make(self) -> LossOptions:
        """The validated :class:`LossOptions` (a ``TypeError`` or ``ValueError`` naming the
        parameter otherwise)."""
        if self.check is not None:
            self.check()
        if self.base is None:
            return loss_options(**self.given)
        return self.base.replace(**self.given)

    def replace(self, **changes: Any) -> PendingOptions:
        """These options with ``changes``, still pending (as :meth:`LossOptions.replace`)."""
        return PendingOptions(self.base, self.check, **(self.given | changes))

    def value(self, name: str) -> Any:
        """The option ``name`` as given (not validated)."""
        if name in self.given:
            return self.given[name]
        return getattr(LossOptions() if self.base is None else self.base, name)


def given_option(opts: LossOptions | PendingOptions, name: str) -> Any:
    """The option ``name`` of options made or pending (then as given, maybe invalid)."""
    return opts.value(name) if isinstance(opts, PendingOptions) else getattr(opts, name)


def made(value: Any) -> Any:
    """What an entry makes in its guarded step: pending options made, a function (one that
    makes a :class:`StatsRequest`, say) called, anything else as it is."""
    if isinstance(value, PendingOptions):
        return value.make()
    return value() if callable(value) else value


# Options that a head sets itself from its shard.
LAYOUT_OPTIONS = frozenset({"vocab_start_index", "global_vocab_size"})


def loss_options(**options: Any) -> LossOptions:
    """:class:`LossOptions` from keyword options, an unknown name a ``TypeError`` naming it
    and listing the options (the module, the head and the integrations build theirs here)."""
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(
            f"{unknown[0]}: not an option of vocab_parallel_linear_cross_entropy "
            f"(its options: {', '.join(OPTION_NAMES)})"
        )
    return LossOptions(**options)


def shown_options(opts: LossOptions, skip: frozenset[str] = frozenset()) -> str:
    """``name=value`` of the options that differ from the defaults (tensors by shape), for
    ``extra_repr``."""
    default = LossOptions()
    parts = []
    for name in OPTION_NAMES:
        value = getattr(opts, name)
        if name in skip or (
            not isinstance(value, torch.Tensor) and value == getattr(default, name)
        ):
            continue
        if isinstance(value, torch.Tensor):
            parts.append(f"{name}=Tensor{list(value.shape)}")
        elif value is not None:
            parts.append(f"{name}={value!r}")
    return ", ".join(parts)


# The documentation of the keywords every public call shares (the loss, its module, the
# token statistics, distillation, the LM head), written once: ``documented`` puts it
# into their docstrings.
SHARED_DOCS = {
    "hidden": (
        "``[..., H]`` fp32/fp16/bf16 (float64: torch backend), identical on every rank of the "
        "group (this rank's tokens with ``sequence_parallel``)."
    ),
    "weight": "``[V_local, H]`` this rank's vocabulary rows (a ``Shard(0)`` DTensor too).",
    "process_group": ("the tensor-parallel group; ``None`` (or one rank): no collectives."),
    "vocab_start_index": (
        "first global id of this shard; default: contiguous shards in rank order (uneven sizes "
        "allowed)."
    ),
    "global_vocab_size": (
        "rows over all shards. With ``vocab_start_index`` it makes the layout known without the "
        "small collective (and device sync) that otherwise finds the shard sizes at every call."
    ),
    "ignore_index": ("target value that contributes no loss and no gradient."),
    "softcap": (
        "``c > 0``: the logits are ``c * tanh(logits / c)`` (after the bias) before the softmax "
        "(Gemma 2/3); None: no cap."
    ),
    "temperature": (
        "``T > 0``, a float or a tensor shaped like ``target`` (one per token): the logits are "
        "``softcap(hidden @ W.T + bias) / T``; no gradient reaches it."
    ),
    "bias": (
        "``[V_local]`` this rank's bias rows (dtype of ``weight``): the logits are ``hidden @ "
        "weight.T + bias``; it gets its gradient."
    ),
    "backend": ('``"triton"``, ``"torch"`` or ``"auto"`` (Triton on CUDA; torch for float64).'),
    "check_inputs": (
        "check that every target id is ``ignore_index`` or in ``[0, global vocabulary)`` (and "
        "every temperature positive), and (on CPU) the layout and token counts of the group at "
        "every call. ``False`` skips these."
    ),
    "sequence_parallel": (
        "``hidden``, ``target`` (and a per-token ``temperature``) are this rank's slice of the "
        'group\'s tokens (uneven slices allowed); the loss is over all of them, ``"none"`` gives '
        "this rank's tokens."
    ),
}


def documented(func):
    """``func`` with each line ``{shared: a, b, ...}`` of its docstring replaced by the
    :data:`SHARED_DOCS` of those keywords, as entries of its ``Args``."""
    doc = func.__doc__ or ""

    def entries(match: re.Match) -> str:
        indent = match.group(1)
        out = []
        for name in (n.strip() for n in match.group(2).split(",")):
            text = textwrap.wrap(
                f"{name}: {SHARED_DOCS[name]}", 92 - len(indent),
                subsequent_indent="    ", break_on_hyphens=False,
            )  # fmt: skip
            out += [indent + line for line in text]
        return "\n".join(out)

    func.__doc__ = re.sub(r"^( *)\{shared: ([a-z_, ]+)\}$", entries, doc, flags=re.M)
    return func
