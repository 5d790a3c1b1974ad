"""Benchmark: peak memory of the LM-head step under DeepSpeed ZeRO-3 (TP 1, 2 ranks).

The head alone: a model whose only layer is ``lm_head = nn.Linear(H, V, bias=False)``,
partitioned by ZeRO-3 over 2 data-parallel ranks (persistence threshold 0), given the
body's output ``hidden [1, T, H]`` (with ``requires_grad``) and labels. Per rank, the
peak extra memory of one forward + ``engine.backward`` (after a warm-up step), fp32:

    hf            HF's default: ``lm_head(hidden)`` (ZeRO-3 gathers the weight for the
                  layer's forward), then ``ForCausalLMLoss`` on the [T, V] logits
    ours_auto     ``vocab_parallel_linear_cross_entropy(hidden, self.lm_head.weight, ...)``
                  inside the model's forward, where ZeRO-3 gathers the weight on the
                  attribute read (what ``apply_vocab_parallel_loss`` does); mode auto
                  (grad_in_forward)
    ours_ms       the same, memory_saving mode
    gather_fused  "gather, then the fused loss" (Liger-style recipes under ZeRO-3): the
                  partitions all-gathered into a whole weight of its own, the fused
                  loss (ours, grad_in_forward, as the stand-in for a chunked fused loss)
                  on it, and its weight gradient reduce-scattered back into a partition

    python benchmarks/bench_zero3.py            # V=32000, H=1024, T=2048
    python benchmarks/bench_zero3.py --quick    # V=8192, H=256, T=512

At TP 1 every row holds the whole weight and its whole gradient at the peak (ZeRO-3 gathers
a layer whole for its use; so does the gather recipe); what differs is the logits. Each
row's loss is printed and must agree (1e-4; the run fails otherwise).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

# Run as a script, Python puts benchmarks/ on sys.path: put the repository root there too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks import harness
from benchmarks.memory import PeakMemory

IMPLS = {
    "hf": "HF default (lm_head, logits, ForCausalLMLoss)",
    "ours_auto": "**ours, auto (grad_in_forward)**",
    "ours_ms": "**ours, memory_saving**",
    "gather_fused": "gather the weight, then the fused loss",
}
WORLD = 2
LOSS_TOL = 1e-4


# ----------------------------------------------------------------------------- the child


def _gather_partition(param) -> torch.Tensor:
    """The whole weight from every rank's ZeRO-3 partition (``ds_tensor``, padded), in a
    tensor of its own."""
    import torch.distributed as dist

    part = param.ds_tensor.detach()
    flat = part.new_empty(part.numel() * dist.get_world_size())
    dist.all_gather_into_tensor(flat, part)
    return flat[: param.ds_numel].view(param.ds_shape)


def _scatter_gradient(grad: torch.Tensor, param) -> torch.Tensor:
    """This rank's partition of the (data-parallel summed) whole gradient."""
    import torch.distributed as dist

    part = param.ds_tensor
    flat = grad.reshape(-1)
    if flat.numel() != part.numel() * dist.get_world_size():  # ZeRO-3 padded the partitions
        flat = torch.cat(
            [flat, flat.new_zeros(part.numel() * dist.get_world_size() - flat.numel())]
        )
    out = part.new_empty(part.numel())
    dist.reduce_scatter_tensor(out, flat)
    return out


class HeadOnly(torch.nn.Module):
    """The LM head as a model: ``forward(hidden, labels)`` is the loss of ``impl``."""

    def __init__(self, v: int, h: int, impl: str):
        super().__init__()
        self.lm_head = torch.nn.Linear(h, v, bias=False)
        self.impl, self.v = impl, v
        self.partition_grad = None

    def forward(self, hidden, labels):
        import torch.nn.functional as F

        from vocab_parallel import vocab_parallel_linear_cross_entropy

        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]  # ForCausalLMLoss's shift
        if self.impl == "hf":
            from transformers.loss.loss_utils import ForCausalLMLoss

            return ForCausalLMLoss(self.lm_head(hidden), labels, self.v)
        if self.impl in ("ours_auto", "ours_ms"):
            mode = "auto" if self.impl == "ours_auto" else "memory_saving"
            weight = self.lm_head.weight  # read in the forward: ZeRO-3 gathers it
            return vocab_parallel_linear_cross_entropy(hidden, weight, shifted, mode=mode)
        # gather_fused: a whole weight of its own, outside ZeRO-3's bookkeeping
        param = self.lm_head._parameters.__class__.__bases__[0].__getitem__(
            self.lm_head._parameters, "weight"
        )  # the parameter object without ZeRO-3's gathering getter
        with torch.no_grad():
            full = _gather_partition(param)
        full.requires_grad_()

        def scatter(grad):
            self.partition_grad = _scatter_gradient(grad, param)
            return grad

        full.register_hook(scatter)
        return vocab_parallel_linear_cross_entropy(hidden, full, shifted, mode="grad_in_forward")


