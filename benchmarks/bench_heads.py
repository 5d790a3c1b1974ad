"""RL token statistics and distillation on one device, every implementation in this process.

The GPU check's benchmark of the objectives beside the cross entropy (the first GPU run's
table, ``docs/benchmarks.md``, "GPU"), one process (a fresh CUDA process costs seconds):

    stats   log-probs + entropy of 4096 tokens, fwd + bwd of sum(a * logp + b * H) with
            random per-token a, b: ours (``vocab_parallel_token_stats``, default mode)
            against materialised torch (``x @ W.T``, ``log_softmax``, ``-(p logp).sum``)
    fkl     the forward KL to a dense teacher head (same hidden size), fwd + bwd to the
            student's hidden states and weight: ours (default and memory-saving mode)
            against materialised (both heads' logits, ``F.kl_div`` of the log-softmaxes)
    jsd     the JSD (beta 0.5): ours, materialised, and Liger-Kernel's fused linear JSD
            (``LigerFusedLinearJSDLoss``, when ``liger_kernel`` imports)

Each row: the best of ``--repeats`` timed calls after two warm-ups (CUDA: synchronised
wall time), the peak memory of the first beyond its inputs and the gradients
(``benchmarks/memory.py``), the ratio of time and memory to the materialised row of its
objective, and the loss's relative difference from it (the run fails above 1e-2 in
bf16, whose materialised logits are rounded to bf16 by their GEMM as users' are; 1e-4 in
fp32).

    python benchmarks/bench_heads.py --device cuda                 # 4096 x 4096 x 128256, bf16
    python benchmarks/bench_heads.py --device cpu --tokens 64 --hidden 32 --vocab 500
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from benchmarks.harness import markdown_table, nbytes, timed_calls  # noqa: E402

OBJECTIVES = ("stats", "fkl", "jsd")


def _materialised(objective, x, w, xt, wt, y, a, b):
    z = (x @ w.T).float()
    logp = torch.log_softmax(z, dim=-1)
    if objective == "stats":
        lp = logp.gather(1, y[:, None])[:, 0]
        ent = -(logp.exp() * logp).sum(dim=-1)
        return (a * lp + b * ent).sum()
    logq = torch.log_softmax((xt @ wt.T).float(), dim=-1)
    if objective == "fkl":
        return F.kl_div(logp, logq, log_target=True, reduction="batchmean")
    m = torch.logsumexp(torch.stack([logp, logq]) + torch.tensor(0.5).log(), dim=0)
    kl_t = F.kl_div(m, logq, log_target=True, reduction="batchmean")
    kl_s = F.kl_div(m, logp, log_target=True, reduction="batchmean")
    return 0.5 * kl_t + 0.5 * kl_s


def _ours(objective, x, w, xt, wt, y, a, b, mode="auto"):
    import vocab_parallel as vp

    if objective == "stats":
        out = vp.vocab_parallel_token_stats(x, w, y, entropy=True)
        return (a * out.logprobs + b * out.entropy).sum()
    div = "forward_kl" if objective == "fkl" else "jsd"
    return vp.vocab_parallel_distillation_loss(x, w, teacher_hidden=xt, teacher_weight=wt,
                                               divergence=div, mode=mode)  # fmt: skip


def _ours_memory_saving(objective, *args):
    return _ours(objective, *args, mode="memory_saving")


def _liger():
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

    jsd = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.5)
    return lambda objective, x, w, xt, wt, y, a, b: jsd(x, w, xt, wt, y)


def run(args) -> list[dict]:
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    g = torch.Generator().manual_seed(0)
    n, h, v = args.tokens, args.hidden, args.vocab
    x = torch.randn(n, h, generator=g).to(device, dtype)
    w = (torch.randn(v, h, generator=g) * h**-0.5).to(device, dtype)
    xt = torch.randn(n, h, generator=g).to(device, dtype)
    wt = (torch.randn(v, h, generator=g) * h**-0.5).to(device, dtype)
    y = torch.randint(0, v, (n,), generator=g).to(device)
    a, b = torch.rand(n, generator=g).to(device), torch.rand(n, generator=g).to(device)
    impls = {"materialised": _materialised, "ours": _ours,
             "ours memory_saving": _ours_memory_saving}  # fmt: skip
    try:
        impls["liger"] = _liger()
    except Exception as exc:  # noqa: BLE001 (a missing peer is a row that says why)
        print(f"liger: not run ({type(exc).__name__}: {str(exc)[:120]})")
    rows = []
    for objective in args.objectives:
        for name, fn in impls.items():
            if name == "liger" and objective != "jsd":
                continue
            if name == "ours memory_saving" and objective == "stats":
                continue  # (the token statistics' default mode is memory-saving's plan)
            leaf = {}

            def before(leaf=leaf):
                leaf["x"] = x.detach().clone().requires_grad_(True)
                leaf["w"] = w.detach().clone().requires_grad_(True)

            def call(fn=fn, leaf=leaf, objective=objective):
                loss = fn(objective, leaf["x"], leaf["w"], xt, wt, y, a, b)
                loss.backward()
                return loss.detach().float(), leaf["x"].grad, leaf["w"].grad

            try:
                for _ in range(2):  # warm-ups: compiles, caches
                    before()
                    call()
                res = timed_calls(call, device, args.repeats, before=before,
                                  keep=lambda out: (float(out[0]), nbytes(out[1:])))  # fmt: skip
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(objective=objective, impl=name, error=f"{type(exc).__name__}"))
                continue
            loss, grads = res["kept"]
            rows.append(dict(objective=objective, impl=name, ms=1e3 * min(res["times_s"]),
                             mib=(res["peak"].extra_bytes - grads) / 2**20, loss=loss))  # fmt: skip
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=OBJECTIVES)
    args = p.parse_args(argv)
    rows = run(args)
    base = {r["objective"]: r for r in rows if r["impl"] == "materialised" and "ms" in r}
    table, bad = [], []
    for r in rows:
        ref = base.get(r["objective"])
        if "error" in r or ref is None:
            table.append([r["objective"], r["impl"], r.get("error", "-"), "", "", "", ""])
            continue
        diff = abs(r["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-12)
        bad += [r] if diff > (1e-2 if args.dtype == "bf16" else 1e-4) else []
        table.append([r["objective"], r["impl"], f"{r['ms']:.1f}", f"{r['ms'] / ref['ms']:.2f}x",
                      f"{r['mib']:.0f}", f"{r['mib'] / max(ref['mib'], 1e-9):.2f}x",
                      f"{diff:.1e}"])  # fmt: skip
    head = ["objective", "impl", "ms", "vs materialised", "extra MiB", "vs materialised",
            "loss rel. diff"]  # fmt: skip
    print(f"{args.tokens} x {args.hidden} x {args.vocab}, {args.dtype}, {args.device}, best of "
          f"{args.repeats}")  # fmt: skip
    print(markdown_table(head, table))
    ours = [r for r in rows if r["impl"] == "ours"]
    ok = not bad and ours and all("ms" in r for r in ours)
    print("OK: every objective ran and agrees with materialised logits" if ok else
          f"FAILED: {[(r['objective'], r['impl']) for r in bad]} off the materialised loss, "
          f"or a row of ours did not run")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
