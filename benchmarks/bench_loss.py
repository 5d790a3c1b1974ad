"""Benchmark: the vocabulary-parallel loss (forward + backward) side by side with others.

Every implementation (``benchmarks/implementations.py`` lists them: ours in both modes,
naive, ``F.linear_cross_entropy``, DeepSpeed, Megatron, Liger, CCE) computes the mean
cross entropy of ``hidden @ W.T`` against ``target`` (5% of the tokens ignored) and its
gradients, on the same inputs:

    python benchmarks/bench_loss.py            # BT=2048, H=1024, V=32768; fp32, bf16; 1, 2 ranks
    python benchmarks/bench_loss.py --quick    # BT=256, H=128, V=4096 (a smoke run)

A package that is not installed is reported as such; the run goes on. DeepSpeed and
megatron-core are not dependencies of this project: install them into a separate venv to
compare (``DS_BUILD_OPS=0 pip install deepspeed megatron-core``, with torch pinned).

Method
    One fresh process per implementation, dtype and world size (the ranks of a group are
    separate processes joined by gloo over a FileStore, ``GLOO_SOCKET_IFNAME=lo``, with
    collective timeouts; NCCL on CUDA, one GPU per rank). The CPU cores are split between
    the ranks: one rank uses them all, two ranks on two cores get one thread each. Each
    process builds the full problem from a seed, keeps its shard of ``W``
    (``vocab_parallel.shard_bounds``), runs one warm-up forward + backward, then
    ``--repeats`` timed ones (ranks start each call together after a barrier); the table
    shows the fastest call (for several ranks, of the slowest rank per call). A whole
    group gets ``--timeout`` seconds, then it is killed and reported as "timeout".

    ``--in-process`` (the GPU check's mode: a fresh CUDA process costs seconds of start-up
    and inputs per row) runs the 1-rank rows of a dtype in ONE process instead, one after
    another on the same inputs, each with its own warm-up and timed calls, memory freed
    between them (on CUDA ``empty_cache`` and the peak statistics reset). That process also
    computes the reference losses and measures "the floor": the three GEMMs a fused linear
    cross entropy needs (``x @ W.T``, ``G @ W``, ``G.T @ x``, ``G`` random in the input
    dtype) as plain ``torch.mm`` calls, before and after the implementations (the faster);
    the table gets a "floor" row and an "x floor" column (time / floor). An implementation
    that fails is its row's status and the next one runs; ``--timeout`` is the whole
    process's, and the rows it did not reach read "timeout". 2-rank rows still run as
    process groups of their own.

Memory
    Peak extra memory of the first timed forward + backward beyond the inputs (hidden,
    W shard, target) with ``benchmarks.memory.PeakMemory``: on CPU the peak RSS during
    the call minus the RSS before it (free heap handed back first), on CUDA
    ``max_memory_allocated`` minus allocated before. The gradients ``hidden.grad`` and
    ``weight.grad`` (same size for everyone) are INCLUDED, and so is everything an
    implementation creates in the call (Megatron's logits too). For several ranks: the
    largest rank.

Correctness
    The naive fp32 process (``--in-process``: each dtype's process) also computes the
    reference losses: fp32 on the fp32 inputs, and fp32 on the bf16-rounded inputs (the
    reference for bf16 rows). Every row shows its
    loss difference from the matching reference and fails the run beyond tolerance.

Targets (issue 3; CPU, fp32, 1 rank): memory-saving mode no slower than DeepSpeed's
chunked version and no more extra memory; high-performance mode within 10% of naive's
time. Printed as PASS/FAIL lines under the table (``benchmarks/loss_report.py``).
Times are compared as measured: rerun on an idle machine.

The default run takes about 6 minutes on 2 idle CPU cores (bf16 competitors included);
``--no-bf16-competitors`` skips the competitors' bf16 rows (ours and naive only) and
``--dtypes fp32`` all of bf16, for a busy machine.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time

# Run as a script, Python puts benchmarks/ on sys.path: put the repository root there too,
# for ``benchmarks`` and for ``vocab_parallel`` from this checkout.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

from benchmarks import harness, loss_report
from benchmarks.implementations import (
    DEFAULT_IMPLS,
    IGNORE,
    IMPLS,
    OURS,
    init_distributed,
    make_loss,
    needs_process_group,
    skip_reason,
)
from vocab_parallel import shard_bounds

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ----------------------------------------------------------------------------- the child


def make_inputs(case: dict, rank: int, world: int, device: torch.device):
    """The full problem from the seed; this rank keeps its shard of ``W``."""
    bt, h, v = case["bt"], case["h"], case["v"]
    gen = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(bt, h, generator=gen)
    w = torch.randn(v, h, generator=gen).mul_(2.0 / math.sqrt(h))  # logits of a few units
    y = torch.randint(0, v, (bt,), generator=gen)
    y[torch.rand(bt, generator=gen) < 0.05] = IGNORE
    lo, hi = shard_bounds(v, world)[rank]
    dt = DTYPES[case["dtype"]]
    x_in = x.to(dt).to(device)
    w_in = w[lo:hi].to(dt).to(device, copy=True)
    return x_in, w_in, y.to(device), (lo, hi), (x, w)


def reference_losses(x, w, y, full, device) -> dict:
    """Naive fp32 losses on the inputs and on their bf16-rounded copies (``full``)."""
    with torch.no_grad():
        ref = {"fp32": F.cross_entropy(F.linear(x, w), y, ignore_index=IGNORE).item()}
        xb, wb = (t.to(torch.bfloat16).float().to(device) for t in full)
        ref["bf16"] = F.cross_entropy(F.linear(xb, wb), y, ignore_index=IGNORE).item()
    return ref


def gemm_baseline(x: torch.Tensor, w: torch.Tensor, device: torch.device, repeats: int) -> float:
    """Seconds of the three plain GEMMs of this shape (``x @ W.T``, ``G @ W``, ``G.T @ x``
    with ``G`` ``[BT, V_local]`` in the input dtype; cuBLAS on CUDA, MKL/oneDNN on CPUs),
    fastest of ``repeats``: what grad_in_forward's three GEMMs would take as single calls."""
    with torch.no_grad():
        g = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=device).normal_()

        def three():
            torch.mm(x, w.t())
            torch.mm(g, w)
            torch.mm(g.t(), x)

        three()  # warm-up
        best = harness.timed_calls(three, device, repeats)["times_s"]
    return min(best)


