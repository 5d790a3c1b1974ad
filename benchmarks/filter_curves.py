"""Does gradient filtering change training? The main job trained exact and filtered.

Runs ``launch/train.py`` (the embedded default config: 2 CPU ranks, TP 2, the GPT on the
embedded corpus) twice per dtype under ``torchrun``, the same seed and batches: once
exact (``filter_eps`` unset) and once with ``--filter-eps auto``; then draws both
training-loss curves, their difference and the share of ``G``'s tiles the filtered run
left out, and prints the losses at a few steps.

    python benchmarks/filter_curves.py                          # bf16 and fp32, 300 steps
    python benchmarks/filter_curves.py --dtypes bfloat16 --steps 100
    python benchmarks/filter_curves.py --out docs/filter_loss_curve.png

Each run takes a few minutes on a 2-core machine; runs land in ``runs/filter_<dtype>_*``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def train(dtype: str, filtered: bool, steps: int, run_dir: Path) -> dict:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        str(ROOT / "launch" / "train.py"), "--steps", str(steps), "--dtype", dtype,
        "--run-dir", str(run_dir), "--log-every", "10",
    ]  # fmt: skip
    if filtered:
        cmd += ["--filter-eps", "auto"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    return json.loads((run_dir / "summary.json").read_text())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default=str(ROOT / "docs" / "filter_loss_curve.png"))
    args = p.parse_args(argv)
    dtypes = args.dtypes.split(",")
    runs = {}
    for dtype in dtypes:
        for filtered in (False, True):
            name = f"filter_{dtype}_{'auto' if filtered else 'exact'}"
            runs[dtype, filtered] = train(dtype, filtered, args.steps, ROOT / "runs" / name)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(dtypes), figsize=(6 * len(dtypes), 6), squeeze=False)
    print("| dtype | step | exact loss | filtered loss | difference | tiles left out |")
    print("|---|---|---|---|---|---|")
    for col, dtype in enumerate(dtypes):
        exact = runs[dtype, False]["history"]
        filt = runs[dtype, True]["history"]
        steps = exact["step"]
        diff = [b - a for a, b in zip(exact["loss"], filt["loss"], strict=True)]
        top, bottom = axes[0][col], axes[1][col]
        top.plot(steps, exact["loss"], label="exact (filter_eps=None)", lw=1.2)
        top.plot(steps, filt["loss"], label='filter_eps="auto"', lw=1.0, ls="--")
        top.set_title(f"main job, {dtype}: training loss")
        top.set_xlabel("step")
        top.legend()
        bottom.plot(steps, diff, color="C2", lw=1.0, label="filtered - exact loss")
        bottom.set_xlabel("step")
        bottom.set_ylabel("loss difference")
        twin = bottom.twinx()
        twin.plot(steps, filt["filtered"], color="C3", lw=0.8, label="tiles left out")
        twin.set_ylabel("share of G's tiles left out")
        twin.set_ylim(0, 1)
        bottom.legend(loc="upper left")
        twin.legend(loc="upper right")
        for s in sorted({1, len(steps) // 4, len(steps) // 2, len(steps)}):
            i = s - 1
            print(
                f"| {dtype} | {steps[i]} | {exact['loss'][i]:.6f} | {filt['loss'][i]:.6f} | "
                f"{diff[i]:+.2e} | {filt['filtered'][i]:.1%} |"
            )
        mean_left_out = sum(filt["filtered"]) / len(filt["filtered"])
        print(
            f"| {dtype} | max over steps | | | {max(abs(d) for d in diff):.2e} | "
            f"mean {mean_left_out:.1%} |"
        )
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
