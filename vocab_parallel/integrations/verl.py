"""verl plug-in: its fused log-probs + entropy, from our token statistics.

verl (0.9) computes the PPO/GRPO actor's per-token log-probs and entropy without logits
when ``actor_rollout_ref.model.use_fused_kernels=True``: through
``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (its Triton kernel,
``fused_kernel_options.impl_backend=triton``; CUDA only, no ``ignore_index``), called by
its Hugging Face forwards (``verl.models.transformers.*``) and, for Megatron, by
``verl.models.mcore.model_forward_fused.fused_output_processor`` (Megatron's
``output_processor`` hook). This module is a drop-in for both, on
:func:`vocab_parallel.vocab_parallel_token_stats` (both backends, CPU and GPU, bf16 and
fp32, any vocabulary split into contiguous shards in rank order):

    from vocab_parallel.integrations import verl as vp_verl
    vp_verl.patch_verl()      # once, before the actor's first forward: the one import

or, in code of one's own, ``vp_verl.linear_cross_entropy(hidden, weight, labels,
temperature, "none", tp_group)`` where verl's was called.

Conventions kept (``tests/test_verl.py`` checks them against verl's own torch and
Megatron references):

* ``linear_cross_entropy(hidden [..., H], weight [V_local, H], labels [...],
  temperature: float = 1.0, reduction="none", dist_process_group=None) -> (logprobs,
  entropy)``, both fp32 and flattened ``[N]``; ``reduction="sum"`` / ``"mean"`` reduce the
  log-probs (not the entropy) over the N tokens, as verl's kernel does.
* **Gradient**: under tensor parallelism the gradient of ``hidden`` is this rank's
  partial one, NOT summed over ``dist_process_group``: verl's callers sum it (the
  sequence-parallel gather's reduce-scatter in the Megatron path). The weight's
  gradient is this rank's rows, as always. (:func:`fused_output_processor` sums it
  itself when ``config.sequence_parallel`` is off: there no gather's backward does.)
* Labels equal to -100 give 0 and no gradient (verl has no ignore index; rolled
  ``input_ids`` never hold -100, so nothing changes for it).

:func:`fused_output_processor` mirrors verl's Megatron one (hidden states gathered under
sequence parallelism with Megatron's own gather, the tied embedding weight when given,
``context.temperature``) and returns the same kind of output, ``log_probs`` and
``entropy`` ``[b * s]`` (hidden ``[s, b, h]`` is put in labels' ``[b, s]`` order first:
the same as verl's flattening for its packed ``b = 1``).

verl and Megatron are imported inside the functions only.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from vocab_parallel.options import PendingOptions, StatsRequest
from vocab_parallel.token_stats import run_token_stats

__all__ = ["fused_output_processor", "linear_cross_entropy", "patch_verl"]

REDUCTIONS = ("none", "sum", "mean")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``linear_cross_entropy``: ``(logprobs, entropy)`` of ``labels`` under
    ``softmax(hidden @ W.T / temperature)`` over the vocabulary sharded over
    ``dist_process_group`` (``weight``: this rank's rows); conventions in the module
    docstring (the hidden gradient stays rank-local)."""
    return _stats(hidden, weight, labels, temperature, reduction, dist_process_group, True)


def _stats(hidden, weight, labels, temperature, reduction, group, partial_grad_input: bool):
    """:func:`linear_cross_entropy`, the hidden gradient this rank's share when
    ``partial_grad_input`` (the caller sums it), else summed over ``group`` here. Its own
    checks run where the entry's do (a value refused on one rank raises on every rank)."""

    def check():
        if isinstance(temperature, bool) or not isinstance(temperature, int | float):
            raise TypeError(f"temperature: expected a float, got {type(temperature).__name__}")
        if not (0.0 < float(temperature) < math.inf):
            raise ValueError(f"temperature: expected a finite float > 0, got {temperature}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")

    flat = isinstance(hidden, torch.Tensor) and hidden.dim() >= 1
    h2 = hidden.reshape(-1, hidden.shape[-1]) if flat else hidden  # else refused, naming it
    y = labels.reshape(-1) if isinstance(labels, torch.Tensor) else labels
    temp = float(temperature) if isinstance(temperature, int | float) else temperature
    opts = PendingOptions(check=check, reduction="none", temperature=temp)
    stats = run_token_stats(
        h2, weight, y, opts, StatsRequest(entropy=True), group,
        partial_grad_input=partial_grad_input,
    )  # fmt: skip
    logprobs = stats.logprobs
    if reduction == "sum":
        logprobs = logprobs.sum()
    elif reduction == "mean":
        logprobs = logprobs.mean()
    return logprobs, stats.entropy


def fused_output_processor(
    *,
    hidden_states: torch.Tensor,
    output_layer,
    output_weight: torch.Tensor | None,
    labels: torch.Tensor,
    context,
    config,
    **_ignored,
):
    """verl's Megatron ``output_processor`` (``GPTModel.forward(...,
    output_processor=fused_output_processor, output_processor_context=ctx)`` with
    ``ctx.temperature``): the model then returns an output whose ``log_probs`` and
    ``entropy`` are ``[b * s]`` fp32, as verl's."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
    from transformers.modeling_outputs import CausalLMOutputWithPast

    output = CausalLMOutputWithPast(loss=None, logits=None, hidden_states=hidden_states)
    sequence_parallel = bool(config.sequence_parallel)
    if sequence_parallel:  # its backward reduce-scatters: sums the hidden gradient
        hidden_states = gather_from_sequence_parallel_region(hidden_states)
    weight = output_weight if output_weight is not None else output_layer.weight
    hidden = hidden_states.transpose(0, 1)  # [s, b, h] -> labels' [b, s] order
    group = parallel_state.get_tensor_model_parallel_group()
    # Without sequence parallelism nothing else sums the hidden gradient over the group
    # (the output layer's copy_to_tensor_model_parallel_region would; it is not called).
    logprobs, entropy = _stats(
        hidden, weight, labels, float(context.temperature), "none", group, sequence_parallel
    )
    output["log_probs"] = logprobs
    output["entropy"] = entropy
    return output


def patch_verl() -> list[str]:
    """Make verl's fused path use these functions: ``linear_cross_entropy`` in
    ``verl.utils.kernel.linear_cross_entropy`` (which verl's Hugging Face forwards import
    at each call) and in the Megatron modules that imported it by name, and
    ``fused_output_processor`` there. Returns the patched ``module.name`` entries (the
    modules loaded now; call it after importing verl's workers)."""
    import importlib

    patched = []
    module = importlib.import_module("verl.utils.kernel.linear_cross_entropy")
    module.linear_cross_entropy = linear_cross_entropy
    patched.append(f"{module.__name__}.linear_cross_entropy")
    megatron_users = ("model_forward_fused", "model_forward_1f1b_overlap")
    for name in (f"verl.models.mcore.{m}" for m in megatron_users):
        loaded = sys.modules.get(name)
        if loaded is None:
            continue
        for attr, value in (
            ("linear_cross_entropy", linear_cross_entropy),
            ("fused_output_processor", fused_output_processor),
        ):
            if hasattr(loaded, attr):
                setattr(loaded, attr, value)
                patched.append(f"{name}.{attr}")
    return patched
