"""The DeepSpeed plug-in on gloo ranks: training inside ``deepspeed.initialize`` equals a
plain unsharded single-process PyTorch run; checkpoints; DeepSpeed AutoTP's head.

Every test spawns its ranks once and loops inside them (DeepSpeed's import and engine set-up
cost seconds per process on a small CPU machine). Equality is checked in fp32 (to 1e-5
relative); bf16 runs are checked to track fp32.

The first DeepSpeed run on a machine JIT-compiles its shared-memory comm op with the C++
compiler (0.5-2 minutes on 2 cores, cached in ``~/.cache/torch_extensions`` or
``TORCH_EXTENSIONS_DIR`` afterwards).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # gloo ranks on CPU, also on a GPU machine
pytest.importorskip("deepspeed")

from multirank import run_ranks  # noqa: E402

from launch.model import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.slow

# Vocabulary 1001: uneven shards for TP 2 (501 + 500 rows).
CFG = GPTConfig(vocab_size=1001, context=16, d_model=32, n_layers=1, n_heads=2)
MICRO = 2  # sequences per data-parallel rank and step
STEPS = 3
SGD_LR = 1.0
ADAM_LR = 3e-3
CLIP = 0.5  # below the gradient norms of these steps (0.8-1.3): clipping is active
REL = 1e-5


def _batch(step: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: ``dp_size * MICRO`` sequences (DP rank r: slice r)."""
    g = torch.Generator().manual_seed(1000 + step)
    shape = (dp_size * MICRO, CFG.context)
    return (
        torch.randint(0, CFG.vocab_size, shape, generator=g),
        torch.randint(0, CFG.vocab_size, shape, generator=g),
    )


def _micro(step: int, dp_size: int, dp_rank: int):
    idx, tgt = _batch(step, dp_size)
    rows = slice(dp_rank * MICRO, (dp_rank + 1) * MICRO)
    return idx[rows], tgt[rows]


def _optimizer(params, kind: str):
    # SGD for the comparisons: its update is proportional to the clipped gradient, so a
    # wrong clipping norm shows in every weight (Adam's update hardly depends on the scale).
    # AdamW for the checkpoint: its moments are optimizer state that must be restored.
    if kind == "sgd":
        return torch.optim.SGD(params, lr=SGD_LR, momentum=0.9)
    return torch.optim.AdamW(params, lr=ADAM_LR, weight_decay=0.01)


def _config(stage: int, dtype: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"},
        "steps_per_print": 10**9,
    }


def _reference(dp_size: int, steps: int = STEPS) -> dict:
    """Unsharded single-process run: per-micro-batch losses, grad norms, final head weight."""
    model = GPT(CFG, seed=0, head="unsharded")
    opt = _optimizer(model.parameters(), "sgd")
    losses, norms = [], []
    for step in range(steps):
        per_rank = [model(*_micro(step, dp_size, r)) for r in range(dp_size)]
        torch.stack(per_rank).mean().backward()  # the mean over the global batch
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append([x.item() for x in per_rank])
    return dict(losses=losses, norms=norms, head=model.head.weight.detach().clone())


def _np(t: torch.Tensor):
    """A tensor as a numpy array: results cross the process boundary as plain pickles (torch
    would pass shared-memory handles, gone once the rank exits)."""
    return t.detach().double().numpy().copy()


def _start_deepspeed(group) -> None:
    """DeepSpeed on the gloo group run_ranks started (all ranks on this machine)."""
    import logging

    from deepspeed.utils import logger

    from vocab_parallel.integrations import deepspeed as vp_deepspeed

    logger.setLevel(logging.WARNING)
    os.environ["LOCAL_RANK"] = str(torch.distributed.get_rank(group))  # torchrun's job
    vp_deepspeed.init_distributed()


def _engine(groups, stage: int, optimizer: str, dtype: str = "fp32", seed: int = 0):
    from vocab_parallel.integrations import deepspeed as vp_deepspeed

    model = GPT(CFG, seed=seed, process_group=groups.tp_group)
    engine, *_ = vp_deepspeed.initialize(
        model, groups, _config(stage, dtype), optimizer=_optimizer(model.parameters(), optimizer)
    )
    return engine


def _train(engine, groups, steps) -> tuple[list[float], list[float]]:
    """Steps of ``engine``; this rank's losses and the global gradient norms."""
    from deepspeed.runtime.utils import clip_grad_norm_

    # The engine's own condition for clipping with runtime.utils.clip_grad_norm_ (fp32,
    # no ZeRO), which discards the norm; the other paths' optimizers report it.
    plain = not (engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization())
    losses, norms = [], []
    for step in steps:
        loss = engine(*_micro(step, groups.dp_size, groups.dp_rank))
        engine.backward(loss)
        if plain:  # the same function on the same (data-parallel averaged) gradients;
            # max_norm inf: it scales them by exactly 1
            mpu = engine.mpu
            norms.append(clip_grad_norm_(engine.module.parameters(), float("inf"), mpu=mpu).item())
        engine.step()
        if not plain:
            norms.append(float(engine.get_global_grad_norm()))
        losses.append(loss.item())
    return losses, norms


