"""Demonstration of the backward operator: the project's main job for now.

It builds one rank's uneven vocabulary shard of a small LM head (default: BT=512 tokens,
H=256, a global vocabulary of 4096 split over 3 fake ranks, this is rank 1), computes
the forward's global statistics, and runs ``fused_linear_cross_entropy_loss_grad`` in
both modes (memory-saving: from ``logits_max``/``sum_exp_logits``; high-performance:
from the saved softmax) on every backend available:

- CUDA: the Triton kernels and the torch backend, at the full shape;
- CPU: the torch backend at the full shape, and, if triton is installed, the same Triton
  kernels under Triton's interpreter (``TRITON_INTERPRET=1``) at a tiny shape.

Each result is compared with the float64 reference (``vocab_parallel.reference``) and
timed against a naive PyTorch implementation of the same formula (full ``[BT, V]``
logits, softmax, one-hot, two matmuls). Finally the shards of all fake ranks are summed
and compared with autograd of the unsharded ``F.cross_entropy(F.linear(x, W), y)``.
Exits with status 1 on any mismatch.

    python launch/demo.py                       # the embedded default
    python launch/demo.py --dtypes fp32 --bt 1024 --vocab 8192 --world 4 --rank 3
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Max |ours - reference| / max |reference| allowed. Both sides round G to the input dtype,
# so what is left is fp32 accumulation order and the final rounding of the outputs.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}
MODES = ("memory_saving", "high_performance")
IGNORE_INDEX = -100


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bt", type=int, default=512, help="tokens (rows of input)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size H")
    p.add_argument("--vocab", type=int, default=4096, help="global vocabulary size")
    p.add_argument("--world", type=int, default=3, help="fake tensor-parallel world size")
    p.add_argument("--rank", type=int, default=1, help="the fake rank whose shard is shown")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--repeats", type=int, default=5, help="timed calls (best is shown)")
    p.add_argument(
        "--tiny",
        type=int,
        nargs=3,
        default=(64, 48, 600),
        metavar=("BT", "H", "V"),
        help="shape for the Triton interpreter on CPU (it runs numpy per tile: keep it tiny)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0 <= args.rank < args.world:
        p.error(f"--rank must be in [0, {args.world}), got {args.rank}")
    if args.vocab < args.world:
        p.error("--vocab must be at least --world (every shard needs a row)")
    return args


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        sys.exit("demo: --device cuda requested but torch.cuda.is_available() is False")
    return torch.device(name)


def shard_bounds(vocab: int, world: int, rank: int) -> tuple[int, int]:
    """Contiguous shards in rank order; the first ``vocab % world`` ranks get one more row."""
    base, extra = divmod(vocab, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class Problem:
    """One LM-head problem: full weight, tokens, targets, upstream grad, global statistics."""

    def __init__(self, bt: int, h: int, vocab: int, dtype: torch.dtype, device, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.dtype, self.device, self.vocab = dtype, device, vocab
        x = torch.randn(bt, h, generator=gen) * (2.0 / h**0.5)
        w = torch.randn(vocab, h, generator=gen)
        self.x = x.to(device=device, dtype=dtype)
        self.w = w.to(device=device, dtype=dtype)
        target = torch.randint(0, vocab, (bt,), generator=gen)
        ignored = torch.rand(bt, generator=gen) < 0.1
        self.target = torch.where(ignored, IGNORE_INDEX, target).to(device)
        # Random per-token upstream gradients; ignored tokens get 0, as a loss would give.
        grad = torch.rand(bt, generator=gen) + 0.5
        self.grad = torch.where(ignored, 0.0, grad).to(device)
        # The forward's global statistics, from the full (gathered) logits in float64.
        from vocab_parallel.reference import global_statistics

        lmax, sumexp, probs = global_statistics(self.x, self.w)
        self.logits_max, self.sum_exp = lmax.float(), sumexp.float()
        self.probs = probs.float()

    def shard(self, start: int, end: int) -> dict:
        """Operator arguments for the shard holding global rows ``[start, end)``."""
        from vocab_parallel import pack_target_mask

        t = self.target
        not_here = (t < start) | (t >= end)  # ignored targets (-100) are never here
        return {
            "weight": self.w[start:end],
            "not_here": not_here,
            "target_mask": pack_target_mask(not_here),  # the bit-packed form
            "masked_target": torch.where(not_here, 0, t - start).to(torch.int32),
            "softmax": self.probs[:, start:end].contiguous(),
        }


def best_time(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Best wall time of ``repeats`` calls, in seconds (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(max(1, repeats)):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def rel_err(ours: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> float:
    """max |ours - ref| / max |ref| over both outputs (the larger of the two)."""
    errs = []
    for a, b in zip(ours, ref, strict=True):
        a, b = a.double(), b.double()
        scale = b.abs().max().item() if b.numel() else 0.0
        diff = (a - b).abs().max().item() if b.numel() else 0.0
        errs.append(diff / scale if scale > 0 else diff)
    return max(errs)


def run_case(args, device, dtype, backend, shape, interpreted) -> dict:
    from vocab_parallel import fused_linear_cross_entropy_loss_grad as op
    from vocab_parallel.reference import loss_grad_reference, naive_loss_grad

    bt, h, vocab = shape
    prob = Problem(bt, h, vocab, dtype, device, args.seed)
    start, end = shard_bounds(vocab, args.world, args.rank)
    s = prob.shard(start, end)
    repeats = 1 if interpreted else args.repeats
    rows = []
    for mode in MODES:
        stats = (
            {"logits_max": prob.logits_max, "sum_exp_logits": prob.sum_exp, "softmax": None}
            if mode == "memory_saving"
            else {"softmax": s["softmax"]}
        )
        call = functools.partial(
            op, prob.grad, prob.x, s["weight"], s["target_mask"], s["masked_target"],
            backend=backend, **stats,
        )  # fmt: skip
        naive = functools.partial(
            naive_loss_grad, prob.grad, prob.x, s["weight"], s["not_here"],
            s["masked_target"], prob.logits_max, prob.sum_exp, stats["softmax"],
        )  # fmt: skip
        ours = call()
        ref = loss_grad_reference(
            prob.grad.cpu(), prob.x.cpu(), s["weight"].cpu(), s["not_here"].cpu(),
            s["masked_target"].cpu(), 0.0, prob.logits_max.cpu(), prob.sum_exp.cpu(),
            None if stats["softmax"] is None else stats["softmax"].cpu(),
        )  # fmt: skip
        err = rel_err(tuple(t.cpu() for t in ours), ref)
        t_ours = best_time(call, repeats, device)
        t_naive = best_time(naive, repeats, device)
        rows.append(
            {
                "mode": mode,
                "backend": backend + (" (interpreter)" if interpreted else ""),
                "dtype": str(dtype).replace("torch.", ""),
                "shape": f"{bt}x{h}x{end - start} (of {vocab})",
                "err": err,
                "tol": TOLERANCE[dtype],
                "ours_ms": t_ours * 1e3,
                "naive_ms": t_naive * 1e3,
                "interpreted": interpreted,
            }
        )
    return rows


def check_shards_sum(args, device) -> tuple[float, bool]:
    """All fake ranks' shards vs autograd of the unsharded loss, fp32 inputs."""
    from vocab_parallel import fused_linear_cross_entropy_loss_grad as op

    prob = Problem(args.bt, args.hidden, args.vocab, torch.float32, device, args.seed)
    grad_input = torch.zeros_like(prob.x)
    grad_weight = []
    for rank in range(args.world):
        s = prob.shard(*shard_bounds(args.vocab, args.world, rank))
        gi, gw = op(
            prob.grad, prob.x, s["weight"], s["target_mask"], s["masked_target"],
            logits_max=prob.logits_max, sum_exp_logits=prob.sum_exp,
        )  # fmt: skip
        grad_input += gi  # what the module's allreduce(SUM) of grad_input does
        grad_weight.append(gw)
    x = prob.x.double().requires_grad_()
    w = prob.w.double().requires_grad_()
    losses = F.cross_entropy(
        F.linear(x, w), prob.target, ignore_index=IGNORE_INDEX, reduction="none"
    )
    (losses * prob.grad.double()).sum().backward()
    err = rel_err((grad_input, torch.cat(grad_weight)), (x.grad, w.grad))
    return err, err <= TOLERANCE[torch.float32]


