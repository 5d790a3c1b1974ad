"""A small GPT-style causal LM whose LM head is a :class:`VocabParallelLMHead`.

It is what ``launch/train.py`` trains and what the integration tests compare: the body
(embeddings, pre-norm transformer blocks) is replicated on the ranks of the
tensor-parallel group (``process_group``), the head's vocabulary is sharded over it. It
is an application of the library, not part of it: any model whose last layer is a
:class:`~vocab_parallel.lm_head.VocabParallelLMHead` trains the same way. ``head="unsharded"``
swaps in an ordinary ``nn.Linear``-style head with ``F.cross_entropy`` on full logits,
initialised to the very same weights, for side-by-side checks.

Initialisation is a function of the seed only, never of the parallel layout: the body
from ``torch.manual_seed(seed)``, the head weight block by block from seeded generators
(each rank draws only the blocks of its own rows), so TP 1, 2 or 8 start identical.

Two more layouts of the head (``docs/parallel_layouts.md``): ``sequence_parallel=True``
gives the head only this TP rank's slice of the tokens, and ``head="dtensor"`` builds the
head on the DTensor weight of an ``nn.Linear`` parallelised with ``ColwiseParallel``
(torch-native tensor parallelism), through
:func:`vocab_parallel.integrations.torch_tp.head_from_colwise`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch.config import DTYPES, filter_eps
from vocab_parallel.lm_head import VocabParallelLMHead
from vocab_parallel.parallel.collectives import world_size
from vocab_parallel.parallel.layout import shard_bounds

_HEAD_INIT_BLOCK = 1024  # rows per seeded block of the head's initial weight


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 8192
    context: int = 64
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class UnshardedHead(nn.Module):
    """The reference head: full ``[vocab, d]`` weight, full logits, ``F.cross_entropy``."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight).float()
        return F.cross_entropy(
            logits.flatten(0, -2),
            target.flatten(),
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
        )


def init_head_rows(weight: torch.Tensor, start: int, seed: int) -> None:
    """Fill ``weight`` with rows ``[start, start + len(weight))`` of the seeded full init."""
    rows, d = weight.shape
    first, last = start // _HEAD_INIT_BLOCK, (start + rows - 1) // _HEAD_INIT_BLOCK
    with torch.no_grad():
        for block in range(first, last + 1):
            g = torch.Generator().manual_seed(seed * 1_000_003 + block)
            values = torch.randn(_HEAD_INIT_BLOCK, d, generator=g) * d**-0.5
            lo = max(start, block * _HEAD_INIT_BLOCK)
            hi = min(start + rows, (block + 1) * _HEAD_INIT_BLOCK)
            b0 = block * _HEAD_INIT_BLOCK
            weight[lo - start : hi - start] = values[lo - b0 : hi - b0].to(weight.dtype)


