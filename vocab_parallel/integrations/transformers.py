"""Hugging Face ``transformers`` causal LMs: their training loss by the vocabulary-parallel loss.

    from vocab_parallel.integrations.transformers import apply_vocab_parallel_loss

    model = AutoModelForCausalLM.from_pretrained(...)        # or from a config
    apply_vocab_parallel_loss(model)                         # before or after deepspeed.initialize
    out = model(input_ids, labels=labels, num_items_in_batch=n)
    out.loss.backward()                                      # out.logits is None (training mode)

One call, and ``model(..., labels=...)`` returns the loss of Hugging Face's causal-LM loss
(``ForCausalLMLoss``: labels shifted by one inside the model, ``-100`` ignored, the mean
over the non-ignored tokens, or the sum divided by ``num_items_in_batch`` when given, as
the ``Trainer`` does for gradient accumulation) computed from the hidden states by
:func:`vocab_parallel.vocab_parallel_linear_cross_entropy`, without logits.

The LM head is whatever ``model.get_output_embeddings()`` is **at each call**:

* a plain ``nn.Linear`` (no tensor parallelism, or a head left whole): the whole
  vocabulary on this rank, no collectives, on the head's own weight (tied to the input
  embedding or not: gradients land in that parameter);
* DeepSpeed AutoTP's ``VocabParallelLinear``, which ``deepspeed.initialize`` puts in place
  of ``lm_head`` with ``"tensor_parallel": {"autotp_size": N, "vocab_parallel_lm_head":
  true}``: the loss runs on the layer's own shard parameter (no copy) over its
  tensor-parallel group and row range (see
  :func:`vocab_parallel.integrations.heads.head_from_autotp`);
* a ``ColwiseParallel`` projection (torch's ``parallelize_module``: a ``Shard(0)`` DTensor
  weight on a 1-D mesh): the loss runs on that DTensor parameter over the mesh's group and
  DTensor's rows (:func:`vocab_parallel.integrations.torch_tp.head_from_colwise`);
* our own :class:`VocabParallelLMHead` (e.g. ``model.lm_head = head_from_colwise(...)``):
  used as it is, with its own loss options; options given to the adapter make a head with
  those on the same parameters.

A layer refused on one rank of its tensor-parallel group (a rank-local check of a shard)
is refused on every rank of it, with that rank's message, before any collective.

So the call works before or after ``deepspeed.initialize`` (which replaces ``lm_head``),
and again after another ``initialize``. The patch lives on the model instance: ``forward``
is replaced by an instance attribute (the class and other instances are untouched), and
nothing is registered as a submodule (``state_dict`` and checkpoints are unchanged).
:func:`remove_vocab_parallel_loss` puts the original ``forward`` back (also on a
``copy.deepcopy`` of a patched model, which is patched on its own).

What the patched ``forward`` does:

* **Without** ``labels`` (and ``shift_labels``): the original ``forward``, unchanged
  (generation, logits for evaluation); with our own head as ``lm_head`` (which the
  original forward would call without targets), the base model and the logits below.
* **With** ``labels``: the base model's forward (``model.base_model``, all other arguments
  passed on), then the fused loss on the last hidden states. Labels are shifted as in
  ``ForCausalLMLoss`` (padded with ``ignore_index`` at the end: position ``t`` predicts
  ``labels[t + 1]``); ``shift_labels`` (already shifted, e.g. from padding-free
  collators) is used as it is. ``num_items_in_batch`` (int or tensor) makes the loss
  ``sum / num_items_in_batch``; without it the loss is the head's ``reduction``
  (``"mean"`` over non-ignored tokens by default).
* **Logits**: in training mode (``model.training``) with labels, none (``logits`` is
  ``None``: in memory-saving mode no ``[tokens, V]`` tensor exists at any time), unless
  asked: ``return_logits=True`` (an argument of the patched ``forward``) or a non-zero
  ``logits_to_keep``. In eval mode (``Trainer.evaluate`` / ``predict``, ``model.eval()``)
  they are computed, as the unpatched model does, so that ``compute_metrics`` and
  ``predict`` get them; ``apply_vocab_parallel_loss(model, eval_logits=False)`` or
  ``return_logits=False`` turns that off. Logits are those of the positions that
  ``logits_to_keep`` selects (all for 0), over the **whole vocabulary on every rank**
  (under tensor parallelism this rank's columns from its shard, the others gathered;
  their gradient, if any, reaches this rank's shard from its own columns, Megatron's
  convention for a computation replicated on the ranks). The loss still covers every
  position with a label. With ``sequence_parallel=True`` no logits are computed (eval:
  a warning; ``return_logits=True``: a ``ValueError``).
* Returns ``transformers.modeling_outputs.CausalLMOutputWithPast`` (``loss``, ``logits``
  and the base model's ``cache`` / ``hidden_states`` / ``attentions``), or its
  ``to_tuple()`` for ``return_dict=False``.

``model.loss_function`` is not used by the patched path and is left alone (Hugging Face's
``ForCausalLMLoss``, or the ``VocabParallelCausalLMLoss`` that DeepSpeed installs with a
vocabulary-parallel head).

Models: decoder-only causal LMs whose causal-LM ``forward`` is base model, then
``lm_head``, then ``ForCausalLMLoss`` (Llama, Mistral, Qwen2/2.5/3, Phi-3, OLMo, SmolLM...).
A head with a bias (Phi) passes it to the loss's ``bias`` option; Gemma 2/3's
``final_logit_softcapping`` becomes the loss's ``softcap``. Refused with a
``NotImplementedError`` naming the config field: models that scale their logits
(``logit_scale``), add a router loss (``output_router_logits``) or are encoder-decoders.
With ``return_lse=True`` the output also has ``lse`` (per position, 0 where ignored).

**Token statistics (RL)**: ``model(input_ids, labels=labels, return_token_stats=True)``
(or a dict of :meth:`VocabParallelLMHead.token_stats` options: ``dict(entropy=True,
top_k=5, temperature=0.7)``) returns, instead of the loss, ``out.token_stats``: a
:class:`vocab_parallel.TokenStats` per position (shifted as the loss: position ``t``
scores ``labels[t + 1]``), log-probs and entropy differentiable; no logits, in eval mode
too (a reference model), unless ``return_logits=True``.
With ``sequence_parallel=True`` pass ``shift_labels`` (the shift crosses the ranks' slices).

``transformers`` is imported inside the functions only: importing this module does not
import it.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import types
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from vocab_parallel.integrations.heads import head_from_layer, layer_group
from vocab_parallel.lm_head import VocabParallelLMHead, head_options
from vocab_parallel.parallel.collectives import all_reduce, group_ranks, world_size
from vocab_parallel.parallel.dtensor import is_dtensor
from vocab_parallel.parallel.sharded import is_fsdp_module, unshard_fsdp_module

_STATE = "_vocab_parallel_loss"  # the patch's state in the model's __dict__

# Loss arguments of the causal-LM forward (ForCausalLMLoss's keywords), not the base model's.
_LOSS_ARGS = ("labels", "shift_labels", "num_items_in_batch", "ignore_index")


@dataclasses.dataclass(eq=False)
class _Patch:
    """What :func:`apply_vocab_parallel_loss` keeps on the model (not a module)."""

    original: Any  # the forward that was in place (a bound method, usually the class's)
    # Whether ``forward`` was an instance attribute before patching, and which. A flag, not
    # a sentinel object: ``copy.deepcopy`` of the model copies a sentinel into another
    # object, and an identity test against it would then fail on the copy.
    had_instance_forward: bool
    previous: Any  # that instance attribute (None when there was none)
    signature: inspect.Signature  # of ``original``
    options: dict[str, Any]  # the loss options (all of them, validated)
    given: dict[str, Any]  # the options as passed (with what the config implies)
    eval_logits: bool  # logits in eval mode (model.training False) unless told otherwise
    head: tuple | None = None  # (layer, weight, bias, VocabParallelLMHead) of the last call

    def __deepcopy__(self, memo: dict) -> _Patch:
        """A copy for the copied model: the bound methods follow the copy (``memo`` maps the
        model to its copy); the cached head is left out and rebuilt on the copy's layer at
        its first call (it may hold a process group, which cannot be copied)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields = {k: copy.deepcopy(v, memo) for k, v in fields.items() if k != "head"}
        return _Patch(**fields)