def _train_stages(group, tp_size, stages, dtype, start=True):
    from vocab_parallel.parallel.groups import init_parallel_groups

    if start:
        _start_deepspeed(group)
    groups = init_parallel_groups(tp_size)
    out = {}
    for stage in stages:
        engine = _engine(groups, stage, "sgd", dtype)
        losses, norms = _train(engine, groups, range(STEPS))
        head = _np(engine.module.head.full_weight())
        out[stage] = dict(dp_rank=groups.dp_rank, losses=losses, norms=norms, head=head)
    return out


def _close(actual, expected, what, rel=REL):
    """Max |difference| within ``rel`` of the largest |expected| value."""
    a, e = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected).double()
    err = (a - e).abs().max().item()
    bound = rel * e.abs().max().item() + 1e-7
    assert err <= bound, f"{what}: max |diff| {err:.3e} > {bound:.3e}\n{a}\n{e}"


def _compare(per_rank, ref, stages, tol):
    for stage in stages:
        for rank, result in enumerate(per_rank):
            r = result[stage]
            where = f"stage {stage}, rank {rank}"
            ref_losses = [step[r["dp_rank"]] for step in ref["losses"]]
            _close(r["losses"][0], ref_losses[0], f"{where}: first loss", tol["first"])
            _close(r["norms"][0], ref["norms"][0], f"{where}: first gradient norm", tol["first"])
            _close(r["losses"], ref_losses, f"{where}: losses", tol["losses"])
            _close(r["norms"], ref["norms"], f"{where}: gradient norms", tol["norms"])
            _close(r["head"], ref["head"], f"{where}: final full head weight", tol["head"])


