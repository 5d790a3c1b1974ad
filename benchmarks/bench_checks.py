"""Benchmark: what the loss's input checks cost on the hot path.

The loss compares what must agree across the ranks (``vocab_parallel.parallel.agreement``: options,
dtypes, gradient needs, token counts, checksums of targets and hidden states; one small
collective), checks every target id against the vocabulary and, on CPU, exchanges one
small row per rank to check the shard layout and the token counts at every call
(``check_inputs=True``, the default; on CUDA the exchange runs once per layout and token
count and the target check is a device-side assertion). This script times, in the same
processes, one forward + backward of the loss with the checks, the same without them
(``check_inputs=False``), and the checks alone (many repetitions, so their few
microseconds are measurable), and prints the checks' share of a step.

    python benchmarks/bench_checks.py                     # BT=4096 H=1024 V=32768, 1 and 2 ranks
    python benchmarks/bench_checks.py --bt 512 --hidden 128 --vocab 4096 --worlds 1

Each world size runs in fresh processes (gloo between ranks, one thread per rank for 2
ranks on 2 cores); the shard layout is stated (as ``VocabParallelLMHead`` does).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Run as a script, Python puts benchmarks/ first on sys.path; the repository root must be
# there for ``benchmarks`` and the checkout's ``vocab_parallel`` to import.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import harness  # noqa: E402


def run_case(case: dict) -> dict:
    """In each rank: time fwd+bwd with and without the checks, and the checks alone."""
    import os

    import torch.distributed as dist

    from vocab_parallel import LossOptions, shard_bounds, vocab_parallel_linear_cross_entropy
    from vocab_parallel.parallel.agreement import check_agreement, fingerprint
    from vocab_parallel.parallel.checks import check_targets
    from vocab_parallel.parallel.layout import resolve_layout

    rank, world = int(os.environ.get("RANK", "0")), case["world"]
    group = None
    if world > 1:
        dist.init_process_group(
            "gloo", init_method="file://" + case["store"], rank=rank, world_size=world
        )
        group = dist.group.WORLD
    bt, h, v = case["bt"], case["h"], case["v"]
    g = torch.Generator().manual_seed(0)
    lo, hi = shard_bounds(v, world)[rank]
    x = torch.randn(bt, h, generator=g).requires_grad_(True)
    w = (torch.randn(v, h, generator=g) / h**0.5)[lo:hi].clone().requires_grad_(True)
    y = torch.randint(0, v, (bt,), generator=g)
    y[::20] = -100
    opts = dict(process_group=group, vocab_start_index=lo, global_vocab_size=v, backend="torch")

    def step(check: bool) -> float:
        if group is not None:
            dist.barrier(group)
        t0 = time.perf_counter()
        vocab_parallel_linear_cross_entropy(x, w, y, check_inputs=check, **opts).backward()
        return time.perf_counter() - t0

    step(True)  # warm-up
    with_checks, without = [], []
    for _ in range(case["repeats"]):  # interleaved: both see the same machine load
        with_checks.append(step(True))
        without.append(step(False))

    n = case["check_repeats"]
    if group is not None:
        dist.barrier(group)
    t0 = time.perf_counter()
    stated = LossOptions(vocab_start_index=lo, global_vocab_size=v)
    for _ in range(n):
        check_agreement(fingerprint(stated, x, w, y), group, x.device)
        layout = resolve_layout(hi - lo, group, lo, v, bt, x.device, recheck=True)
        check_targets(y, -100, layout.global_size)
    checks = (time.perf_counter() - t0) / n
    if group is not None:
        dist.destroy_process_group()
    return {"with": min(with_checks), "without": min(without), "checks": checks}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bt", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    p.add_argument("--repeats", type=int, default=3, help="timed steps each way")
    p.add_argument("--check-repeats", type=int, default=200, help="repetitions of the checks")
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    harness.print_load_before()
    rows = []
    for world in args.worlds:
        case = dict(
            world=world,
            bt=args.bt,
            h=args.hidden,
            v=args.vocab,
            repeats=args.repeats,
            check_repeats=args.check_repeats,
            threads=harness.threads_per_rank(world, cuda=False),
        )
        res = harness.run_children(__file__, case, world=world, timeout=args.timeout)
        if res["status"] != "ok":
            print(f"world {world}: {res['status']}")
            return 1
        worst = max(res["ranks"], key=lambda r: r["checks"])
        rows.append(
            [
                str(world),
                f"{worst['with'] * 1e3:.0f}",
                f"{worst['without'] * 1e3:.0f}",
                f"{worst['checks'] * 1e6:.0f}",
                f"{100 * worst['checks'] / worst['without']:.3f}%",
                f"{worst['with'] / worst['without']:.3f}",
            ]
        )
        harness.print_progress(f"world {world}", t_start)
    print(f"\nBT={args.bt} H={args.hidden} V={args.vocab}, CPU, torch backend, memory-saving")
    head = ["ranks", "fwd+bwd ms, checks on", "checks off", "checks alone us", "share", "on/off"]
    print(harness.markdown_table(head, rows))
    harness.print_load_after(t_start)
    return 0


if __name__ == "__main__":
    sys.exit(harness.script_main(main, run_case))
