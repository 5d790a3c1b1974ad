"""Benchmark: RL token statistics (log-probs + entropy, forward + backward) side by side.

    python benchmarks/bench_token_stats.py             # BT=2048, H=1024, V=32768; fp32; 1, 2 ranks
    python benchmarks/bench_token_stats.py --quick     # BT=256, H=128, V=4096

Every row computes, for the same inputs (5% of the tokens ignored), the per-token
log-probs of the targets and the entropy over the global vocabulary, then the gradients
of ``sum(a * logprobs + b * entropy)`` with random per-token ``a``, ``b``:

    materialised   ``x @ W.T`` logits, ``log_softmax``, ``-(p * logp).sum``: at 2 ranks the
                   vocabulary-parallel version on materialised shards (max and sums
                   all-reduced with differentiable collectives, as verl's
                   ``vocab_parallel_entropy`` and Megatron's cross entropy do)
    ours_stats     ``vocab_parallel_token_stats(..., entropy=True)`` (memory-saving mode)
    ours_loss_ms   our loss alone, ``mode="memory_saving"`` (the same four GEMMs)
    ours_loss      our loss alone, default mode (``grad_in_forward``: three GEMMs)

Liger-Kernel 0.8.5's ``liger_fused_linear_scaled_cross_entropy_tp`` is Triton-only (CUDA);
it does not run on a CPU and has no row here (``benchmarks/implementations.py`` skips it
on CPUs likewise). Method, memory and threads as ``benchmarks/bench_loss.py``: one fresh
process per row and rank, fastest of ``--repeats`` timed calls after a warm-up, the peak
extra memory of the first (gradients included), the largest rank. The ratios are of CPU
time (the process's, all threads): steadier than wall time on a shared machine.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks import harness
from vocab_parallel import shard_bounds, vocab_parallel_linear_cross_entropy
from vocab_parallel import vocab_parallel_token_stats as token_stats

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IMPLS = ("materialised", "ours_stats", "ours_loss_ms", "ours_loss")
IGNORE = -100


def materialised(hidden, weight, y, group, lo):
    """Log-probs and entropy from this shard's materialised logits (differentiable)."""
    import torch.distributed.nn.functional as dnn

    z = (hidden @ weight.T).float()
    world = 1 if group is None else torch.distributed.get_world_size(group)
    m = z.max(dim=1, keepdim=True).values.detach()
    if world > 1:
        m = dnn.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group).detach()
    e = torch.exp(z - m)
    s = e.sum(dim=1, keepdim=True)
    ez = (e * (z - m)).sum(dim=1, keepdim=True)
    local = (y - lo).clamp(0, z.shape[1] - 1)
    here = ((y - lo) >= 0) & ((y - lo) < z.shape[1])
    picked = torch.where(here, z.gather(1, local[:, None]).squeeze(1), 0.0)
    if world > 1:
        s = dnn.all_reduce(s, group=group)
        ez = dnn.all_reduce(ez, group=group)
        picked = dnn.all_reduce(picked, group=group)
    lse = (torch.log(s) + m).squeeze(1)
    ignored = y == IGNORE
    logprobs = (picked - lse).masked_fill(ignored, 0.0)
    entropy = (torch.log(s) - ez / s).squeeze(1).masked_fill(ignored, 0.0)
    return logprobs, entropy


