"""Distillation step time and memory: ours against materialised-logits KD and Liger-Kernel.

One row per (ranks, vocabulary, implementation), each a fresh group of gloo ranks (the
vocabulary cut over them), the same inputs: forward KL + 0.1 CE of a student head
(hidden 256) against a teacher head (hidden 512), forward + backward to the gradients of
the student's hidden states and weight shard:

    ours          vp.vocab_parallel_distillation_loss (mode auto: grad_in_forward)
    ours_ms       the same, mode memory_saving (both heads' logits recomputed)
    materialised  each rank's [tokens, V_local] logits of both heads, the log-softmax
                  over the group with differentiable all-reduces (what Megatron-style
                  vocab-parallel KD does), F.kl_div + F.cross_entropy alike
    liger         Liger-Kernel's chunked LigerFusedLinearJSDLoss (beta=0: forward KL,
                  weight_hard_loss 0.1), compiled=False; 1 rank only (no tensor
                  parallelism), when liger_kernel is installed

Peak extra memory (``benchmarks/memory.py``: ``VmHWM - VmRSS`` on CPU) of the first step,
largest rank; time: the median of the later steps. Every row also reports its loss, and
the run fails when an implementation is off ours.

    python benchmarks/bench_distillation.py            # tokens 1024, V 32768 and 131072
    python benchmarks/bench_distillation.py --quick    # tokens 128, V 4096
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from benchmarks.harness import (  # noqa: E402
    cores,
    markdown_table,
    run_children,
    script_main,
    timed_calls,
)

HIDDEN, TEACHER_HIDDEN, CE_WEIGHT = 256, 512, 0.1


def _materialised(x, w, xt, wt, y, group):
    """KD on each rank's materialised logits shards, normalised over the group."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dnn

    from vocab_parallel.parallel.layout import shard_bounds

    world = 1 if group is None else dist.get_world_size(group)

    def log_softmax(z):
        if world == 1:
            return torch.log_softmax(z, dim=-1)
        m = z.detach().max(dim=-1, keepdim=True).values
        dist.all_reduce(m, dist.ReduceOp.MAX, group=group)
        s = dnn.all_reduce((z - m).exp().sum(dim=-1, keepdim=True), group=group)
        return z - m - s.log()

    ls, lt = log_softmax(x @ w.T), log_softmax(xt @ wt.T)
    kl = (lt.exp() * (lt - ls)).sum(dim=-1)
    rank = 0 if world == 1 else dist.get_rank(group)
    lo = shard_bounds(_vocab(w, group), world)[rank][0]
    here = (y >= lo) & (y < lo + w.shape[0])
    picked = torch.where(here, ls.gather(1, (y - lo).clamp(0, w.shape[0] - 1)[:, None])[:, 0], 0)
    if world > 1:
        kl, picked = dnn.all_reduce(kl, group=group), dnn.all_reduce(picked, group=group)
    return ((1 - CE_WEIGHT) * kl - CE_WEIGHT * picked).mean()


def _vocab(w, group):
    import torch.distributed as dist

    if group is None:
        return w.shape[0]
    n = torch.tensor([w.shape[0]])
    dist.all_reduce(n, group=group)
    return int(n)


