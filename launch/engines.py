"""The two training engines of the launcher, each behind a runner with the same interface.

``torch``: :class:`TorchEngine`, a plain-PyTorch optimizer step for a model whose LM head
is sharded over a TP group, without DDP or DeepSpeed. What data and tensor parallelism
need from it:

- gradients averaged over the data-parallel group, in one fp32 bucket (one all-reduce in
  a fixed order: deterministic, and correct for bf16 models on gloo, which has no bf16
  collectives; the mean is also not rounded to bf16 before the optimizer sees it);
- a gradient norm for clipping that counts every parameter once: the vocabulary shards
  (``tensor_model_parallel`` attribute, see :func:`vocab_parallel.lm_head.mark_tensor_parallel`)
  are summed over the TP group, the body, replicated on every TP rank, is counted once;
- AdamW on fp32 master weights when the model itself is in bf16 (as DeepSpeed's bf16 mode
  does), copied back into the model after each step.

Every TP rank of a DP replica sees the same batch and, since the loss all-reduces the
input gradient, computes the same body gradients: the replicated body stays bitwise in
sync, which :func:`replicas_in_sync` checks. With sequence parallelism
(``sequence_parallel``) each TP rank back-propagates only its own tokens through the
replicated body, so the gradients of the replicated parameters are first summed over the
TP group (one fp32 bucket, the same sum on every rank), then averaged over DP.

A head made with ``tp_style dtensor`` has a ``Shard(0)`` DTensor weight: it counts as
tensor-parallel (:func:`is_tensor_parallel`), and the step, the fp32 master weights and
the checkpoints work on its ``to_local()`` tensor (which shares the DTensor's storage).

``deepspeed``: ``vocab_parallel.integrations.deepspeed`` around the same model.

The runners (:class:`TorchRunner`, :class:`DeepSpeedRunner`, made by :func:`make_runner`)
give the training loop one interface, ``train_step``, ``forward`` and ``module``, and
each owns the files of its own checkpoint (``save`` / ``load`` into a folder), since the
two engines store their state very differently; ``launch.checkpoints`` writes what is
common to both around them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from launch.config import deepspeed_config
from launch.dist_env import collective, deepspeed_integration
from vocab_parallel.parallel.collectives import world_size
from vocab_parallel.parallel.groups import ParallelGroups


def _is_dtensor(t: object) -> bool:
    from vocab_parallel.parallel.dtensor import is_dtensor

    return is_dtensor(t)


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """A vocabulary shard: marked ``tensor_model_parallel``, or a DTensor with a Shard
    placement (a ``ColwiseParallel`` weight)."""
    if _is_dtensor(param):
        from torch.distributed.tensor import Shard

        return any(isinstance(pl, Shard) for pl in param.placements)
    return bool(getattr(param, "tensor_model_parallel", False))


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's plain tensor: ``to_local()`` of a DTensor (same storage, detached from
    autograd), the tensor itself otherwise."""
    return t.to_local().detach() if _is_dtensor(t) else t


def local_state_dict(model: nn.Module) -> dict:
    """``model.state_dict()`` with every DTensor as its local tensor (what this rank holds)."""
    return {k: local(v) for k, v in model.state_dict().items()}


def load_local_state_dict(model: nn.Module, state: dict) -> None:
    """The inverse of :func:`local_state_dict`: local tensors copied into the DTensors."""
    own = model.state_dict()
    plain = {k: v for k, v in state.items() if not _is_dtensor(own.get(k))}
    dtensors = {k: own[k] for k in state if k not in plain}
    missing, unexpected = model.load_state_dict(plain, strict=False)
    missing = [k for k in missing if k not in dtensors]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint: missing keys {missing}, unexpected keys {unexpected}")
    with torch.no_grad():
        for k, target in dtensors.items():
            dest = target.to_local()
            if tuple(dest.shape) != tuple(state[k].shape):
                raise RuntimeError(f"checkpoint: {k} has shape {tuple(state[k].shape)} here, "
                                   f"this rank holds {tuple(dest.shape)}")  # fmt: skip
            dest.copy_(state[k])


