"""Hugging Face ``transformers`` causal LMs: their training loss by the vocabulary-parallel loss.

    from vocab_parallel.integrations.transformers import apply_vocab_parallel_loss

    model = AutoModelForCausalLM.from_pretrained(...)        # or from a config
    apply_vocab_parallel_loss(model)                         # before or after deepspeed.initialize
    out = model(input_ids, labels=labels, num_items_in_batch=n)
    out.loss.backward()                                      # out.logits is None: none computed

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
  :func:`vocab_parallel.integrations.deepspeed.head_from_autotp`).

So the call works before or after ``deepspeed.initialize`` (which replaces ``lm_head``),
and again after another ``initialize``. The patch lives on the model instance: ``forward``
is replaced by an instance attribute (the class and other instances are untouched), and
nothing is registered as a submodule (``state_dict`` and checkpoints are unchanged).
:func:`remove_vocab_parallel_loss` puts the original ``forward`` back.

What the patched ``forward`` does:

* **Without** ``labels`` (and ``shift_labels``): the original ``forward``, unchanged
  (generation, logits for evaluation).
* **With** ``labels``: the base model's forward (``model.base_model``, all other arguments
  passed on), then the fused loss on the last hidden states. Labels are shifted as in
  ``ForCausalLMLoss`` (padded with ``ignore_index`` at the end: position ``t`` predicts
  ``labels[t + 1]``); ``shift_labels`` (already shifted, e.g. from padding-free
  collators) is used as it is. ``num_items_in_batch`` (int or tensor) makes the loss
  ``sum / num_items_in_batch``; without it the loss is the head's ``reduction``
  (``"mean"`` over non-ignored tokens by default).
* **Logits** only when asked: ``return_logits=True`` (an argument of the patched
  ``forward``) or a non-zero ``logits_to_keep`` then also run ``lm_head`` on the positions
  that ``logits_to_keep`` selects (all of them for 0). The loss still covers every position
  with a label. Under AutoTP these logits are the rank-local ``[..., V_local]`` slice, as
  DeepSpeed's ``VocabParallelLinear`` returns them. ``return_logits=False`` never computes
  logits. Otherwise ``logits`` is ``None``: in memory-saving mode no ``[tokens, V]`` tensor
  exists at any time.
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
With ``sequence_parallel=True`` pass ``shift_labels`` (the shift crosses the ranks' slices).

``transformers`` is imported inside the functions only: importing this module does not
import it.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vocab_parallel.integrations.deepspeed import head_from_autotp
from vocab_parallel.lm_head import VocabParallelLMHead, head_options

_STATE = "_vocab_parallel_loss"  # the patch's state in the model's __dict__
_MISSING = object()

# Loss arguments of the causal-LM forward (ForCausalLMLoss's keywords), not the base model's.
_LOSS_ARGS = ("labels", "shift_labels", "num_items_in_batch", "ignore_index")


@dataclasses.dataclass(eq=False)
class _Patch:
    """What :func:`apply_vocab_parallel_loss` keeps on the model (not a module)."""

    original: Any  # the forward that was in place (a bound method, usually the class's)
    previous: Any  # the instance attribute ``forward`` before patching, or _MISSING
    signature: inspect.Signature  # of ``original``
    options: dict[str, Any]  # the loss options (all of them, validated)
    head: tuple | None = None  # (layer, weight, bias, VocabParallelLMHead) of the last call


def apply_vocab_parallel_loss(model: nn.Module, **loss_options: Any) -> nn.Module:
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
        TypeError: not a causal LM, a bad option name, or an output layer that is neither
            an ``nn.Linear`` nor AutoTP's vocabulary-parallel head (the message names the
            DeepSpeed option to turn on).
        ValueError: a bad option value, or a softcap other than the model's.
        NotImplementedError: a model whose logits are more than ``lm_head(hidden)`` (see
            the module docstring).
    """
    _check_model(model)
    options = _model_options(model, loss_options)
    head_options(options)  # a bad name or value fails now
    existing = model.__dict__.get(_STATE)
    if existing is None:
        original = model.forward
        previous = model.__dict__.get("forward", _MISSING)
        patch = _Patch(original, previous, inspect.signature(original), options)
    else:  # applied again: new options, the same original forward
        patch = dataclasses.replace(existing, options=options, head=None)
    _current_head(model, patch)  # a wrong head fails now (the model still unchanged)
    model.__dict__[_STATE] = patch
    model.forward = types.MethodType(_make_forward(patch.signature, patch.original), model)
    return model


