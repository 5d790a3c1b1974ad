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
from dataclasses import dataclass, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

GIB = 1 << 30
DENSE_ABOVE = 0.75  # vocab_parallel.engine.filtering: a mask keeping more runs whole


@dataclass(frozen=True)
class GPU:
    name: str
    tflops: float  # dense bf16 peak
    tbps: float  # HBM bandwidth, TB/s
    host_us: float  # host time per launch issued from the library's Python
    gemm_efficiency: float = 0.88


# host_us: the first GPU run's distillation call spent 280 ms of CPU time on ~8,500
# launches (1,536 kernels and ~7,000 small torch ops): 33 us each.
GPUS = {"h200": GPU("H200", 790.0, 4.3, 33.0)}


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
    kept: float | None = None  # gradient filtering: the share of columns kept (None: off)


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
    Row("filter_none", 'CE default, filter_eps="auto", nothing left out (random data)', 8192,
        4096, 128256, "ce_gif", "248.8 ms (3.6x exact)", "exact default (model)", None,
        "<= 1.05x exact", 1.05, kept=1.0),
    # A trained head: the share of columns some token keeps, measured on the trained
    # workload (benchmarks/trained_workload.py, V 32768, 4096 held-out tokens, bf16's
    # auto eps): 6.6% (10% of the columns its tokenizer uses); --kept for another.
    Row("filter_trained", 'CE default, filter_eps="auto", a trained head (KEPT of the '
        "columns kept)", 8192, 4096, 128256, "ce_gif", "(not measured)",
        "exact default (model)", None, "<= 0.80x exact", 0.80, kept=0.066),
    Row("jsd", "JSD, dense teacher (grad_in_forward)", 4096, 4096, 128256, "kd_jsd",
        "145.5 ms (1.85x Liger fused JSD 78.6 ms)", "Liger fused JSD", 78.6,
        "<= 1.0x Liger", 1.0),
]  # fmt: skip


def token_rows(tokens: int, vocab: int, heads: int, hidden: int) -> int:
    """The engine's GPU token chunk for bf16 inputs (``vocab_parallel.engine.memory_policy``)."""
    from vocab_parallel.engine import memory_policy as memory

    return memory.token_rows(tokens, vocab, 1, "cuda", heads, hidden, 2)


def keeps_g(tokens: int, vocab: int, hidden: int) -> bool:
    """Whether the engine keeps G on a GPU for bf16 inputs (the memory policy's choice)."""
    from vocab_parallel.engine import memory_policy as memory

    return memory.keeps_g(tokens, vocab, 1, hidden, 2, "cuda")


def column_width(tokens: int, vocab: int, hidden: int, what: str = "logits") -> int:
    """The engine's GPU column chunk of ``tokens`` rows (a share of the workspace)."""
    from vocab_parallel.engine import memory_policy as memory

    return memory.columns(tokens, vocab, "cuda", what, h=hidden)


def _gemm(name, m, n, k, chunks, out_bytes, extra_bytes=0.0):
    """``chunks`` GEMMs of ``[m, k] @ [k, n]`` (bf16 operands) per call."""
    flops = 2.0 * m * n * k * chunks
    bytes_ = chunks * (2.0 * (m * k + k * n) + out_bytes + extra_bytes)
    return Part(name, flops, bytes_, chunks, gemm=True)


# The distillation epilogue in torch ops (memory-saving mode: no kept blocks for the
# fused kernels), per column chunk, each reading and writing about one fp32 block
# (benchmarks/launches.py counted 2494 and 3899 launches per grad-in-forward call at the
# headline before the fused epilogue, less the GEMMs and the per-token work).
TORCH_EPILOGUE_OPS = {"kd": 37, "kd_jsd": 58}