def run_case(case: dict) -> dict:
    rank, world = int(os.environ.get("RANK", "0")), case["world"]
    device = torch.device("cpu")
    group = None
    if world > 1:
        torch.distributed.init_process_group(
            "gloo", init_method="file://" + case["store"], rank=rank, world_size=world,
            timeout=timedelta(seconds=300),
        )  # fmt: skip
        group = torch.distributed.group.WORLD
    bt, h, v = case["bt"], case["h"], case["v"]
    gen = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(bt, h, generator=gen)
    w = torch.randn(v, h, generator=gen).mul_(2.0 / math.sqrt(h))
    y = torch.randint(0, v, (bt,), generator=gen)
    y[torch.rand(bt, generator=gen) < 0.05] = IGNORE
    a, b = torch.randn(bt, generator=gen), torch.randn(bt, generator=gen)
    lo, hi = shard_bounds(v, world)[rank]
    dt = DTYPES[case["dtype"]]
    hidden = x.to(dt).requires_grad_(True)
    weight = w[lo:hi].to(dt).clone().requires_grad_(True)
    layout = dict(process_group=group, vocab_start_index=lo, global_vocab_size=v)
    impl = case["impl"]

    def fwd_bwd():
        hidden.grad = weight.grad = None
        if impl == "materialised":
            lp, ent = materialised(hidden, weight, y, group, lo)
            out = (a * lp + b * ent).sum()
        elif impl == "ours_stats":
            stats = token_stats(hidden, weight, y, entropy=True, **layout)
            out = (a * stats.logprobs + b * stats.entropy).sum()
        else:
            mode = "memory_saving" if impl == "ours_loss_ms" else "auto"
            out = vocab_parallel_linear_cross_entropy(hidden, weight, y, mode=mode, **layout)
        out.backward()
        return out

    def before():
        hidden.grad = weight.grad = None
        if group is not None:
            torch.distributed.barrier(group)

    fwd_bwd()
    res = harness.timed_calls(fwd_bwd, device, case["repeats"], before=before,
                              keep=lambda out: float(out.detach()))  # fmt: skip
    if group is not None:
        torch.distributed.destroy_process_group()
    return {"times_s": res["times_s"], "cpu_s": res["cpu_s"],
            "peak_bytes": res["peak"].extra_bytes, "value": res["kept"],
            "threads": torch.get_num_threads()}  # fmt: skip


def parent(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    harness.add_common_args(p, DTYPES, "timed calls after the warm-up (default 3)")
    p.add_argument("--bt", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--worlds", nargs="+", type=int, choices=(1, 2), default=[1, 2])
    args = p.parse_args(argv)
    if args.dtypes == ["fp32", "bf16"]:
        args.dtypes = ["fp32"]
    args = harness.fill_defaults(
        args, bt=(2048, 256), hidden=(1024, 128), vocab=(32768, 4096), repeats=(3, 2)
    )
    t_start = time.perf_counter()
    harness.print_load_before()
    print(f"# BT={args.bt} H={args.hidden} V={args.vocab}, log-probs + entropy, fwd+bwd")
    rows = []
    for dtype in args.dtypes:
        for world in args.worlds:
            base = {}
            for impl in IMPLS:
                case = dict(impl=impl, dtype=dtype, world=world, bt=args.bt, h=args.hidden,
                            v=args.vocab, seed=args.seed, repeats=args.repeats,
                            threads=harness.threads_per_rank(world, False))  # fmt: skip
                res = harness.run_children(__file__, case, world, timeout=1800)
                harness.print_progress(f"{impl} {dtype} x{world}: {res['status']}", t_start)
                if res["status"] != "ok":
                    rows.append([impl, dtype, str(world), res["status"], "", "", "", ""])
                    continue
                ranks = res["ranks"]
                best = min(max(r["times_s"][i] for r in ranks) for i in range(args.repeats))
                cpu = min(max(r["cpu_s"][i] for r in ranks) for i in range(args.repeats))
                peak = max(r["peak_bytes"] for r in ranks) / 2**20
                base[impl] = cpu
                rows.append([impl, dtype, str(world), f"{best * 1e3:.0f}", f"{cpu * 1e3:.0f}",
                             f"{peak:.0f}", f"{ranks[0]['value']:.6g}", ""])  # fmt: skip
            for row in rows[-len(IMPLS) :]:
                if row[0] in base and "ours_stats" in base:
                    row[7] = f"{base['ours_stats'] / base[row[0]]:.2f}"
    head = ["impl", "dtype", "ranks", "wall ms (best)", "CPU ms (best)", "peak extra MiB",
            "value", "ours_stats / this (CPU)"]  # fmt: skip
    print(harness.markdown_table(head, rows))
    harness.print_load_after(t_start)
    return 0


if __name__ == "__main__":
    sys.exit(harness.script_main(parent, run_case))