def child(case: dict) -> dict:
    import torch.distributed as dist

    import vocab_parallel as vp
    from vocab_parallel.parallel.layout import shard_bounds

    world, rank = case["world"], int(os.environ["RANK"])
    group = None
    if world > 1:
        store = dist.FileStore(case["store"], world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=900))  # fmt: skip
        group = dist.group.WORLD
    torch.set_num_threads(max(1, cores() // world))
    n, v = case["tokens"], case["vocab"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, HIDDEN, generator=g)
    w = torch.randn(v, HIDDEN, generator=g) * HIDDEN**-0.5
    xt = torch.randn(n, TEACHER_HIDDEN, generator=g)
    wt = torch.randn(v, TEACHER_HIDDEN, generator=g) * TEACHER_HIDDEN**-0.5
    y = torch.randint(0, v, (n,), generator=g)
    lo, hi = shard_bounds(v, world)[rank]
    w, wt = w[lo:hi].contiguous(), wt[lo:hi].contiguous()
    del g
    leaf = {}
    impl = case["impl"]
    if impl == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        liger = LigerFusedLinearJSDLoss(weight_hard_loss=CE_WEIGHT,
                                        weight_soft_loss=1 - CE_WEIGHT, beta=0.0,
                                        compiled=False)  # fmt: skip

    def before():
        leaf["x"] = x.clone().requires_grad_(True)
        leaf["w"] = w.clone().requires_grad_(True)

    def step():
        h, ws = leaf["x"], leaf["w"]
        if impl in ("ours", "ours_ms"):
            loss = vp.vocab_parallel_distillation_loss(
                h, ws, teacher_hidden=xt, teacher_weight=wt, target=y, process_group=group,
                hard_label_weight=CE_WEIGHT, mode="auto" if impl == "ours" else "memory_saving",
                vocab_start_index=lo, global_vocab_size=v,
            )  # fmt: skip
        elif impl == "liger":
            loss = liger(h, ws, xt, wt, y)
        else:
            loss = _materialised(h, ws, xt, wt, y, group)
        loss.backward()
        return loss.detach()

    res = timed_calls(step, torch.device("cpu"), case["repeats"], before=before,
                      keep=lambda out: float(out))  # fmt: skip
    grads = (leaf["x"].grad, leaf["w"].grad)
    extra = res["peak"].extra_bytes - sum(t.numel() * t.element_size() for t in grads)
    if group is not None:
        dist.destroy_process_group()
    return {"extra": extra, "times": res["times_s"][1:] or res["times_s"],
            "cpu": res["cpu_s"][1:] or res["cpu_s"], "loss": res["kept"]}  # fmt: skip


def parent(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tokens 128, vocab 4096")
    p.add_argument("--repeats", type=int, default=3, help="steps per row (the first: memory)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="group sizes")
    p.add_argument("--vocab", type=int, nargs="+", help="vocabularies (default 32768 131072)")
    args = p.parse_args(argv)
    tokens, vocabs = (128, [4096]) if args.quick else (1024, [32768, 131072])
    vocabs = args.vocab or vocabs
    try:
        import liger_kernel  # noqa: F401

        has_liger = True
    except ImportError:
        has_liger = False
    print(f"tokens {tokens}, student hidden {HIDDEN}, teacher hidden {TEACHER_HIDDEN}, fp32, "
          f"CPU ({cores()} cores split between the ranks), KL + {CE_WEIGHT} CE")  # fmt: skip
    if not has_liger:
        print("liger_kernel is not installed: its rows are left out")
    rows, failed = [], False
    for world in args.ranks:
        for vocab in vocabs:
            impls = ["ours", "ours_ms", "materialised"] + (["liger"] if has_liger and world == 1
                                                          else [])  # fmt: skip
            ref = None
            for impl in impls:
                case = {"impl": impl, "world": world, "tokens": tokens, "vocab": vocab,
                        "repeats": args.repeats}  # fmt: skip
                out = run_children(__file__, case, world=world, timeout=1800)
                if out["status"] != "ok":
                    rows.append([str(world), str(vocab), impl, out["status"], "", "", "", ""])
                    failed = True
                    continue
                extra = max(r["extra"] for r in out["ranks"]) / 2**20
                t = max(statistics.median(r["times"]) for r in out["ranks"])
                cpu = max(statistics.median(r["cpu"]) for r in out["ranks"])
                loss = out["ranks"][0]["loss"]
                ref = loss if ref is None else ref
                if abs(loss - ref) > 1e-4 * max(1.0, abs(ref)):
                    failed = True
                rows.append([str(world), str(vocab), impl, f"{t:.3f}", f"{extra:.0f}",
                             f"{loss:.6f}", "", f"{cpu:.3f}"])  # fmt: skip
                print(" | ".join(rows[-1][:6] + rows[-1][7:]), flush=True)
            base = {r[2]: r for r in rows if r[0] == str(world) and r[1] == str(vocab)}
            if "materialised" in base and base["materialised"][3][0].isdigit():
                m = base["materialised"]
                for r in base.values():
                    if r[3][0].isdigit():
                        r[6] = (f"{float(r[3]) / float(m[3]):.2f}x time, "
                                f"{float(r[4]) / max(1.0, float(m[4])):.2f}x memory")  # fmt: skip
    head = ["ranks", "vocab", "impl", "step s", "peak extra MiB", "loss", "vs materialised",
            "CPU s (all threads)"]  # fmt: skip
    print(markdown_table(head, rows))
    if failed:
        print("a row failed or its loss is off ours")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(script_main(parent, child))
