"""Benchmark: our loss on a DTensor weight against torch's ``loss_parallel()``.

Both start from the same torch-native tensor-parallel model: an output projection
``nn.Linear(H, V, bias=False)`` parallelised with ``ColwiseParallel`` on a 1-D DeviceMesh
(the weight a ``Shard(0)`` DTensor), replicated hidden states ``[BT, H]`` and targets
(5% ignored), mean cross entropy, forward + backward:

    ours_ms        vocab_parallel.integrations.torch_tp.head_from_colwise(output)(hidden, target),
                   mode="memory_saving" (no [BT, V/world] logits kept)
    ours_hp        the same, mode="high_performance" (keeps the fp32 softmax shard)
    loss_parallel  ColwiseParallel(output_layouts=Shard(-1), use_local_output=False): the
                   logits are a [BT, V] DTensor sharded by vocabulary, then
                   F.cross_entropy under torch.distributed.tensor.parallel.loss_parallel()

    python benchmarks/bench_dtensor.py            # BT=2048, H=1024, V=32768, 2 ranks, fp32
    python benchmarks/bench_dtensor.py --quick    # BT=256, H=128, V=4096

Method and memory as ``bench_loss.py`` (``benchmarks/harness.py``): one fresh group of
processes per implementation (gloo over a FileStore), one warm-up, then the fastest of
``--repeats`` calls (of the slowest rank); peak extra memory of the first timed call
(``benchmarks/memory.py``: ``VmHWM - VmRSS`` on CPU, ``max_memory_allocated`` on CUDA),
largest rank, INCLUDING the gradients of hidden and of the weight shard. Every rank also
computes the fp32 reference loss (before the measured calls, in chunks of tokens) and
the run fails when a loss is off it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from datetime import timedelta

# Run as a script, Python puts benchmarks/ on sys.path: put the repository root there too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

from benchmarks import harness

IGNORE = -100
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IMPLS = {
    "ours_ms": "ours, DTensor weight, memory_saving",
    "ours_hp": "ours, DTensor weight, high_performance",
    "loss_parallel": "torch loss_parallel() on DTensor logits",
}
LOSS_TOL = {"fp32": 1e-4, "bf16": 2e-2}  # relative, against the fp32 reference


def reference_loss(x, w, y, chunk: int = 256) -> float:
    """fp32 mean cross entropy of ``x @ w.T`` in chunks of tokens (little memory)."""
    total, count = 0.0, int((y != IGNORE).sum())
    with torch.no_grad():
        for i in range(0, x.shape[0], chunk):
            logits = F.linear(x[i : i + chunk].float(), w.float())
            total += float(F.cross_entropy(logits, y[i : i + chunk], reduction="sum"))
    return total / max(count, 1)


def run_case(case: dict) -> dict:
    """One rank of one implementation: warm-up, then timed and measured fwd+bwd calls."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    from vocab_parallel.integrations.torch_tp import head_from_colwise

    rank, world = int(os.environ["RANK"]), case["world"]
    device = torch.device(case["device"])
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method="file://" + case["store"],
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=case["coll_timeout"]),
    )
    mesh = init_device_mesh(device.type, (world,))

    bt, h, v = case["bt"], case["h"], case["v"]
    gen = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(bt, h, generator=gen)
    w = torch.randn(v, h, generator=gen).mul_(2.0 / math.sqrt(h))
    y = torch.randint(0, v, (bt,), generator=gen)
    y[torch.rand(bt, generator=gen) < 0.05] = IGNORE
    dt = DTYPES[case["dtype"]]
    ref = reference_loss(x.to(dt), w.to(dt), y)  # the inputs as the implementations see them

    model = nn.Module()
    model.output = nn.Linear(h, v, bias=False, dtype=dt, device=device)
    with torch.no_grad():
        model.output.weight.copy_(w.to(dt))
    impl = case["impl"]
    if impl == "loss_parallel":
        style = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    else:
        style = ColwiseParallel()
    parallelize_module(model, mesh, {"output": style})
    weight = model.output.weight
    hidden = x.to(dt).to(device).requires_grad_(True)
    target = y.to(device)
    del x, w

    if impl == "loss_parallel":

        def loss_fn():
            with loss_parallel():
                logits = model.output(hidden)
                loss = F.cross_entropy(logits, target, ignore_index=IGNORE)
                loss.backward()
            return loss.to_local()

    else:
        mode = "high_performance" if impl == "ours_hp" else "memory_saving"
        backend = "triton" if device.type == "cuda" else "torch"
        head = head_from_colwise(model.output, mode=mode, backend=backend)

        def loss_fn():
            loss = head(hidden, target)
            loss.backward()
            return loss

    def before():
        hidden.grad = weight.grad = None  # the last call's gradients are not in the peak
        dist.barrier()

    def keep(loss):
        grads = harness.nbytes((hidden.grad, weight.grad.to_local()))
        return float(loss.detach()), grads

    loss_fn()  # warm-up
    res = harness.timed_calls(loss_fn, device, case["repeats"], before=before, keep=keep)
    dist.destroy_process_group()
    loss_value, grads = res["kept"]
    return {
        "rank": rank,
        "times_s": res["times_s"],
        "peak_bytes": res["peak"].extra_bytes,
        "mem_method": res["peak"].method,
        "grads_bytes": grads,
        "loss": loss_value,
        "ref": ref,
        "threads": torch.get_num_threads(),
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Time and peak memory: ours on a DTensor weight vs torch's loss_parallel().",
        epilog="Defaults: BT=2048 H=1024 V=32768; --quick: BT=256 H=128 V=4096.",
    )
    harness.add_common_args(p, DTYPES, "timed calls after the warm-up (CPU 3, CUDA 10)")
    p.set_defaults(dtypes=["fp32"])
    p.add_argument("--bt", type=int, help="tokens (default 2048; --quick 256)")
    p.add_argument("--hidden", type=int, help="hidden size H (default 1024; --quick 128)")
    p.add_argument("--vocab", type=int, help="global vocabulary V (default 32768; --quick 4096)")
    p.add_argument("--world", type=int, default=2, help="ranks of the mesh (default 2)")
    p.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per process group")
    args = p.parse_args(argv)
    return harness.fill_defaults(args, bt=(2048, 256), hidden=(1024, 128), vocab=(32768, 4096))


