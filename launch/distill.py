"""Distillation example: a small GPT student learns from a fixed larger teacher GPT, both
LM heads vocabulary-sharded over the ranks, the divergence computed without logits.

    torchrun --nproc-per-node 2 launch/distill.py                  # the README figure
    torchrun --nproc-per-node 2 launch/distill.py --teacher-steps 20 --steps 20   # a smoke run

On the embedded corpus (``data/kjv.txt.gz``, the BPE of ``launch/train.py``):

1. the teacher, ``GPT(d_model 192, 3 layers)``, trains ``--teacher-steps`` steps on cross
   entropy through its :class:`~vocab_parallel.VocabParallelLMHead`, then is frozen;
2. the student, ``GPT(d_model 128, 2 layers)``, trains ``--steps`` steps on
   ``0.9 KL(p_teacher || p_student) + 0.1 CE`` from ``student.head.distillation_loss(h,
   teacher.head, h_teacher, targets, hard_label_weight=0.1)``;
3. the same student run (same initialisation, same batches, same optimiser) computed
   from full logits: both heads' whole weights, ``F.kl_div`` and ``F.cross_entropy`` on
   ``[tokens, vocab]`` (replicated on every rank: no collective).

Rank 0 writes both curves to ``--out`` (``curve.json``, ``curve.png``) and prints how far
apart they are. Tensor parallelism only: the bodies are replicated, the gradient of the
hidden states arrives summed over the group from the loss, so the replicas stay equal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from launch.data import load_data  # noqa: E402
from launch.model import GPT, GPTConfig  # noqa: E402

CONTEXT, BATCH, LR, CE_WEIGHT = 64, 16, 3e-3, 0.1
TEACHER = dict(context=CONTEXT, d_model=192, n_layers=3, n_heads=6)
STUDENT = dict(context=CONTEXT, d_model=128, n_layers=2, n_heads=4)


def hidden_states(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """The body's output (what the head receives)."""
    x = model.tok(idx) + model.pos(torch.arange(idx.shape[1], device=idx.device))
    for block in model.blocks:
        x = block(x)
    return model.ln_f(x)


def full_logits_loss(student: GPT, teacher: GPT, w_teacher, idx, targets) -> torch.Tensor:
    """The reference: both heads' logits materialised."""
    h = hidden_states(student, idx)
    with torch.no_grad():
        zt = hidden_states(teacher, idx) @ w_teacher.T
    ls = torch.log_softmax(h.reshape(-1, h.shape[-1]) @ student.head.weight.T, dim=-1)
    lt = torch.log_softmax(zt.reshape(-1, zt.shape[-1]), dim=-1)
    kd = F.kl_div(ls, lt, reduction="batchmean", log_target=True)
    return (1 - CE_WEIGHT) * kd + CE_WEIGHT * F.nll_loss(ls, targets.reshape(-1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--teacher-steps", type=int, default=300)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default="runs/distill")
    p.add_argument("--figure", help="also write the figure here (the README's)")
    p.add_argument("--data", default="data/kjv.txt.gz")
    p.add_argument("--cache-dir", default=str(ROOT / "runs/cache"))
    p.add_argument("--vocab-size", type=int, default=8192)
    args = p.parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, group = dist.get_rank(), dist.group.WORLD
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    o = dict(data=args.data, vocab_size=args.vocab_size, cache_dir=args.cache_dir,
             tokenizer=None, val_fraction=0.02)  # fmt: skip
    data, _ = load_data(o, rank, torch.device("cpu"))

    def batch(step: int, stream: int):
        return data.batch(seed=stream, step=step, dp_rank=0, batch_size=BATCH, context=CONTEXT)

    t0 = time.perf_counter()
    teacher = GPT(GPTConfig(vocab_size=args.vocab_size, **TEACHER), seed=7, process_group=group)
    opt = torch.optim.AdamW(teacher.parameters(), lr=LR, weight_decay=0.1)
    for step in range(args.teacher_steps):
        loss = teacher(*batch(step, stream=1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    teacher.requires_grad_(False).eval()
    teacher_ce = float(loss.detach()) if args.teacher_steps else float("nan")
    w_teacher = teacher.head.full_weight()  # for the reference run only

    curves = {}
    for run in ("vocab_parallel", "full_logits"):
        head = "vocab_parallel" if run == "vocab_parallel" else "unsharded"
        cfg = GPTConfig(vocab_size=args.vocab_size, **STUDENT)
        student = GPT(cfg, seed=1, head=head, process_group=group)
        opt = torch.optim.AdamW(student.parameters(), lr=LR, weight_decay=0.1)
        losses = []
        for step in range(args.steps):
            idx, targets = batch(step, stream=2)
            if run == "vocab_parallel":
                h = hidden_states(student, idx)
                with torch.no_grad():
                    h_t = hidden_states(teacher, idx)
                loss = student.head.distillation_loss(
                    h, teacher.head, h_t, targets, hard_label_weight=CE_WEIGHT
                )
            else:
                loss = full_logits_loss(student, teacher, w_teacher, idx, targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        curves[run] = losses
    seconds = time.perf_counter() - t0
    if rank == 0:
        a, b = curves["vocab_parallel"], curves["full_logits"]
        gap = max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        summary = dict(teacher_steps=args.teacher_steps, teacher_final_ce=teacher_ce,
                       steps=args.steps, max_abs_gap=gap, seconds=round(seconds, 1),
                       ranks=dist.get_world_size(), curves=curves)  # fmt: skip
        (out / "curve.json").write_text(json.dumps(summary))
        _figure(curves, [out / "curve.png"] + ([Path(args.figure)] if args.figure else []))
        first, last = (a[0], a[-1]) if a else (float("nan"),) * 2
        print(f"teacher CE after {args.teacher_steps} steps: {teacher_ce:.4f}")
        print(f"student KD loss: {first:.4f} -> {last:.4f} over {args.steps} steps; full "
              f"logits: {b[-1] if b else float('nan'):.4f}; max |gap| {gap:.2e}; "
              f"{seconds:.0f} s in all")  # fmt: skip
    dist.destroy_process_group()
    return 0


def _figure(curves: dict, paths: list[Path]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(curves["full_logits"], label="full logits (F.kl_div, F.cross_entropy)", lw=3,
            alpha=0.4)  # fmt: skip
    ax.plot(curves["vocab_parallel"], label="head.distillation_loss, TP 2, no logits", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("0.9 KL(teacher || student) + 0.1 CE")
    ax.set_title("Student GPT distilled from a larger teacher GPT")
    ax.legend()
    fig.tight_layout()
    for path in paths:
        fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
