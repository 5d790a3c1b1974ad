"""The loss implementations ``bench_loss.py`` compares, and what each needs to run.

Every one is ``loss(hidden, weight)``: the mean cross entropy of ``hidden @ weight.T``
against the target, ``IGNORE`` tokens left out, where ``weight`` is this rank's shard.

    ours_gif         vocab_parallel_linear_cross_entropy(mode="grad_in_forward"), what the
                     default mode="auto" runs for this scalar loss
    ours_gif_sync    the same with the grad_input all-reduces blocking (2 ranks): the
                     time the overlap saves
    ours_ms          vocab_parallel_linear_cross_entropy(mode="memory_saving")
    ours_hp          vocab_parallel_linear_cross_entropy(mode="high_performance")
                     (backend "torch" on CPU, "triton" on CUDA; the shard layout stated,
                     as VocabParallelLMHead does)
    ours_ms_nocheck  ours_ms with check_inputs=False: the price of the input checks
    naive            F.cross_entropy(F.linear(x, W), y), full [BT, V] logits (1 rank)
    torch_lce_auto   F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())
    torch_lce_512    the same with batch_chunk_size=512, chunking_method=None (1 rank)
    deepspeed        deepspeed.sequence.linear_cross_entropy.vocab_parallel_linear_cross_entropy
                     with chunk_size=512 on CPU (its default gives tiny chunks there)
    deepspeed_dflt   the same with its default chunk_size (1 rank)
    megatron         megatron.core vocab_parallel_cross_entropy on materialised logits
                     F.linear(x, W_local) (no ignore_index: masked and averaged here)
    liger, cce       Liger-Kernel / Cut Cross-Entropy fused linear CE (CUDA only, 1 rank;
                     CCE with its default gradient filtering)
    cce_exact        Cut Cross-Entropy with filter_eps=None: no gradient filtering
    liger_tp         Liger-Kernel's tensor-parallel function
                     (liger_fused_linear_scaled_cross_entropy_tp) at TP 1: per-token NLL,
                     averaged here over the non-ignored tokens (CUDA only)
"""

from __future__ import annotations

import importlib.util
from datetime import timedelta

import torch
import torch.nn.functional as F

IGNORE = -100
OURS = ("ours_gif", "ours_gif_sync", "ours_ms", "ours_hp", "ours_ms_nocheck")
MODE_OF = {"ours_gif": "grad_in_forward", "ours_gif_sync": "grad_in_forward"}
MODE_OF |= {"ours_hp": "high_performance", "ours_ms": "memory_saving"}
MODE_OF |= {"ours_ms_nocheck": "memory_saving"}
# name: (description, world sizes it runs at, modules it needs)
IMPLS = {
    "naive": ("F.cross_entropy(F.linear)", (1,), ()),
    "ours_gif": ("ours grad_in_forward (auto)", (1, 2), ()),
    "ours_gif_sync": ("ours grad_in_forward, no overlap", (2,), ()),
    "ours_ms": ("ours memory_saving", (1, 2), ()),
    "ours_hp": ("ours high_performance", (1, 2), ()),
    "ours_ms_nocheck": ("ours memory_saving check_inputs=False", (1, 2), ()),
    "torch_lce_auto": ("F.linear_cross_entropy chunking=auto", (1,), ()),
    "torch_lce_512": ("F.linear_cross_entropy batch_chunk=512", (1,), ()),
    "deepspeed": ("DeepSpeed vp_linear_ce", (1, 2), ("deepspeed",)),
    "deepspeed_dflt": ("DeepSpeed vp_linear_ce default chunks", (1,), ("deepspeed",)),
    "megatron": ("Megatron vp_cross_entropy(logits)", (1, 2), ("megatron.core",)),
    "liger": ("Liger fused linear CE", (1,), ("liger_kernel",)),
    "liger_tp": ("Liger TP function, TP 1", (1,), ("liger_kernel",)),
    "cce": ("Cut Cross-Entropy", (1,), ("cut_cross_entropy",)),
    "cce_exact": ("Cut Cross-Entropy exact (no filtering)", (1,), ("cut_cross_entropy",)),
}
CUDA_ONLY = ("liger", "liger_tp", "cce", "cce_exact")
DEFAULT_IMPLS = [k for k in IMPLS if k not in ("deepspeed_dflt", "ours_ms_nocheck")]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def skip_reason(
    impl: str, world: int, dtype: str, bf16_competitors: bool, cuda: bool
) -> str | None:
    """Why ``impl`` does not run in this configuration (None: it runs)."""
    if impl in CUDA_ONLY and not cuda:
        return "n/a on CPU"
    if impl.startswith("torch_lce") and not hasattr(F, "linear_cross_entropy"):
        return f"not in torch {torch.__version__}"
    for module in IMPLS[impl][2]:
        if not _installed(module):
            return "not installed"
    if dtype == "bf16" and impl not in (*OURS, "naive") and not bf16_competitors:
        return "skipped (--no-bf16-competitors)"
    if cuda and world > torch.cuda.device_count():
        return f"needs {world} GPUs"
    return None


