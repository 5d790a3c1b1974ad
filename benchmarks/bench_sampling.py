"""Sampling replay: the sampler's truncated log-probs + entropy against the untruncated ones.

One process, the same inputs for every row: forward + backward of ``sum(logprobs) +
sum(entropy)`` (the targets drawn from the top of each token's distribution, as a sampler
draws them), the torch backend on CPU (Triton on CUDA), the default mode:

    untruncated     vocab_parallel_token_stats(..., entropy=True)
    top-k 50        sample_top_k=50
    top-p 0.9       sample_top_p=0.9
    top-k + top-p   sample_top_k=50, sample_top_p=0.9 (vLLM's usual pair)
    min-p 0.05      sample_min_p=0.05

    python benchmarks/bench_sampling.py                  # tokens 1024, H 256, V 32768
    python benchmarks/bench_sampling.py --vocab 131072
    python benchmarks/bench_sampling.py --quick          # tokens 64, V 4096

The logits are scaled like a trained head's (a few tokens hold most of the mass: ``--scale``
sets the spread); each row's median time of ``--repeats`` after a warm-up, and its ratio to
the untruncated row (the target: at most 2x).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import vocab_parallel as vp  # noqa: E402

ROWS = {
    "untruncated": {},
    "top-k 50": dict(sample_top_k=50),
    "top-p 0.9": dict(sample_top_p=0.9),
    "top-k 50 + top-p 0.9": dict(sample_top_k=50, sample_top_p=0.9),
    "min-p 0.05": dict(sample_min_p=0.05),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--scale", type=float, default=0.3, help="weight scale: the logits' spread")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tokens 64, vocab 4096, 2 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.vocab, args.repeats = 64, 4096, 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(device)
    w = (torch.randn(args.vocab, args.hidden, generator=g) * args.scale).to(device)
    z = x @ w.T
    y = z.topk(3, dim=1).indices.gather(1, torch.randint(0, 3, (args.tokens, 1)).to(device))[:, 0]
    del z
    threads = torch.get_num_threads()
    print(f"tokens {args.tokens}, hidden {args.hidden}, vocab {args.vocab}, fp32, {device}, "
          f"{threads} threads; fwd + bwd of sum(logprobs) + sum(entropy)")  # fmt: skip
    print("| what | ms (median) | vs untruncated | kept targets | mean kept log-mass |")
    print("|---|---|---|---|---|")
    base = None
    for name, kw in ROWS.items():
        times, out = [], None
        for i in range(args.repeats + 1):
            h = x.clone().requires_grad_(True)
            wt = w.clone().requires_grad_(True)
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = vp.vocab_parallel_token_stats(h, wt, y, entropy=True, **kw)
            lp = torch.where(torch.isfinite(out.logprobs), out.logprobs, 0.0)
            (lp.sum() + out.entropy.sum()).backward()
            if device == "cuda":
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        ms = 1e3 * statistics.median(times)
        base = base or ms
        kept = int(torch.isfinite(out.logprobs).sum())
        mass = "-" if out.kept_logmass is None else f"{float(out.kept_logmass.mean()):.3f}"
        print(f"| {name} | {ms:.1f} | {ms / base:.2f}x | {kept}/{args.tokens} | {mass} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
