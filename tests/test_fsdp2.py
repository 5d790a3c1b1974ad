"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on gloo ranks, alone and composed with
tensor parallelism on a 2-D ``(dp_shard, tp)`` DeviceMesh (torchtitan's layout).

FSDP2 swaps each parameter between a shard (a DTensor over the data-parallel mesh) and the
whole parameter around the forward of its FSDP module; the loss runs inside that forward
and sees the whole head (under TP, this rank's vocabulary shard as a ``Shard(0)`` DTensor
on the ``tp`` mesh, which the DTensor path of the loss takes).

- 2 ranks, TP 1: our small GPT (``launch.model``, vocabulary 1001: FSDP2 shards 501 + 500
  rows), its blocks and root ``fully_shard``-ed, the head with the root or as an FSDP
  module of its own; a tiny transformers Llama, tied, patched by
  ``apply_vocab_parallel_loss``. Losses and gradient norms equal the unsharded
  single-process run (fp32, 1e-5), also an untied Llama whose ``lm_head`` is an FSDP2
  module of its own (the patched forward never runs its forward: the adapter unshards
  it, FSDP2's post-backward reduce-scatters its gradient). The head called outside the
  forward (its weight an FSDP2 shard) is refused naming FSDP2, on both ranks; the shard
  given to the loss function by hand is stopped by the ranks' agreement check.
- 4 ranks, ``(dp_shard, tp) = (2, 2)``: the GPT's output projection ``ColwiseParallel``
  on ``tp`` (uneven vocabulary shards 501 + 500, each split again by FSDP2), our head on
  it (``head_from_colwise``), ``fully_shard`` on ``dp_shard``; the same equality.

gloo has no ``PREMUL_SUM``/``AVG`` reduce-scatter: every FSDP module gets
``set_force_sum_reduction_for_comms(True)`` (FSDP2 then divides separately).
"""

from __future__ import annotations

import pytest
import torch
from multirank import run_ranks
from torch import nn

from launch.model import GPT, GPTConfig

pytestmark = pytest.mark.slow

# Vocabulary 1001: uneven shards (501 + 500) for FSDP2 over 2 ranks and for TP 2.
CFG = GPTConfig(vocab_size=1001, context=16, d_model=32, n_layers=1, n_heads=2)
MICRO = 2  # sequences per data-parallel rank and step
CLIP = 0.5  # below the gradient norms of these steps (0.8-0.9): clipping is active
REL = 1e-5
STEPS = 3


def _micro(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank ``dp_rank``'s micro-batch of a step (of 2 ranks)."""
    g = torch.Generator().manual_seed(1000 + step)
    shape = (2 * MICRO, CFG.context)
    idx, tgt = (torch.randint(0, CFG.vocab_size, shape, generator=g) for _ in range(2))
    rows = slice(dp_rank * MICRO, (dp_rank + 1) * MICRO)
    return idx[rows], tgt[rows]


def _reference() -> dict:
    """The unsharded single-process run: both ranks' micro-batch losses per step, the
    gradient norm of their mean (before clipping)."""
    model = GPT(CFG, seed=0, head="unsharded")
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    losses, norms = [], []
    for step in range(STEPS):
        per_rank = [model(*_micro(step, r)) for r in range(2)]
        torch.stack(per_rank).mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append([x.item() for x in per_rank])
    return dict(losses=losses, norms=norms)


def _close(actual, expected, what: str) -> None:
    a, e = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected).double()
    err = (a - e).abs().max().item()
    bound = REL * e.abs().max().item() + 1e-7
    assert err <= bound, f"{what}: max |diff| {err:.3e} > {bound:.3e}\n{a}\n{e}"


def _shard(modules, mesh) -> None:
    """``fully_shard`` each module (children first, the root last) over ``mesh``, with the
    sum-only reductions gloo supports."""
    from torch.distributed.fsdp import fully_shard

    for module in modules:
        fully_shard(module, mesh=mesh).set_force_sum_reduction_for_comms(True)


def _grad_norm_and_clip(params, max_norm: float) -> float:
    """The global gradient norm over DTensor gradients on any meshes (each gathered: tiny
    models), then clipping as ``torch.nn.utils.clip_grad_norm_`` does."""
    grads = [p.grad for p in params if p.grad is not None]
    full = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in full)).item()
    coef = min(1.0, max_norm / (norm + 1e-6))
    for g in grads:
        g.mul_(coef)
    return norm


