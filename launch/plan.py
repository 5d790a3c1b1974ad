"""``--dry-run``: the plan of a configuration, on any machine, in one process.

A config written for two 8-GPU nodes should be checkable on a laptop before it is
queued: the groups are built for the planned world (``world_size``) on a fake process
group standing for its ranks, and the model on the meta device (no memory, no GPU), so
what is printed (the TP x DP layout, rank 0's head shard, parameter counts, a memory
estimate, the DeepSpeed config) comes from the very code a real run executes.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from launch.config import DTYPES, deepspeed_config
from launch.dist_env import init_groups
from launch.model import build_model
from launch.report import mib


def dry_run(o: dict) -> int:
    """Build groups and the model on the meta device for the planned world, in one process
    (a fake process group stands for the ranks), and print the plan."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = o["world_size"] or o["tp"]
    if world % o["tp"]:
        raise SystemExit(f"tp {o['tp']} does not divide world_size {world}")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    groups = init_groups(o)  # as a real run makes them, timeout_s included
    dtype = DTYPES[o["dtype"]]
    with torch.device("meta"):
        model = build_model(o, "vocab_parallel", groups, "meta").to(dtype)
    head = [p for n, p in model.named_parameters() if n.startswith("head.")]
    body = [p for n, p in model.named_parameters() if not n.startswith("head.")]
    n_head, n_body = sum(p.numel() for p in head), sum(p.numel() for p in body)
    n = n_head + n_body
    size = dtype.itemsize
    tokens = o["batch_size"] * o["context"]
    zero = groups.dp_size if o["engine"] == "deepspeed" and o["zero_stage"] else 1
    master = (4 * n if dtype != torch.float32 else 0) / zero  # ZeRO-1/2 partition both
    adam = 8 * n / zero
    bucket = 4 * n if o["engine"] == "torch" else 0
    total = 2 * n * size + master + adam + bucket
    full_logits = tokens * o["vocab_size"] * 4
    lines = [
        f"plan for {o['config']}",
        f"world {world} = TP {groups.tp_size} x DP {groups.dp_size}; engine {o['engine']}"
        + (f" (ZeRO {o['zero_stage']})" if o["engine"] == "deepspeed" else ""),
        f"model: vocab {o['vocab_size']:,}, d_model {o['d_model']}, {o['n_layers']} layers, "
        f"{o['n_heads']} heads, context {o['context']}, {o['dtype']}",
        f"head shard of rank 0: rows {model.head.vocab_start_index:,}.."
        f"{model.head.vocab_end_index:,} ({n_head:,} parameters); "
        f"body (replicated over TP): {n_body:,} parameters",
        f"tokens per step: {tokens:,} per DP rank, {tokens * groups.dp_size:,} in all",
        "memory per rank (estimate, activations aside): "
        f"parameters {mib(n * size)}, gradients {mib(n * size)}, fp32 master {mib(master)}, "
        f"AdamW states {mib(adam)}, fp32 DP bucket {mib(bucket)}: {mib(total)} in all",
        f"full fp32 logits an unsharded head would materialise per rank: {mib(full_logits)} "
        f"(ours: sharded {groups.tp_size} ways, {o['mode']}, never the full logits)",
    ]
    if o["engine"] == "deepspeed":
        lines.append("DeepSpeed config: " + json.dumps(deepspeed_config(o)))
    print("\n".join("[dry-run] " + line for line in lines))
    dist.destroy_process_group()
    return 0
