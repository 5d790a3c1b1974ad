"""A vocabulary-parallel LM head that owns its shard: ``lm_head`` + loss in one module.

    head = VocabParallelLMHead(hidden_size=4096, vocab_size=128256, process_group=tp_group)
    loss = head(hidden, labels)          # never materialises [tokens, vocab] logits

Rank r of the tensor-parallel group holds rows ``[vocab_start_index, vocab_end_index)`` of
the ``[vocab_size, hidden_size]`` weight (contiguous, uneven shards allowed). The weight
carries the Megatron/DeepSpeed tensor-parallel attributes (``tensor_model_parallel``,
``partition_dim``, ``partition_stride``) so that gradient clipping counts its norm once
per shard across the group and checkpoints know it is partitioned.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from vocab_parallel.distributed import world_size
from vocab_parallel.layout import shard_bounds
from vocab_parallel.loss import check_options, vocab_parallel_linear_cross_entropy


def mark_tensor_parallel(param: torch.Tensor, partition_dim: int = 0) -> torch.Tensor:
    """Tag ``param`` as a tensor-parallel shard (the attributes Megatron and DeepSpeed read)."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = 1
    return param


class VocabParallelLMHead(nn.Module):
    """This rank's rows of the LM head, computing the cross entropy without full logits.

    Args:
        hidden_size, vocab_size: the full head is ``[vocab_size, hidden_size]``.
        process_group: the tensor-parallel group (``None``: one shard, no collectives).
        vocab_start_index, vocab_end_index: this rank's rows; default contiguous shards in
            rank order, the first ``vocab_size % tp`` ranks one row larger.
        ignore_index, reduction, label_smoothing, mode, backend: as in
            :func:`vocab_parallel.vocab_parallel_linear_cross_entropy`.
        dtype, device: of the weight.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        process_group: dist.ProcessGroup | None = None,
        vocab_start_index: int | None = None,
        vocab_end_index: int | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        mode: str = "memory_saving",
        backend: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_options(
            ignore_index, reduction, label_smoothing, mode, backend, vocab_start_index
        )  # fail at construction rather than at the first forward
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
        self.loss_options = dict(
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
            mode=mode,
            backend=backend,
        )
        rows = vocab_end_index - vocab_start_index
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype, device=device))
        mark_tensor_parallel(self.weight)
        nn.init.normal_(self.weight, std=hidden_size**-0.5)

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
        tensor-parallel LM head; its gradient then lands in that same parameter."""
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            raise TypeError("weight: expected a 2-D nn.Parameter [rows, hidden_size]")
        head = cls(
            weight.shape[1],
            vocab_size,
            process_group=process_group,
            vocab_start_index=vocab_start_index,
            vocab_end_index=vocab_start_index + weight.shape[0],
            dtype=weight.dtype,
            device="meta",  # no throw-away allocation: the parameter is replaced below
            **options,
        )
        head.weight = mark_tensor_parallel(weight)
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

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Loss of ``hidden [..., H]`` against global token ids ``target [...]``."""
        return vocab_parallel_linear_cross_entropy(
            hidden,
            self.weight,
            target,
            process_group=self.process_group,
            vocab_start_index=self.vocab_start_index,
            global_vocab_size=self.vocab_size,  # layout known: no collective per call
            **self.loss_options,
        )

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, "
            f"rows=[{self.vocab_start_index}, {self.vocab_end_index}), "
            + ", ".join(f"{k}={v!r}" for k, v in self.loss_options.items())
        )