def run_case(case: dict) -> dict:
    import logging

    import deepspeed
    import deepspeed.comm.torch as ds_torch
    import torch.distributed as dist
    from deepspeed.utils import logger

    ds_torch.build_shm_op = lambda: None  # skips a C++ build; comms go via gloo
    rank = int(os.environ["RANK"])
    dist.init_process_group(
        "gloo",
        init_method="file://" + case["store"],
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=case["coll_timeout"]),
    )
    deepspeed.init_distributed(dist_backend="gloo")
    logger.setLevel(logging.ERROR)
    torch.manual_seed(case["seed"])
    model = HeadOnly(case["v"], case["h"], case["impl"])
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    g = torch.Generator().manual_seed(case["seed"] + 1)
    hidden = torch.randn(1, case["t"], case["h"], generator=g).requires_grad_()
    labels = torch.randint(0, case["v"], (1, case["t"]), generator=g)

    def head_step():
        loss = engine(hidden, labels)
        engine.backward(loss)
        return loss

    head_step()  # warm-up: DeepSpeed's first-step set-up, thread pools (no optimizer step:
    hidden.grad = None  # every row measures the same weights; its gradient buffers stay)
    dist.barrier()
    t0 = time.perf_counter()
    with PeakMemory("cpu") as peak:
        loss = head_step()
    elapsed = time.perf_counter() - t0
    dist.destroy_process_group()
    return {"rank": rank, "peak_bytes": peak.extra_bytes, "loss": loss.item(), "time_s": elapsed}


# ----------------------------------------------------------------------------- the parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Peak memory of the LM-head step under ZeRO-3.")
    p.add_argument("--quick", action="store_true", help="a small shape (seconds)")
    p.add_argument("--vocab", type=int, help="vocabulary V (default 32000)")
    p.add_argument("--hidden", type=int, help="hidden size H (default 1024)")
    p.add_argument("--tokens", type=int, help="tokens T per rank (default 2048)")
    p.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per process group")
    p.add_argument("--json", help="also write the raw results to this file")
    args = p.parse_args(argv)
    return harness.fill_defaults(args, vocab=(32000, 8192), hidden=(1024, 256), tokens=(2048, 512))


def main(argv=None) -> int:
    args = parse_args(argv)
    _, where = harness.pick_device("cpu")
    v, h, t = args.vocab, args.hidden, args.tokens
    mib = harness.MIB
    print(f"# bench_zero3: {where}, torch {torch.__version__}")
    print(
        f"# the LM head under ZeRO-3 on {WORLD} gloo ranks (TP 1): V={v} H={h} T={t} per "
        f"rank, fp32; whole weight {v * h * 4 / mib:.0f} MiB, logits {t * v * 4 / mib:.0f} MiB"
    )
    load_before = harness.print_load_before()
    base = {"v": v, "h": h, "t": t, "seed": args.seed, "coll_timeout": max(60, int(args.timeout))}
    base["threads"] = harness.threads_per_rank(WORLD, False)
    rows, t_start = [], time.perf_counter()
    for impl in args.impls:
        res = harness.run_children(__file__, base | {"impl": impl}, WORLD, args.timeout)
        if res["status"] == "ok":
            ranks = res["ranks"]
            res |= {
                "peak_bytes": max(r["peak_bytes"] for r in ranks),
                "loss": ranks[0]["loss"],
                "time_s": max(r["time_s"] for r in ranks),
            }
        rows.append({"impl": impl} | res)
        harness.print_progress(f"{impl}: {res['status']}", t_start)
    harness.print_load_after(t_start)
    head = ["implementation", "head step peak MiB (largest rank)", "ms", "loss"]
    cells = []
    for r in rows:
        if r["status"] != "ok":
            cells.append([IMPLS[r["impl"]], r["status"], "", ""])
            continue
        peak, ms = f"{r['peak_bytes'] / mib:.0f}", f"{r['time_s'] * 1e3:.0f}"
        cells.append([IMPLS[r["impl"]], peak, ms, f"{r['loss']:.6f}"])
    print()
    print(harness.markdown_table(head, cells))
    print()
    print(
        "Peak extra memory: peak RSS minus RSS before, of one forward + engine.backward of "
        "the head (after a warm-up step), the largest rank; it includes ZeRO-3's gathered "
        "weight and the whole weight gradient before its reduce-scatter."
    )
    harness.write_json(args.json, {"args": vars(args), "device": where, "rows": rows})
    ok = [r for r in rows if r["status"] == "ok"]
    bad = [r for r in ok if abs(r["loss"] - ok[0]["loss"]) > LOSS_TOL * abs(ok[0]["loss"])]
    if bad:
        print("\nLOSS MISMATCH: " + ", ".join(f"{r['impl']} {r['loss']}" for r in bad))
    del load_before
    return 1 if bad or len(ok) != len(rows) else 0


if __name__ == "__main__":
    sys.exit(harness.script_main(main, run_case))
