"""DeepSpeed ZeRO-3 (TP 1) on 2 gloo ranks: the head's weight is partitioned over the
data-parallel ranks, and the loss reads it where ZeRO-3 gathers it.

- Our small GPT (``launch.model``), whose head is a :class:`VocabParallelLMHead` submodule:
  ZeRO-3 gathers the head's weight for the head's forward (and backward). Each mode of the
  loss trains as the unsharded single-process model does (losses, gradient norms, fp32,
  1e-5); a checkpoint saved under ZeRO-3 and loaded into a new engine resumes exactly.
- A tiny random-init transformers Llama patched by ``apply_vocab_parallel_loss`` before
  or after ``deepspeed.initialize``, untied and tied (the tied weight is released again
  by the embedding's forward, so the patched forward reads it after the body): the same
  as the unpatched single-process model; a tied checkpoint resumes exactly.
- Misuse, on every rank alike: the partitioned weight given to the loss outside any
  gather, and the head called after the model's forward (as trainers that compute the
  loss themselves do), raise a ``ValueError`` naming ZeRO-3 and the fix.

One spawn per model family (DeepSpeed's import and engine set-up dominate the time).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # gloo ranks on CPU, also on a GPU machine
pytest.importorskip("deepspeed")

from multirank import run_ranks  # noqa: E402
from test_deepspeed import CFG, SGD_LR, _close, _micro, _optimizer, _reference  # noqa: E402

pytestmark = pytest.mark.slow

CLIP = 0.5  # below the GPT's gradient norms (0.8-0.9): clipping is active
REL = 1e-5


def _start(group) -> None:
    import logging

    from deepspeed.utils import logger

    from vocab_parallel.integrations import deepspeed as vp_deepspeed

    logger.setLevel(logging.WARNING)
    os.environ["LOCAL_RANK"] = str(torch.distributed.get_rank(group))  # torchrun's job
    vp_deepspeed.init_distributed()


def _z3_config(micro: int, accumulation: int = 1) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": CLIP,
        # persistence 0: every parameter partitioned between uses (by default ZeRO-3 keeps
        # ones under 1e5 elements gathered for good after the first step, these heads too)
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,  # torch's optimizers: exact under ZeRO
        "steps_per_print": 10**9,
    }


def _refused(fn) -> str:
    """The message of the ``ValueError`` ``fn()`` raises (an AssertionError if none)."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    raise AssertionError("accepted a ZeRO-3 partition read outside a gather")


def _gpt_runs(group, ckpt_dir):
    import deepspeed

    from launch.model import GPT
    from vocab_parallel import vocab_parallel_linear_cross_entropy

    _start(group)
    rank = torch.distributed.get_rank(group)

    def engine_for(mode, optimizer="sgd", seed=0):
        model = GPT(CFG, seed=seed, mode=mode)
        opt = _optimizer(model.parameters(), optimizer)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=_z3_config(2))
        return engine

    def train(engine, steps):
        losses, norms = [], []
        for step in steps:
            loss = engine(*_micro(step, 2, rank))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            norms.append(float(engine.get_global_grad_norm()))
        return losses, norms

    out = {}
    for mode in ("auto", "memory_saving", "high_performance"):
        engine = engine_for(mode)
        losses, norms = train(engine, range(3))
        weight = engine.module.head.weight  # between steps: partitioned
        partition = (tuple(weight.shape), tuple(weight.ds_shape), weight.ds_status.name)
        out[mode] = dict(losses=losses, norms=norms, partition=partition)

    # The partitioned weight given to the loss outside any gather (every rank alike).
    h = torch.randn(2, 5, CFG.d_model)
    y = torch.randint(0, CFG.vocab_size, (2, 5))
    out["refused"] = _refused(lambda: vocab_parallel_linear_cross_entropy(h, weight, y))

    # Checkpoint: save after 2 steps (AdamW: its moments are partitioned state too), 2
    # more; a new engine (other initial weights) loads it and trains the same 2 steps.
    engine = engine_for("auto", "adamw")
    train(engine, range(2))
    engine.save_checkpoint(ckpt_dir, tag="step2")
    uninterrupted = train(engine, range(2, 4))
    resumed_engine = engine_for("auto", "adamw", seed=1)
    path, _ = resumed_engine.load_checkpoint(ckpt_dir, tag="step2")
    assert path is not None, "load_checkpoint found no checkpoint"
    out["checkpoint"] = dict(
        uninterrupted=uninterrupted, resumed=train(resumed_engine, range(2, 4))
    )
    return out


