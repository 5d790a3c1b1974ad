"""A vocabulary-parallel LM head that owns its shard: ``lm_head`` + loss in one module.

    head = VocabParallelLMHead(hidden_size=4096, vocab_size=128256, process_group=tp_group)
    loss = head(hidden, labels)          # never materialises [tokens, vocab] logits

Rank r of the tensor-parallel group holds rows ``[vocab_start_index, vocab_end_index)`` of
the ``[vocab_size, hidden_size]`` weight (contiguous, uneven shards allowed). The weight
carries the Megatron/DeepSpeed tensor-parallel attributes (``tensor_model_parallel``,
``partition_dim``, ``partition_stride``) so that gradient clipping counts its norm once
per shard across the group and checkpoints know it is partitioned.

The loss options (``ignore_index``, ``reduction``, ``mode``...) are passed on to
:func:`vocab_parallel.vocab_parallel_linear_cross_entropy` as they are: every keyword
option of that function is an option of the head, including ones added to it later.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vocab_parallel import options as _options
from vocab_parallel.distillation import run_distillation
from vocab_parallel.loss import LossOutput, run_loss
from vocab_parallel.options import (
    LAYOUT_OPTIONS,
    OPTION_NAMES,
    LossOptions,
    PendingOptions,
    StatsRequest,
    shown_options,
)
from vocab_parallel.parallel.collectives import world_size
from vocab_parallel.parallel.layout import shard_bounds
from vocab_parallel.parallel.sharded import check_plain, full_shape
from vocab_parallel.token_stats import TOKEN_STATS_MODES, TokenStats, run_token_stats

# The head's options that also shape its token statistics (the logits and execution).
TOKEN_STATS_OPTIONS = (
    "ignore_index", "softcap", "temperature", "mode", "backend", "check_inputs",
    "sequence_parallel",
)  # fmt: skip


# The head's options that also shape its distillation loss.
DISTILL_OPTIONS = (
    "ignore_index", "softcap", "mode", "backend", "check_inputs", "sequence_parallel",
)  # fmt: skip


def mark_tensor_parallel(param: torch.Tensor, partition_dim: int = 0) -> torch.Tensor:
    """Tag ``param`` as a tensor-parallel shard (the attributes Megatron and DeepSpeed read)."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = 1
    return param


def head_options(options: dict[str, Any]) -> LossOptions:
    """The :class:`LossOptions` of a head from its keyword options: validated at
    construction, not at the first forward; the layout options are the head's own."""
    owned = sorted(set(options) & (LAYOUT_OPTIONS | {"process_group"}))
    if owned:
        raise TypeError(f"{owned[0]}: set by the head from its shard, not a loss option")
    return _options.loss_options(**options)