@pytest.mark.parametrize("world,tp_size", [(2, 2), (4, 2)], ids=["tp2", "tp2xdp2"])
def test_zero_stages_equal_unsharded_pytorch(world, tp_size):
    """fp32, ZeRO 0, 1, 2, gradient clipping: every rank's losses, the gradient norms and the
    final full head weight of a TP (x DP) DeepSpeed run equal a single-process PyTorch run
    with an ordinary head, the same data (each DP rank its micro-batch) and optimizer."""
    ref = _reference(world // tp_size)
    assert min(ref["norms"]) > CLIP, "clipping must be active for the norm to matter"
    per_rank = run_ranks(_train_stages, world, tp_size, (0, 1, 2), "fp32")
    _compare(per_rank, ref, (0, 1, 2), dict.fromkeys(("first", "losses", "norms", "head"), REL))


def _bf16(group):
    """bf16 without ZeRO is refused (its clipping norm misses TP shards); ZeRO 1, 2 train."""
    from vocab_parallel.parallel.groups import init_parallel_groups

    _start_deepspeed(group)
    groups = init_parallel_groups(2)
    try:
        _engine(groups, 0, "sgd", "bf16")
    except ValueError as e:
        assert "FP16_UnfusedOptimizer" in str(e), e
    else:
        raise AssertionError("bf16 at ZeRO stage 0 with TP 2 and clipping was accepted")
    return _train_stages(group, 2, (1, 2), "bf16", start=False)


def test_bf16_zero_stages_track_fp32():
    """bf16, TP 2 x DP 2 (gloo in torch 2.13 reduces bf16; our head communicates fp32
    anyway), ZeRO 1 and 2: the first step agrees with the fp32 reference to bf16 rounding,
    the later ones drift as bf16 training does. Stage 0 is refused, see
    vocab_parallel.integrations.deepspeed._check_clipping."""
    ref = _reference(2)
    per_rank = run_ranks(_bf16, 4)
    _compare(per_rank, ref, (1, 2), dict(first=2e-3, losses=1e-2, norms=5e-2, head=0.1))


def _checkpoint(group, tp_size, stages, ckpt_dir):
    from vocab_parallel.parallel.groups import init_parallel_groups

    _start_deepspeed(group)
    groups = init_parallel_groups(tp_size)
    out = {}
    for stage in stages:
        save_dir = os.path.join(ckpt_dir, f"stage{stage}")
        engine = _engine(groups, stage, "adamw")
        _train(engine, groups, range(2))
        engine.save_checkpoint(save_dir, tag="step2")
        uninterrupted, _ = _train(engine, groups, range(2, 4))
        head = _np(engine.module.head.full_weight())

        # Another initialisation: only a real load can reproduce the losses.
        resumed_engine = _engine(groups, stage, "adamw", seed=1)
        path, _ = resumed_engine.load_checkpoint(save_dir, tag="step2")
        assert path is not None, "load_checkpoint found no checkpoint"
        resumed, _ = _train(resumed_engine, groups, range(2, 4))
        out[stage] = dict(
            uninterrupted=uninterrupted,
            resumed=resumed,
            head=head,
            resumed_head=_np(resumed_engine.module.head.full_weight()),
            files=sorted(os.listdir(os.path.join(save_dir, "step2"))),
        )
    return out


def test_checkpoint_resume_equals_uninterrupted(tmp_path):
    """TP 2 x DP 2, AdamW, ZeRO 0 and 2: save after 2 steps, train 2 more; a new engine
    (other initial weights) loads the checkpoint and trains the same 2 steps: identical
    losses and head. The sharded head is saved per TP rank; at stage 2 the optimizer
    moments are partitioned over the DP group as well."""
    stages = (0, 2)
    per_rank = run_ranks(_checkpoint, 4, 2, stages, str(tmp_path))
    for stage in stages:
        for rank, result in enumerate(per_rank):
            r = result[stage]
            where = f"stage {stage}, rank {rank}"
            assert r["resumed"] == r["uninterrupted"], f"{where}: {r}"
            assert (r["resumed_head"] == r["head"]).all(), f"{where}: head differs"
        files = per_rank[0][stage]["files"]
        # One model file per TP rank, each holding that rank's head shard.
        assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"} <= set(files), files


def _autotp(group, vocab, hidden, grain):
    import torch.nn.functional as F
    from deepspeed.module_inject.layers import VocabParallelLinear, set_autotp_mode
    from deepspeed.module_inject.tp_shard import AutoTPMeta

    from vocab_parallel.integrations import deepspeed as vp_deepspeed

    _start_deepspeed(group)
    set_autotp_mode(training=True)
    torch.manual_seed(0)  # the same full head, input and targets on every rank
    full = torch.nn.Linear(hidden, vocab, bias=False)
    w_full = full.weight.detach().clone().requires_grad_()
    x = torch.randn(3, 7, hidden)
    y = torch.randint(0, vocab, (3, 7))
    y[0, :2] = -100

    layer = VocabParallelLinear(
        full, mp_group=group, name="lm_head", tp_meta=AutoTPMeta(tp_grain_size=grain)
    )
    head = vp_deepspeed.head_from_autotp(layer)
    assert head.weight is layer.weight, "the head must share the AutoTP shard, not copy it"
    start, end = layer.vocab_start_index, layer.vocab_end_index
    assert (head.vocab_start_index, head.vocab_end_index) == (start, end)
    # The layer's own rank-local logits agree with the rows we hold.
    torch.testing.assert_close(layer(x), x @ w_full[start:end].detach().T)

    xs = x.clone().requires_grad_()
    loss = head(xs, y)
    loss.backward()
    xr = x.clone().requires_grad_()
    ref = F.cross_entropy((xr @ w_full.T).flatten(0, 1), y.flatten())
    ref.backward()
    return dict(
        bounds=(start, end),
        loss=(loss.item(), ref.item()),
        grad_input=(_np(xs.grad), _np(xr.grad)),
        grad_weight=(_np(layer.weight.grad), _np(w_full.grad[start:end])),
    )


def test_head_from_autotp_shares_the_shard_and_equals_unsharded():
    """DeepSpeed AutoTP's VocabParallelLinear (grain 64: shards 512 + 489 rows, not our
    default 501 + 500) as our loss head: same parameter, unsharded loss and gradients."""
    per_rank = run_ranks(_autotp, 2, 1001, 32, 64)
    assert [r["bounds"] for r in per_rank] == [(0, 512), (512, 1001)]
    for rank, r in enumerate(per_rank):
        for what in ("loss", "grad_input", "grad_weight"):
            _close(*r[what], f"rank {rank}: {what}")


def test_importing_the_integration_does_not_import_deepspeed():
    code = (
        "import sys, vocab_parallel.integrations.deepspeed; "
        "assert 'deepspeed' not in sys.modules, 'imported deepspeed'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


class _AutoTPLike(torch.nn.Module):
    """The attributes of DeepSpeed's VocabParallelLinear, without DeepSpeed (one rank)."""

    def __init__(self, vocab, hidden, bias=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(vocab, hidden))
        self.bias = torch.nn.Parameter(torch.zeros(vocab)) if bias else None
        self.vocab_size, self.vocab_start_index, self.vocab_end_index = vocab, 0, vocab
        self.mp_group = None


def test_head_from_autotp_single_rank_and_errors():
    import torch.nn.functional as F

    from vocab_parallel.integrations.deepspeed import head_from_autotp

    torch.manual_seed(0)
    layer = _AutoTPLike(37, 8)
    head = head_from_autotp(layer, reduction="sum")
    assert head.weight is layer.weight
    x, y = torch.randn(5, 8), torch.randint(0, 37, (5,))
    _close(head(x, y).item(), F.cross_entropy(x @ layer.weight.T, y, reduction="sum").item(), "")
    biased = _AutoTPLike(37, 8, bias=True)  # the layer's bias goes to the loss's bias option
    assert head_from_autotp(biased).loss_options["bias"] is biased.bias
    assert head_from_autotp(torch.nn.Linear(8, 37, bias=False)).process_group is None  # TP 1
    with pytest.raises(TypeError, match='"vocab_parallel_lm_head": true'):
        head_from_autotp(torch.nn.Embedding(37, 8))
    bad = _AutoTPLike(37, 8)
    bad.vocab_end_index = 30
    with pytest.raises(ValueError, match="30 rows"):
        head_from_autotp(bad)