def remove_vocab_parallel_loss(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_vocab_parallel_loss`: the original ``forward`` again (a model that
    is not patched is returned as it is)."""
    patch = model.__dict__.pop(_STATE, None)
    if patch is None:
        return model
    if patch.previous is _MISSING:
        model.__dict__.pop("forward", None)
    else:
        model.forward = patch.previous
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


def _current_head(model: nn.Module, patch: _Patch) -> VocabParallelLMHead:
    """Our head on the model's output layer as it is now (cached while it stays the same)."""
    layer = model.get_output_embeddings()
    key = (layer, getattr(layer, "weight", None), getattr(layer, "bias", None))
    if patch.head is not None:
        *cached, head = patch.head
        if all(a is b for a, b in zip(cached, key, strict=True)) and head.weight is key[1]:
            return head
    head = head_from_autotp(layer, **patch.options)
    patch.head = (*key, head)
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
    named = _named_arguments(patch.signature, args, kwargs)
    if named is None or (named.get("labels") is None and named.get("shift_labels") is None):
        return patch.original(*args, **kwargs)  # no loss asked for: unchanged

    loss_args = {name: named.pop(name, None) for name in _LOSS_ARGS}
    logits_to_keep = named.pop("logits_to_keep", 0)
    return_dict = named.pop("return_dict", None)

    head = _current_head(model, patch)
    ignore_index = head.loss_options["ignore_index"]
    if loss_args["ignore_index"] not in (None, ignore_index):
        raise ValueError(
            f"ignore_index: {loss_args['ignore_index']} given to forward, but the loss was "
            f"set up with {ignore_index}; pass ignore_index to apply_vocab_parallel_loss"
        )

    outputs = model.base_model(**named)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]

    target = loss_args["shift_labels"]
    if target is None:  # ForCausalLMLoss's shift: position t predicts labels[t + 1]
        if head.loss_options.get("sequence_parallel"):
            raise ValueError(
                "labels: with sequence_parallel=True each rank holds a slice of the sequence, "
                "and the next token of its last position is on the next rank: pass "
                "shift_labels (the labels shifted over the whole sequence, then sliced)"
            )
        target = F.pad(loss_args["labels"], (0, 1), value=ignore_index)[..., 1:]
    device = head.weight.device
    loss = head(
        hidden.to(device),
        target.to(device),
        num_items_in_batch=loss_args["num_items_in_batch"],
    )
    extras = ()
    if isinstance(loss, tuple):  # return_lse=True: (loss, lse)
        loss, *extras = loss

    logits = None
    keep_some = not (isinstance(logits_to_keep, int) and logits_to_keep == 0)
    if return_logits or (return_logits is None and keep_some):
        layer = model.get_output_embeddings()
        logits = layer(_slice_logits_to_keep(hidden, logits_to_keep))
        cap = head.loss_options.get("softcap")
        if cap is not None:  # as the model's own forward (Gemma 2/3) returns them
            logits = torch.tanh(logits / cap) * cap

    from transformers.modeling_outputs import CausalLMOutputWithPast

    extra = {}
    if isinstance(outputs, Mapping):
        for field in dataclasses.fields(CausalLMOutputWithPast):
            if field.name not in ("loss", "logits") and outputs.get(field.name) is not None:
                extra[field.name] = outputs[field.name]
    out = CausalLMOutputWithPast(loss=loss, logits=logits, **extra)
    if extras:
        out["lse"] = extras[0]  # a key of its own (the last item of to_tuple())
    if return_dict is None:
        return_dict = getattr(getattr(model, "config", None), "return_dict", True)
    return out if return_dict is not False else out.to_tuple()


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
