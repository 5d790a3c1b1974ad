"""The torchtitan plug-in against real torchtitan (0.3) on gloo ranks.

A tiny Llama 3 (torchtitan's ``debugmodel`` cut to 2 layers, vocabulary 515: DTensor chunks
of 258 and 257 rows at TP 2; SDPA attention; fp32), parallelised by torchtitan's own
``parallelize_llama`` (``partial_dtensor``: ``ColwiseParallel`` ``lm_head`` with a
``Shard(0)`` DTensor weight, sequence parallelism, FSDP2 over the data-parallel ranks), at
TP 2 (2 ranks) and FSDP2 x TP 2 x 2 (4 ranks). Two SGD steps of the same model with
torchtitan's ``ChunkedLossWrapper`` + ``CrossEntropyLoss`` and with our
``VocabParallelLossWrapper`` (``-100`` labels in one data-parallel rank's batch only, so
``global_valid_tokens`` matters) give the same losses and the same gradient shards on every
rank (fp32, 1e-5 relative to the largest value). The CPU shims are in
``framework_shims.py``; each world is one spawn (importing torchtitan costs seconds).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("torchtitan") is None,
        reason="torchtitan is not installed (the torchtitan extra; scripts/setup.sh)",
    ),
]

V, SEQ, BATCH, STEPS, LR = 515, 8, 2, 2, 0.5
REL = 1e-5


def sdpa_model(seed: int):
    """torchtitan's llama3 ``debugmodel`` (dim 256) with 2 layers, vocabulary ``V`` and SDPA."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    spec = model_registry("debugmodel")
    config = spec.model
    config.vocab_size = config.tok_embeddings.num_embeddings = config.lm_head.out_features = V
    config.layers = config.layers[:2]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(config, enable_sp=True)
    torch.manual_seed(seed)
    model = config.build()
    model.init_weights(buffer_device=None)
    return spec, model


def _parallel(dp: int):
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    world = torch.distributed.get_world_size()
    parallelism = ParallelismConfig(
        tensor_parallel_degree=world // dp,
        data_parallel_shard_degree=dp,
        spmd_backend="partial_dtensor",
    )
    dist_utils.set_spmd_backend("partial_dtensor")
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    kwargs = dict(
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="/tmp",
    )
    return kwargs


def _batch(step: int, dp_rank: int):
    """Data-parallel rank ``dp_rank``'s ``(ids, labels)`` of a step; rank 0 has ignored labels."""
    g = torch.Generator().manual_seed(10 * step + dp_rank)
    ids = torch.randint(0, V, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, V, (BATCH, SEQ), generator=g)
    if dp_rank == 0:
        labels[0, : SEQ // 2] = -100  # uneven valid tokens over the data-parallel ranks
    return ids, labels


def _global_valid_tokens(step: int, dp: int) -> torch.Tensor:
    """The trainer's ``global_valid_tokens``: non-ignored labels over all data-parallel ranks."""
    return sum((_batch(step, r)[1] != -100).sum() for r in range(dp))


def _local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).detach().double()


def _compare(group, dp: int) -> dict:
    from framework_shims import fsdp_sum_reduction, torchtitan_on_cpu

    torchtitan_on_cpu()
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    from vocab_parallel.integrations.torchtitan import VocabParallelLossWrapper

    kwargs = _parallel(dp)
    losses = {
        "theirs": ChunkedLossWrapper.Config(
            num_chunks=2, loss_fn=CrossEntropyLoss.Config(global_vocab_size=V)
        ).build(),
        "ours": VocabParallelLossWrapper.Config().build(),
    }
    models = {}
    for name, loss_fn in losses.items():
        spec, model = sdpa_model(seed=0)
        model = spec.parallelize_fn(model, **kwargs)
        fsdp_sum_reduction(model)
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True  # what torchtitan's trainer does for a ChunkedLossWrapper
        models[name] = model
    opts = {n: torch.optim.SGD(m.parameters(), lr=LR) for n, m in models.items()}
    tp = torch.distributed.get_world_size() // dp
    dp_rank = torch.distributed.get_rank() // tp
    worst = {"loss": 0.0, "grad": 0.0, "grad_at": "", "weight_type": None}
    for step in range(STEPS):
        ids, labels = _batch(step, dp_rank)
        valid = _global_valid_tokens(step, dp)
        value, grads = {}, {}
        for name, model in models.items():
            loss, _ = losses[name](model(ids), labels, valid)
            loss.backward()
            value[name] = loss.detach().double()
            grads[name] = {n: _local(p.grad) for n, p in model.named_parameters()}
        worst["loss"] = max(worst["loss"], float((value["ours"] - value["theirs"]).abs()))
        for n, ref in grads["theirs"].items():
            assert ref.abs().max() > 0, n
            d = float((grads["ours"][n] - ref).abs().max() / ref.abs().max())
            if d >= worst["grad"]:
                worst["grad"], worst["grad_at"] = d, n
        for opt in opts.values():
            opt.step()
            opt.zero_grad()
    worst["weight_type"] = type(models["ours"].lm_head.weight).__name__
    return worst


def _check(per_rank: list[dict]) -> None:
    for rank, r in enumerate(per_rank):
        assert r["loss"] < REL, (rank, r)
        assert r["grad"] < REL, (rank, r)
        assert r["weight_type"] == "DTensor", (rank, r)


def test_tp2_equals_torchtitan_loss():
    from multirank import run_ranks

    _check(run_ranks(_compare, 2, 1))


def test_fsdp2_x_tp2_equals_torchtitan_loss():
    from multirank import run_ranks

    _check(run_ranks(_compare, 4, 2))
