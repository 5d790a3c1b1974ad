"""Offsets past 2^31 on a real GPU: the Triton kernels against the torch backend.

    python scripts/gpu_large_offsets.py            # needs one CUDA GPU with ~40 GiB free
    python scripts/gpu_large_offsets.py --dry-run  # the same code on CPU, interpreter, tiny

Case "softmax": high-performance mode at BT=16,800, H=64, V=128,256 (Llama-3's vocabulary
at TP 1): the saved fp32 softmax has 2.15e9 elements, so its rows from 16,744 on sit past
2^31 (the forward stores the logits there, the backward reads them back).
Case "weight": memory-saving mode with a shard of V x H = 532,480 x 4,096 > 2^31 weight
elements (the logits recompute reads rows past 2^31).

Each case runs the loss forward and backward with both backends (``reduction="none"``,
random upstream gradients) and compares losses and gradients; the tokens past the 2^31
boundary are also checked against a float64 reference of their rows. Prints a table;
exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import vocab_parallel as vp  # noqa: E402

LIMIT = 2**31
CASES = {
    # name: (BT, H, V, mode)
    "softmax": (16_800, 64, 128_256, "high_performance"),
    "weight": (512, 4_096, 532_480, "memory_saving"),
}
# --dry-run: the same cases at sizes Triton's interpreter runs in seconds (no 2^31 there).
DRY_CASES = {"softmax": (40, 16, 300, "high_performance"), "weight": (8, 32, 600, "memory_saving")}


def rel(a: torch.Tensor, b: torch.Tensor, rows: int = 4096) -> float:
    """max |a - b| / max |b|, in float64, a block of rows at a time (big gradients)."""
    err, scale = 0.0, 0.0
    for a_, b_ in zip(a.split(rows), b.split(rows), strict=True):
        a_, b_ = a_.double(), b_.double()
        if not torch.isfinite(a_).all():
            return float("inf")
        err = max(err, (a_ - b_).abs().max().item())
        scale = max(scale, b_.abs().max().item())
    return err / max(scale, 1e-12)


def run(backend, x, w, y, up, mode):
    hidden = x.clone().requires_grad_(True)
    weight = w.clone().requires_grad_(True)
    loss = vp.vocab_parallel_linear_cross_entropy(
        hidden, weight, y, reduction="none", mode=mode, backend=backend
    )
    loss.backward(up)
    if x.is_cuda:
        torch.cuda.synchronize()
    out = loss.detach(), hidden.grad, weight.grad
    del hidden, weight, loss
    return out


def check(name: str, dtype: torch.dtype, seed: int = 0, dry_run: bool = False) -> list[dict]:
    bt, h, v, mode = (DRY_CASES if dry_run else CASES)[name]
    dev = torch.device("cpu" if dry_run else "cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(bt, h, device=dev, generator=gen).to(dtype)
    w = (torch.randn(v, h, device=dev, generator=gen) / h**0.5 * 4).to(dtype)
    y = torch.randint(0, v, (bt,), device=dev, generator=gen)
    y[::7] = -100
    up = torch.rand(bt, device=dev, generator=gen) + 0.5

    t0 = time.time()
    ours = run("triton", x, w, y, up, mode)
    t1 = time.time()
    ref = run("torch", x, w, y, up, mode)
    t2 = time.time()
    # Rows past the boundary: the last rows of the softmax; for the weight case the
    # columns past it enter every row, so the last rows serve as well.
    far = slice(max(0, bt - 64), bt)
    x64 = x[far].double()
    logits64 = torch.cat([x64 @ part.double().T for part in w.split(65_536)], dim=1)
    loss64 = F.cross_entropy(logits64, y[far], reduction="none")
    tol = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    rows = []
    for what, a, b, limit in (
        ("loss", ours[0], ref[0], 1e-5),
        ("grad_hidden", ours[1], ref[1], tol),
        ("grad_weight", ours[2], ref[2], tol),
        ("loss rows past 2^31 vs fp64", ours[0][far], loss64, 1e-5),
    ):
        err = rel(a, b)
        rows.append(dict(case=name, dtype=str(dtype)[6:], what=what, err=err, ok=err <= limit))
    rows[0]["seconds"] = f"triton {t1 - t0:.1f} s, torch {t2 - t1:.1f} s"
    if dry_run:
        pass
    elif name == "softmax":
        assert bt * v > LIMIT and (bt - 1) * v >= LIMIT
    else:
        assert v * h > LIMIT
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    p.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_large_offsets: no CUDA device", file=sys.stderr)
        return 2
    dtypes = [getattr(torch, d) for d in (args.dtypes or ["bfloat16"])]
    rows = []
    for name in args.cases:
        for dtype in dtypes:
            rows += check(name, dtype, dry_run=args.dry_run)
            if not args.dry_run:
                torch.cuda.empty_cache()
    print("| case | dtype | compared | max rel err | ok | time |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ok = "yes" if r["ok"] else "NO"
        print(
            f"| {r['case']} | {r['dtype']} | {r['what']} | {r['err']:.1e} | {ok} "
            f"| {r.get('seconds', '')} |"
        )
    bad = [r for r in rows if not r["ok"]]
    print(f"\n{'FAILED' if bad else 'OK'}: {len(rows) - len(bad)}/{len(rows)} comparisons agree")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
