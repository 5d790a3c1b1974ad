"""A performance model of one call on a GPU: each part's FLOPs, bytes, launches, time.

    python benchmarks/gpu_model.py                      # every target row, H200
    python benchmarks/gpu_model.py --row ce_default --parts
    python benchmarks/gpu_model.py --gpu h200 --tflops 790 --tbps 4.3 --launch-us 5

For each row of the GPU targets (``docs/benchmarks.md``, "GPU"; the issue's table) it
prints the figures the first GPU run measured for the code of that time
(``GPU_BASELINE``, from the run's notes), the launches and host syncs the code issues
today (counted without a GPU by ``benchmarks/launches.py``, when triton is installed),
and the model's time and memory for the engine's CUDA plan (``docs/design.md``, "The
engine"): per token chunk of ``R`` rows, the logits by one GEMM with fp32 output, one
fused epilogue pass for the statistics and one for ``G`` (written in the input dtype),
``grad_input`` by one GEMM and ``grad_weight`` added inside one GEMM into its fp32
accumulator.

The model: a GEMM takes ``max(flops / (peak * gemm_efficiency), bytes / bandwidth)``,
a memory-bound pass ``bytes / bandwidth``; the device time is their sum; the host issues
one launch per ``launch_us``, overlapped with the device, so a call takes ``max(device,
launches * launch_us)``. ``gemm_efficiency`` (0.88) is what the first GPU run measured for
plain cuBLAS calls at these shapes (the three GEMMs in 37.2 ms: 694 of 790 TFLOP/s).
Memory: the peak of what the plan holds beyond inputs and gradients' final values is
counted from its buffers. Nothing here measures: a GPU run of ``scripts/gpu_check.sh``
does.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

GIB = 1 << 30


@dataclass(frozen=True)
class GPU:
    name: str
    tflops: float  # dense bf16 peak
    tbps: float  # HBM bandwidth, TB/s
    launch_us: float  # host time per launch
    gemm_efficiency: float = 0.88


GPUS = {"h200": GPU("H200", 790.0, 4.3, 5.0)}


@dataclass(frozen=True)
class Part:
    name: str
    flops: float  # per call
    bytes: float  # per call
    launches: int  # per call
    gemm: bool = False

    def ms(self, gpu: GPU) -> float:
        memory = self.bytes / (gpu.tbps * 1e12)
        if not self.gemm:
            return 1e3 * memory
        return 1e3 * max(self.flops / (gpu.tflops * 1e12 * gpu.gemm_efficiency), memory)


@dataclass(frozen=True)
class Row:
    key: str
    what: str
    tokens: int
    hidden: int
    vocab: int
    plan: str  # which plan function
    baseline: str  # the first GPU run's figure for the code of that time
    reference: str  # what the target compares with
    reference_ms: float | None  # its measured time (None: the floor, modelled)
    target: str
    target_ratio: float
    target_mib: float | None = None


# The first GPU run (H200, torch 2.11, triton 3.6; bf16; gpu-baseline notes).
ROWS = [
    Row("ce_default", "CE default (grad_in_forward)", 8192, 4096, 128256, "ce_gif",
        "69.3 ms (1.86x floor), 2132 MiB", "floor", None, "<= 1.10x floor, <= 2.5 GiB",
        1.10, 2560),
    Row("ce_memory_saving", "CE memory_saving", 8192, 4096, 128256, "ce_ms",
        "82.8 ms (2.23x floor), 640 MiB", "floor", None, "<= 1.40x floor, <= 700 MiB",
        1.40, 700),
    Row("ce_gemma", "CE default, Gemma-like head", 8192, 2304, 256000, "ce_gif",
        "104.9 ms (2.51x floor)", "floor", None, "<= 1.15x floor", 1.15),
    Row("stats", "log-probs + entropy (per-token upstream)", 4096, 4096, 128256, "stats",
        "48.7 ms (1.43x materialised 34.1 ms), 449 MiB", "materialised", 34.1,
        "<= 1.0x materialised, <= 1/10 of its 8986 MiB", 1.0, 898),
    Row("forward_kl", "forward KL, dense teacher (grad_in_forward)", 4096, 4096, 128256,
        "kd", "222.8 ms (5.5x materialised 40.3 ms), 2068 MiB", "materialised", 40.3,
        "<= 1.0x materialised, <= 1/4 of its 8986 MiB", 1.0, 2246),
    Row("forward_kl_ms", "forward KL, dense teacher (memory_saving)", 4096, 4096, 128256,
        "kd_columns", "(not measured)", "materialised", 40.3,
        "<= 1.0x materialised, <= 1/4 of its 8986 MiB", 1.0, 2246),
    Row("stats_replay", "log-probs + entropy, sampling replay (top-k 50, top-p 0.9)", 4096,
        4096, 128256, "stats_replay", "(not measured)", "untruncated statistics (model)",
        None, "<= 2.0x the untruncated statistics", 2.0),
    Row("jsd", "JSD, dense teacher (grad_in_forward)", 4096, 4096, 128256, "kd_jsd",
        "145.5 ms (1.85x Liger fused JSD 78.6 ms)", "Liger fused JSD", 78.6,
        "<= 1.0x Liger", 1.0),
]  # fmt: skip


def token_rows(tokens: int, vocab: int, heads: int) -> int:
    """The engine's GPU token chunk (``vocab_parallel.engine.memory_policy``)."""
    from vocab_parallel.engine import memory_policy as memory

    return memory.token_rows(tokens, vocab, 1, "cuda", heads)