def token_chunked(
    n: int, h: int, v: int, heads: int, passes: int, plan: str, fused: bool, kept=None
):
    """Grad-in-forward (``vocab_parallel.engine.grad_in_forward``): token chunks of ``R``
    rows, each head's fp32 logits kept for the chunk by one GEMM, the statistics (one
    pass, two for the JSD), ``G`` in the input dtype (the cross entropy's row kernel;
    ``fused=False``: today's distillation epilogue, torch ops on column chunks). Then, as
    the memory policy chooses (``keeps_g``): ``G`` kept whole and its two GEMMs made once
    in the backward (``grad_weight`` in vocabulary chunks of fp32 rows), times the
    upstream scalar and rounded once; or per chunk ``grad_input``'s fp32 rows by one GEMM
    and ``grad_weight`` added inside one GEMM into its fp32 ``[V, H]`` accumulator (whose
    read and write by each later chunk's GEMM is counted as a pass of its own: the first
    GPU run's prototype lost 0.8 ms a chunk to it), and the hand-out's one pass."""
    rows = token_rows(n, v, heads, h)
    chunks = -(-n // rows)
    r = n / chunks  # the average chunk (the last one may be shorter)
    logits = 4.0 * r * v  # one head's fp32 chunk
    parts = [
        _gemm(f"logits GEMM, head {i} (fp32 out)", r, v, h, chunks, logits) for i in range(heads)
    ]
    temps = 0.0
    if fused:  # (the epilogue writes G into a kept G itself: no copy)
        parts += [
            Part("epilogue: statistics (one pass)", 0, chunks * passes * heads * logits, chunks),
            Part("epilogue: G over the logits (one pass)", 0, chunks * (heads * logits + 2 * r * v),
                 chunks),
        ]  # fmt: skip
    else:
        width = column_width(rows, v, h, "epilogue")
        col_chunks = chunks * -(-v // width)
        ops = TORCH_EPILOGUE_OPS[plan] * col_chunks
        parts.append(Part(f"epilogue: torch ops ({TORCH_EPILOGUE_OPS[plan]} a column chunk)",
                          0, ops * 2 * 4.0 * rows * width, ops))  # fmt: skip
        temps = 4 * 4.0 * rows * width  # a handful of blocks live at once
    grads = 2.0 * (v + n) * h
    blocks = 4.0 * rows * v * heads + temps  # the chunk's kept blocks (and temporaries)
    if keeps_g(n, v, h):  # G kept (the inputs' dtype), its GEMMs in the backward
        width = column_width(1, v, h)  # grad_weight's fp32 rows at a time
        w_chunks = -(-v // width)
        f = 1.0 if kept is None or kept >= DENSE_ABOVE else kept  # the products' share
        if kept is not None:  # filtering: the mask, and the kept columns gathered
            parts.append(Part("backward: filter mask, max |G| per column (two reads)", 0,
                              2 * 2.0 * n * v, 4))  # fmt: skip
        if f < 1.0:
            parts.append(Part("backward: kept columns of G gathered, for each product", 0,
                              2 * 2 * 2.0 * n * v * f, 4 * w_chunks))  # fmt: skip
            parts.append(Part("backward: grad_input accumulator, each vocabulary chunk", 0,
                              (2 * w_chunks - 1) * 4.0 * n * h, 0))  # fmt: skip
        parts += [
            _gemm("backward: grad_input = G @ W (fp32 out)", n, h, v * f, 1, 4.0 * n * h),
            _gemm("backward: grad_weight rows = G.T @ x (fp32 out)", v * f / w_chunks, h, n,
                  w_chunks, 4.0 * v * h * f / w_chunks),
            Part("backward: x upstream scalar, rounded once (one pass)", 0, 6.0 * (v + n) * h,
                 w_chunks + 1),
        ]  # fmt: skip
        backward = 2.0 * n * v + 4.0 * (width * h + n * h) + grads
        extra = max(2.0 * n * v + blocks, backward) - grads
        return parts, extra, f"{chunks} token chunks of {rows} rows, G kept"
    parts += [
        _gemm("grad_input = G @ W (fp32 out)", r, h, v, chunks, 4.0 * r * h),
        _gemm("grad_weight += G.T @ x (fp32, in the GEMM)", v, h, r, chunks, 0),
        Part("grad_weight accumulator: read and written by each later GEMM", 0,
             (2 * chunks - 1) * 4.0 * v * h, 0),
        Part("hand-out: x upstream scalar, rounded once (one pass)", 0, 6.0 * (v + n) * h, 2),
    ]  # fmt: skip
    accumulators = 4.0 * (v + n) * h
    extra = max(accumulators + blocks, accumulators + grads) - grads
    return parts, extra, f"{chunks} token chunks of {rows} rows, G accumulated"


def column_chunked(n: int, h: int, v: int, heads: int = 1, fused: bool = True, plan: str = ""):
    """Memory-saving (and per-token upstream gradients): all tokens, vocabulary chunks of
    ``c`` columns (the "logits" share; two heads share it); the forward makes each
    chunk's products by a GEMM with fp32 output into one buffer and the statistics'
    kernel reads them, the backward makes them again and the row kernel writes ``G`` over
    them (bias, cap, temperature applied on the way), ``grad_input`` added inside a GEMM
    into its fp32 ``[N, H]`` accumulator (read and written by each later chunk) and
    ``grad_weight``'s rows by one GEMM with fp32 output into a scratch, rounded into the
    gradient (one pass)."""
    width = column_width(n, v, h) // heads
    chunks = -(-v // width)
    c = v / chunks  # the average chunk
    logits = 4.0 * n * c
    parts = []
    for i in range(heads):
        parts.append(_gemm(f"forward: logits GEMM, head {i} (fp32 out)", n, c, h, chunks, logits))
    if fused:
        parts.append(Part("forward: statistics (one pass)", 0, chunks * heads * logits, chunks))
    for i in range(heads):
        parts.append(_gemm(f"backward: logits GEMM again, head {i}", n, c, h, chunks, logits))
    if fused:
        parts.append(Part("backward: G over the products (one pass)", 0,
                          chunks * (heads * logits + 2.0 * n * c), chunks))  # fmt: skip
    else:
        ops = 2 * TORCH_EPILOGUE_OPS[plan] * chunks  # forward and backward
        parts.append(Part(f"epilogue: torch ops ({TORCH_EPILOGUE_OPS[plan]} a column chunk)",
                          0, ops * 2 * logits, ops))  # fmt: skip
    parts += [
        _gemm("grad_input += G @ W_c (fp32, in the GEMM)", n, h, c, chunks, 0),
        Part(
            "grad_input accumulator: read and written by each later GEMM",
            0,
            (2 * chunks - 1) * 4.0 * n * h,
            0,
        ),
        _gemm("grad_weight[c] = G.T @ x (fp32 scratch out)", c, h, n, chunks, 4.0 * c * h),
        Part("grad_weight rows rounded from the scratch (one pass)", 0, 6.0 * v * h, chunks),
    ]
    extra = heads * 4.0 * n * width + 4.0 * n * h + 4.0 * width * heads * h
    if not fused:
        extra += 4 * 4.0 * n * width  # the torch epilogue's temporaries
    return parts, extra, f"{chunks} column chunks of {width}"


def plan_parts(plan: str, n: int, h: int, v: int, fused: bool = True, kept=None):
    """The parts of one call of ``plan`` (the code's structure; ``fused=False``: today's
    distillation epilogue of torch ops instead of a fused one), its extra memory (bytes
    beyond inputs and the returned gradients), its chunking."""
    if plan in ("ce_ms", "stats"):
        return column_chunked(n, h, v)
    if plan == "stats_replay":  # + the candidates: one top-C pass per chunk, one all-gather
        parts, peak, chunking = column_chunked(n, h, v)
        chunks = int(chunking.split()[0])
        parts.insert(2, Part("candidates (top-C of each chunk)", 0, 4.0 * n * v, chunks))
        return parts, peak, chunking
    if plan == "kd_columns":
        return column_chunked(n, h, v, heads=2, fused=fused, plan="kd")
    heads = 2 if plan.startswith("kd") else 1
    return token_chunked(n, h, v, heads, 1 + (plan == "kd_jsd"), plan, fused, kept)


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
            "forward_kl_ms": "distillation, forward KL, memory_saving",
        }.get(row.key)
        from benchmarks.launches import count_call

        budget.make_constants()  # a process's constants are no call's launches
        if row.key == "ce_gemma":  # the default mode at this row's shape
            shape = dict(tokens=row.tokens, hidden=row.hidden, vocab=row.vocab)
            return count_call(budget._ce("auto", shape))
        if name is None:
            return None
        return count_call(budget.CALLS[name][0])
    except Exception as err:  # the model stands without the counts
        print(f"(launch count of {row.key} unavailable: {type(err).__name__}: {err})")
        return None


def _verdict(row: Row, ratio: float, mib: float) -> str:
    ok = ratio <= row.target_ratio and (row.target_mib is None or mib <= row.target_mib)
    return "met (predicted)" if ok else "NOT met (predicted)"


def report(row: Row, gpu: GPU, show_parts: bool) -> str:
    shape = (row.tokens, row.hidden, row.vocab)
    parts, peak, chunking = plan_parts(row.plan, *shape, True, row.kept)
    device = sum(p.ms(gpu) for p in parts)
    counts = today_counts(row)
    modelled = sum(p.launches for p in parts) + 6  # + the call's set-up and reduction
    launches = modelled if counts is None else counts.launches
    host = launches * gpu.host_us / 1e3  # the host issues them while the device works
    total = max(device, host)
    ref = row.reference_ms
    if ref is None and row.reference.startswith("exact"):
        base, _, _ = plan_parts(row.plan, *shape)
        ref = sum(p.ms(gpu) for p in base)
    elif ref is None and row.reference.startswith("untruncated"):
        base, _, _ = plan_parts("stats", row.tokens, row.hidden, row.vocab)
        ref = sum(p.ms(gpu) for p in base)
    elif ref is None:  # the floor, at the measured cuBLAS rate
        ref = floor_ms(row.tokens, row.hidden, row.vocab, gpu)
    ratio = total / ref
    mib = peak / (1 << 20)
    counted = "counted" if counts is not None else "modelled"
    syncs = "" if counts is None else f", {counts.syncs} host syncs"
    lines = [
        f"{row.what.replace('KEPT', f'{row.kept or 1:.0%}')}: {row.tokens} x {row.hidden} x "
        f"{row.vocab}",
        f"  measured (first GPU run, the code of that time): {row.baseline}",
        f"  today's code (model): {total:.1f} ms = {ratio:.2f}x {row.reference} "
        f"({ref:.1f} ms; device {device:.1f} ms, host {host:.1f} ms), {mib:.0f} MiB extra, "
        f"{launches} launches ({counted}){syncs}, {chunking}; target {row.target}: "
        + _verdict(row, ratio, mib),
    ]
    if show_parts:
        lines.append(f"  {'part':58s} {'GFLOP':>7s} {'GB':>7s} {'launches':>8s} {'ms':>7s}")
        for p in parts:
            lines.append(
                f"  {p.name:58s} {p.flops / 1e9:7.0f} {p.bytes / 1e9:7.2f} {p.launches:8d} "
                f"{p.ms(gpu):7.2f}"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--gpu", default="h200", choices=sorted(GPUS))
    p.add_argument("--tflops", type=float, help="dense bf16 peak (default: the GPU's)")
    p.add_argument("--tbps", type=float, help="HBM TB/s (default: the GPU's)")
    p.add_argument("--host-us", type=float, help="host microseconds per launch")
    p.add_argument("--row", choices=[r.key for r in ROWS], action="append")
    p.add_argument("--parts", action="store_true", help="each part's FLOPs, bytes, time")
    p.add_argument("--kept", type=float, help="filtering rows: the share of columns kept")
    args = p.parse_args(argv)
    gpu = GPUS[args.gpu]
    gpu = GPU(
        gpu.name, args.tflops or gpu.tflops, args.tbps or gpu.tbps,
        args.host_us or gpu.host_us, gpu.gemm_efficiency,
    )  # fmt: skip
    print(f"{gpu.name}: {gpu.tflops:g} TFLOP/s bf16 x {gpu.gemm_efficiency} (cuBLAS at these "
          f"shapes), {gpu.tbps:g} TB/s, {gpu.host_us:g} us of host time a launch")  # fmt: skip
    for row in ROWS:
        if args.row and row.key not in args.row:
            continue
        if args.kept is not None and row.key == "filter_trained":
            row = replace(row, kept=args.kept)
        print(report(row, gpu, args.parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