def measure(loss_fn, hidden, weight, device, repeats: int, barrier=lambda: None) -> dict:
    """One warm-up forward + backward of ``loss_fn(hidden, weight)``, then ``repeats`` timed
    ones (the first also measures the peak memory); ranks start each call together."""

    def fwd_bwd():
        hidden.grad = weight.grad = None
        loss = loss_fn(hidden, weight)
        loss.backward()
        return loss

    def before():
        hidden.grad = weight.grad = None  # the last call's gradients are not in the peak
        barrier()

    def keep(loss):
        return loss.item(), harness.nbytes((hidden.grad, weight.grad))

    fwd_bwd()  # warm-up: library set-up, thread pools, compilation
    res = harness.timed_calls(fwd_bwd, device, repeats, before=before, keep=keep)
    peak, (loss_value, grads) = res["peak"], res["kept"]
    return {
        "times_s": res["times_s"],
        "peak_bytes": peak.extra_bytes,
        "mem_method": peak.method,
        "grads_bytes": grads,
        "loss": loss_value,
        "threads": torch.get_num_threads(),
    }


def run_case(case: dict) -> dict:
    """One rank of one implementation: warm-up, then timed and measured fwd+bwd calls
    (every implementation of ``case["impls"]`` in this one process: ``run_in_process``)."""
    if "impls" in case:
        return run_in_process(case)
    rank, world = int(os.environ.get("RANK", "0")), case["world"]
    device = torch.device(case["device"])
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)

    group = None
    if needs_process_group(case["impl"], world):
        group = init_distributed(case, rank, device)
    barrier = (lambda: torch.distributed.barrier(group)) if world > 1 else (lambda: None)

    x, w, y, bounds, full = make_inputs(case, rank, world, device)
    ref = {}
    if case["impl"] == "naive" and case["dtype"] == "fp32":
        ref = reference_losses(x, w, y, full, device)  # every row is compared with these
    del full
    hidden = x.requires_grad_(True)
    weight = w.requires_grad_(True)
    loss_fn = make_loss(case["impl"], case, y, bounds, group, device)
    res = measure(loss_fn, hidden, weight, device, case["repeats"], barrier)
    gemms_s = None
    if case["impl"] == "ours_gif" and world == 1 and case.get("gemm_baseline", True):
        gemms_s = gemm_baseline(hidden.detach(), weight.detach(), device, case["repeats"])
    if group is not None:
        torch.distributed.destroy_process_group()
    return {"rank": rank} | res | {"ref": ref, "gemms_s": gemms_s}


