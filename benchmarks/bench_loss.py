"""Benchmark: the vocabulary-parallel loss (forward + backward) side by side with others.

Every implementation computes the mean cross entropy of ``hidden @ W.T`` against
``target`` (5% of the tokens ignored) and its gradients, on the same inputs:

    ours_ms          vocab_parallel_linear_cross_entropy(mode="memory_saving")
    ours_hp          vocab_parallel_linear_cross_entropy(mode="high_performance")
                     (backend "torch" on CPU, "triton" on CUDA)
    naive            F.cross_entropy(F.linear(x, W), y), full [BT, V] logits (1 rank)
    torch_lce_auto   F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())
    torch_lce_512    the same with batch_chunk_size=512, chunking_method=None (1 rank)
    deepspeed        deepspeed.sequence.linear_cross_entropy.vocab_parallel_linear_cross_entropy
                     with chunk_size=512 on CPU (its default gives tiny chunks there)
    deepspeed_dflt   the same with its default chunk_size (1 rank)
    megatron         megatron.core vocab_parallel_cross_entropy on materialised logits
                     F.linear(x, W_local) (no ignore_index: masked and averaged here)
    liger, cce       Liger-Kernel / Cut Cross-Entropy fused linear CE (CUDA only, 1 rank)

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
    process builds the full problem from a seed, keeps its contiguous shard of ``W``, runs
    one warm-up forward + backward, then ``--repeats`` timed ones (ranks start each call
    together after a barrier); the table shows the fastest call (for several ranks, of the
    slowest rank per call). A whole group gets ``--timeout`` seconds, then it is killed
    and reported as "timeout".

Memory
    Peak extra memory of the first timed forward + backward beyond the inputs (hidden,
    W shard, target) with ``vocab_parallel.memory.PeakMemory``: on CPU the peak RSS during
    the call minus the RSS before it (free heap handed back first), on CUDA
    ``max_memory_allocated`` minus allocated before. The gradients ``hidden.grad`` and
    ``weight.grad`` (same size for everyone) are INCLUDED, and so is everything an
    implementation creates in the call (Megatron's logits too). For several ranks: the
    largest rank.

Correctness
    The naive fp32 process also computes the reference losses: fp32 on the fp32 inputs,
    and fp32 on the bf16-rounded inputs (the reference for bf16 rows). Every row shows its
    loss difference from the matching reference and fails the run beyond tolerance.

Targets (issue 3; CPU, fp32, 1 rank): memory-saving mode no slower than DeepSpeed's
chunked version and no more extra memory; high-performance mode within 10% of naive's
time. Printed as PASS/FAIL lines under the table; peaks within ``MEM_TIE`` (1 MiB: the
resolution of RSS measurements, ranks doing identical work differ by ~0.1 MiB) count as a
tie, i.e. "no more". Times are compared as measured: rerun on an idle machine.

The default run takes about 6 minutes on 2 idle CPU cores (bf16 competitors included);
``--no-bf16-competitors`` skips the competitors' bf16 rows (ours and naive only) and
``--dtypes fp32`` all of bf16, for a busy machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MIB = 1024 * 1024
RESULT = "BENCH-RESULT "
IGNORE = -100
OURS = ("ours_ms", "ours_hp")
# name: (description, world sizes it runs at, modules it needs)
IMPLS = {
    "naive": ("F.cross_entropy(F.linear)", (1,), ()),
    "ours_ms": ("ours memory_saving", (1, 2), ()),
    "ours_hp": ("ours high_performance", (1, 2), ()),
    "torch_lce_auto": ("F.linear_cross_entropy chunking=auto", (1,), ()),
    "torch_lce_512": ("F.linear_cross_entropy batch_chunk=512", (1,), ()),
    "deepspeed": ("DeepSpeed vp_linear_ce", (1, 2), ("deepspeed",)),
    "deepspeed_dflt": ("DeepSpeed vp_linear_ce default chunks", (1,), ("deepspeed",)),
    "megatron": ("Megatron vp_cross_entropy(logits)", (1, 2), ("megatron.core",)),
    "liger": ("Liger fused linear CE", (1,), ("liger_kernel",)),
    "cce": ("Cut Cross-Entropy", (1,), ("cut_cross_entropy",)),
}
CUDA_ONLY = ("liger", "cce")
DEFAULT_IMPLS = [k for k in IMPLS if k != "deepspeed_dflt"]
# Relative loss difference allowed against the matching naive fp32 reference. bf16 rows
# differ from it by the rounding of their bf16 logits (ours and DeepSpeed: fp32 logits).
LOSS_TOL = {"fp32": 1e-4, "bf16": 2e-2}
MEM_TIE = 1 * MIB  # peak differences below this are measurement noise


# ----------------------------------------------------------------------------- the child


def _project():
    """Import ``vocab_parallel`` (from the checkout when it is not installed)."""
    try:
        import vocab_parallel.memory
    except ImportError:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import vocab_parallel.memory
    return vocab_parallel


def make_inputs(case: dict, rank: int, world: int, device: torch.device):
    """The full problem from the seed; this rank keeps its contiguous shard of ``W``."""
    bt, h, v = case["bt"], case["h"], case["v"]
    gen = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(bt, h, generator=gen)
    w = torch.randn(v, h, generator=gen).mul_(2.0 / math.sqrt(h))  # logits of a few units
    y = torch.randint(0, v, (bt,), generator=gen)
    y[torch.rand(bt, generator=gen) < 0.05] = IGNORE
    lo, hi = v * rank // world, v * (rank + 1) // world
    dt = DTYPES[case["dtype"]]
    x_in = x.to(dt).to(device)
    w_in = w[lo:hi].to(dt).to(device, copy=True)
    return x_in, w_in, y.to(device), (lo, hi), (x, w)


def make_loss(impl: str, case: dict, w_local, y, bounds, group, device):
    """``loss(hidden, weight)``: the scalar mean loss (over non-ignored tokens) of ``impl``."""
    world = case["world"]
    if impl == "naive":
        return lambda x, w: F.cross_entropy(F.linear(x, w), y, ignore_index=IGNORE)
    if impl in OURS:
        from vocab_parallel import vocab_parallel_linear_cross_entropy

        mode = "memory_saving" if impl == "ours_ms" else "high_performance"
        backend = "triton" if device.type == "cuda" else "torch"
        pg = group if world > 1 else None
        return lambda x, w: vocab_parallel_linear_cross_entropy(
            x, w, y, process_group=pg, ignore_index=IGNORE, mode=mode, backend=backend
        )
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
    if impl == "cce":
        from cut_cross_entropy import linear_cross_entropy

        return lambda x, w: linear_cross_entropy(x, w, y, ignore_index=IGNORE)
    raise ValueError(f"unknown implementation {impl!r}")


def _init_distributed(case: dict, rank: int, device: torch.device):
    import torch.distributed as dist

    world = case["world"]
    backend = "nccl" if device.type == "cuda" else "gloo"
    if case["impl"].startswith("deepspeed"):
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
    if case["impl"].startswith("deepspeed"):
        deepspeed.init_distributed(dist_backend=backend)  # reuses the group above
    if case["impl"] == "megatron":
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    return dist.new_group(list(range(world)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(case: dict) -> dict:
    """One rank of one implementation: warm-up, then timed and measured fwd+bwd calls."""
    rank, world = int(os.environ.get("RANK", "0")), case["world"]
    torch.set_num_threads(case["threads"])
    device = torch.device(case["device"])
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    peak_memory = _project().memory.PeakMemory

    needs_pg = world > 1 or case["impl"] == "megatron"
    group = _init_distributed(case, rank, device) if needs_pg else None
    barrier = (lambda: torch.distributed.barrier(group)) if world > 1 else (lambda: None)

    x, w, y, bounds, full = make_inputs(case, rank, world, device)
    ref = {}
    if case["impl"] == "naive" and case["dtype"] == "fp32":
        with torch.no_grad():  # the references every row is compared with
            ref["fp32"] = F.cross_entropy(F.linear(x, w), y, ignore_index=IGNORE).item()
            xb, wb = (t.to(torch.bfloat16).float().to(device) for t in full)
            ref["bf16"] = F.cross_entropy(F.linear(xb, wb), y, ignore_index=IGNORE).item()
            del xb, wb
    del full
    hidden = x.requires_grad_(True)
    weight = w.requires_grad_(True)
    loss_fn = make_loss(case["impl"], case, w, y, bounds, group, device)

    def fwd_bwd():
        hidden.grad = weight.grad = None
        loss = loss_fn(hidden, weight)
        loss.backward()
        return loss

    fwd_bwd()  # warm-up: library set-up, thread pools, compilation
    times, loss_value, peak = [], None, None
    for i in range(case["repeats"]):
        hidden.grad = weight.grad = None
        barrier()
        _sync(device)
        if i == 0:
            with peak_memory(device) as peak:
                t0 = time.perf_counter()
                loss = fwd_bwd()
                _sync(device)
                times.append(time.perf_counter() - t0)
            loss_value = loss.item()
            grads = sum(t.numel() * t.element_size() for t in (hidden.grad, weight.grad))
        else:
            t0 = time.perf_counter()
            fwd_bwd()
            _sync(device)
            times.append(time.perf_counter() - t0)
    if group is not None:
        torch.distributed.destroy_process_group()
    return {
        "rank": rank,
        "times_s": times,
        "peak_bytes": peak.extra_bytes,
        "mem_method": peak.method,
        "grads_bytes": grads,
        "loss": loss_value,
        "ref": ref,
        "threads": torch.get_num_threads(),
    }


# ----------------------------------------------------------------------------- the parent


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except (OSError, AttributeError):
        return "n/a"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def skip_reason(impl: str, world: int, dtype: str, args, cuda: bool) -> str | None:
    """Why ``impl`` does not run in this configuration (None: it runs)."""
    if impl in CUDA_ONLY and not cuda:
        return "n/a on CPU"
    if impl.startswith("torch_lce") and not hasattr(F, "linear_cross_entropy"):
        return f"not in torch {torch.__version__}"
    for module in IMPLS[impl][2]:
        if not _installed(module):
            return "not installed"
    if dtype == "bf16" and impl not in (*OURS, "naive") and not args.bf16_competitors:
        return "skipped (--no-bf16-competitors)"
    if cuda and world > torch.cuda.device_count():
        return f"needs {world} GPUs"
    return None


def run_group(case: dict, timeout: float) -> dict:
    """Run ``case`` as ``case["world"]`` fresh processes; their results, or a failure."""
    world = case["world"]
    with tempfile.TemporaryDirectory(prefix="bench_loss_") as tmp:
        case = case | {"store": os.path.join(tmp, "store")}
        procs, outs = [], []
        for rank in range(world):
            env = os.environ | {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500",  # unused (FileStore), but some libraries read it
                "GLOO_SOCKET_IFNAME": "lo",
                "OMP_NUM_THREADS": str(case["threads"]),
                "MKL_NUM_THREADS": str(case["threads"]),
                "DS_ACCELERATOR": "cuda" if case["device"] == "cuda" else "cpu",
            }
            out = open(os.path.join(tmp, f"rank{rank}.log"), "w+")  # noqa: SIM115
            cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(case)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
            outs.append(out)
        deadline = time.monotonic() + timeout
        status = None
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                status = "timeout"
            elif any(p.poll() not in (None, 0) for p in procs):
                status = "error"  # one rank failed: do not wait for the others' timeouts
            if status:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                break
            time.sleep(0.2)
        results, tails = [], []
        for p, out in zip(procs, outs, strict=True):
            out.seek(0)
            text = out.read()
            out.close()
            found = [ln for ln in text.splitlines() if ln.startswith(RESULT)]
            if found:
                results.append(json.loads(found[-1][len(RESULT) :]))
            elif p.returncode not in (0, None) and status != "timeout":
                tails.append(f"rank exit {p.returncode}: " + text.strip()[-2000:])
    if status == "timeout":
        return {"status": "timeout"}
    if len(results) != world:
        sys.stderr.write("\n".join(tails) + "\n")
        last = (tails[-1].strip().splitlines() or ["?"])[-1] if tails else "no result"
        return {"status": "error: " + last[:120]}
    return {"status": "ok", "ranks": results}


def summarise(res: dict) -> dict:
    """Fastest call (of the slowest rank per call), largest peak, rank 0's loss."""
    ranks = res["ranks"]
    per_call = [max(r["times_s"][i] for r in ranks) for i in range(len(ranks[0]["times_s"]))]
    return res | {
        "time_s": min(per_call),
        "peak_bytes": max(r["peak_bytes"] for r in ranks),
        "grads_bytes": max(r["grads_bytes"] for r in ranks),
        "loss": ranks[0]["loss"],
        "mem_method": ranks[0]["mem_method"],
        "threads": ranks[0]["threads"],
    }