def column_width(tokens: int, vocab: int) -> int:
    """The engine's GPU column chunk of all tokens (the "logits" share of the workspace)."""
    from vocab_parallel.engine import memory_policy as memory

    return memory.columns(tokens, vocab, "cuda", "logits")


def _gemm(name, m, n, k, chunks, out_bytes, extra_bytes=0.0):
    """``chunks`` GEMMs of ``[m, k] @ [k, n]`` (bf16 operands) per call."""
    flops = 2.0 * m * n * k * chunks
    bytes_ = chunks * (2.0 * (m * k + k * n) + out_bytes + extra_bytes)
    return Part(name, flops, bytes_, chunks, gemm=True)


def token_chunked(n: int, h: int, v: int, heads: int, passes: int):
    """Grad-in-forward: token chunks of ``R`` rows, each head's fp32 logits kept for the
    chunk, ``G`` written in the input dtype over the student's (in place: no buffer of
    its own), ``grad_input``'s rows by one GEMM in the input dtype (one rank; with
    tensor parallelism fp32 rows for the SUM all-reduce), ``grad_weight`` added into its
    fp32 ``[V, H]`` accumulator inside the GEMM."""
    rows = token_rows(n, v, heads)
    chunks = -(-n // rows)
    r = n / chunks  # the average chunk (the last one may be shorter)
    logits = 4.0 * r * v  # one head's fp32 chunk
    parts = [
        _gemm(f"logits GEMM, head {i} (fp32 out)", r, v, h, chunks, logits) for i in range(heads)
    ]
    parts += [
        Part("epilogue: statistics (one pass)", 0, chunks * passes * heads * logits, chunks),
        Part("epilogue: G in place (one pass)", 0, chunks * (heads * logits + 2 * r * v), chunks),
        _gemm("grad_input = G @ W", r, h, v, chunks, 2.0 * r * h),
        _gemm("grad_weight += G.T @ x (fp32, in the GEMM)", v, h, r, chunks, 0, 4.0 * v * h),
    ]  # fmt: skip
    peak = 4.0 * v * h + heads * 4.0 * rows * v + 2.0 * n * h
    return parts, peak, f"{chunks} token chunks of {rows} rows"


def column_chunked(n: int, h: int, v: int, heads: int = 1):
    """Memory-saving (and per-token upstream gradients): all tokens, vocabulary chunks of
    ``c`` columns; the forward makes each chunk's logits and statistics, the backward
    makes them again, ``G``, ``grad_input`` added into its fp32 ``[N, H]`` inside the
    GEMM and ``grad_weight``'s rows written once by one GEMM in the input dtype (all
    tokens in one product: one rounding, as today)."""
    width = column_width(n, v) // heads
    chunks = -(-v // width)
    c = v / chunks  # the average chunk
    logits = 4.0 * n * c
    parts = []
    for i in range(heads):
        parts.append(_gemm(f"forward: logits GEMM, head {i} (fp32 out)", n, c, h, chunks, logits))
    parts.append(Part("forward: statistics (one pass)", 0, chunks * heads * logits, chunks))
    for i in range(heads):
        parts.append(_gemm(f"backward: logits GEMM again, head {i}", n, c, h, chunks, logits))
    parts += [
        Part("backward: G in place (one pass)", 0, chunks * (heads * logits + 2.0 * n * c), chunks),
        _gemm("grad_input += G @ W_c (fp32, in the GEMM)", n, h, c, chunks, 0, 8.0 * n * h),
        _gemm("grad_weight[c] = G.T @ x (input dtype out)", c, h, n, chunks, 2.0 * c * h),
    ]
    peak = heads * 4.0 * n * width + 4.0 * n * h
    return parts, peak, f"{chunks} column chunks of {width}"


def plan_parts(plan: str, n: int, h: int, v: int) -> tuple[list[Part], float, str]:
    """The CUDA plan's parts of one call, its peak extra memory (bytes), its chunking."""
    if plan in ("ce_ms", "stats"):
        return column_chunked(n, h, v)
    if plan == "stats_replay":  # + the candidates: one top-C pass per chunk, one all-gather
        parts, peak, chunking = column_chunked(n, h, v)
        chunks = int(chunking.split()[0])
        parts.insert(2, Part("candidates (top-C of each chunk)", 0, 4.0 * n * v, chunks))
        return parts, peak, chunking
    if plan == "kd_columns":
        return column_chunked(n, h, v, heads=2)
    heads = 2 if plan.startswith("kd") else 1
    return token_chunked(n, h, v, heads, 1 + (plan == "kd_jsd"))


def floor_ms(n: int, h: int, v: int, gpu: GPU) -> float:
    """The three GEMMs of a fused linear cross entropy as plain cuBLAS calls."""
    return 3 * _gemm("", n, v, h, 1, 0).ms(gpu)


def today_counts(row: Row):
    """Launches and syncs of today's code for the row (None without triton)."""
    try:
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return None
        os.environ.setdefault("TRITON_INTERPRET", "1")
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import test_launch_budget as budget

        name = {
            "ce_default": "cross entropy, auto (grad_in_forward)",
            "ce_memory_saving": "cross entropy, memory_saving",
            "stats": "token statistics (log-probs + entropy)",
            "forward_kl": "distillation, forward KL (dense teacher)",
            "jsd": "distillation, JSD (dense teacher)",
        }.get(row.key)
        if name is None:
            return None
        from benchmarks.launches import count_call

        return count_call(budget.CALLS[name][0])
    except Exception as err:  # the model stands without the counts
        print(f"(launch count of {row.key} unavailable: {type(err).__name__}: {err})")
        return None


def report(row: Row, gpu: GPU, show_parts: bool) -> str:
    parts, peak, chunking = plan_parts(row.plan, row.tokens, row.hidden, row.vocab)
    device = sum(p.ms(gpu) for p in parts)
    launches = sum(p.launches for p in parts) + 6  # the call's set-up and reduction
    total = max(device, launches * gpu.launch_us / 1e3)
    ref = row.reference_ms
    if ref is None and row.reference.startswith("untruncated"):
        base, _, _ = plan_parts("stats", row.tokens, row.hidden, row.vocab)
        ref = sum(p.ms(gpu) for p in base)
    elif ref is None:  # the floor, at the measured cuBLAS rate
        ref = floor_ms(row.tokens, row.hidden, row.vocab, gpu)
    ratio = total / ref
    mib = peak / (1 << 20)
    ok = ratio <= row.target_ratio and (row.target_mib is None or mib <= row.target_mib)
    counts = today_counts(row)
    today = (
        ""
        if counts is None
        else f"; today's code: {counts.launches} launches, {counts.syncs} syncs"
    )
    lines = [
        f"{row.what}: {row.tokens} x {row.hidden} x {row.vocab}",
        f"  measured (first GPU run): {row.baseline}{today}",
        f"  plan (model): {total:.1f} ms = {ratio:.2f}x {row.reference} ({ref:.1f} ms), "
        f"{mib:.0f} MiB, {launches} launches ({chunking}); target {row.target}: "
        + ("met (predicted)" if ok else "NOT met (predicted)"),
    ]
    if show_parts:
        lines.append(f"  {'part':46s} {'GFLOP':>9s} {'GB':>7s} {'launches':>8s} {'ms':>7s}")
        for p in parts:
            lines.append(
                f"  {p.name:46s} {p.flops / 1e9:9.0f} {p.bytes / 1e9:7.2f} {p.launches:8d} "
                f"{p.ms(gpu):7.2f}"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--gpu", default="h200", choices=sorted(GPUS))
    p.add_argument("--tflops", type=float, help="dense bf16 peak (default: the GPU's)")
    p.add_argument("--tbps", type=float, help="HBM TB/s (default: the GPU's)")
    p.add_argument("--launch-us", type=float, help="host microseconds per launch")
    p.add_argument("--row", choices=[r.key for r in ROWS], action="append")
    p.add_argument("--parts", action="store_true", help="each part's FLOPs, bytes, time")
    args = p.parse_args(argv)
    gpu = GPUS[args.gpu]
    gpu = GPU(
        gpu.name, args.tflops or gpu.tflops, args.tbps or gpu.tbps,
        args.launch_us or gpu.launch_us, gpu.gemm_efficiency,
    )  # fmt: skip
    print(f"{gpu.name}: {gpu.tflops:g} TFLOP/s bf16 x {gpu.gemm_efficiency} (cuBLAS at these "
          f"shapes), {gpu.tbps:g} TB/s, {gpu.launch_us:g} us a launch")  # fmt: skip
    for row in ROWS:
        if args.row and row.key not in args.row:
            continue
        print(report(row, gpu, args.parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