def tp_grad_norm(
    grads: list[torch.Tensor], sharded: list[bool], tp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """L2 norm of the whole model's gradient: ``sharded`` ones summed over ``tp_group``."""
    device = grads[0].device if grads else torch.device("cpu")
    sq = [torch.zeros((), dtype=torch.float32, device=device) for _ in range(2)]
    for g, is_shard in zip(grads, sharded, strict=True):
        sq[is_shard] += g.float().pow(2).sum()
    if world_size(tp_group) > 1:
        with collective("all-reduce of the gradient norm", tp_group, "the tensor-parallel group"):
            dist.all_reduce(sq[1], group=tp_group)
    return (sq[0] + sq[1]).sqrt()


class TorchEngine:
    """DP gradient averaging, TP-aware clipping and AdamW for ``model`` (see module doc).

    ``loss = model(x, y); loss.backward(); grad_norm = engine.step(lr)``.
    Weight decay applies to matrices and embeddings only, not to biases and norms.
    """

    def __init__(
        self,
        model: nn.Module,
        groups: ParallelGroups,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        grad_clip: float = 1.0,
        sequence_parallel: bool = False,
    ) -> None:
        self.model, self.groups, self.grad_clip = model, groups, grad_clip
        self.sequence_parallel = sequence_parallel
        self.dparams = [p for p in model.parameters() if p.requires_grad]  # DTensors included
        self.sharded = [is_tensor_parallel(p) for p in self.dparams]
        # What the step works on: plain tensors (a DTensor's local shard, same storage).
        self.params = [local(p) for p in self.dparams]
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        if self.mixed:
            self.master = [p.detach().float().clone() for p in self.params]
        else:
            self.master = self.params
        decay = [m for m, p in zip(self.master, self.params, strict=True) if p.dim() >= 2]
        no_decay = [m for m, p in zip(self.master, self.params, strict=True) if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=lr,
            betas=betas,
            eps=eps,
        )

    def step(self, lr: float) -> float:
        """Average, clip and apply the gradients of the last backward; returns the norm
        before clipping. Clears the gradients."""
        grads = [
            local(d.grad) if d.grad is not None else torch.zeros_like(p)
            for d, p in zip(self.dparams, self.params, strict=True)
        ]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        if self.sequence_parallel and self.groups.tp_size > 1:
            self._sum_replicated_over_tp(flat)
        if self.groups.dp_size > 1:
            dp = self.groups.dp_group
            with collective("all-reduce of the gradients", dp, "the data-parallel group"):
                dist.all_reduce(flat, group=dp)
            flat.div_(self.groups.dp_size)
        views = flat.split([p.numel() for p in self.params])
        norm = tp_grad_norm(views, self.sharded, self.groups.tp_group)
        scale = 1.0
        if self.grad_clip and self.grad_clip > 0:
            scale = min(1.0, self.grad_clip / (norm.item() + 1e-6))
        for m, v in zip(self.master, views, strict=True):
            m.grad = v.view_as(m).mul_(scale) if scale != 1.0 else v.view_as(m)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        with torch.no_grad():
            for d, p, m in zip(self.dparams, self.params, self.master, strict=True):
                if p is not m:
                    p.copy_(m)
                d.grad = None
                m.grad = None
        return norm.item()

    def _sum_replicated_over_tp(self, flat: torch.Tensor) -> None:
        """Sequence parallelism: each TP rank's body gradients cover only its own tokens;
        their sum over the TP group (in place in ``flat``, fp32, one bucket in a fixed
        order, so the same bits on every rank) is the replicated parameters' gradient."""
        views = flat.split([p.numel() for p in self.params])
        replicated = [v for v, s in zip(views, self.sharded, strict=True) if not s]
        if not replicated:
            return
        bucket = torch.cat(replicated)
        tp = self.groups.tp_group
        with collective("all-reduce of the replicated gradients (sequence parallel)", tp,
                        "the tensor-parallel group"):  # fmt: skip
            dist.all_reduce(bucket, group=tp)
        for v, summed in zip(replicated, bucket.split([v.numel() for v in replicated]),
                             strict=True):  # fmt: skip
            v.copy_(summed)

    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict()}
        if self.mixed:
            state["master"] = [m.clone() for m in self.master]
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.mixed:
            with torch.no_grad():
                for m, saved, p in zip(self.master, state["master"], self.params, strict=True):
                    m.copy_(saved)
                    p.copy_(saved)


