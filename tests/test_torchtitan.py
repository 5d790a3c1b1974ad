"""The torchtitan plug-in against real torchtitan (0.3) on gloo ranks.

A tiny Llama 3 (torchtitan's ``debugmodel`` cut to 2 layers, vocabulary 515: DTensor chunks
of 258 and 257 rows at TP 2; SDPA attention; fp32), parallelised by torchtitan's own
``parallelize_llama`` (``partial_dtensor``: ``ColwiseParallel`` ``lm_head`` with a
``Shard(0)`` DTensor weight, sequence parallelism, FSDP2 over the data-parallel ranks), at
TP 2 (2 ranks) and FSDP2 x TP 2 x 2 (4 ranks). Two SGD steps of the same model with
torchtitan's ``ChunkedLossWrapper`` + ``CrossEntropyLoss`` and with our
``VocabParallelLossWrapper`` (``-100`` labels in one data-parallel rank's batch only, so
``global_valid_tokens`` matters) give the same losses and the same gradient shards on every
rank (fp32, 1e-5 relative to the largest value). torchtitan's default backend,
``spmd_types``, at TP 2 (plain local shards) is refused with an error naming
``parallelism.spmd_backend`` on every rank, and a plain shard of unknown layout is refused
by ``lm_head_loss``. The CPU shims are in
``framework_shims.py``; each world is one spawn (importing torchtitan costs seconds).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed (the torchtitan extra; scripts/setup.sh)",
)

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


@pytest.mark.slow
def test_tp2_equals_torchtitan_loss():
    from multirank import run_ranks

    _check(run_ranks(_compare, 2, 1))


@pytest.mark.slow
def test_fsdp2_x_tp2_equals_torchtitan_loss():
    from multirank import run_ranks

    _check(run_ranks(_compare, 4, 2))


# --- torchtitan's default backend, spmd_types: plain local shards, refused ----------------


def _spmd_types_tp2(group) -> dict:
    """The model at TP 2 under torchtitan's default ``spmd_backend`` (``"spmd_types"``),
    parallelised as ``parallelize_llama`` does before its FSDP step (``Module.parallelize``:
    ``lm_head``'s weight a plain ``[258 | 257, 256]`` shard, the hidden states plain
    tensors), our wrapper called as the trainer calls it (inside its SPMD context) and
    outside that context; labels anywhere, and all within rank 1's shard (which gave a
    wrong loss without an error). Returns the error messages (or the losses)."""
    from framework_shims import torchtitan_on_cpu

    torchtitan_on_cpu()
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    from vocab_parallel.integrations.torchtitan import VocabParallelLossWrapper

    parallelism = ParallelismConfig(tensor_parallel_degree=2)  # the default backend
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, 2)
    dims.build_mesh()
    context = dist_utils.get_spmd_context(parallel_dims=dims)
    _, model = sdpa_model(seed=0)
    model.parallelize(dims)
    model._skip_lm_head = True
    loss_fn = VocabParallelLossWrapper.Config().build()
    out = {"backend": parallelism.spmd_backend, "rows": model.lm_head.weight.shape[0]}
    try:
        loss_fn.set_lm_head(model.lm_head)  # what the trainer does after parallelize_fn
        out["set_lm_head"] = "no error"
    except ValueError as e:
        out["set_lm_head"] = str(e)
    loss_fn.lm_head = model.lm_head  # past set_lm_head: the call must refuse it too
    ids, labels = _batch(0, 1)
    for case, y in (("labels", labels), ("labels_in_one_shard", labels % 257)):
        for where in ("in_context", "outside"):
            try:
                if where == "in_context":
                    with context():
                        loss, _ = loss_fn(model(ids), y, 16)
                else:
                    with context():
                        pred = model(ids)
                    loss, _ = loss_fn(pred, y, 16)
                out[f"{case} {where}"] = f"no error: loss {float(loss):.6f}"
            except ValueError as e:
                out[f"{case} {where}"] = str(e)
    return out


@pytest.mark.slow
def test_default_spmd_types_backend_at_tp2_is_refused_naming_the_setting():
    from multirank import run_ranks

    per_rank = run_ranks(_spmd_types_tp2, 2)
    assert [r["rows"] for r in per_rank] == [258, 257]
    assert per_rank[0]["backend"] == "spmd_types"
    messages = [{k: v for k, v in r.items() if k not in ("rows", "backend")} for r in per_rank]
    assert messages[0] == messages[1], messages  # the same error on every rank
    for case, message in messages[0].items():
        assert message.startswith("parallelism.spmd_backend: "), (case, message)
        assert "partial_dtensor" in message, (case, message)


def test_plain_local_shard_of_unknown_layout_is_refused():
    """An ``lm_head`` whose weight is a plain tensor of fewer rows than its ``out_features``
    is a shard whose place in the vocabulary nothing states: refused, never a loss over
    the shard as if it were the vocabulary (labels all within it gave one, silently)."""
    from vocab_parallel.integrations.torchtitan import lm_head_loss

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, V, bias=False)
    head.weight = torch.nn.Parameter(torch.randn(V // 2, 16, generator=g))
    hidden = torch.randn(2, 4, 16, generator=g)
    labels = torch.randint(0, V // 2, (2, 4), generator=g)
    with pytest.raises(
        ValueError, match=r"^lm_head: its weight is a plain tensor whose rows are not "
    ):
        lm_head_loss(hidden, head, labels)
    head.weight = torch.nn.Parameter(torch.randn(V, 16, generator=g))  # the whole vocabulary
    full = lm_head_loss(hidden, head, labels)
    ref = torch.nn.functional.cross_entropy(
        (hidden @ head.weight.T).reshape(-1, V), labels.reshape(-1), reduction="sum"
    )
    torch.testing.assert_close(full, ref)