def main(argv=None) -> int:
    args = parse_args(argv)
    name, where = harness.pick_device(args.device)
    cuda = name == "cuda"
    repeats = args.repeats or (10 if cuda else 3)
    print(f"# bench_dtensor: {name} ({where}), torch {torch.__version__}")
    print(
        f"# BT={args.bt} H={args.hidden} V={args.vocab}, {args.world} ranks (1-D DeviceMesh, "
        f"weight Shard(0)); fastest of {repeats} fwd+bwd calls after a warm-up"
    )
    load_before = harness.print_load_before()
    base = {"device": name, "bt": args.bt, "h": args.hidden, "v": args.vocab, "seed": args.seed}
    base |= {"repeats": repeats, "world": args.world, "coll_timeout": max(60, int(args.timeout))}
    base |= {"threads": harness.threads_per_rank(args.world, cuda)}
    rows, failures, t_start = [], [], time.perf_counter()
    for dtype in args.dtypes:
        for impl in args.impls:
            case = base | {"impl": impl, "dtype": dtype}
            res = harness.run_children(__file__, case, args.world, args.timeout)
            row = {"impl": impl, "dtype": dtype, "status": res["status"]}
            if res["status"] == "ok":
                ranks = res["ranks"]
                per_call = [max(t) for t in zip(*(r["times_s"] for r in ranks), strict=True)]
                ref = ranks[0]["ref"]
                row |= {
                    "time_s": min(per_call),
                    "peak_mib": max(r["peak_bytes"] for r in ranks) / harness.MIB,
                    "grads_mib": max(r["grads_bytes"] for r in ranks) / harness.MIB,
                    "loss": ranks[0]["loss"],
                    "rel_err": abs(ranks[0]["loss"] - ref) / abs(ref),
                    "method": ranks[0]["mem_method"],
                }
                if row["rel_err"] > LOSS_TOL[dtype] or len({r["loss"] for r in ranks}) > 1:
                    failures.append(f"{impl} {dtype}: loss {row['loss']} vs reference {ref}")
            rows.append(row)
            shown = f"{row['time_s'] * 1e3:.0f} ms" if res["status"] == "ok" else ""
            harness.print_progress(f"{impl} {dtype}: {res['status']} {shown}", t_start)
    harness.print_load_after(t_start)

    lp = [r for r in rows if r["impl"] == "loss_parallel" and r["status"] == "ok"]
    base_time = {r["dtype"]: r["time_s"] for r in lp}
    table = []
    for r in rows:
        if r["status"] != "ok":
            table.append([IMPLS[r["impl"]], r["dtype"], r["status"], "", "", ""])
            continue
        ratio = r["time_s"] / base_time[r["dtype"]] if r["dtype"] in base_time else float("nan")
        table.append(
            [
                IMPLS[r["impl"]],
                r["dtype"],
                f"{r['time_s'] * 1e3:.0f}",
                f"{ratio:.2f}",
                f"{r['peak_mib']:.0f} (grads {r['grads_mib']:.0f})",
                f"{r['rel_err']:.1e}",
            ]
        )
    print()
    head = ["implementation", "dtype", "ms / fwd+bwd", "time / loss_parallel"]
    head += ["peak extra MiB per rank", "loss rel. err"]
    print(harness.markdown_table(head, table))
    method = next((r["method"] for r in rows if "method" in r), "?")
    print(f"\nMemory: {method}, largest rank, gradients included.")
    info = {"args": vars(args), "device": where, "load_before": load_before}
    harness.write_json(args.json, info | {"rows": rows})
    if failures:
        print("\nLOSS MISMATCH against the fp32 reference:\n" + "\n".join(failures))
    broken = [f"{r['impl']} {r['dtype']}: {r['status']}" for r in rows if r["status"] != "ok"]
    if broken:
        print("\nDid not run:\n" + "\n".join(broken))
    return 1 if failures or broken else 0


if __name__ == "__main__":
    sys.exit(harness.script_main(main, run_case))