def table(rows: list[dict], naive: dict, refs: dict) -> str:
    head = ["implementation", "ranks", "dtype", "threads/rank", "best ms", "time / naive"]
    head += ["peak extra MiB", "loss", "|loss - ref|", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [IMPLS[r["impl"]][0], str(r["world"]), r["dtype"]]
        if r["status"] != "ok":
            cells += ["", "", "", "", "", "", r["status"]]
        else:
            base = naive.get(r["dtype"])
            ratio = f"{r['time_s'] / base:.2f}" if base else "-"
            ref = refs.get(r["dtype"])
            diff = "-" if ref is None else f"{abs(r['loss'] - ref):.1e}"
            if r.get("mismatch"):
                diff += " MISMATCH"
            cells += [
                str(r["threads"]), f"{r['time_s'] * 1e3:.0f}", ratio,
                f"{r['peak_bytes'] / MIB:.0f}", f"{r['loss']:.5f}", diff, "ok",
            ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pct(a: float, b: float) -> str:
    return f"{abs(a / b - 1) * 100:.1f}% {'slower' if a > b else 'faster'}"


def targets(rows: list[dict]) -> list[str]:
    """The issue's two targets (fp32, 1 rank) as PASS/FAIL lines."""

    def get(impl):
        for r in rows:
            if (r["impl"], r["world"], r["dtype"]) == (impl, 1, "fp32") and r["status"] == "ok":
                return r
        return None

    ms, hp, naive, ds = get("ours_ms"), get("ours_hp"), get("naive"), get("deepspeed")
    out = []
    if ms and ds:
        t_ok = ms["time_s"] <= ds["time_s"]
        m_diff = ms["peak_bytes"] - ds["peak_bytes"]
        m_ok = m_diff <= MEM_TIE
        m_word = (
            "ok" if m_diff <= 0 else (f"tie within {MEM_TIE / MIB:.0f} MiB" if m_ok else "more")
        )
        out.append(
            f"{'PASS' if t_ok and m_ok else 'FAIL'}: memory-saving no slower than DeepSpeed "
            f"(chunked) and no more extra memory: time {ms['time_s'] * 1e3:.0f} vs "
            f"{ds['time_s'] * 1e3:.0f} ms ({_pct(ms['time_s'], ds['time_s'])}), peak "
            f"{ms['peak_bytes'] / MIB:.1f} vs {ds['peak_bytes'] / MIB:.1f} MiB ({m_word})"
        )
    else:
        out.append("n/a: memory-saving vs DeepSpeed (one of them did not run)")
    if hp and naive:
        ratio = hp["time_s"] / naive["time_s"]
        out.append(
            f"{'PASS' if ratio <= 1.10 else 'FAIL'}: high-performance within 10% of naive's "
            f"time: {hp['time_s'] * 1e3:.0f} vs {naive['time_s'] * 1e3:.0f} ms "
            f"({_pct(hp['time_s'], naive['time_s'])})"
        )
    else:
        out.append("n/a: high-performance vs naive (one of them did not run)")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Time and peak memory of the vocab-parallel loss (fwd+bwd) vs others.",
        epilog="Defaults: BT=2048 H=1024 V=32768; --quick: BT=256 H=128 V=4096.",
    )
    p.add_argument("--quick", action="store_true", help="a small shape (seconds, not minutes)")
    p.add_argument("--bt", type=int, help="tokens (default 2048; --quick 256)")
    p.add_argument("--hidden", type=int, help="hidden size H (default 1024; --quick 128)")
    p.add_argument("--vocab", type=int, help="global vocabulary V (default 32768; --quick 4096)")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    p.add_argument("--worlds", nargs="+", type=int, choices=(1, 2), default=[1, 2])
    p.add_argument(
        "--impls", nargs="+", choices=list(IMPLS), default=DEFAULT_IMPLS,
        help="implementations (default: all but deepspeed_dflt); naive always runs",
    )  # fmt: skip
    p.add_argument(
        "--no-bf16-competitors", dest="bf16_competitors", action="store_false",
        help="bf16 rows for ours and naive only (saves several minutes on a CPU)",
    )  # fmt: skip
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--repeats", type=int, help="timed calls after the warm-up (CPU 3, CUDA 10)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per process group")
    p.add_argument("--ds-chunk", type=int, default=512, help="DeepSpeed chunk_size on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the raw results to this file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.bt = args.bt or (256 if args.quick else 2048)
    args.hidden = args.hidden or (128 if args.quick else 1024)
    args.vocab = args.vocab or (4096 if args.quick else 32768)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        case = json.loads(args.child)
        print(RESULT + json.dumps(run_case(case)), flush=True)
        return 0
    _project()  # fail early when the project cannot be imported
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        sys.exit("bench: --device cuda requested but CUDA is not available")
    cuda = name == "cuda"
    cores = _cores()
    where = torch.cuda.get_device_name() if cuda else f"{platform.machine()}, {cores} cores"
    repeats = args.repeats or (10 if cuda else 3)
    impls = ["naive"] + [i for i in IMPLS if i in args.impls and i != "naive"]
    print(f"# bench_loss: {name} ({where}), torch {torch.__version__}, python {sys.executable}")
    print(
        f"# BT={args.bt} H={args.hidden} V={args.vocab}; fastest of {repeats} fwd+bwd calls "
        f"after a warm-up; {args.timeout:.0f} s per process group"
    )
    load_before = _loadavg()
    print(f"# load average before: {load_before} (other work on the machine skews the times)")
    base = {"device": name, "bt": args.bt, "h": args.hidden, "v": args.vocab}
    base |= {"repeats": repeats, "seed": args.seed, "ds_chunk": args.ds_chunk}
    base |= {"coll_timeout": max(60, int(args.timeout))}
    dtypes = [d for d in DTYPES if d in args.dtypes]
    if "fp32" not in dtypes:
        dtypes = ["fp32"] + dtypes  # the naive fp32 run gives the reference losses
    rows, t_start = [], time.perf_counter()
    for dtype in dtypes:
        for world in sorted(args.worlds):
            for impl in impls:
                if world not in IMPLS[impl][1]:
                    continue
                if dtype not in args.dtypes and not (impl == "naive" and world == 1):
                    continue
                row = {"impl": impl, "world": world, "dtype": dtype}
                reason = skip_reason(impl, world, dtype, args, cuda)
                if reason:
                    rows.append(row | {"status": reason})
                    continue
                threads = 1 if cuda else max(1, cores // world)
                case = base | row | {"threads": threads}
                res = run_group(case, args.timeout)
                if res["status"] == "ok":
                    res = summarise(res)
                rows.append(row | res)
                shown = f"{res['time_s'] * 1e3:.0f} ms" if res["status"] == "ok" else ""
                print(
                    f"#   {impl} {world} rank(s) {dtype}: {res['status']} {shown} "
                    f"({time.perf_counter() - t_start:.0f} s elapsed, load {_loadavg()})",
                    flush=True,
                )
    print(f"# load average after: {_loadavg()}, {time.perf_counter() - t_start:.0f} s in all")

    naive = {r["dtype"]: r for r in rows if r["impl"] == "naive" and r["status"] == "ok"}
    refs = naive["fp32"]["ranks"][0]["ref"] if "fp32" in naive else {}
    failures = []
    for r in rows:
        if r["status"] == "ok" and r["dtype"] in refs:
            ref = refs[r["dtype"]]
            if abs(r["loss"] - ref) > LOSS_TOL[r["dtype"]] * abs(ref):
                r["mismatch"] = True
                failures.append(f"{r['impl']} {r['world']} rank(s) {r['dtype']}: {r['loss']}")
    shown = [r for r in rows if r["dtype"] in args.dtypes]
    method = next((r["mem_method"] for r in rows if r["status"] == "ok"), "-")
    grads = {(r["world"], r["dtype"]): r["grads_bytes"] / MIB for r in rows if r["status"] == "ok"}
    print()
    print(table(shown, {d: n["time_s"] for d, n in naive.items()}, refs))
    print()
    print(
        f"best ms: fastest of {repeats} fwd+bwd calls after a warm-up (several ranks: of the "
        f"slowest rank per call). time / naive: against naive of the same dtype, 1 rank. "
        f"peak extra MiB: peak memory of one fwd+bwd beyond the inputs ({method}), largest "
        f"rank, INCLUDING the gradients of hidden and weight ("
        + ", ".join(f"{w} rank(s) {d}: {m:.0f} MiB" for (w, d), m in sorted(grads.items()))
        + "). |loss - ref|: against naive fp32 on the same inputs (bf16 rows: on the "
        f"bf16-rounded inputs); tolerance {LOSS_TOL['fp32']:g} (fp32), {LOSS_TOL['bf16']:g} "
        f"(bf16) relative. DeepSpeed chunk_size={args.ds_chunk if not cuda else 'default'}."
    )
    print()
    if cuda:
        print("Targets (issue 3) are defined for CPU fp32 1 rank; figures on CUDA:")
    else:
        print("Targets (issue 3; CPU, fp32, 1 rank):")
    for line in targets(rows):
        print("  " + line)
    if args.json:
        with open(args.json, "w") as f:
            info = {"args": vars(args), "device": where, "load_before": load_before}
            json.dump(info | {"load_after": _loadavg(), "rows": rows}, f, indent=1)
    broken = [
        f"{r['impl']} {r['world']} rank(s) {r['dtype']}: {r['status']}"
        for r in rows
        if r["impl"] in (*OURS, "naive") and r["status"] != "ok"
    ]
    if failures:
        print("\nLOSS MISMATCH against the naive fp32 reference:")
        print("\n".join(failures))
    if broken:
        print("\nOurs or naive did not run:")
        print("\n".join(broken))
    return 1 if failures or broken else 0


if __name__ == "__main__":
    sys.exit(main())