def needs_process_group(impl: str, world: int) -> bool:
    return world > 1 or impl in ("megatron", "liger_tp")  # liger_tp wants a group at TP 1


def init_distributed(case: dict, rank: int, device: torch.device, impls=None):
    """The process group of ``case["world"]`` ranks, set up as ``case["impl"]`` wants it
    (as every one of ``impls`` wants it, when given: several in one process)."""
    import torch.distributed as dist

    impls = tuple(impls or (case["impl"],))
    deepspeed_too = any(i.startswith("deepspeed") for i in impls)
    world = case["world"]
    backend = "nccl" if device.type == "cuda" else "gloo"
    if deepspeed_too:
        import deepspeed
        import deepspeed.comm.torch as ds_torch

        ds_torch.build_shm_op = lambda: None  # skips a ~2 min C++ build; comms go via gloo
    dist.init_process_group(
        backend,
        init_method="file://" + case["store"],
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=case["coll_timeout"]),
    )
    if deepspeed_too:
        deepspeed.init_distributed(dist_backend=backend)  # reuses the group above
    if "megatron" in impls:
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    return dist.new_group(list(range(world)))


def make_loss(impl: str, case: dict, y, bounds, group, device):
    """``loss(hidden, weight)``: the scalar mean loss (over non-ignored tokens) of ``impl``."""
    world = case["world"]
    if impl == "naive":
        return lambda x, w: F.cross_entropy(F.linear(x, w), y, ignore_index=IGNORE)
    if impl in OURS:
        from vocab_parallel import vocab_parallel_linear_cross_entropy
        from vocab_parallel.engine import grad_in_forward

        grad_in_forward.OVERLAP = impl != "ours_gif_sync"
        options = dict(
            process_group=group if world > 1 else None,
            vocab_start_index=bounds[0],
            global_vocab_size=case["v"],
            ignore_index=IGNORE,
            mode=MODE_OF[impl],
            backend="triton" if device.type == "cuda" else "torch",
            check_inputs=impl != "ours_ms_nocheck",
        )
        return lambda x, w: vocab_parallel_linear_cross_entropy(x, w, y, **options)
    if impl.startswith("torch_lce"):
        from torch.nn import LinearCrossEntropyOptions

        opts = LinearCrossEntropyOptions()
        if impl == "torch_lce_512":
            opts = LinearCrossEntropyOptions(batch_chunk_size=512, chunking_method=None)
        return lambda x, w: F.linear_cross_entropy(x, w, y, ignore_index=IGNORE, options=opts)
    if impl.startswith("deepspeed"):
        from deepspeed.sequence.linear_cross_entropy import vocab_parallel_linear_cross_entropy

        chunk = None
        if impl == "deepspeed" and device.type == "cpu":
            chunk = case["ds_chunk"]
        kw = {}
        if world > 1:
            kw = dict(tp_group=group, vocab_start_index=bounds[0], vocab_end_index=bounds[1])
        return lambda x, w: vocab_parallel_linear_cross_entropy(
            x, w, y, ignore_index=IGNORE, reduction="mean", chunk_size=chunk, **kw
        )
    if impl == "megatron":
        from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

        valid = y != IGNORE
        tgt = torch.where(valid, y, 0)[:, None]  # [s, b=1]; no ignore_index in Megatron
        count = valid.sum().clamp(min=1)

        def megatron(x, w):
            # Fresh logits every call, fed straight in as in a Megatron model: its in-place
            # use of an fp32 input harms nothing here (nothing else reads these logits).
            logits = F.linear(x, w)[:, None, :]
            per_token = vocab_parallel_cross_entropy(logits, tgt)[:, 0]
            return (per_token * valid).sum() / count

        return megatron
    if impl == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        fn = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE)
        return lambda x, w: fn(w, x, y)
    if impl == "liger_tp":
        from liger_kernel.transformers.functional import (
            liger_fused_linear_scaled_cross_entropy_tp,
        )

        valid = y != IGNORE
        count = valid.sum().clamp(min=1)

        def liger_tp(x, w):
            nll = liger_fused_linear_scaled_cross_entropy_tp(x, w, y, group, ignore_index=IGNORE)
            return torch.where(valid, nll, 0.0).sum() / count

        return liger_tp
    if impl in ("cce", "cce_exact"):
        from cut_cross_entropy import linear_cross_entropy

        kw = {"filter_eps": None} if impl == "cce_exact" else {}  # else its default filter
        return lambda x, w: linear_cross_entropy(x, w, y, ignore_index=IGNORE, **kw)
    raise ValueError(f"unknown implementation {impl!r}")