def _train(model, steps, dp_rank: int) -> tuple[list[float], list[float]]:
    """SGD (momentum) steps on this data-parallel rank's micro-batches, as the reference."""
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    losses, norms = [], []
    for step in steps:
        loss = model(*_micro(step, dp_rank))
        loss.backward()
        norms.append(_grad_norm_and_clip(list(model.parameters()), CLIP))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _refused(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    raise AssertionError("accepted an FSDP2 shard as the head's weight")


def _tp1_runs(group):
    from torch.distributed.device_mesh import init_device_mesh

    from vocab_parallel import vocab_parallel_linear_cross_entropy

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    rank = torch.distributed.get_rank(group)
    out = {}
    for mode, own_unit in (("auto", False), ("memory_saving", True)):
        model = GPT(CFG, seed=0, mode=mode)
        extra = [model.head] if own_unit else []
        _shard([*model.blocks, *extra, model], mesh)
        out[f"{mode}/{'head unit' if own_unit else 'root'}"] = _train(model, range(STEPS), rank)
    # outside the model's forward the head's weight is this rank's FSDP2 shard
    g = torch.Generator().manual_seed(rank)  # data-parallel ranks: their own tokens
    h = torch.randn(2, 5, CFG.d_model, generator=g)
    y = torch.randint(0, CFG.vocab_size, (2, 5), generator=g)
    model = GPT(CFG, seed=0)
    _shard([model], mesh)
    out["refused"] = _refused(lambda: model.head(h, y))
    # given to the loss by hand, the shard looks like a vocabulary shard over the mesh:
    # the ranks' agreement check stops it (their tokens differ)
    raw = lambda: vocab_parallel_linear_cross_entropy(h, model.head.weight, y)
    out["raw"] = _refused(raw)
    out["llama"] = _llama(mesh, rank)
    return out


def _llama_steps(model, rank: int | None, clip) -> dict:
    """SGD steps of a tiny Llama (``test_transformers``' model and data): data-parallel
    rank r trains on micro-batch r of each step; ``rank=None``: one process, the mean of
    both ranks' losses (the reference). Per step: the losses of both micro-batches (the
    reference) or this rank's, and the gradient norm before clipping."""
    from test_transformers import LR, micro_batches

    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, norms = [], []
    for step in range(STEPS):
        batches = micro_batches(step)
        mine = batches if rank is None else [batches[rank]]
        per_rank = [model(ids, labels=labels).loss for ids, labels in mine]
        torch.stack(per_rank).mean().backward()
        norms.append(float(clip(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        losses.append([x.item() for x in per_rank])
    return dict(losses=losses, norms=norms)


def _llama(mesh, rank: int) -> dict:
    """Tiny Llamas, patched, each data-parallel rank its own micro-batches: tied, layers
    and root fully_shard-ed (lm_head with the root, as accelerate's FSDP2 wraps it),
    patched after fully_shard; untied with lm_head an FSDP2 module of its own
    (torchtitan's grouping), whose forward the patched forward never runs: the adapter
    unshards it."""
    from test_transformers import make_model

    from vocab_parallel.integrations.transformers import apply_vocab_parallel_loss

    def clip(params, max_norm):
        return _grad_norm_and_clip(list(params), max_norm)

    out = {}
    model = make_model("llama", True)
    _shard([*model.model.layers, model], mesh)
    apply_vocab_parallel_loss(model)  # after fully_shard: the head is built in the forward
    out["tied"] = _llama_steps(model, rank, clip)
    model = make_model("llama", False)
    apply_vocab_parallel_loss(model, mode="memory_saving")  # the weight read in backward too
    _shard([*model.model.layers, model.lm_head, model], mesh)
    out["untied, lm_head its own unit"] = _llama_steps(model, rank, clip)
    return out


def test_fsdp2_equals_unsharded():
    """TP 1 on 2 ranks: GPT (head with the root or its own FSDP module, two modes) and
    Llamas (tied; untied with lm_head its own FSDP module) under fully_shard train as the
    unsharded single-process models do; a shard read as the head's weight is refused on
    both ranks, naming FSDP2."""
    pytest.importorskip("transformers")
    from test_transformers import close, make_model

    ref = _reference()
    clip = torch.nn.utils.clip_grad_norm_
    ref_llama = {
        tied: _llama_steps(make_model("llama", tied), None, clip) for tied in (False, True)
    }
    per_rank = run_ranks(_tp1_runs, 2)
    for rank, result in enumerate(per_rank):
        message = result.pop("refused")
        assert message.startswith("weight: a DTensor") and "FSDP2" in message, message
        message = result.pop("raw")
        assert "the ranks of process_group pass different" in message, message
        for key, r in result.pop("llama").items():
            want = ref_llama[key == "tied"]
            mine = [step[rank] for step in want["losses"]]
            close([step[0] for step in r["losses"]], mine, f"rank {rank}, llama {key}: losses")
            close(r["norms"], want["norms"], f"rank {rank}, llama {key}: gradient norms")
        assert len(result) == 2, result.keys()
        for key, (losses, norms) in result.items():
            where = f"rank {rank}, {key}"
            _close(losses, [step[rank] for step in ref["losses"]], f"{where}: losses")
            _close(norms, ref["norms"], f"{where}: gradient norms")


def _tp_runs(group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from vocab_parallel.integrations.torch_tp import head_from_colwise

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    out = {}
    for mode in ("auto", "memory_saving"):
        model = GPT(CFG, seed=0, mode=mode)  # one shard: the whole seeded head, every rank
        proj = nn.Linear(CFG.d_model, CFG.vocab_size, bias=False)
        with torch.no_grad():
            proj.weight.copy_(model.head.weight)
        parallelize_module(proj, mesh["tp"], ColwiseParallel())
        model.head = head_from_colwise(proj, mode=mode)
        rows = (model.head.vocab_start_index, model.head.vocab_end_index)
        _shard([*model.blocks, model], mesh["dp_shard"])
        placements = tuple(type(p).__name__ for p in model.head.weight.placements)
        losses, norms = _train(model, range(STEPS), mesh["dp_shard"].get_local_rank())
        out[mode] = dict(losses=losses, norms=norms, rows=rows, placements=placements)
    # outside the forward: the 2-D shard, refused naming FSDP2
    h = torch.randn(2, 5, CFG.d_model)
    y = torch.randint(0, CFG.vocab_size, (2, 5))
    out["refused"] = _refused(lambda: model.head(h, y))
    out["dp_rank"] = mesh["dp_shard"].get_local_rank()
    return out


def test_fsdp2_x_tp_2d_mesh_equals_unsharded():
    """(dp_shard, tp) = (2, 2): ColwiseParallel head (501 + 500 rows) through our DTensor
    path, fully_shard on dp_shard (the head's weight a 2-D DTensor between steps), two
    modes: every rank's losses and the gradient norms equal the unsharded run."""
    ref = _reference()
    per_rank = run_ranks(_tp_runs, 4)
    for rank, result in enumerate(per_rank):
        message = result.pop("refused")
        assert message.startswith("weight: a DTensor") and "FSDP2" in message, message
        dp_rank = result.pop("dp_rank")
        assert dp_rank == rank // 2
        for mode, r in result.items():
            where = f"rank {rank}, {mode}"
            assert r["rows"] == [(0, 501), (501, 1001)][rank % 2], (where, r["rows"])
            assert r["placements"] == ("_StridedShard", "Shard"), (where, r["placements"])
            _close(r["losses"], [step[dp_rank] for step in ref["losses"]], f"{where}: losses")
            _close(r["norms"], ref["norms"], f"{where}: gradient norms")