def apply_vocab_parallel_loss(
    model: nn.Module, *, eval_logits: bool = True, **loss_options: Any
) -> nn.Module:
    """Make ``model(..., labels=...)`` compute its loss with the vocabulary-parallel loss.

    Args:
        model: a ``transformers`` causal LM (a model with ``base_model`` and
            ``get_output_embeddings()``), before or after ``deepspeed.initialize`` (pass
            the model, ``engine.module``, not the engine).
        **loss_options: options of the loss, passed on as they are: any keyword option of
            :func:`vocab_parallel.vocab_parallel_linear_cross_entropy` but the layout ones
            (``ignore_index``, ``reduction``, ``label_smoothing``, ``mode``, ``backend``...;
            defaults: the loss's, so ``"mean"`` and ``-100`` as in Hugging Face).

    Applying again replaces the options. Returns ``model`` (patched in place).

    Raises:
        TypeError: not a causal LM, a bad option name, or an output layer that is none of
            an ``nn.Linear``, AutoTP's vocabulary-parallel head (the message names the
            DeepSpeed option to turn on), a ``ColwiseParallel`` projection (DTensor weight)
            and a :class:`VocabParallelLMHead`.
        ValueError: a bad option value, or a softcap other than the model's.

    A layer refused on one rank of its tensor-parallel group is refused on every rank, with
    the failing rank's message (the ranks agree before any of them goes on to a
    collective of the loss).
        NotImplementedError: a model whose logits are more than ``lm_head(hidden)`` (see
            the module docstring).
    """
    _check_model(model)
    if not isinstance(eval_logits, bool):
        raise TypeError(f"eval_logits: expected a bool, got {type(eval_logits).__name__}")
    given = _model_options(model, loss_options)
    head_options(given)  # a bad name or value fails now
    options = given
    existing = model.__dict__.get(_STATE)
    if existing is None:
        original = model.forward
        had = "forward" in model.__dict__
        previous = model.__dict__["forward"] if had else None
        signature = inspect.signature(original)
        patch = _Patch(original, had, previous, signature, options, given, eval_logits)
    else:  # applied again: new options, the same original forward
        patch = dataclasses.replace(
            existing, options=options, given=given, eval_logits=eval_logits, head=None
        )
    # a wrong head fails now (the model still unchanged); under FSDP2 the head is whole
    # only inside the forward, and is built there
    if not (is_fsdp_module(model) or is_fsdp_module(model.get_output_embeddings())):
        _current_head(model, patch)
    model.__dict__[_STATE] = patch
    model.forward = types.MethodType(_make_forward(patch.signature, patch.original), model)
    return model