def test_zero3_gpt_head_equals_unsharded(tmp_path):
    """GPT with our head as a ZeRO-3 submodule, 2 data-parallel ranks, SGD with active
    clipping, every mode: each rank's losses and the global gradient norms equal the
    unsharded single-process run; the partitioned weight read outside a gather is refused
    on both ranks, naming ZeRO-3; a checkpoint resumes exactly."""
    assert SGD_LR == 1.0  # test_deepspeed's reference optimizer, the same here
    ref = _reference(2)
    assert min(ref["norms"]) > CLIP, "clipping must be active for the norm to matter"
    per_rank = run_ranks(_gpt_runs, 2, str(tmp_path / "ckpt"))
    for rank, result in enumerate(per_rank):
        message = result.pop("refused")
        assert message.startswith("weight: a DeepSpeed ZeRO-3 partition"), message
        assert "(0,)" in message and "inside the forward" in message, message
        ckpt = result.pop("checkpoint")
        assert ckpt["resumed"] == ckpt["uninterrupted"], (rank, ckpt)
        for mode, r in result.items():
            where = f"rank {rank}, {mode}"
            # the head's weight really is partitioned between steps
            assert r["partition"] == ((0,), (CFG.vocab_size, CFG.d_model), "NOT_AVAILABLE"), r
            _close(r["losses"], [step[rank] for step in ref["losses"]], f"{where}: losses", REL)
            _close(r["norms"], ref["norms"], f"{where}: gradient norms", REL)


# ----------------------------------------------------------------------------- transformers


def _llama_runs(group, ckpt_dir):
    import deepspeed
    from test_transformers import LR, _ds_train, make_model, micro_batches

    from vocab_parallel.integrations.transformers import apply_vocab_parallel_loss, current_head

    _start(group)

    def no_logits(*args):
        raise AssertionError("lm_head ran: logits were computed")

    def engine_for(tied, when, seed=0, mode="auto"):
        from test_transformers import BATCH, GA

        model = make_model("llama", tied, seed)
        if when == "before":
            apply_vocab_parallel_loss(model, mode=mode)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        config = _z3_config(BATCH, GA) | {"gradient_clipping": 1.0}
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        if when == "after":
            apply_vocab_parallel_loss(engine.module, mode=mode)
        lm_head = engine.module.lm_head
        assert current_head(engine.module).weight is lm_head.weight, "must share the parameter"
        lm_head.register_forward_hook(no_logits)
        return engine

    # The loss outside the model's forward (as trainers that compute it themselves do):
    # the hidden states of the base model, then the head, on a weight ZeRO-3 keeps empty.
    (ids, labels), _ = micro_batches(0)
    engine = engine_for(False, "after")
    hidden = engine.module.model(ids).last_hidden_state
    head = current_head(engine.module)
    out = {"refused": _refused(lambda: head(hidden, labels))}

    # memory_saving and high_performance read the weight in the backward too
    for tied, when, mode in (
        (False, "before", "auto"),
        (True, "before", "memory_saving"),
        (True, "after", "auto"),
        (False, "after", "high_performance"),
    ):
        engine = engine_for(tied, when, mode=mode)
        out[f"{'tied' if tied else 'untied'}/{when}/{mode}"] = _ds_train(engine, range(3))

    # Checkpoint, tied: save after 1 step, 2 more; a new model (other weights) resumes.
    engine = engine_for(True, "before")
    _ds_train(engine, range(1))
    engine.save_checkpoint(ckpt_dir, tag="step1")
    uninterrupted = _ds_train(engine, range(1, 3))
    resumed_engine = engine_for(True, "after", seed=1)
    path, _ = resumed_engine.load_checkpoint(ckpt_dir, tag="step1")
    assert path is not None, "load_checkpoint found no checkpoint"
    out["checkpoint"] = dict(
        uninterrupted=uninterrupted, resumed=_ds_train(resumed_engine, range(1, 3))
    )
    return out


def test_zero3_transformers_equals_unpatched(tmp_path):
    """A tiny Llama under ZeRO-3 on 2 ranks (the same data on each), patched before or
    after deepspeed.initialize, untied and tied, gradient accumulation 2 with
    num_items_in_batch, active clipping: losses and gradient norms equal the unpatched
    single-process model's, and lm_head never runs; the head called after the model's
    forward refuses the partitioned weight on both ranks; a tied checkpoint resumes
    exactly."""
    pytest.importorskip("transformers")
    from test_transformers import close, reference

    refs = {tied: reference("llama", tied) for tied in (False, True)}
    per_rank = run_ranks(_llama_runs, 2, str(tmp_path / "ckpt"))
    for rank, result in enumerate(per_rank):
        message = result.pop("refused")
        assert message.startswith("weight: a DeepSpeed ZeRO-3 partition"), message
        assert "inside the forward" in message and "(257, 32)" in message, message
        ckpt = result.pop("checkpoint")
        assert ckpt["resumed"] == ckpt["uninterrupted"], (rank, ckpt)
        assert len(result) == 4, result.keys()
        for key, r in result.items():
            ref = refs[key.startswith("tied")]
            close(r["losses"], ref["losses"], f"rank {rank}, {key}: losses")
            close(r["norms"], ref["norms"], f"rank {rank}, {key}: gradient norms")
