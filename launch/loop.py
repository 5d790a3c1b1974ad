"""The training loop: steps, validation, periodic checkpoints, and the log of each.

Every model of the run (the vocabulary-parallel one, and with
``--check-against-unsharded`` its unsharded copy) takes each step on the same batch, so
their losses are comparable step by step. What is drawn at a step is a function of the
step alone (the batch of ``(seed, step, dp_rank)``, the learning rate of ``lr_at``):
starting the loop at a checkpoint's step continues exactly as the uninterrupted run did.
The loss reported is the mean over the data-parallel ranks (their batches differ).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from launch.checkpoints import checkpoint_root, save_checkpoint
from launch.config import lr_at
from launch.dist_env import RunRefused, collective
from launch.report import (
    FILE_ONLY,
    mib,
    peak_memory_bytes,
    progress_bar,
    record_error,
    side_by_side,
)
from vocab_parallel.engine.filtering import gradient_filter_stats

log = logging.getLogger("train")


@dataclass
class LoopResult:
    """How the loop ended (``status``: done, stopped by ``--stop-at``, or diverged), the
    loss history and what the throughput is computed from (the first step is untimed)."""

    status: str
    history: dict
    tokens_per_step: int
    timed_steps: int
    timed_seconds: float


@torch.no_grad()
def evaluate(runner, batches, groups, device) -> float:
    """Mean validation loss over every DP rank's share of the validation set."""
    runner.module.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in batches:
        total[0] += runner.forward(x.to(device), y.to(device)).double()
        total[1] += 1
    runner.module.train()
    if groups.dp_size > 1:
        with collective("all-reduce of the validation loss", groups.dp_group,
                        "the data-parallel group"):  # fmt: skip
            dist.all_reduce(total, group=groups.dp_group)
    return (total[0] / total[1]).item()


def train(o: dict, runners: dict, data, groups, device: torch.device, *, start: int,
          history: dict, interactive: bool, run_id: str) -> LoopResult:  # fmt: skip
    """Steps ``start + 1 .. o["steps"]`` of every runner (collective), appending to
    ``history``; validation every ``eval_every`` steps and at the end; checkpoints (of the
    run ``run_id``) every ``save_every`` steps."""
    # What the data cannot give is known now, and alike on every rank: say so and stop.
    if len(data.train) < o["context"] + 2:
        raise RunRefused(f"data: the training part of {o['data']} ({len(data.train):,} tokens) "
                         f"is too short for context {o['context']}")  # fmt: skip
    try:
        val_batches = data.val_batches(
            dp_rank=groups.dp_rank,
            dp_size=groups.dp_size,
            batch_size=o["batch_size"],
            context=o["context"],
            max_batches=o["val_batches"],
        )
    except ValueError as exc:
        raise RunRefused(f"data: {exc}") from None

    def validate(step: int) -> None:
        losses = [evaluate(r, val_batches, groups, device) for r in runners.values()]
        history["val"] = [v for v in history["val"] if v[0] != step] + [[step, *losses]]
        extra = f" (unsharded {losses[1]:.4f})" if len(losses) > 1 else ""
        log.info(f"step {step}: validation loss {losses[0]:.4f}{extra}")

    tokens_per_step = o["batch_size"] * o["context"] * groups.dp_size
    bar = progress_bar(o["steps"], start, dist.get_rank(), interactive)
    timed_steps, timed_seconds = 0, 0.0

    def result(status: str) -> LoopResult:
        return LoopResult(status, history, tokens_per_step, timed_steps, timed_seconds)

    if o["check_against_unsharded"] and start == 0:
        log.info("side by side (train loss, DP mean):\n" + side_by_side(history, 1).split("\n")[0])
    for step in range(start + 1, o["steps"] + 1):
        x, y = data.batch(
            seed=o["seed"],
            step=step,
            dp_rank=groups.dp_rank,
            batch_size=o["batch_size"],
            context=o["context"],
        )
        x, y = x.to(device), y.to(device)
        lr = lr_at(step, o)
        t0 = time.perf_counter()
        results = [r.train_step(x, y, lr) for r in runners.values()]
        losses = torch.stack([loss for loss, _ in results]).double()
        if groups.dp_size > 1:
            with collective("all-reduce of the loss", groups.dp_group, "the data-parallel group"):
                dist.all_reduce(losses, group=groups.dp_group)
            losses /= groups.dp_size
        losses = losses.tolist()  # also waits for the GPU: the step time below is real
        seconds = time.perf_counter() - t0
        if step > start + 1 or o["steps"] == start + 1:  # the first step warms up
            timed_steps, timed_seconds = timed_steps + 1, timed_seconds + seconds
        history["step"].append(step)
        history["loss"].append(losses[0])
        history["grad_norm"].append(results[0][1])
        history["lr"].append(lr)
        if o["check_against_unsharded"]:
            history["ref_loss"].append(losses[1])
        if "filtered" in history:  # this rank's products, this step
            history["filtered"].append(gradient_filter_stats(reset=True).skipped_fraction)
        if not math.isfinite(losses[0]):
            log.error(f"step {step}: loss is {losses[0]}, stopping")
            if dist.get_rank() == 0:
                record_error(f"error: step {step}: loss is {losses[0]}, stopping")
            return result("diverged")
        tok_s = tokens_per_step * timed_steps / timed_seconds if timed_seconds else 0.0
        bar.set_postfix_str(
            f"loss={losses[0]:.4f}, tok/s={tok_s:,.0f}, mem={mib(peak_memory_bytes(device))}",
            refresh=False,
        )
        bar.update(1)
        if step % o["log_every"] == 0 or step == o["steps"] or step == 1:
            line = (
                f"step {step}/{o['steps']}: loss {losses[0]:.6f}, lr {lr:.2e}, "
                f"grad norm {results[0][1]:.3f}, {tok_s:,.0f} tok/s, "
                f"peak {mib(peak_memory_bytes(device))}"
            )
            if "filtered" in history:
                line += f", filtered {history['filtered'][-1]:.1%} of G's tiles"
            if o["check_against_unsharded"]:
                a, b = losses
                log.info(f"{step:5d} | {a:14.6f} | {b:10.6f} | {abs(a - b):.2e}")
                line += f", unsharded {b:.6f}"
            log.info(line, **FILE_ONLY)
        if o["eval_every"] and step % o["eval_every"] == 0 and step != o["steps"]:
            validate(step)
        if o["save_every"] and (step % o["save_every"] == 0 or step == o["steps"]):
            tag = save_checkpoint(o, runners, step, history, run_id)
            log.info(f"step {step}: saved checkpoint {checkpoint_root(o) / tag}", **FILE_ONLY)
        if o["stop_at"] and step == o["stop_at"] and step != o["steps"]:
            log.info(f"step {step}: stopping here without saving (--stop-at)")
            bar.close()
            return result("stopped")
    bar.close()
    validate(o["steps"])
    return result("done")
