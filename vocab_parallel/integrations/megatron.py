"""Megatron-core plug-in: ``GPTModel``'s loss from its hidden states, without logits.

    from vocab_parallel.integrations.megatron import VocabParallelOutputProcessor

    processor = VocabParallelOutputProcessor()              # any loss option: z_loss=1e-4...
    losses = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask,
                   output_processor=processor)              # [b, s] as without it
    # or once for all calls: apply_vocab_parallel_loss(model)

Megatron-core's ``GPTModel.forward`` (0.19) hands its last stage's decoder output to an
``output_processor`` when one is given, in place of ``output_layer`` + the loss: it gets
``hidden_states`` (``[s, b, h]``, or this rank's ``[s/tp, b, h]`` under sequence
parallelism), ``output_layer`` (a ``ColumnParallelLinear``: weight ``[V/tp, h]``, its
``tp_group``), ``output_weight`` (the embedding weight when input and output embeddings are
tied, else None), ``labels [b, s]``, ``loss_mask [b, s]``, ``config`` and a few more, and
its return value is what the model returns. :class:`VocabParallelOutputProcessor` returns
what the model returns without it: with labels, ``compute_language_model_loss``'s per-token
fp32 losses ``[b, s]`` (the training loop's ``loss_func`` then multiplies by ``loss_mask``
and sums, as before), computed by :func:`vocab_parallel.loss.run_loss` from the hidden states
and the weight shard; without labels, the logits of the output layer.

Why the result equals Megatron's (``tests/test_megatron.py`` checks loss and every
gradient within 1e-6 in fp32):

* **The vocabulary layout** is Megatron's: rank r of ``output_layer.tp_group`` holds rows
  ``[r V/tp, (r+1) V/tp)`` (Megatron divides the padded vocabulary evenly); given to the
  loss, so no layout collective runs per call. Padded rows are real rows of the softmax, as
  in Megatron.
* **The gradient of the hidden states is reduced over the group once**: the loss
  all-reduces its ``grad_input``. The output layer is not called, so its own reduction
  (``copy_to_tensor_model_parallel_region``'s backward, or the sequence-parallel
  reduce-scatter) does not run as well.
* **Sequence parallelism** (``output_layer.sequence_parallel``): the ranks' token slices are
  all-gathered (``vocab_parallel.parallel.sequence_parallel.gather_tokens``), every rank
  computes the losses of all ``s`` positions (Megatron's ``[b, s]`` is complete on every
  rank), and the gradient of each rank's slice is its rows of the (already reduced)
  gathered gradient.
* **loss_mask**: positions where it is 0 become ``ignore_index`` (loss 0, no gradient);
  the caller's ``loss_mask`` multiplication leaves them 0 as before. Other values (weights)
  are left to the caller's multiplication, as before.
* MuP's ``mup_output_mult`` (``config.use_mup``) scales the logits: it becomes the loss's
  temperature (``T / mult``).

Loss options are those of :func:`vocab_parallel.vocab_parallel_linear_cross_entropy`
(``label_smoothing``, ``z_loss``, ``softcap``, ``temperature``, ``class_weight``,
``mode``...), fixed for the processor, or per call through ``output_processor_context``
(a mapping of options, e.g. ``{"temperature": t}`` with ``t`` a ``[b, s]`` tensor).
``reduction="sum"`` / ``"mean"`` make the model return a scalar over the positions that
``loss_mask`` keeps instead (then the loss can compute its gradient in the forward; the
training loop's ``loss_func`` must take a scalar). The layout options and
``sequence_parallel`` come from the output layer.

:func:`vocab_parallel_cross_entropy` is the drop-in for Megatron's
``tensor_parallel.vocab_parallel_cross_entropy`` where logits exist already: same
arguments and result, but it never writes into the logits (Megatron's subtracts the
maximum from fp32 logits in place) and smooths labels over the global vocabulary.

Megatron is imported inside the functions only: importing this module does not import it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from vocab_parallel.loss import run_loss
from vocab_parallel.options import LAYOUT_OPTIONS, LossOptions, loss_options
from vocab_parallel.parallel import sequence_parallel as _sp
from vocab_parallel.parallel.collectives import all_reduce, world_size

__all__ = [
    "VocabParallelOutputProcessor",
    "apply_vocab_parallel_loss",
    "remove_vocab_parallel_loss",
    "vocab_parallel_cross_entropy",
]

# Options the processor takes from the output layer and the model, not from the caller.
_OWN_OPTIONS = LAYOUT_OPTIONS | {"sequence_parallel", "bias"}


def _options(given: Mapping[str, Any], what: str) -> dict[str, Any]:
    if not isinstance(given, Mapping):
        raise TypeError(f"{what}: expected a mapping of loss options, got {type(given).__name__}")
    owned = sorted(set(given) & _OWN_OPTIONS)
    if owned:
        raise TypeError(
            f"{owned[0]}: set by the output processor from the output layer, not a loss option"
        )
    if given.get("return_lse"):
        raise ValueError(
            "return_lse: the model returns one tensor; the output processor cannot add lse"
        )
    loss_options(**given)  # unknown names and bad values fail here, naming the option
    return dict(given)


class VocabParallelOutputProcessor:
    """``GPTModel.forward(..., output_processor=VocabParallelOutputProcessor(**options))``:
    the model's loss by the vocabulary-parallel loss (see the module docstring).

    Args:
        **options: any keyword option of
            :func:`vocab_parallel.vocab_parallel_linear_cross_entropy` but those the output
            layer sets (``vocab_start_index``, ``global_vocab_size``, ``sequence_parallel``,
            ``bias``). ``reduction`` defaults to ``"none"``: the ``[b, s]`` losses of
            ``compute_language_model_loss``.
    """

    def __init__(self, **options: Any) -> None:
        options.setdefault("reduction", "none")
        self.options = _options(options, "options")

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({shown})"

    def __call__(
        self,
        *,
        hidden_states: torch.Tensor,
        output_layer: torch.nn.Module,
        output_weight: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        context: Mapping[str, Any] | None = None,
        config: Any = None,
        runtime_gather_output: bool | None = None,
        scale_logits: Any = None,
        inference_context: Any = None,
        **_unused: Any,
    ) -> torch.Tensor:
        """What ``GPTModel._postprocess`` calls (keywords only): the ``[b, s]`` losses (or the
        scalar of ``reduction="sum"`` / ``"mean"``); without labels the ``[b, s, V]`` logits
        of the output layer, as the model computes them without a processor."""
        if labels is None:
            if inference_context is not None:
                raise ValueError(
                    "labels: None with an inference_context; the output processor computes "
                    "the training loss, run inference without it"
                )
            logits, _ = output_layer(
                hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output
            )
            if scale_logits is not None:
                logits = scale_logits(logits)
            return logits.transpose(0, 1).contiguous()
        options = self.options
        if context is not None:
            options = options | _options(context, "output_processor_context")
        return megatron_loss(
            hidden_states, output_layer, output_weight, labels, loss_mask, options, config
        )


def _mup_multiplier(config: Any) -> float:
    """The factor MuP multiplies the logits by (``LanguageModule._scale_logits``), or 1."""
    if config is not None and getattr(config, "use_mup", False):
        return float(getattr(config, "mup_output_mult", 1.0))
    return 1.0


def _seq_major(t: torch.Tensor, sp_rank: int | None, s_local: int) -> torch.Tensor:
    """A ``[b, s]`` tensor as the ``[s, b]`` order of the hidden states (this rank's
    positions under sequence parallelism)."""
    t = t.transpose(0, 1)
    if sp_rank is not None:
        t = t[sp_rank * s_local : (sp_rank + 1) * s_local]
    return t.reshape(-1)


def megatron_loss(
    hidden_states: torch.Tensor,
    output_layer: torch.nn.Module,
    output_weight: torch.Tensor | None,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None,
    options: Mapping[str, Any],
    config: Any = None,
) -> torch.Tensor:
    """The loss of :class:`VocabParallelOutputProcessor` for validated ``options``."""
    weight = output_weight if output_weight is not None else getattr(output_layer, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(
            "output_layer: expected a weight [V/tp, h] (output_layer.weight, or output_weight "
            "for tied embeddings)"
        )
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        raise ValueError("hidden_states: expected a [s, b, h] tensor ([s/tp, b, h] under SP)")
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        raise ValueError("labels: expected a [b, s] tensor of token ids")
    group = getattr(output_layer, "tp_group", None)
    tp = world_size(group)
    rank = dist.get_rank(group) if tp > 1 else 0
    sp = tp > 1 and bool(getattr(output_layer, "sequence_parallel", False))
    s_local, b, h = hidden_states.shape
    s = s_local * tp if sp else s_local
    if tuple(labels.shape) != (b, s):
        raise ValueError(
            f"labels: expected shape [b, s] = {[b, s]} (from hidden_states "
            f"{list(hidden_states.shape)}{', sequence parallel' if sp else ''}), got "
            f"{list(labels.shape)}"
        )
    if loss_mask is not None and tuple(loss_mask.shape) != (b, s):
        raise ValueError(f"loss_mask: expected shape {[b, s]}, got {list(loss_mask.shape)}")
    opts = LossOptions(**options)
    sp_rank = rank if sp else None
    target = labels
    if loss_mask is not None:
        target = labels.masked_fill(loss_mask == 0, opts.ignore_index)
    target = _seq_major(target, sp_rank, s_local)
    temperature = opts.temperature
    if isinstance(temperature, torch.Tensor):
        if tuple(temperature.shape) != (b, s):
            raise ValueError(
                f"temperature: expected a float or a [b, s] = {[b, s]} tensor, got shape "
                f"{list(temperature.shape)}"
            )
        temperature = _seq_major(temperature, sp_rank, s_local).float()
    mult = _mup_multiplier(config)
    if mult != 1.0:
        temperature = temperature / mult
    x = hidden_states.reshape(-1, h)
    if sp:  # every rank scores every position: [b, s] is complete on every rank
        extra = temperature if isinstance(temperature, torch.Tensor) else None
        x, target, _, extra = _sp.gather_tokens(x, target, group, extra=extra)
        temperature = extra if extra is not None else temperature
    rows = weight.shape[0]
    bias = getattr(output_layer, "bias", None)
    opts = opts.replace(
        temperature=temperature,
        vocab_start_index=rank * rows,
        global_vocab_size=rows * tp,
        bias=bias if isinstance(bias, torch.Tensor) else None,
    )
    loss = run_loss(x, weight, target, opts, group)
    if opts.reduction == "none":
        return loss.reshape(s, b).transpose(0, 1).contiguous()  # [s b] -> [b s], as Megatron
    return loss


# --- The processor as a model's default ------------------------------------------------

_STATE = "_vocab_parallel_output_processor"


def _gpt_models(model: Any) -> list:
    """The ``GPTModel`` instances in ``model`` (a module, wrappers such as DDP and
    ``Float16Module`` included, or a list of virtual-pipeline chunks)."""
    from megatron.core.models.gpt import GPTModel

    chunks = model if isinstance(model, list | tuple) else [model]
    found = [m for c in chunks for m in c.modules() if isinstance(m, GPTModel)]
    if not found:
        raise TypeError(
            f"model: no megatron.core GPTModel in {type(model).__name__}; pass the model "
            "(or its list of chunks) that holds one"
        )
    return found


def apply_vocab_parallel_loss(model: Any, **options: Any) -> Any:
    """Make :class:`VocabParallelOutputProcessor` the default of every ``GPTModel`` in
    ``model``: each call with ``labels`` and no ``output_processor`` of its own gets it
    (calls without labels, e.g. inference, are left as they are). The patch is an
    instance attribute ``forward`` (the class, other instances, ``state_dict`` and
    checkpoints are untouched); :func:`remove_vocab_parallel_loss` undoes it. Returns
    ``model``. ``options``: those of :class:`VocabParallelOutputProcessor`.
    """
    processor = VocabParallelOutputProcessor(**options)
    for gpt in _gpt_models(model):
        remove_vocab_parallel_loss(gpt)
        original = gpt.forward
        signature = inspect.signature(original)

        def forward(*args, _original=original, _signature=signature, **kwargs):
            labels = _signature.bind_partial(*args, **kwargs).arguments.get("labels")
            if labels is not None and kwargs.get("output_processor") is None:
                kwargs["output_processor"] = processor
            return _original(*args, **kwargs)

        gpt.__dict__[_STATE] = processor
        gpt.forward = forward
    return model


def remove_vocab_parallel_loss(model: Any) -> Any:
    """Undo :func:`apply_vocab_parallel_loss` (a model without it is left as it is)."""
    for gpt in _gpt_models(model):
        if gpt.__dict__.pop(_STATE, None) is not None:
            gpt.__dict__.pop("forward", None)
    return model


# --- The drop-in on logits ---------------------------------------------------------------


class _LogitsCrossEntropy(torch.autograd.Function):
    """Megatron's vocabulary-parallel cross entropy on logits, out of place, in fp32."""

    @staticmethod
    def forward(ctx, logits, target, smoothing, group, start):
        rows = logits.shape[-1]
        vocab = rows * world_size(group)
        z = logits.float()  # may be ``logits`` itself: never written below
        zmax = all_reduce(z.amax(dim=-1), "MAX", group, "logits maximum")
        shifted = z - zmax.unsqueeze(-1)
        local = target - start
        here = (local >= 0) & (local < rows)
        index = torch.where(here, local, 0).unsqueeze(-1)
        picked = torch.where(here, shifted.gather(-1, index).squeeze(-1), 0.0)
        probs = shifted.exp()
        sums = torch.stack([probs.sum(-1), picked, shifted.sum(-1)])
        total, predicted, logit_sum = all_reduce(sums, "SUM", group, "logits statistics")
        lse = total.log()  # of the shifted logits
        loss = lse - (1.0 - smoothing) * predicted - smoothing * logit_sum / vocab
        probs.div_(total.unsqueeze(-1))  # our own buffer: the softmax
        ctx.save_for_backward(probs, index, here)
        ctx.smoothing, ctx.vocab, ctx.dtype = smoothing, vocab, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        probs, index, here = ctx.saved_tensors
        g = grad_loss.float().unsqueeze(-1)
        grad = probs * g
        on_target = ((1.0 - ctx.smoothing) * here.float()).unsqueeze(-1) * g
        grad.scatter_add_(-1, index, -on_target)
        if ctx.smoothing:
            grad.sub_(g * (ctx.smoothing / ctx.vocab))
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Drop-in for ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy``.

    ``vocab_parallel_logits`` ``[..., V/tp]`` is this rank's columns (rank r holds ids
    ``[r V/tp, (r+1) V/tp)``), ``target`` ``[...]`` global ids; returns the fp32 per-token
    losses ``[...]``, as Megatron's, and its gradient (to the logits, in their dtype).
    A target outside the vocabulary gets Megatron's result: the log-sum-exp, no target
    term (mask such positions with ``loss_mask``). Differences, on purpose:

    * the logits are never written to (Megatron's subtracts the maximum in place from fp32
      logits, so a caller's logits are changed after the call);
    * ``label_smoothing`` ``alpha`` is Megatron's (``alpha / (V - 1)`` on each non-target
      id) over the **global** vocabulary ``V``; Megatron's uses this rank's ``V/tp`` and
      mean, so at ``tp > 1`` its smoothed loss differs from rank to rank (at tp 1 they are
      equal).

    ``tp_group``: default Megatron's tensor-parallel group (``parallel_state``).
    """
    if tp_group is None:
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
    if not isinstance(vocab_parallel_logits, torch.Tensor) or not (
        vocab_parallel_logits.is_floating_point() and vocab_parallel_logits.dim() >= 1
    ):
        raise TypeError("vocab_parallel_logits: expected a floating-point tensor [..., V/tp]")
    if not isinstance(target, torch.Tensor) or tuple(target.shape) != tuple(
        vocab_parallel_logits.shape[:-1]
    ):
        raise ValueError(
            f"target: expected a tensor of shape {list(vocab_parallel_logits.shape[:-1])} "
            "(the logits without their last dim)"
        )
    rows = vocab_parallel_logits.shape[-1]
    vocab = rows * world_size(tp_group)
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, int | float):
        raise TypeError(f"label_smoothing: expected a float, got {type(label_smoothing).__name__}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(
            f"label_smoothing: expected 0 <= label_smoothing < 1, got {label_smoothing}"
        )
    # Megatron's alpha / (V - 1) on every non-target id is eps / V on every id (the target
    # too) with eps = alpha V / (V - 1): F.cross_entropy's label_smoothing.
    smoothing = label_smoothing * vocab / (vocab - 1) if label_smoothing and vocab > 1 else 0.0
    start = (dist.get_rank(tp_group) if world_size(tp_group) > 1 else 0) * rows
    return _LogitsCrossEntropy.apply(
        vocab_parallel_logits, target.long(), smoothing, tp_group, start
    )