def replicas_in_sync(model: nn.Module, group: dist.ProcessGroup | None) -> bool:
    """Whether the parameters that should be replicated over ``group`` (all but the
    tensor-parallel shards) are bitwise equal on its ranks (collective)."""
    if world_size(group) == 1:
        return True
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        if not is_tensor_parallel(p):
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    digests = [None] * world_size(group)
    with collective("all-gather of the replicas' digests", group, "the tensor-parallel group"):
        dist.all_gather_object(digests, h.hexdigest(), group=group)
    return len(set(digests)) == 1


class TorchRunner:
    """The torch engine: :class:`TorchEngine` around the model.

    Checkpoint: ``model_tp<TP rank>.pt`` in the folder, written by DP rank 0 only (the DP
    replicas are identical), holding ``{name: {"model": ..., "engine": ...}}``.
    """

    def __init__(self, model, groups: ParallelGroups, o: dict) -> None:
        self.model, self.groups = model, groups
        self.engine = TorchEngine(
            model,
            groups,
            lr=o["lr"],
            betas=(o["beta1"], o["beta2"]),
            weight_decay=o["weight_decay"],
            grad_clip=o["grad_clip"],
            sequence_parallel=bool(getattr(model, "sequence_parallel", False)),
        )

    def train_step(self, x, y, lr: float) -> tuple[torch.Tensor, float]:
        loss = self.model(x, y)
        loss.backward()
        return loss.detach().float(), self.engine.step(lr)

    def forward(self, x, y) -> torch.Tensor:
        return self.model(x, y)

    @property
    def module(self):
        return self.model

    def _file(self, folder: Path) -> Path:
        return folder / f"model_tp{self.groups.tp_rank}.pt"

    def save(self, folder: Path, name: str) -> None:
        """Write this model's state into ``folder``: DP rank 0 writes, the others return."""
        if self.groups.dp_rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            state = {"model": local_state_dict(self.model), "engine": self.engine.state_dict()}
            torch.save({name: state}, self._file(folder))

    def load(self, folder: Path, name: str) -> None:
        """Restore the state :meth:`save` wrote into ``folder`` (every DP rank reads it)."""
        path = self._file(folder)
        if not path.exists():
            raise SystemExit(f"--resume: no {path}")
        device = next(self.model.parameters()).device
        state = torch.load(path, map_location=device, weights_only=True)[name]
        load_local_state_dict(self.model, state["model"])
        self.engine.load_state_dict(state["engine"])


class DeepSpeedRunner:
    """The deepspeed engine, through ``vocab_parallel.integrations.deepspeed``.

    The optimizer is the same torch AdamW (with the same parameter groups) as the torch
    engine's; the LR is set on it every step, so no scheduler state needs saving.
    Checkpoint: DeepSpeed's own files (``save_checkpoint``, collective), in the folder.
    """

    def __init__(self, model, groups: ParallelGroups, o: dict) -> None:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": o["weight_decay"]},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=o["lr"],
            betas=(o["beta1"], o["beta2"]),
        )
        result = deepspeed_integration().initialize(
            model, groups, deepspeed_config(o), optimizer=optimizer
        )
        self.engine = result[0] if isinstance(result, tuple) else result

    def train_step(self, x, y, lr: float) -> tuple[torch.Tensor, float]:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return loss.detach().float(), float(norm) if norm is not None else float("nan")

    def forward(self, x, y) -> torch.Tensor:
        return self.engine(x, y)

    @property
    def module(self):
        return self.engine.module

    def save(self, folder: Path, name: str) -> None:
        """DeepSpeed's checkpoint, tag ``folder.name`` under ``folder.parent`` (collective)."""
        # ``latest`` is launch.checkpoints' to write, once the whole checkpoint is complete.
        self.engine.save_checkpoint(str(folder.parent), tag=folder.name, save_latest=False)

    def load(self, folder: Path, name: str) -> None:
        path, _ = self.engine.load_checkpoint(str(folder.parent), tag=folder.name)
        if path is None:
            raise SystemExit(f"--resume: DeepSpeed could not load {folder}")


def make_runner(model, groups: ParallelGroups, o: dict):
    """The runner of ``o["engine"]`` around ``model``."""
    return (DeepSpeedRunner if o["engine"] == "deepspeed" else TorchRunner)(model, groups, o)