def print_table(rows: list[dict]) -> None:
    head = ["mode", "backend", "dtype", "BT x H x V", "max rel err", "tol", "ours ms"]
    head += ["naive ms", "ours/naive", "check"]
    body = [
        [
            r["mode"], r["backend"], r["dtype"], r["shape"], f"{r['err']:.2e}",
            f"{r['tol']:.0e}", f"{r['ours_ms']:.2f}", f"{r['naive_ms']:.2f}",
            "-" if r["interpreted"] else f"{r['ours_ms'] / r['naive_ms']:.2f}",
            "ok" if r["err"] <= r["tol"] else "MISMATCH",
        ]
        for r in rows
    ]  # fmt: skip
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body, strict=True)]
    for line in [head, ["-" * w for w in widths], *body]:
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = pick_device(args.device)
    interpret = device.type == "cpu" and importlib.util.find_spec("triton") is not None
    if interpret:
        # Must happen before triton is first imported (vocab_parallel imports it lazily).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.manual_seed(args.seed)
    start, end = shard_bounds(args.vocab, args.world, args.rank)
    print(
        f"vocab_parallel demo on {device} (torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads): rank {args.rank} of {args.world} fake ranks "
        f"holds vocabulary rows [{start}, {end}) of {args.vocab}; best of {args.repeats} calls"
    )
    full = (args.bt, args.hidden, args.vocab)
    plan = []  # (backend, shape, interpreted)
    if device.type == "cuda":
        plan += [("triton", full, False), ("torch", full, False)]
    else:
        plan.append(("torch", full, False))
        if interpret:
            plan.append(("triton", tuple(args.tiny), True))
        else:
            print("(triton is not installed: the Triton kernels are skipped)")
    rows = []
    for backend, shape, interpreted in plan:
        for name in args.dtypes:
            rows += run_case(args, device, DTYPES[name], backend, shape, interpreted)
    print()
    print_table(rows)
    if any(r["interpreted"] for r in rows):
        print("(interpreter rows: Triton kernels run as numpy on the CPU, checked, not fast)")
    err, ok = check_shards_sum(args, device)
    print(
        f"\nvocabulary parallelism: grad_input summed over {args.world} shards and grad_weight "
        f"concatenated vs autograd of the unsharded F.cross_entropy (fp32 inputs): "
        f"max rel err {err:.2e} {'ok' if ok else 'MISMATCH'}"
    )
    bad = [r for r in rows if not r["err"] <= r["tol"]]
    if bad or not ok:
        print(f"\nFAILED: {len(bad) + (not ok)} mismatch(es) against the reference")
        return 1
    print("\nall results match the float64 reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