def remove_vocab_parallel_loss(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_vocab_parallel_loss`: the original ``forward`` again (a model that
    is not patched is returned as it is)."""
    patch = model.__dict__.pop(_STATE, None)
    if patch is None:
        return model
    if patch.had_instance_forward:
        model.forward = patch.previous
    else:  # the class's forward again
        model.__dict__.pop("forward", None)
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether :func:`apply_vocab_parallel_loss` is in effect on ``model``."""
    return _STATE in model.__dict__


def current_head(model: nn.Module) -> VocabParallelLMHead:
    """The :class:`VocabParallelLMHead` the patched model computes its loss with now (built
    on its current output layer)."""
    patch = model.__dict__.get(_STATE)
    if patch is None:
        raise ValueError("model: apply_vocab_parallel_loss(model) was not called")
    return _current_head(model, patch)


# ----------------------------------------------------------------------------- internals


def _check_model(model: nn.Module) -> None:
    name = type(model).__name__
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a transformers causal LM (nn.Module), got {name}")
    if not hasattr(model, "get_output_embeddings") or not hasattr(model, "base_model"):
        hint = (
            "; for a DeepSpeed engine pass engine.module"
            if isinstance(getattr(model, "module", None), nn.Module)
            else ""
        )
        raise TypeError(
            f"model: {name} is not a transformers causal LM (no base_model or "
            f"get_output_embeddings){hint}"
        )
    if model.base_model is model:
        raise TypeError(f"model: {name} is a base model; expected a causal LM with an lm_head")
    if not isinstance(model.get_output_embeddings(), nn.Module):
        raise TypeError(f"model: {name}.get_output_embeddings() gives no output layer")
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError(
            f"model: {name} is an encoder-decoder (config.is_encoder_decoder); only decoder-only "
            "causal LMs are supported"
        )
    scale = getattr(config, "logit_scale", None)
    if scale is not None and scale != 1:
        raise NotImplementedError(
            f"model: {name} scales its logits (config.logit_scale={scale!r}); the "
            "vocabulary-parallel loss computes the cross entropy of lm_head(hidden) only"
        )
    if getattr(config, "output_router_logits", False):
        raise NotImplementedError(
            f"model: {name} adds a router loss (config.output_router_logits=True), which the "
            "patched forward would drop; set it to False or do not patch this model"
        )
    loss_type = getattr(model, "loss_type", None)
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:  # another layout of transformers: skip this check
        return
    if loss_type is not None and LOSS_MAPPING.get(loss_type) is not ForCausalLMLoss:
        raise TypeError(
            f"model: {name} is not a causal LM (loss_type={loss_type!r}, whose loss is not "
            "ForCausalLMLoss)"
        )


def _model_options(model: nn.Module, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with what the model's config implies: Gemma 2/3's
    ``final_logit_softcapping`` is the loss's ``softcap`` (``c * tanh(z / c)``)."""
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    if cap is None:
        return options
    if options.get("softcap") not in (None, cap):
        raise ValueError(
            f"softcap: {options['softcap']!r}, but the model caps its logits at "
            f"config.final_logit_softcapping={cap!r}"
        )
    return options | {"softcap": cap}


def _current_head(model: nn.Module, patch: _Patch, in_forward: bool = False) -> VocabParallelLMHead:
    """Our head on the model's output layer as it is now (cached while it stays the same).
    ``in_forward``: an output layer that is an FSDP2 module of its own is unsharded first
    (``vocab_parallel.parallel.sharded.unshard_fsdp_module``)."""
    layer = model.get_output_embeddings()
    if in_forward and not isinstance(layer, VocabParallelLMHead):  # ours: called, gathered
        unshard_fsdp_module(layer)
    key = (layer, getattr(layer, "weight", None), getattr(layer, "bias", None))
    if patch.head is not None:
        *cached, head = patch.head
        if all(a is b for a, b in zip(cached, key, strict=True)) and head.weight is key[1]:
            return head
    head = _build_head_on_every_rank(layer, patch)
    patch.head = (*key, head)
    return head


def _build_head(layer: nn.Module, patch: _Patch) -> VocabParallelLMHead:
    """Our head for the output layer (``vocab_parallel.integrations.heads``)."""
    return head_from_layer(layer, **patch.given)


_ERRORS = {e.__name__: e for e in (TypeError, ValueError, NotImplementedError)}


def _build_head_on_every_rank(layer: nn.Module, patch: _Patch) -> VocabParallelLMHead:
    """:func:`_build_head`, with the ranks of the layer's group agreeing on the outcome.

    Some checks of a shard are rank-local (this rank's rows against the layer's bounds, the
    local shape of a DTensor): a rank that raised alone would leave the others waiting in
    the loss's first collective. So each rank's outcome is exchanged (one small
    collective, only when the head is (re)built: at ``apply_vocab_parallel_loss`` and when
    the output layer changes, on every rank alike) and every rank raises the failing
    rank's error.
    """
    group = layer_group(layer)
    try:
        head, failure = _build_head(layer, patch), None
    except tuple(_ERRORS.values()) as exc:
        head, failure = None, exc
    if world_size(group) > 1:
        report = None if failure is None else (type(failure).__name__, str(failure))
        reports: list = [None] * world_size(group)
        dist.all_gather_object(reports, report, group=group)
        failed = [(r, rep) for r, rep in zip(group_ranks(group), reports, strict=True) if rep]
        if failed and failure is None:
            rank, (kind, message) = failed[0]
            ranks = [r for r, _ in failed]
            raise _ERRORS.get(kind, ValueError)(
                f"{message} [raised on rank {rank} (ranks {ranks} of the tensor-parallel "
                f"group {group_ranks(group)} refused the output layer); every rank refuses it]"
            )
    if failure is not None:
        raise failure
    return head


def _make_forward(signature: inspect.Signature, original: Any):
    """The patched ``forward`` (unbound): the original's signature and docstring, so that
    the ``Trainer`` and ``generate`` inspect the same parameters as before."""

    def forward(self, *args, **kwargs):
        return _patched_forward(self, args, kwargs)

    forward.__name__ = "forward"
    forward.__qualname__ = f"{type(getattr(original, '__self__', None)).__name__}.forward"
    forward.__doc__ = (
        "Patched by vocab_parallel.integrations.transformers.apply_vocab_parallel_loss: with "
        "labels, the loss is computed without logits (return_logits=True or logits_to_keep "
        "asks for them).\n\n" + (getattr(original, "__doc__", None) or "")
    )
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = signature.replace(
        parameters=[self_param, *signature.parameters.values()]
    )
    return forward


def _named_arguments(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict | None:
    """The call's arguments by name (``**kwargs`` flattened); None if they do not bind (the
    original forward then raises its own error) or use ``*args``."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    named = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                return None
        else:
            named[name] = value
    return named


def _patched_forward(model: nn.Module, args: tuple, kwargs: dict):
    patch: _Patch = model.__dict__[_STATE]
    return_logits = kwargs.pop("return_logits", None)
    stats_args = _token_stats_args(kwargs.pop("return_token_stats", None))
    named = _named_arguments(patch.signature, args, kwargs)
    wants_loss = named is not None and (
        named.get("labels") is not None or named.get("shift_labels") is not None
    )
    if stats_args is not None and not wants_loss:
        raise ValueError(
            "return_token_stats: needs labels (or shift_labels): the tokens whose log-probs "
            "are computed (e.g. the sampled response tokens, -100 elsewhere)"
        )
    # No loss asked for: the original forward, unchanged; but not with our own head as
    # lm_head, which the original forward would call without targets.
    own_head = isinstance(model.get_output_embeddings(), VocabParallelLMHead)
    if not wants_loss and (named is None or not own_head):
        return patch.original(*args, **kwargs)

    loss_args = {name: named.pop(name, None) for name in _LOSS_ARGS}
    logits_to_keep = named.pop("logits_to_keep", 0)
    return_dict = named.pop("return_dict", None)

    outputs = model.base_model(**named)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    # The head is read only now, after the base model: under DeepSpeed ZeRO-3 reading the
    # output layer's weight inside the engine's forward gathers it (and keeps it for this
    # forward's backward); read before, a weight tied to the input embedding would be
    # released again by the embedding's forward, and an untied one held through the body.
    # (An output layer that is an FSDP2 module of its own is unsharded here.)
    head = _current_head(model, patch, in_forward=True)
    ignore_index = head.loss_options["ignore_index"]
    if loss_args["ignore_index"] not in (None, ignore_index):
        raise ValueError(
            f"ignore_index: {loss_args['ignore_index']} given to forward, but the loss was "
            f"set up with {ignore_index}; pass ignore_index to apply_vocab_parallel_loss"
        )
    sequence_parallel = bool(head.loss_options.get("sequence_parallel"))
    want_logits = _wants_logits(model, patch, return_logits, logits_to_keep, wants_loss)
    if stats_args is not None and return_logits is None:
        want_logits = False  # a reference model in eval mode: still no logits
    if want_logits and sequence_parallel:
        if return_logits:
            raise ValueError(
                "return_logits: with sequence_parallel=True each rank holds a slice of the "
                "tokens; logits are not computed (call the model without sequence_parallel "
                "for them)"
            )
        warnings.warn(
            "vocab_parallel: no logits in eval mode with sequence_parallel=True (each rank "
            "holds a slice of the tokens): Trainer.predict and compute_metrics get none; "
            "pass eval_logits=False to apply_vocab_parallel_loss to silence this",
            stacklevel=3,
        )
        want_logits = False

    loss, extras, token_stats = None, (), None
    if wants_loss:
        target = loss_args["shift_labels"]
        if target is None:  # ForCausalLMLoss's shift: position t predicts labels[t + 1]
            if sequence_parallel:
                raise ValueError(
                    "labels: with sequence_parallel=True each rank holds a slice of the "
                    "sequence, and the next token of its last position is on the next rank: "
                    "pass shift_labels (the labels shifted over the whole sequence, then sliced)"
                )
            target = F.pad(loss_args["labels"], (0, 1), value=ignore_index)[..., 1:]
        device = head.weight.device
        if stats_args is not None:  # the token statistics instead of the loss
            token_stats = head.token_stats(hidden.to(device), target.to(device), **stats_args)
        else:
            loss = head(
                hidden.to(device),
                target.to(device),
                num_items_in_batch=loss_args["num_items_in_batch"],
            )
        if isinstance(loss, tuple):  # return_lse=True: (loss, lse)
            loss, *extras = loss

    logits = None
    if want_logits:
        logits = full_logits(head, _slice_logits_to_keep(hidden, logits_to_keep))

    from transformers.modeling_outputs import CausalLMOutputWithPast

    extra = {}
    if isinstance(outputs, Mapping):
        for field in dataclasses.fields(CausalLMOutputWithPast):
            if field.name not in ("loss", "logits") and outputs.get(field.name) is not None:
                extra[field.name] = outputs[field.name]
    out = CausalLMOutputWithPast(loss=loss, logits=logits, **extra)
    if extras:
        out["lse"] = extras[0]  # a key of its own (the last item of to_tuple())
    if token_stats is not None:
        out["token_stats"] = token_stats
    if return_dict is None:
        return_dict = getattr(getattr(model, "config", None), "return_dict", True)
    return out if return_dict is not False else out.to_tuple()


def _token_stats_args(value: Any) -> dict[str, Any] | None:
    """``return_token_stats``: None (the loss), True (log-probs only) or a dict of
    :meth:`VocabParallelLMHead.token_stats` keywords (``entropy``, ``top_k``,
    ``temperature``...)."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            "return_token_stats: expected True or a dict of token_stats options (entropy, "
            f"sum_p_squared, top_k, argmax, temperature...), got {type(value).__name__}"
        )
    return dict(value)


def _wants_logits(
    model: nn.Module, patch: _Patch, return_logits: Any, logits_to_keep: Any, wants_loss: bool
) -> bool:
    """Whether this call computes logits: when asked (``return_logits=True``, a non-zero
    ``logits_to_keep``), always without labels (that is all the call is for), and in eval
    mode unless ``eval_logits=False``. In training mode, with labels, none: the point."""
    if return_logits is not None:
        if not isinstance(return_logits, bool):
            raise TypeError(f"return_logits: expected a bool, got {type(return_logits).__name__}")
        return return_logits
    keep_some = not (isinstance(logits_to_keep, int) and logits_to_keep == 0)
    return keep_some or not wants_loss or (patch.eval_logits and not model.training)


class _GatherVocab(torch.autograd.Function):
    """Rank-local logits ``[..., rows]`` to the whole vocabulary ``[..., V]`` on every rank
    of the group (shards are disjoint: a SUM all-reduce of zero-padded fp32 logits is exact,
    and gloo has no half all-reduce). Backward: this rank's columns of the gradient, with no
    collective, as Megatron's gather: what is computed from the full logits is assumed to be
    the same on every rank (each rank's columns get the gradient once)."""

    @staticmethod
    def forward(ctx, local, process_group, start: int, vocab: int):
        ctx.columns = (start, start + local.shape[-1])
        full = local.new_zeros((*local.shape[:-1], vocab), dtype=torch.float32)
        full[..., start : start + local.shape[-1]] = local
        all_reduce(full, "SUM", process_group, "logits (eval/return_logits)")
        return full.to(local.dtype)

    @staticmethod
    def backward(ctx, grad):
        start, end = ctx.columns
        return grad[..., start:end], None, None, None


def full_logits(head: VocabParallelLMHead, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden [..., H]`` times the whole head: logits ``[..., vocab_size]`` on every rank
    (this rank's rows from its shard, the rest gathered over the head's group), with the
    head's bias and softcap, as the unpatched model computes them. Differentiable (see
    :class:`_GatherVocab` for the gradient under tensor parallelism)."""
    if is_dtensor(hidden):
        hidden = hidden.full_tensor()
    weight = head.weight.to_local() if is_dtensor(head.weight) else head.weight
    bias = head.bias if head.bias is not None else head.loss_options.get("bias")
    if is_dtensor(bias):
        bias = bias.to_local()
    logits = F.linear(hidden.to(device=weight.device, dtype=weight.dtype), weight, bias)
    if world_size(head.process_group) > 1:
        logits = _GatherVocab.apply(
            logits, head.process_group, head.vocab_start_index, head.vocab_size
        )
    cap = head.loss_options.get("softcap")
    if cap is not None:  # as the model's own forward (Gemma 2/3) returns them
        logits = torch.tanh(logits / cap) * cap
    return logits


def _slice_logits_to_keep(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor):
    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:
        slice_logits_to_keep = None
    if slice_logits_to_keep is not None:
        return slice_logits_to_keep(hidden, logits_to_keep)
    if isinstance(logits_to_keep, int):
        return hidden[:, -logits_to_keep:, :] if logits_to_keep else hidden
    return hidden[:, logits_to_keep, :]