class GPT(nn.Module):
    """Token + position embeddings, ``n_layers`` blocks, final norm, then the LM head.

    ``forward(idx [B, T], targets [B, T]) -> loss`` (mean over non-ignored tokens).
    ``process_group``: the tensor-parallel group the head's vocabulary is sharded over
    (``None``: one shard); ``head_options`` go to the head (mode, backend, smoothing,
    ``sequence_parallel``...).

    ``head``: ``"vocab_parallel"`` (our head owns its shard, a plain parameter),
    ``"dtensor"`` (an ``nn.Linear(d_model, vocab, bias=False)`` on ``device``,
    parallelised with ``ColwiseParallel`` over a 1-D DeviceMesh of ``process_group`` and
    turned into our head by ``head_from_colwise``: its weight is a ``Shard(0)`` DTensor,
    chunked as ``torch.chunk`` does) or ``"unsharded"`` (the reference).

    ``sequence_parallel`` (with more than one TP rank): the head receives only this TP
    rank's contiguous slice of the tokens along the sequence (``shard_bounds(T, tp)``,
    uneven allowed) and returns the loss over all tokens of the group. Unlike
    Megatron-style sequence parallelism, the body is not split here: it stays replicated
    and only the head's input is cut, which still exercises the head's gather/reduce
    path; each TP rank then back-propagates only its own tokens through the body, so the
    engine sums the body's gradients over the TP group (``launch.engines.TorchEngine``).
    """

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        seed: int = 0,
        head: str = "vocab_parallel",
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        **head_options,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.process_group = process_group
        self.tp = world_size(process_group)
        self.tp_rank = dist.get_rank(process_group) if self.tp > 1 else 0
        self.sequence_parallel = bool(head_options.get("sequence_parallel", False))
        torch.manual_seed(seed)
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        if head == "vocab_parallel":
            self.head = VocabParallelLMHead(
                cfg.d_model, cfg.vocab_size, process_group=process_group, **head_options
            )
            start = self.head.vocab_start_index
        elif head == "dtensor":
            self.head = dtensor_head(cfg, process_group, device, **head_options)
            # this rank's rows of the very same seeded full init (no_grad inside)
            weight = self.head.weight
            local = weight.to_local() if hasattr(weight, "to_local") else weight  # meta: plain
            init_head_rows(local, self.head.vocab_start_index, seed)
            return
        elif head == "unsharded":
            keep = ("ignore_index", "label_smoothing")  # the rest concern our kernels only
            options = {k: v for k, v in head_options.items() if k in keep}
            self.head = UnshardedHead(cfg.d_model, cfg.vocab_size, **options)
            self.sequence_parallel = False  # the reference sees every token
            start = 0
        else:
            raise ValueError(
                f"head: expected 'vocab_parallel', 'dtensor' or 'unsharded', got {head!r}"
            )
        init_head_rows(self.head.weight, start, seed)

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        """The head's input ``[B, T, d_model]``: the body's output after the final norm
        (what RL and distillation losses take, with ``self.head``)."""
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.hidden_states(idx)
        if self.sequence_parallel and self.tp > 1:
            lo, hi = shard_bounds(t, self.tp)[self.tp_rank]  # this TP rank's tokens
            return self.head(h[:, lo:hi], targets[:, lo:hi])
        return self.head(h, targets)


def dtensor_head(
    cfg: GPTConfig,
    process_group: dist.ProcessGroup | None,
    device: torch.device | str,
    **head_options,
) -> VocabParallelLMHead:
    """Our head on a ``ColwiseParallel`` ``nn.Linear``'s DTensor weight (no copy).

    On the meta device (``--dry-run``, where DTensor cannot be built) a plain head with
    the rows DTensor would give this rank stands in for it, for the plan's numbers.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from vocab_parallel.integrations.torch_tp import head_from_colwise

    device = torch.device(device)
    if device.type == "meta":  # --dry-run: no DTensor on meta; the same rows, plain
        tp = world_size(process_group)
        rank = dist.get_rank(process_group) if tp > 1 else 0
        chunk = -(-cfg.vocab_size // tp)  # torch.chunk's rows per rank, the last ones fewer
        start, end = (min(cfg.vocab_size, r * chunk) for r in (rank, rank + 1))
        return VocabParallelLMHead(
            cfg.d_model, cfg.vocab_size, process_group=process_group,
            vocab_start_index=start, vocab_end_index=end, device=device, **head_options,
        )  # fmt: skip
    group = process_group if process_group is not None else dist.group.WORLD
    mesh = DeviceMesh.from_group(group, device.type)
    proj = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, device=device)
    parallelize_module(proj, mesh, ColwiseParallel())
    return head_from_colwise(proj, **head_options)


def build_model(o: dict, head: str, groups, device: torch.device | str) -> GPT:
    """The launcher's GPT from its options ``o``: ``head`` is ``"vocab_parallel"`` (sharded
    over ``groups.tp_group``; a DTensor ``ColwiseParallel`` head with ``tp_style
    dtensor``) or ``"unsharded"`` (the reference copy)."""
    cfg = GPTConfig(
        vocab_size=o["vocab_size"],
        context=o["context"],
        d_model=o["d_model"],
        n_layers=o["n_layers"],
        n_heads=o["n_heads"],
        mlp_ratio=o["mlp_ratio"],
    )
    options = {"label_smoothing": o["label_smoothing"]}
    if head == "vocab_parallel":
        options.update(
            mode=o["mode"], backend=o["backend"], sequence_parallel=o["sequence_parallel"],
            filter_eps=filter_eps(o),
        )  # fmt: skip
        if o["tp_style"] == "dtensor":
            head = "dtensor"
    model = GPT(
        cfg, seed=o["seed"], head=head, process_group=groups.tp_group, device=device, **options
    )
    # The torch engine trains the model in its dtype (fp32 master weights in the engine);
    # DeepSpeed converts an fp32 model itself when its bf16 mode is on.
    if o["engine"] == "torch":
        model = model.to(DTYPES[o["dtype"]])
    return model.to(device)