class VocabParallelLMHead(nn.Module):
    """This rank's rows of the LM head, computing the cross entropy without full logits.

    Args:
        hidden_size, vocab_size: the full head is ``[vocab_size, hidden_size]``.
        process_group: the tensor-parallel group (``None``: one shard, no collectives).
        vocab_start_index, vocab_end_index: this rank's rows; default contiguous shards in
            rank order, the first ``vocab_size % tp`` ranks one row larger.
        dtype, device: of the weight.
        bias: ``True`` gives the head this rank's ``[rows]`` bias parameter (zeros, tagged
            tensor-parallel like the weight); a tensor is passed to the loss as it is.
        **loss_options: any keyword option of
            :func:`vocab_parallel.vocab_parallel_linear_cross_entropy` except the layout
            ones the head sets (``process_group``, ``vocab_start_index``,
            ``global_vocab_size``): ``ignore_index``, ``reduction``, ``label_smoothing``,
            ``mode``, ``backend``... Omitted ones take the loss's defaults. Kept in
            ``self.loss_options`` (all of them) and passed on at every call.
    """

    _dtensor_weight = False  # a plain shard (DTensorLMHead: a DTensor one)

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        process_group: dist.ProcessGroup | None = None,
        vocab_start_index: int | None = None,
        vocab_end_index: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        **loss_options: Any,
    ) -> None:
        super().__init__()
        # bias=True: the head owns a [rows] bias parameter (a tensor: someone else's, e.g.
        # an AutoTP layer's, passed to the loss as it is).
        own_bias = loss_options.get("bias") is True
        if isinstance(loss_options.get("bias"), bool):
            loss_options.pop("bias")
        self.options = head_options(loss_options)  # fails here, not at the first forward
        for name, value in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        tp = world_size(process_group)
        rank = dist.get_rank(process_group) if tp > 1 else 0
        if (vocab_start_index is None) != (vocab_end_index is None):
            raise ValueError("vocab_start_index, vocab_end_index: give both or neither")
        if vocab_start_index is None:
            vocab_start_index, vocab_end_index = shard_bounds(vocab_size, tp)[rank]
        if not 0 <= vocab_start_index <= vocab_end_index <= vocab_size:
            raise ValueError(
                f"vocab_start_index, vocab_end_index: expected 0 <= start <= end <= "
                f"{vocab_size}, got [{vocab_start_index}, {vocab_end_index})"
            )
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.vocab_start_index, self.vocab_end_index = vocab_start_index, vocab_end_index
        self.process_group = process_group
        rows = vocab_end_index - vocab_start_index
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype, device=device))
        mark_tensor_parallel(self.weight)
        nn.init.normal_(self.weight, std=hidden_size**-0.5)
        self.bias = None
        if own_bias:  # this rank's rows of the bias, sharded like the weight
            self.bias = nn.Parameter(torch.zeros(rows, dtype=dtype, device=device))
            mark_tensor_parallel(self.bias)

    @classmethod
    def from_full_weight(
        cls, weight: torch.Tensor, process_group: dist.ProcessGroup | None = None, **options
    ) -> VocabParallelLMHead:
        """A head whose shard is this rank's rows of ``weight [vocab_size, hidden_size]``."""
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError("weight: expected a 2-D tensor [vocab_size, hidden_size]")
        options.setdefault("dtype", weight.dtype)
        options.setdefault("device", weight.device)
        head = cls(weight.shape[1], weight.shape[0], process_group=process_group, **options)
        head.load_full_weight_(weight)
        return head

    @classmethod
    def from_shard(
        cls,
        weight: nn.Parameter,
        vocab_size: int,
        vocab_start_index: int,
        process_group: dist.ProcessGroup | None = None,
        **options,
    ) -> VocabParallelLMHead:
        """A head around an existing shard parameter (no copy), e.g. another framework's
        tensor-parallel LM head; its gradient then lands in that same parameter.

        With more than one rank in ``process_group`` the parameter is tagged
        tensor-parallel (see :func:`mark_tensor_parallel`); a whole head (one rank) is left
        as it is: it may be replicated over a tensor-parallel group, or tied to an
        embedding, and must then count once in gradient norms.

        A DeepSpeed ZeRO-3 parameter is taken at its whole shape (``ds_shape``); the loss
        then reads it where ZeRO-3 gathers it (``vocab_parallel.parallel.sharded``).
        """
        shape = full_shape(weight) if isinstance(weight, torch.Tensor) else ()
        if not isinstance(weight, nn.Parameter) or len(shape) != 2:
            raise TypeError("weight: expected a 2-D nn.Parameter [rows, hidden_size]")
        head = cls(
            shape[1],
            vocab_size,
            process_group=process_group,
            vocab_start_index=vocab_start_index,
            vocab_end_index=vocab_start_index + shape[0],
            dtype=weight.dtype,
            device="meta",  # no throw-away allocation: the parameter is replaced below
            **options,
        )
        head.weight = mark_tensor_parallel(weight) if world_size(process_group) > 1 else weight
        return head

    @torch.no_grad()
    def load_full_weight_(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of a full ``[vocab_size, hidden_size]`` weight (e.g. from
        an unsharded checkpoint) into the shard."""
        expected = (self.vocab_size, self.hidden_size)
        if tuple(weight.shape) != expected:
            raise ValueError(f"weight: expected shape {expected}, got {tuple(weight.shape)}")
        self.weight.copy_(weight[self.vocab_start_index : self.vocab_end_index])

    @torch.no_grad()
    def full_weight(self) -> torch.Tensor:
        """The whole ``[vocab_size, hidden_size]`` weight, gathered over the group (collective)."""
        if world_size(self.process_group) == 1:
            return self.weight.detach().clone()
        full = torch.zeros(
            self.vocab_size, self.hidden_size, dtype=torch.float32, device=self.weight.device
        )
        full[self.vocab_start_index : self.vocab_end_index] = self.weight.float()
        dist.all_reduce(full, group=self.process_group)  # shards are disjoint: SUM = gather
        return full.to(self.weight.dtype)

    @property
    def loss_options(self) -> dict[str, Any]:
        """The head's loss options by name (a read-only view of ``self.options``; the layout
        is the head's own)."""
        return {n: getattr(self.options, n) for n in OPTION_NAMES if n not in LAYOUT_OPTIONS}

    def forward(
        self,
        hidden: torch.Tensor,
        target: torch.Tensor,
        *,
        reduction: str | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor | LossOutput:
        """Loss of ``hidden [..., H]`` against global token ids ``target [...]``.

        Args:
            reduction: this call's reduction (``"none"``, ``"sum"``, ``"mean"``), instead of
                the head's.
            num_items_in_batch: the loss is then the SUM over this call's tokens divided by
                ``num_items_in_batch`` (Hugging Face's convention for gradient accumulation:
                the non-ignored tokens of all micro-batches of a step, so that their losses
                add up to the step's mean). A finite count > 0 (an int, a float or a 0-d /
                one-element tensor); 0 only for a batch whose tokens are all ignored (the
                loss is then 0, not NaN). With it, ``reduction`` may only be ``None`` or
                ``"sum"``.
        """
        if not self._dtensor_weight:  # a DTensor here is FSDP2's shard, outside its forward
            check_plain("weight", self.weight)
        changes: dict[str, Any] = {
            "vocab_start_index": self.vocab_start_index,
            "global_vocab_size": self.vocab_size,  # layout known: no collective per call
        }
        if num_items_in_batch is not None and reduction is None:
            reduction = "sum"  # another one is refused with num_items_in_batch (prepare_call)
        if reduction is not None:
            changes["reduction"] = reduction
        if self.bias is not None:
            changes["bias"] = self.bias
        opts = PendingOptions(self.options, **changes)  # made where a refusal is told to all
        return run_loss(hidden, self.weight, target, opts, self.process_group, num_items_in_batch)

    def token_stats(
        self,
        hidden: torch.Tensor,
        target: torch.Tensor,
        *,
        entropy: bool = False,
        sum_p_squared: bool = False,
        top_k: int = 0,
        argmax: bool = False,
        sample_top_k: int | torch.Tensor | None = None,
        sample_top_p: float | torch.Tensor | None = None,
        sample_min_p: float | torch.Tensor | None = None,
        **options: Any,
    ) -> TokenStats:
        """Per-token log-probs of ``target`` (and entropy, sum of squared probabilities,
        top-k, argmax; or those of a sampler's truncation, ``sample_top_k`` /
        ``sample_top_p`` / ``sample_min_p``) under this head:
        :func:`vocab_parallel.vocab_parallel_token_stats`
        with the head's shard, bias and logits options (``softcap``, ``temperature``,
        ``ignore_index``, ``backend``, ``sequence_parallel``...); ``options`` override
        those for this call (e.g. a per-token rollout ``temperature``). The loss-only
        options (label smoothing, z-loss, class weights, reduction) do not apply; a head
        whose mode is ``"grad_in_forward"`` computes them in ``"auto"`` mode."""
        unknown = sorted(set(options) - set(TOKEN_STATS_OPTIONS))
        if unknown:
            raise TypeError(
                f"{unknown[0]}: not an option of token_stats (its options: "
                f"{', '.join(TOKEN_STATS_OPTIONS)})"
            )
        chosen = {name: getattr(self.options, name) for name in TOKEN_STATS_OPTIONS}
        if chosen["mode"] not in TOKEN_STATS_MODES:
            chosen["mode"] = "auto"
        chosen.update(options)
        opts = PendingOptions(  # made, like the request, where a refusal is told to all
            reduction="none",
            bias=self.bias,
            vocab_start_index=self.vocab_start_index,
            global_vocab_size=self.vocab_size,
            **chosen,
        )
        request = functools.partial(StatsRequest, entropy, sum_p_squared, top_k, argmax)
        sampling = dict(sample_top_k=sample_top_k, sample_top_p=sample_top_p,
                        sample_min_p=sample_min_p)  # fmt: skip
        return run_token_stats(
            hidden, self.weight, target, opts, request, self.process_group, sampling=sampling
        )

    def distillation_loss(
        self,
        hidden: torch.Tensor,
        teacher_head: VocabParallelLMHead,
        teacher_hidden: torch.Tensor,
        target: torch.Tensor | None = None,
        *,
        divergence: str = "forward_kl",
        beta: float = 0.5,
        temperature: float | torch.Tensor = 1.0,
        hard_label_weight: float = 0.0,
        reduction: str | None = None,
        **options: Any,
    ) -> torch.Tensor:
        """The distillation loss of this head (the student) from ``teacher_head`` (another
        :class:`VocabParallelLMHead` with the same shard layout; its hidden size may
        differ): :func:`vocab_parallel.vocab_parallel_distillation_loss` with both heads'
        shards and biases and this head's options (``softcap``, ``ignore_index``,
        ``mode``, ``backend``, ``sequence_parallel``...; ``options`` override them for
        this call). No gradient reaches the teacher's parameters."""
        unknown = sorted(set(options) - set(DISTILL_OPTIONS))
        if unknown:
            raise TypeError(
                f"{unknown[0]}: not an option of distillation_loss (its options: "
                f"{', '.join(DISTILL_OPTIONS)})"
            )
        chosen = {name: getattr(self.options, name) for name in DISTILL_OPTIONS}
        chosen.update(options)
        opts = PendingOptions(  # made, the teacher head checked, where a refusal is told to all
            check=lambda: self._check_teacher_head(teacher_head),
            reduction=reduction if reduction is not None else self.options.reduction,
            temperature=temperature,
            bias=self.bias,
            vocab_start_index=self.vocab_start_index,
            global_vocab_size=self.vocab_size,
            **chosen,
        )
        teacher = (getattr(teacher_head, "weight", None), getattr(teacher_head, "bias", None))
        given = dict(hidden=teacher_hidden, weight=teacher[0], bias=teacher[1], ids=None,
                     logprobs=None)  # fmt: skip
        return run_distillation(
            hidden, self.weight, given, target, opts, self.process_group, divergence, beta,
            hard_label_weight,
        )  # fmt: skip

    def _check_teacher_head(self, teacher_head: object) -> None:
        """A teacher of :meth:`distillation_loss`: a head with this head's shard layout."""
        if not isinstance(teacher_head, VocabParallelLMHead):
            raise TypeError(
                f"teacher_head: expected a VocabParallelLMHead, got {type(teacher_head).__name__}"
            )
        mine = (self.vocab_size, self.vocab_start_index, self.vocab_end_index)
        theirs = (teacher_head.vocab_size, teacher_head.vocab_start_index,
                  teacher_head.vocab_end_index)  # fmt: skip
        if mine != theirs:
            raise ValueError(
                f"teacher_head: its vocabulary rows {theirs[1:]} of {theirs[0]} differ from "
                f"the student's {mine[1:]} of {mine[0]}; the heads must share one layout"
            )

    def extra_repr(self) -> str:
        shown = shown_options(self.options)
        return (
            f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, "
            f"rows=[{self.vocab_start_index}, {self.vocab_end_index})"
            + (", bias=True" if self.bias is not None else "")
            + (f", {shown}" if shown else "")
        )