def free_memory(device: torch.device) -> None:
    """Between two implementations in one process: drop what the last one left behind."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run_one(impl: str, case: dict, inputs, group, device: torch.device) -> dict:
    """One implementation in the shared process, on the shared inputs (new leaves of the
    same storage); its failure is its row's status, and the memory is freed after it."""
    x, w, y, bounds = inputs
    hidden = x.detach().requires_grad_(True)
    weight = w.detach().requires_grad_(True)
    try:
        loss_fn = make_loss(impl, case | {"impl": impl}, y, bounds, group, device)
        res = measure(loss_fn, hidden, weight, device, case["repeats"])
    except Exception as exc:  # reported in its row; the others still run
        res = {"error": f"error: {type(exc).__name__}: {exc}".splitlines()[0][:120]}
    loss_fn = hidden = weight = None
    free_memory(device)
    return res


def run_in_process(case: dict) -> dict:
    """Every implementation of ``case["impls"]`` (1 rank) one after another in this process,
    on the same inputs, each with its own warm-up and timed calls; the reference losses and
    the floor (``gemm_baseline``, before and after them: the faster) measured here too. A
    partial result is reported after each implementation (``harness.report_partial``)."""
    device = torch.device(case["device"])
    if device.type == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    x, w, y, bounds, full = make_inputs(case, 0, 1, device)
    ref = reference_losses(full[0].to(device), full[1].to(device), y, full, device)
    del full
    free_memory(device)
    floor_s = gemm_baseline(x, w, device, case["repeats"])
    grouped = [i for i in case["impls"] if needs_process_group(i, 1)]
    group = init_distributed(case, 0, device, case["impls"]) if grouped else None
    out = {"in_process": True, "ref": ref, "floor_s": floor_s, "impls": {}, "complete": False}
    for impl in case["impls"]:
        out["impls"][impl] = run_one(impl, case, (x, w, y, bounds), group, device)
        harness.report_partial(out)
    out["floor_s"] = min(floor_s, gemm_baseline(x, w, device, case["repeats"]))
    if group is not None:
        torch.distributed.destroy_process_group()
    return out | {"complete": True}


