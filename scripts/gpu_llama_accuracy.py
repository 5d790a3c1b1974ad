"""Loss, grad_input and grad_weight at a Llama-3-8B head, every mode, against float64.

    python scripts/gpu_llama_accuracy.py            # BT 8192, H 4096, V 128,256, bf16, CUDA
    python scripts/gpu_llama_accuracy.py --dry-run  # CPU, Triton's interpreter, tiny sizes

For each mode (``auto``, which runs grad_in_forward for this mean loss, ``memory_saving``,
``high_performance``) the Triton backend computes the mean loss (5% of the tokens
ignored) and its gradients on bf16 inputs; the reference is the same loss in float64 on
the same (bf16-valued) inputs, computed a block of rows at a time. Each is compared as
max |ours - ref| / max |ref|; bf16 gradients carry G rounded to bf16 (2^-8 relative),
hence the tolerances. Also printed: each mode's time and peak memory of the call.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = ("auto", "memory_saving", "high_performance")
IGNORE = -100
TOL = {"loss": 1e-4, "grad_input": 2e-2, "grad_weight": 2e-2}


def reference(x, w, y, rows: int):
    """float64 mean CE of ``x @ w.T`` and its gradients, ``rows`` rows at a time."""
    import torch

    x64, w64 = x.double(), w.double()
    valid = y != IGNORE
    count = max(int(valid.sum()), 1)
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    gx = torch.empty_like(x64)
    gw = torch.zeros_like(w64)
    for r0 in range(0, x.shape[0], rows):
        xs, ys, vs = x64[r0 : r0 + rows], y[r0 : r0 + rows], valid[r0 : r0 + rows]
        logits = xs @ w64.T
        lse = torch.logsumexp(logits, dim=1)
        safe = torch.where(vs, ys, 0)
        picked = logits.gather(1, safe[:, None])[:, 0]
        loss += ((lse - picked) * vs).sum()
        g = torch.softmax(logits, dim=1)
        del logits
        g[torch.arange(len(ys), device=x.device), safe] -= 1.0
        g *= (vs.double() / count)[:, None]
        gx[r0 : r0 + rows] = g @ w64
        gw += g.T @ xs
        del g
    return loss / count, gx, gw


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    if not bool(a.isfinite().all()):
        return float("inf")
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny")
    p.add_argument("--bt", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128_256)
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        args.bt, args.hidden, args.vocab = 40, 32, 300
    import torch

    import vocab_parallel as vp

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_llama_accuracy: no CUDA device (--dry-run runs on CPU)", file=sys.stderr)
        return 2
    dev = torch.device("cpu" if args.dry_run else "cuda")
    cuda = dev.type == "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    bt, h, v = args.bt, args.hidden, args.vocab
    x = torch.randn(bt, h, device=dev, generator=gen).to(torch.bfloat16)
    w = (torch.randn(v, h, device=dev, generator=gen) * (2.0 / h**0.5)).to(torch.bfloat16)
    y = torch.randint(0, v, (bt,), device=dev, generator=gen)
    y[torch.rand(bt, device=dev, generator=gen) < 0.05] = IGNORE

    t0 = time.time()
    ref = reference(x, w, y, rows=1024)
    if cuda:
        torch.cuda.synchronize()
    print(f"# float64 reference: {time.time() - t0:.1f} s; BT={bt} H={h} V={v} bf16")
    rows = []
    for mode in MODES:
        hidden = x.clone().requires_grad_(True)
        weight = w.clone().requires_grad_(True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t = time.perf_counter()
        loss = vp.vocab_parallel_linear_cross_entropy(
            hidden, weight, y, ignore_index=IGNORE, mode=mode, backend="triton"
        )
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else float("nan")
        for what, ours, theirs in (
            ("loss", loss.detach(), ref[0]),
            ("grad_input", hidden.grad, ref[1]),
            ("grad_weight", weight.grad, ref[2]),
        ):
            err = rel(ours, theirs)
            rows.append(dict(mode=mode, what=what, err=err, ok=err <= TOL[what],
                             seconds=seconds, peak=peak))  # fmt: skip
        del hidden, weight, loss
    print("| mode | compared | max rel err vs fp64 | ok | first call s | peak GiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['what']} | {r['err']:.1e} | {'yes' if r['ok'] else 'NO'} "
            f"| {r['seconds']:.2f} | {r['peak']:.2f} |"
        )
    bad = [r for r in rows if not r["ok"]]
    print(f"\n{'FAILED' if bad else 'OK'}: {len(rows) - len(bad)}/{len(rows)} agree with float64")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
