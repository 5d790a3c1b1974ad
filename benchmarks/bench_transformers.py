"""Benchmark: a Hugging Face causal LM's training step with our loss vs the losses it has.

A random-init ``LlamaForCausalLM`` (nothing downloaded) is trained one step at a time
(forward with ``labels``, backward, SGD step), fp32:

    hf              the unpatched model: logits, then ``ForCausalLMLoss`` (1 rank)
    ours_ms         ``apply_vocab_parallel_loss(model)``, memory-saving mode (1 rank)
    ours_hp         the same, high-performance mode (1 rank)
    ds_autotp       DeepSpeed AutoTP TP 2 with ``"vocab_parallel_lm_head": true``: rank-local
                    logits and the ``VocabParallelCausalLMLoss`` DeepSpeed installs (2 ranks)
    ours_ms_autotp  the same engine, then ``apply_vocab_parallel_loss(engine.module)``:
                    our loss on AutoTP's shard, memory-saving mode (2 ranks)
    ours_hp_autotp  the same, high-performance mode (2 ranks)

    python benchmarks/bench_transformers.py            # V=32000, seq 256, batch 4, H=512, 2 layers
    python benchmarks/bench_transformers.py --quick    # V=4096, seq 64, batch 2, H=128

Method
    Each row in fresh process(es) through ``benchmarks/harness.py`` (the ranks of a group
    are processes joined by gloo over a FileStore; the CPU cores split between them). The
    model and the batch are built from the seed (the same weights and tokens everywhere,
    5% of the labels -100). One warm-up step, then ``--repeats`` timed steps; the table
    shows the fastest (for 2 ranks: of the slower rank per step). Peak extra memory
    (``benchmarks/memory.py``'s ``PeakMemory``: peak RSS minus RSS before, the largest
    rank) of the first timed step, and of one more forward + backward alone (the
    optimizer step outside the measurement: what the loss changes, without DeepSpeed's
    step buffers). Both INCLUDE the parameter gradients, set to None before every step
    (their size is in its own column); "fwd+bwd - grads" is activations, logits and the
    loss's temporaries. Each row's loss of the first timed step is printed: all
    rows train the same model on the same batch and must agree (checked to 1e-4; the run
    fails otherwise).

DeepSpeed rows need DeepSpeed (``pip install -e '.[deepspeed]'``) and skip its C++
shared-memory op build (collectives go through gloo).
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

IGNORE = -100
IMPLS = {  # name: (description, ranks, mode of our loss or None)
    "hf": ("HF default (logits + ForCausalLMLoss)", 1, None),
    "ours_ms": ("**ours, memory_saving**", 1, "memory_saving"),
    "ours_hp": ("**ours, high_performance**", 1, "high_performance"),
    "ds_autotp": ("DeepSpeed AutoTP, its VocabParallelCausalLMLoss", 2, None),
    "ours_ms_autotp": ("**ours on AutoTP, memory_saving**", 2, "memory_saving"),
    "ours_hp_autotp": ("**ours on AutoTP, high_performance**", 2, "high_performance"),
}
DEEPSPEED = ("ds_autotp", "ours_ms_autotp", "ours_hp_autotp")
LOSS_TOL = 1e-4


# ----------------------------------------------------------------------------- the child


def make_model(case: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=case["v"],
        hidden_size=case["h"],
        intermediate_size=2 * case["h"],
        num_hidden_layers=case["layers"],
        num_attention_heads=case["heads"],
        num_key_value_heads=case["heads"],
        max_position_embeddings=case["seq"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(case["seed"])
    return LlamaForCausalLM(config)


def make_batch(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(case["seed"] + 1)
    ids = torch.randint(0, case["v"], (case["batch"], case["seq"]), generator=g)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=g) < 0.05] = IGNORE
    return ids, labels


def start_deepspeed(case: dict, rank: int):
    import deepspeed
    import deepspeed.comm.torch as ds_torch
    import torch.distributed as dist

    ds_torch.build_shm_op = lambda: None  # skips a ~2 min C++ build; comms go via gloo
    dist.init_process_group(
        "gloo",
        init_method="file://" + case["store"],
        rank=rank,
        world_size=case["world"],
        timeout=timedelta(seconds=case["coll_timeout"]),
    )
    deepspeed.init_distributed(dist_backend="gloo")  # reuses the group above
    return deepspeed


def run_case(case: dict) -> dict:
    """One rank of one row: warm-up step, then timed and measured steps."""
    import logging

    from vocab_parallel.integrations.transformers import apply_vocab_parallel_loss

    rank = int(os.environ.get("RANK", "0"))
    impl, mode = case["impl"], IMPLS[case["impl"]][2]
    model = make_model(case)
    ids, labels = make_batch(case)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    if impl in DEEPSPEED:
        deepspeed = start_deepspeed(case, rank)
        from deepspeed.utils import logger

        logger.setLevel(logging.ERROR)
        config = {
            "train_micro_batch_size_per_gpu": case["batch"],
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 0},
            "steps_per_print": 10**9,
            "tensor_parallel": {"autotp_size": case["world"], "vocab_parallel_lm_head": True},
        }
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        if mode is not None:
            apply_vocab_parallel_loss(engine.module, mode=mode)
        model = engine.module

        def forward_backward():
            loss = engine(ids, labels=labels).loss
            engine.backward(loss)
            return loss

        update = engine.step
    else:
        if mode is not None:
            apply_vocab_parallel_loss(model, mode=mode)

        def forward_backward():
            loss = model(ids, labels=labels).loss
            loss.backward()
            return loss

        update = optimizer.step

    def step():
        loss = forward_backward()
        update()
        return loss

    params = [p for p in model.parameters() if p.requires_grad]
    barrier = torch.distributed.barrier if case["world"] > 1 else (lambda: None)

    def before():
        for p in params:
            p.grad = None  # every measured step allocates its gradients
        barrier()

    before()
    step()  # warm-up: thread pools, DeepSpeed's first-step set-up
    res = harness.timed_calls(
        step, torch.device("cpu"), case["repeats"], before, lambda x: x.item()
    )
    # Once more, the forward + backward alone (the optimizer step outside the measurement).
    before()
    with PeakMemory("cpu") as fwd_bwd_peak:
        forward_backward()
    update()
    loss_value = res["kept"]
    grads = harness.nbytes(params)  # one gradient per parameter (DeepSpeed frees them in step)
    if case["world"] > 1:
        torch.distributed.destroy_process_group()
    return {
        "rank": rank,
        "times_s": res["times_s"],
        "peak_bytes": res["peak"].extra_bytes,
        "fwd_bwd_bytes": fwd_bwd_peak.extra_bytes,
        "grads_bytes": grads,
        "loss": loss_value,
        "lm_head": type(model.lm_head).__name__,
    }


# ----------------------------------------------------------------------------- the parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="A Hugging Face Llama's training step: our loss vs HF's and DeepSpeed's.",
        epilog="Defaults: V=32000 seq=256 batch=4 H=512 2 layers; --quick: V=4096 seq=64 "
        "batch=2 H=128.",
    )
    p.add_argument("--quick", action="store_true", help="a small shape (seconds, not minutes)")
    p.add_argument("--vocab", type=int, help="vocabulary V (default 32000)")
    p.add_argument("--seq", type=int, help="sequence length (default 256)")
    p.add_argument("--batch", type=int, help="sequences per step (default 4)")
    p.add_argument("--hidden", type=int, help="hidden size (default 512)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS))
    p.add_argument("--repeats", type=int, default=3, help="timed steps after the warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per process group")
    p.add_argument("--json", help="also write the raw results to this file")
    args = p.parse_args(argv)
    return harness.fill_defaults(
        args, vocab=(32000, 4096), seq=(256, 64), batch=(4, 2), hidden=(512, 128)
    )


def summarise(res: dict) -> dict:
    ranks = res["ranks"]
    per_step = [max(t) for t in zip(*(r["times_s"] for r in ranks), strict=True)]
    worst = max(ranks, key=lambda r: r["peak_bytes"])
    return res | {
        "time_s": min(per_step),
        "peak_bytes": worst["peak_bytes"],
        "fwd_bwd_bytes": max(r["fwd_bwd_bytes"] for r in ranks),
        "grads_bytes": worst["grads_bytes"],
        "loss": ranks[0]["loss"],
        "lm_head": ranks[0]["lm_head"],
    }


def table(rows: list[dict]) -> str:
    hf = next((r for r in rows if r["impl"] == "hf" and r["status"] == "ok"), None)
    head = ["implementation", "ranks", "ms / step", "time / HF", "step peak MiB"]
    head += ["fwd+bwd peak MiB", "of which grads", "fwd+bwd - grads", "loss"]
    cells = []
    for r in rows:
        name, world, _ = IMPLS[r["impl"]]
        if r["status"] != "ok":
            cells.append([name, str(world), r["status"]] + [""] * (len(head) - 3))
            continue
        mib = harness.MIB
        cells.append(
            [
                name,
                str(world),
                f"{r['time_s'] * 1e3:.0f}",
                f"{r['time_s'] / hf['time_s']:.2f}" if hf else "n/a",
                f"{r['peak_bytes'] / mib:.0f}",
                f"{r['fwd_bwd_bytes'] / mib:.0f}",
                f"{r['grads_bytes'] / mib:.0f}",
                f"{(r['fwd_bwd_bytes'] - r['grads_bytes']) / mib:.0f}",
                f"{r['loss']:.6f}",
            ]
        )
    return harness.markdown_table(head, cells)


def main(argv=None) -> int:
    args = parse_args(argv)
    name, where = harness.pick_device("cpu")
    tokens = args.seq * args.batch
    print(f"# bench_transformers: {where}, torch {torch.__version__}, python {sys.executable}")
    print(
        f"# LlamaForCausalLM V={args.vocab} H={args.hidden} layers={args.layers} "
        f"seq={args.seq} batch={args.batch} ({tokens} tokens), fp32, SGD; fastest of "
        f"{args.repeats} steps after a warm-up"
    )
    load_before = harness.print_load_before()
    base = {
        "device": name,
        "v": args.vocab,
        "seq": args.seq,
        "batch": args.batch,
        "h": args.hidden,
        "layers": args.layers,
        "heads": args.heads,
        "repeats": args.repeats,
        "seed": args.seed,
        "coll_timeout": max(60, int(args.timeout)),
    }
    env = {"DS_ACCELERATOR": "cpu"}
    rows, t_start = [], time.perf_counter()
    for impl in IMPLS:
        if impl not in args.impls:
            continue
        world = IMPLS[impl][1]
        row = {"impl": impl, "world": world}
        if impl in DEEPSPEED:
            try:
                import deepspeed  # noqa: F401
            except ImportError:
                rows.append(row | {"status": "not installed"})
                continue
        case = base | row | {"threads": harness.threads_per_rank(world, False)}
        res = harness.run_children(__file__, case, world, args.timeout, env)
        if res["status"] == "ok":
            res = summarise(res)
        rows.append(row | res)
        shown = f"{res['time_s'] * 1e3:.0f} ms" if res["status"] == "ok" else ""
        harness.print_progress(f"{impl} ({world} rank(s)): {res['status']} {shown}", t_start)
    harness.print_load_after(t_start)
    print()
    print(table(rows))
    print()
    print(
        "Peak extra memory (the largest rank): peak RSS minus RSS before, of one whole step "
        "(forward, backward, optimizer step) and of a forward + backward alone; both include "
        "the parameter gradients (per rank: their own column), allocated in the step. "
        "fwd+bwd - grads: activations, logits and the loss's temporaries. Time: fastest "
        "step (2 ranks: of the slower rank), the CPU cores split between the ranks."
    )
    harness.write_json(args.json, {"args": vars(args), "device": where} | {"rows": rows})
    ok = [r for r in rows if r["status"] == "ok"]
    bad = [r for r in ok if abs(r["loss"] - ok[0]["loss"]) > LOSS_TOL * abs(ok[0]["loss"])]
    if bad:
        print("\nLOSS MISMATCH: " + ", ".join(f"{r['impl']} {r['loss']}" for r in bad))
    broken = [r["impl"] for r in rows if r["impl"] not in DEEPSPEED and r["status"] != "ok"]
    if broken:
        print("\nDid not run: " + ", ".join(broken))
    del load_before
    return 1 if bad or broken else 0


if __name__ == "__main__":
    sys.exit(harness.script_main(main, run_case))