# ----------------------------------------------------------------------------- the parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Time and peak memory of the vocab-parallel loss (fwd+bwd) vs others.",
        epilog="Defaults: BT=2048 H=1024 V=32768; --quick: BT=256 H=128 V=4096.",
    )
    harness.add_common_args(p, DTYPES, "timed calls after the warm-up (CPU 3, CUDA 10)")
    p.add_argument("--bt", type=int, help="tokens (default 2048; --quick 256)")
    p.add_argument("--hidden", type=int, help="hidden size H (default 1024; --quick 128)")
    p.add_argument("--vocab", type=int, help="global vocabulary V (default 32768; --quick 4096)")
    p.add_argument("--worlds", nargs="+", type=int, choices=(1, 2), default=[1, 2])
    p.add_argument(
        "--impls", nargs="+", choices=list(IMPLS), default=DEFAULT_IMPLS,
        help="implementations (default: all but deepspeed_dflt); naive always runs",
    )  # fmt: skip
    p.add_argument(
        "--no-bf16-competitors", dest="bf16_competitors", action="store_false",
        help="bf16 rows for ours and naive only (saves several minutes on a CPU)",
    )  # fmt: skip
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per process group")
    p.add_argument("--ds-chunk", type=int, default=512, help="DeepSpeed chunk_size on CPU")
    p.add_argument(
        "--in-process", action="store_true",
        help="the 1-rank rows of each dtype in ONE process (--timeout for all of them), "
        "the floor (the three GEMMs as torch.mm calls) measured in it: an 'x floor' column",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.in_process and 1 not in args.worlds:
        p.error("--in-process: runs the 1-rank rows in one process; --worlds must include 1")
    return harness.fill_defaults(args, bt=(2048, 256), hidden=(1024, 128), vocab=(32768, 4096))


def plan(args, dtypes: list[str], impls: list[str]):
    """``(impl, world, dtype)`` of every row, in table order."""
    for dtype in dtypes:
        for world in sorted(args.worlds):
            for impl in impls:
                if world not in IMPLS[impl][1]:
                    continue
                if dtype not in args.dtypes and not (impl == "naive" and world == 1):
                    continue
                yield impl, world, dtype


def check_losses(rows: list[dict], refs: dict) -> list[str]:
    """Mark the rows whose loss is off the matching reference; one line per such row."""
    failures = []
    for r in rows:
        if r["status"] == "ok" and r["dtype"] in refs:
            ref = refs[r["dtype"]]
            if abs(r["loss"] - ref) > loss_report.LOSS_TOL[r["dtype"]] * abs(ref):
                r["mismatch"] = True
                failures.append(f"{r['impl']} {r['world']} rank(s) {r['dtype']}: {r['loss']}")
    return failures


def run_separately(args, base: dict, todo: list, cuda: bool, env: dict, t_start) -> list[dict]:
    """Each ``(impl, world, dtype)`` of ``todo`` in its own fresh process(es)."""
    rows = []
    for impl, world, dtype in todo:
        row = {"impl": impl, "world": world, "dtype": dtype}
        reason = skip_reason(impl, world, dtype, args.bf16_competitors, cuda)
        if reason:
            rows.append(row | {"status": reason, "skipped": True})
            continue
        case = base | row | {"threads": harness.threads_per_rank(world, cuda)}
        res = harness.run_children(__file__, case, world, args.timeout, env)
        if res["status"] == "ok":
            res = loss_report.summarise(res)
        rows.append(row | res)
        shown = f"{res['time_s'] * 1e3:.0f} ms" if res["status"] == "ok" else ""
        harness.print_progress(f"{impl} {world} rank(s) {dtype}: {res['status']} {shown}", t_start)
    return rows


def run_together(args, base: dict, todo: list, cuda: bool, env: dict, t_start):
    """``--in-process``: the 1-rank rows of ``todo`` of each dtype in one process
    (``run_in_process``). Returns the rows, the reference losses and the floors (seconds)
    by dtype. A row its process did not reach (timeout, crash) gets the process's status."""
    rows, refs, floors = [], {}, {}
    for dtype in dict.fromkeys(d for _, _, d in todo):
        mine = [{"impl": i, "world": 1, "dtype": dtype} for i, _, d in todo if d == dtype]
        for row in mine:
            reason = skip_reason(row["impl"], 1, dtype, args.bf16_competitors, cuda)
            if reason:
                row |= {"status": reason, "skipped": True}
        runnable = [r["impl"] for r in mine if not r.get("skipped")]
        case = base | {"dtype": dtype, "world": 1, "impl": "in-process", "impls": runnable}
        case |= {"threads": harness.threads_per_rank(1, cuda)}
        res = harness.run_children(__file__, case, 1, args.timeout, env)
        child = res.get("ranks", [{}])[0]
        lost = "error: its process ended early" if res["status"] == "ok" else res["status"]
        for row in mine:
            got = child.get("impls", {}).get(row["impl"])
            if row.get("skipped"):
                continue
            if got is None or "error" in got:
                row["status"] = lost if got is None else got["error"]
            else:
                got |= {"rank": 0, "ref": {}, "gemms_s": child["floor_s"]}
                row |= loss_report.summarise({"status": "ok", "ranks": [got]})
            shown = f" {row['time_s'] * 1e3:.0f} ms" if row["status"] == "ok" else ""
            what = f"{row['impl']} 1 rank(s) {dtype}, in one process: {row['status']}{shown}"
            harness.print_progress(what, t_start)
        if "ref" in child:
            refs[dtype], floors[dtype] = child["ref"][dtype], child["floor_s"]
        rows += mine
    return rows, refs, floors


def main(argv=None) -> int:
    args = parse_args(argv)
    name, where = harness.pick_device(args.device)
    cuda = name == "cuda"
    repeats = args.repeats or (10 if cuda else 3)
    impls = ["naive"] + [i for i in IMPLS if i in args.impls and i != "naive"]
    how = "the 1-rank ones of a dtype in one process" if args.in_process else "per process group"
    print(f"# bench_loss: {name} ({where}), torch {torch.__version__}, python {sys.executable}")
    print(
        f"# BT={args.bt} H={args.hidden} V={args.vocab}; fastest of {repeats} fwd+bwd calls "
        f"after a warm-up; {args.timeout:.0f} s {how}"
    )
    load_before = harness.print_load_before()
    base = {"device": name, "bt": args.bt, "h": args.hidden, "v": args.vocab}
    base |= {"repeats": repeats, "seed": args.seed, "ds_chunk": args.ds_chunk}
    base |= {"coll_timeout": max(60, int(args.timeout))}
    dtypes = [d for d in DTYPES if d in args.dtypes]
    if "fp32" not in dtypes and not args.in_process:
        dtypes = ["fp32"] + dtypes  # the naive fp32 run gives the reference losses
    env = {"DS_ACCELERATOR": "cuda" if cuda else "cpu"}
    t_start = time.perf_counter()
    todo = list(plan(args, dtypes, impls))
    together = [t for t in todo if args.in_process and t[1] == 1]
    rows, refs, floors = run_together(args, base, together, cuda, env, t_start)
    rows += run_separately(args, base, [t for t in todo if t not in together], cuda, env, t_start)
    rows.sort(key=lambda r: todo.index((r["impl"], r["world"], r["dtype"])))  # table order
    harness.print_load_after(t_start)

    naive = {r["dtype"]: r for r in rows if r["impl"] == "naive" and r["status"] == "ok"}
    if not args.in_process:
        refs = naive["fp32"]["ranks"][0]["ref"] if "fp32" in naive else {}
    failures = check_losses(rows, refs)
    shown = [r for r in rows if r["dtype"] in args.dtypes]
    print()
    naive_s = {d: n["time_s"] for d, n in naive.items()}
    print(loss_report.table(shown, naive_s, refs, floors if args.in_process else None))
    print()
    chunk = args.ds_chunk if not cuda else "default"
    print(loss_report.legend(rows, repeats, chunk, args.in_process))
    print()
    if cuda:
        print("Targets (issues 3 and 10) are defined for CPUs; figures on CUDA:")
    else:
        print("Targets (issue 3: CPU, fp32, 1 rank; issue 10: grad_in_forward):")
    for line in loss_report.targets(rows):
        print("  " + line)
    for line in loss_report.gemm_throughput(rows, args.bt, args.hidden, args.vocab):
        print(line)
    info = {"args": vars(args), "device": where, "load_before": load_before, "floors_s": floors}
    harness.write_json(args.json, info | {"rows": rows})
    broken = [
        f"{r['impl']} {r['world']} rank(s) {r['dtype']}: {r['status']}"
        for r in rows
        if r["impl"] in (*OURS, "naive") and r["status"] != "ok" and not r.get("skipped")
    ]  # a row skipped for a reason (2 ranks on 1 GPU: "needs 2 GPUs") is not broken
    if failures:
        print("\nLOSS MISMATCH against the naive fp32 reference:")
        print("\n".join(failures))
    if broken:
        print("\nOurs or naive did not run:")
        print("\n".join(broken))
    return 1 if failures or broken else 0


if __name__ == "__main__":
    sys.exit(harness.script_main(main, run_case))
