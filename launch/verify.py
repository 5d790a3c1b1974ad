"""Check the vocabulary-parallel loss against the unsharded reference on every rank.

    torchrun --nproc-per-node 2 launch/verify.py                    # embedded default
    torchrun --nproc-per-node 2 launch/verify.py --config configs/verify.yaml --dtypes float32

Every rank takes its (uneven) shard of a seeded LM head, runs forward and backward for a
grid of shapes, modes, reductions, label smoothing values and dtypes, and compares its
loss, ``hidden.grad`` and ``weight.grad`` with ``F.cross_entropy(F.linear(x, W_full), y)``
in float64. Rank 0 prints a table (worst error over ranks); the exit status is non-zero
on any mismatch. NCCL on GPUs, gloo otherwise; multi-node works as torchrun does.

No rank hangs forever: collectives have a timeout, and after every case the ranks agree
(MAX of a failure flag) to stop together when any of them failed.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

# Run as a script (``torchrun ... launch/verify.py``), Python puts launch/ itself first on
# sys.path; the repository root must be there for ``launch`` to import as a package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from launch.config import coerce, describe_range, load_yaml_config  # noqa: E402
from launch.dist_env import CollectiveError, collective, init_from_env  # noqa: E402
from vocab_parallel.testing import Case, check_case, grid  # noqa: E402

DEFAULTS = {
    "tokens": [37, 512],
    "hidden": [64],
    "vocab": [1031],
    "dtypes": ["float32", "bfloat16"],
    "modes": ["grad_in_forward", "memory_saving", "high_performance"],
    "reductions": ["none", "sum", "mean"],
    "label_smoothing": [0.0, 0.1],
    "backends": ["auto"],
    "timeout_s": 300,
}
# The type of each key (of each element, for the lists) and its allowed values or range.
KINDS = {
    "tokens": int,
    "hidden": int,
    "vocab": int,
    "dtypes": str,
    "modes": str,
    "reductions": str,
    "label_smoothing": float,
    "backends": str,
    "timeout_s": int,
}
CHOICES = {
    "dtypes": ("float32", "bfloat16", "float16"),
    "modes": ("grad_in_forward", "memory_saving", "high_performance"),
    "reductions": ("none", "sum", "mean"),
    "backends": ("auto", "triton", "torch"),
}
RANGES = {  # (low, high, low included, high included)
    "tokens": (1, None, True, None),
    "hidden": (1, None, True, None),
    "vocab": (1, None, True, None),
    "label_smoothing": (0.0, 1.0, True, False),
    "timeout_s": (1, None, True, None),
}


def parse_args(argv: list[str] | None = None) -> dict:
    """The options: defaults, then the YAML ``--config``, then the flags. Any value of a
    wrong type, out of its range, or an empty list is a usage error naming the option."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", help="YAML file with any of the keys below (flags override it)")
    for key, value in DEFAULTS.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, list):
            p.add_argument(flag, nargs="+", type=KINDS[key], default=None)
        else:
            p.add_argument(flag, type=KINDS[key], default=None)
    args = vars(p.parse_args(argv))
    options = dict(DEFAULTS)
    config = args.pop("config")
    if config:
        loaded = load_yaml_config(config, p)
        unknown = set(loaded) - set(DEFAULTS)
        if unknown:
            p.error(f"unknown keys in config: {sorted(unknown)}")
        for key, value in loaded.items():
            try:
                if isinstance(DEFAULTS[key], list):
                    if not isinstance(value, list):
                        raise ValueError(f"expected a list, got {value!r}")
                    value = [coerce(v, KINDS[key]) for v in value]
                else:
                    value = coerce(value, KINDS[key])
            except ValueError as exc:
                p.error(f"{config}: {key}: {exc}")
            options[key] = value
    options.update({k: v for k, v in args.items() if v is not None})
    for key, value in options.items():
        name = f"{key} (--{key.replace('_', '-')})"
        values = value if isinstance(DEFAULTS[key], list) else [value]
        if not values:
            p.error(f"{name}: expected a non-empty list")
        for v in values:
            if key in CHOICES and v not in CHOICES[key]:
                p.error(f"{name}: expected one of {', '.join(CHOICES[key])}, got {v!r}")
            if key in RANGES:
                low, high, low_in, high_in = RANGES[key]
                inside = (
                    math.isfinite(v)
                    and (v >= low if low_in else v > low)
                    and (high is None or (v <= high if high_in else v < high))
                )
                if not inside:
                    what = describe_range(low, high, low_in, high_in, KINDS[key])
                    p.error(f"{name}: expected {what}, got {v!r}")
    return options


def table(rows: list[dict]) -> str:
    head = (
        "| world | BT | H | V | dtype | mode | reduction | eps | backend "
        "| loss err | dx err | dW err | ok |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['world']} | {r['tokens']} | {r['hidden']} | {r['vocab']} | {r['dtype']} "
            f"| {r['mode']} | {r['reduction']} | {r['label_smoothing']} | {r['backend']} "
            f"| {r['loss']:.1e} | {r['grad_hidden']:.1e} | {r['grad_weight']:.1e} "
            f"| {'yes' if r['ok'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    backend, device = init_from_env(opts["timeout_s"])
    try:
        return run(opts, backend, device)
    except CollectiveError as exc:  # a rank died, stopped or hung: say which collective
        print(f"verify: rank {dist.get_rank()}: error: {exc}", file=sys.stderr, flush=True)
        return 1


def run(opts: dict, backend: str, device: torch.device) -> int:
    """Every case of the grid on every rank (collective); 1 on any mismatch."""
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    cases: list[Case] = grid(
        tokens=opts["tokens"],
        hidden=opts["hidden"],
        vocab=opts["vocab"],
        dtypes=opts["dtypes"],
        modes=opts["modes"],
        reductions=opts["reductions"],
        label_smoothing=opts["label_smoothing"],
        backends=opts["backends"],
    )
    if rank == 0:
        print(f"verify: {len(cases)} cases on {world} rank(s), {backend} on {device.type}")
    rows, failed, t0 = [], False, time.time()
    for case in cases:
        try:
            result = check_case(case, group, device)
            error = None
        except Exception as exc:  # reported, then agreed on below
            result, error = None, f"rank {rank}: {type(exc).__name__}: {exc}"
        flag = torch.tensor([0 if result and result["ok"] else 1], device=device)
        gathered = [None] * world
        with collective("agreement on the case's verdict", group):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            dist.all_gather_object(gathered, (result, error))
        errors = [e for _, e in gathered if e]
        if errors:
            if rank == 0:
                print(f"case {case} raised:\n  " + "\n  ".join(errors), file=sys.stderr)
            failed = True
            break
        results = [r for r, _ in gathered]
        worst = dict(results[0])
        for key in ("loss", "grad_hidden", "grad_weight"):
            worst[key] = max(r[key] for r in results)
        worst["ok"] = all(r["ok"] for r in results)
        rows.append(worst)
        failed |= bool(flag.item())
    if rank == 0:
        print(table(rows))
        n_bad = sum(not r["ok"] for r in rows)
        verdict = "FAILED" if failed else "OK"
        print(
            f"\n{verdict}: {len(rows) - n_bad}/{len(cases)} cases match the unsharded float64 "
            f"reference on {world} rank(s) in {time.time() - t0:.1f} s"
        )
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
