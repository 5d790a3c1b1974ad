"""Benchmark: the backward operator side by side with a naive PyTorch implementation.

For every case (vocabulary size x mode x dtype) it reports the best time of a few calls,
the time ratio ours/naive, and the peak memory each implementation needs beyond its
inputs and outputs (its temporaries). The naive implementation is the formula written
plainly: full ``[BT, V]`` fp32 logits, softmax, a materialised one-hot, two matmuls.

    python benchmarks/bench_backward.py            # BT=4096, H=1024, V=32768 and 131072
    python benchmarks/bench_backward.py --quick    # BT=512, H=256, V=4096 and 16384

Memory
    CPU: every implementation runs in its own fresh subprocess. After the inputs exist
    (built chunk by chunk, without large temporaries) and a tiny warm-up call, the
    process's peak RSS is reset (``/proc/self/clear_refs``) and free heap memory is handed
    back to the OS (``malloc_trim``); the figure is the peak RSS (``VmHWM``) during one
    call minus the RSS before it, minus the outputs' size. Without ``/proc`` it falls
    back to the growth of ``ru_maxrss`` (a lower bound).
    CUDA: ``torch.cuda.max_memory_allocated`` during one call minus the allocated memory
    before it, minus the outputs' size; all cases run in this process.

Speed
    CPU: both implementations compute their products in fp32, bf16 inputs included (the
    torch backend does so because half-precision GEMMs are far slower on most CPUs; a
    naive bf16 GEMM would be a straw man). ``G`` is rounded to the input dtype in both.
    CUDA: products in the input dtype; TFLOP/s counts the backward's GEMMs (2 in
    high-performance mode, 3 in memory-saving mode, which recomputes the logits) and is
    compared with plain ``torch.matmul`` calls of the same shapes and dtype.

Default cases: BT=4096, H=1024; V=32768 in both modes, and V=131072 (4x) in memory-saving
mode only (the mode whose peak must not grow with V; ``--more-v-modes`` adds the other).
About 6 minutes on 2 idle CPU cores. ``--quick`` is a smoke run (half a minute): at its
BT=512 one chunk of the torch backend covers the whole vocabulary, so its peak does grow
with V there. Without a GPU the Triton kernels can still be run, under Triton's
interpreter (numpy per tile: tiny shapes only), beside the torch backend:

    python benchmarks/bench_backward.py --backends torch triton --bt 64 --hidden 48 --vocab 600

Every row also checks that both sides computed the same gradients (norms within 1%); the
exit status is 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Run as a script, Python puts benchmarks/ on sys.path: put the repository root there too,
# for ``benchmarks`` and for ``vocab_parallel`` from this checkout.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks import harness
from benchmarks.harness import MIB
from vocab_parallel.reference import naive_loss_grad

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODES = ("memory_saving", "high_performance")


# ----------------------------------------------------------------------------- inputs


def make_inputs(bt: int, h: int, v: int, dtype: torch.dtype, mode: str, device, seed=0):
    """The operator's inputs, built without temporaries larger than a 64 MiB chunk.

    About 10% of the rows are "not here" (target on another shard, or ignored).
    Statistics are exact (fp32, online over vocabulary chunks); high-performance mode
    also gets the fp32 softmax ``[BT, V]``.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(bt, h, generator=gen, device=device, dtype=dtype).mul_(2.0 / h**0.5)
    w = torch.randn(v, h, generator=gen, device=device, dtype=dtype)
    target = torch.randint(0, v, (bt,), generator=gen, device=device, dtype=torch.int32)
    not_here = torch.rand(bt, generator=gen, device=device) < 0.1
    grad = torch.rand(bt, generator=gen, device=device).add_(0.5)
    cdt = torch.float32 if device.type == "cpu" else dtype
    xc = x.to(cdt)
    cols = max(1, min(v, 64 * MIB // max(1, 4 * bt)))
    lmax = torch.full((bt,), -float("inf"), device=device)
    sumexp = torch.zeros(bt, device=device)
    softmax = torch.empty((bt, v), device=device) if mode == "high_performance" else None
    for v0 in range(0, v, cols):
        logits = (xc @ w[v0 : v0 + cols].to(cdt).T).float()
        if softmax is not None:
            softmax[:, v0 : v0 + cols] = logits
        new_max = torch.maximum(lmax, logits.max(dim=1).values)
        sumexp.mul_(torch.exp(lmax - new_max)).add_(logits.sub_(new_max[:, None]).exp_().sum(dim=1))
        lmax = new_max
        del logits
    if softmax is not None:
        softmax.sub_(lmax[:, None]).exp_().div_(sumexp[:, None])
    return {
        "grad": grad,
        "x": x,
        "w": w,
        "not_here": not_here,
        "target": target,
        "logits_max": lmax,
        "sum_exp": sumexp,
        "softmax": softmax,
    }


# ----------------------------------------------------------------------------- the two sides


def make_call(impl: str, inp: dict, mode: str):
    """A zero-argument callable running ``impl`` ("naive" or a backend name) on ``inp``."""
    softmax = inp["softmax"] if mode == "high_performance" else None
    if impl == "naive":
        return lambda: naive_loss_grad(
            inp["grad"], inp["x"], inp["w"], inp["not_here"], inp["target"],
            inp["logits_max"], inp["sum_exp"], softmax,
        )  # fmt: skip
    from vocab_parallel import fused_linear_cross_entropy_loss_grad, pack_target_mask

    mask = pack_target_mask(inp["not_here"])
    stats = {"softmax": softmax}
    if softmax is None:
        stats = {"logits_max": inp["logits_max"], "sum_exp_logits": inp["sum_exp"]}
    return lambda: fused_linear_cross_entropy_loss_grad(
        inp["grad"], inp["x"], inp["w"], mask, inp["target"], backend=impl, **stats
    )


# ----------------------------------------------------------------------------- measuring


def measure(call, device: torch.device, repeats: int) -> dict:
    """Peak extra memory of the first call; best time of ``repeats`` calls, the first included.

    (The first call is timed too: on CPU a call takes seconds at the default shape and
    nothing is compiled; on CUDA the caller has run a warm-up call before.)
    """

    def keep(out):  # the outputs' size, and their norms for the sanity check
        return harness.nbytes(out), [t.double().norm().item() for t in out]

    res = harness.timed_calls(call, device, repeats, keep=keep)
    peak, (outputs, norms) = res["peak"], res["kept"]
    return {
        "time_s": min(res["times_s"]),
        "times_s": res["times_s"],
        "cpu_s": min(res["cpu_s"]),  # process CPU seconds, all threads: steadier than wall time
        "extra_bytes": peak.extra_bytes,
        "out_bytes": outputs,
        "temp_bytes": peak.extra_bytes - outputs,
        "mem_method": peak.method,
        "norms": norms,
    }


def run_case(case: dict) -> dict:
    """Build the inputs of one case and measure one implementation on them."""
    device = torch.device(case["device"])
    dtype = DTYPES[case["dtype"]]
    mode, impl = case["mode"], case["impl"]
    # Warm-up on a tiny problem: library initialisation does not count as the call's memory.
    tiny = make_inputs(64, 64, 256, dtype, mode, device, seed=1)
    make_call(impl, tiny, mode)()
    del tiny
    inp = make_inputs(case["bt"], case["h"], case["v"], dtype, mode, device, case["seed"])
    call = make_call(impl, inp, mode)
    if device.type == "cuda":
        call()  # compile the Triton kernels outside the measurement
    return measure(call, device, case["repeats"])


def run_matmul(case: dict) -> float:
    """Best time of plain ``torch.matmul`` calls with the backward's GEMM shapes."""
    device = torch.device(case["device"])
    dtype = DTYPES[case["dtype"]]
    bt, h, v = case["bt"], case["h"], case["v"]
    x = torch.randn(bt, h, device=device, dtype=dtype)
    w = torch.randn(v, h, device=device, dtype=dtype)
    g = torch.randn(bt, v, device=device, dtype=dtype)

    def call():
        if case["mode"] == "memory_saving":
            torch.matmul(x, w.T)  # the recompute of the logits
        torch.matmul(g, w)
        torch.matmul(g.T, x)

    call()
    return measure(call, device, case["repeats"])["time_s"]


def in_subprocess(case: dict, timeout: float) -> dict:
    """``run_case`` in a fresh Python process: its peak RSS is this case's alone."""
    res = harness.run_children(__file__, case, timeout=timeout)
    if res["status"] != "ok":
        raise RuntimeError(f"benchmark subprocess failed ({res['status']}) for {case}")
    return res["ranks"][0]


# ----------------------------------------------------------------------------- report


def gemm_flops(bt: int, h: int, v: int, mode: str) -> float:
    return 2.0 * bt * h * v * (3 if mode == "memory_saving" else 2)


def compare(ours: dict, naive: dict, what: str) -> list[str]:
    """Sanity: both sides compute the same gradients (norms within 1%)."""
    failures = []
    for a, c, grad in zip(ours["norms"], naive["norms"], ("input", "weight"), strict=True):
        if abs(a - c) > 1e-2 * max(abs(c), 1e-30):
            failures.append(f"{what}: |grad_{grad}| {a} vs {c}")
    return failures


def table(rows: list[dict], cuda: bool) -> str:
    head = ["V", "mode", "dtype", "backend", "ours ms", "naive ms", "ours/naive"]
    if not cuda:
        head += ["ours/naive CPU time"]
    head += ["ours temp MiB", "naive temp MiB", "outputs MiB"]
    if cuda:
        head += ["ours TFLOP/s", "naive TFLOP/s", "matmul TFLOP/s"]
    body = []
    for r in rows:
        o, n = r["ours"], r["naive"]
        cells = [
            str(r["v"]), r["mode"], r["dtype"], r["backend"],
            f"{o['time_s'] * 1e3:.0f}", f"{n['time_s'] * 1e3:.0f}",
            f"{o['time_s'] / n['time_s']:.2f}",
            *([] if cuda else [f"{o['cpu_s'] / n['cpu_s']:.2f}"]),
            f"{o['temp_bytes'] / MIB:.0f}", f"{n['temp_bytes'] / MIB:.0f}",
            f"{o['out_bytes'] / MIB:.0f}",
        ]  # fmt: skip
        if cuda:
            flops = gemm_flops(r["bt"], r["h"], r["v"], r["mode"])
            cells += [f"{flops / t / 1e12:.1f}" for t in (o["time_s"], n["time_s"], r["matmul_s"])]
        body.append(cells)
    return harness.markdown_table(head, body)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Time and peak memory of the backward operator vs a naive implementation.",
        epilog="Defaults: BT=4096 H=1024 V=32768,131072; --quick: BT=512 H=256 V=4096,16384.",
    )
    harness.add_common_args(
        p, DTYPES, "timed calls, best shown (CPU 2, CUDA 10); the first of them also "
        "measures memory",
    )  # fmt: skip
    p.add_argument("--bt", type=int, help="tokens (default 4096; --quick 512)")
    p.add_argument("--hidden", type=int, help="hidden size H (default 1024; --quick 256)")
    p.add_argument("--vocab", type=int, nargs="+", help="vocabulary sizes V of the shard")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument(
        "--more-v-modes", nargs="+", choices=MODES, default=["memory_saving"],
        help="modes run for every V after the first (default: memory_saving, whose peak "
        "must not grow with V; the first V runs all --modes)",
    )  # fmt: skip
    p.add_argument(
        "--backends", nargs="+", choices=("torch", "triton"),
        help="operator backends (default: triton on CUDA, torch on CPU; triton on CPU runs "
        "under Triton's interpreter: tiny shapes only)",
    )  # fmt: skip
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per CPU subprocess")
    args = p.parse_args(argv)
    return harness.fill_defaults(
        args, bt=(4096, 512), hidden=(1024, 256), vocab=([32768, 131072], [4096, 16384])
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    name, where = harness.pick_device(args.device)
    cuda = name == "cuda"
    backends = args.backends or (["triton"] if cuda else ["torch"])
    repeats = args.repeats or (10 if cuda else 2)
    if not cuda and "triton" in backends:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # for the subprocesses
    print(f"# bench_backward: {name} ({where}), torch {torch.__version__}")
    print(f"# BT={args.bt} H={args.hidden} V={args.vocab}, best of {repeats} calls")
    harness.print_load_before()

    def run(case):  # on CPU in a fresh process: its peak RSS is this case's alone
        return run_case(case) if cuda else in_subprocess(case, args.timeout)

    rows, failures = [], []
    t_start = time.perf_counter()
    for v in args.vocab:
        modes = args.modes if v == args.vocab[0] else args.more_v_modes
        for mode in [m for m in MODES if m in modes]:
            for dt in args.dtypes:
                base = {"device": name, "bt": args.bt, "h": args.hidden, "v": v, "mode": mode}
                base |= {"dtype": dt, "repeats": repeats, "seed": args.seed}
                naive = run(base | {"impl": "naive"})
                matmul_s = run_matmul(base) if cuda else None
                for b in backends:
                    ours = run(base | {"impl": b})
                    row = {"v": v, "mode": mode, "dtype": dt, "backend": b, "bt": args.bt}
                    row |= {"h": args.hidden, "ours": ours, "naive": naive, "matmul_s": matmul_s}
                    rows.append(row)
                    failures += compare(ours, naive, f"{v} {mode} {dt} {b}")
                    harness.print_progress(
                        f"V={v} {mode} {dt} {b}: ours {ours['time_s'] * 1e3:.0f} ms, "
                        f"naive {naive['time_s'] * 1e3:.0f} ms",
                        t_start,
                    )
    harness.print_load_after(t_start)
    method = rows[0]["ours"]["mem_method"] if rows else "-"
    print()
    print(table(rows, cuda))
    print()
    print(
        f"Times: best of {repeats} calls (CPU time: process CPU seconds, all threads; steadier "
        f"than wall time on a shared machine). temp MiB: peak memory of one call beyond its inputs "
        f"and outputs ({method}). outputs MiB: grad_input + grad_weight (same for both)."
    )
    harness.write_json(args.json, {"args": vars(args), "device": where, "rows": rows})
    if failures:
        print("\nMISMATCH between the operator and the naive implementation:")
        print("\n".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(harness.script_main(main, run_case))
