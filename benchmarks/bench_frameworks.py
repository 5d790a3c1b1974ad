"""Memory of the head step inside Megatron-core, torchtitan and verl: their own vs ours.

One row per framework and implementation, each a fresh group of 2 gloo ranks (TP 2) from
one invocation, the same shapes and inputs:

    megatron  megatron    GPTModel's output_layer + compute_language_model_loss
                          (vocab_parallel_cross_entropy), the [b, s] losses summed
              ours        VocabParallelOutputProcessor on the same output layer
    torchtitan titan      ChunkedLossWrapper (num_chunks=8, its default) + CrossEntropyLoss
              ours        VocabParallelLossWrapper
    verl       verl       vocab_parallel_log_probs_from_logits + vocab_parallel_entropy on
                          the materialised logits shard (its fused kernel is CUDA-only)
              ours        vocab_parallel.integrations.verl.linear_cross_entropy

The head step is forward + backward from the final hidden states (a leaf, so the decoder is
not measured) to the gradients of the hidden states and the weight shard. Peak extra
memory (``benchmarks/memory.py``: ``VmHWM - VmRSS`` on CPU), largest rank; every rank also
reports its loss, and the run fails when ours is off the framework's.

    python benchmarks/bench_frameworks.py            # tokens 2048, hidden 256, vocab 32768
    python benchmarks/bench_frameworks.py --quick    # tokens 256, vocab 4096

CPU only (the frameworks' CPU shims of ``tests/framework_shims.py`` are applied).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from benchmarks.harness import run_children, script_main  # noqa: E402
from benchmarks.memory import PeakMemory  # noqa: E402

HIDDEN = 256  # torchtitan's debugmodel width


def _init(case: dict):
    import torch.distributed as dist

    store = dist.FileStore(case["store"], 2)
    dist.init_process_group(
        "gloo", store=store, rank=int(os.environ["RANK"]), world_size=2,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    return dist.get_rank()


def _megatron(case: dict) -> dict:
    from framework_shims import megatron_on_cpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from vocab_parallel.integrations.megatron import VocabParallelOutputProcessor

    megatron_on_cpu(tp_size=2)
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, tensor_model_parallel_size=2,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=case["vocab"],
                     max_sequence_length=case["tokens"])  # fmt: skip
    seq, batch = case["tokens"] // 2, 2
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(seq, batch, HIDDEN, generator=g).requires_grad_()
    labels = torch.randint(0, case["vocab"], (batch, seq), generator=g)
    layer = model.output_layer
    with PeakMemory() as peak:
        if case["impl"] == "ours":
            losses = VocabParallelOutputProcessor()(
                hidden_states=hidden, output_layer=layer, labels=labels
            )
        else:
            logits, _ = layer(hidden)
            losses = model.compute_language_model_loss(labels, logits)
        loss = losses.sum()
        loss.backward()
    return {"extra": peak.extra_bytes, "loss": loss.item()}


def _torchtitan(case: dict) -> dict:
    import test_torchtitan as tt
    from framework_shims import fsdp_sum_reduction, torchtitan_on_cpu

    torchtitan_on_cpu()
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    from vocab_parallel.integrations.torchtitan import VocabParallelLossWrapper

    tt.V = case["vocab"]
    spec, model = tt.sdpa_model(seed=0)
    model = spec.parallelize_fn(model, **tt._parallel(dp=1))
    fsdp_sum_reduction(model)
    model._skip_lm_head = True
    if case["impl"] == "ours":
        loss_fn = VocabParallelLossWrapper.Config().build()
    else:
        inner = CrossEntropyLoss.Config(global_vocab_size=case["vocab"])
        loss_fn = ChunkedLossWrapper.Config(num_chunks=8, loss_fn=inner).build()
    loss_fn.set_lm_head(model.lm_head)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, case["vocab"], (2, case["tokens"] // 2), generator=g)
    labels = torch.randint(0, case["vocab"], ids.shape, generator=g)
    hidden = model(ids).detach().requires_grad_()
    with PeakMemory() as peak:
        loss, _ = loss_fn(hidden, labels, torch.tensor(labels.numel()))
        loss.backward()
    return {"extra": peak.extra_bytes, "loss": loss.item()}


def _verl(case: dict) -> dict:
    """verl's log-probs + entropy: its Megatron functions on this rank's materialised
    logits (what verl runs with use_fused_kernels off; its fused kernel is CUDA-only) vs
    our drop-in for its fused ``linear_cross_entropy``."""
    from framework_shims import megatron_on_cpu, verl_module

    from vocab_parallel.integrations import verl as vp_verl

    megatron_on_cpu(tp_size=2)
    tp = verl_module("verl.utils.megatron.tensor_parallel")
    group = torch.distributed.group.WORLD
    rows = case["vocab"] // 2
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(case["tokens"], HIDDEN, generator=g).requires_grad_()
    weight = (torch.randn(rows, HIDDEN, generator=g) * HIDDEN**-0.5).requires_grad_()
    labels = torch.randint(0, case["vocab"], (case["tokens"],), generator=g)
    with PeakMemory() as peak:
        if case["impl"] == "ours":
            lp, ent = vp_verl.linear_cross_entropy(hidden, weight, labels, 1.0, "none", group)
        else:
            logits = hidden @ weight.T
            ent = tp.vocab_parallel_entropy(logits)
            # A copy: Megatron's cross entropy under it writes into fp32 logits in place.
            lp = tp.vocab_parallel_log_probs_from_logits(logits.clone(), labels)
        loss = (lp + ent).sum()
        loss.backward()
    return {"extra": peak.extra_bytes, "loss": loss.item()}


def child(case: dict) -> dict:
    _init(case)
    torch.set_num_threads(1)
    run = {"megatron": _megatron, "torchtitan": _torchtitan, "verl": _verl}[case["framework"]]
    return run(case)


ROWS = (("megatron", "megatron"), ("megatron", "ours"), ("torchtitan", "titan"),
        ("torchtitan", "ours"), ("verl", "verl"), ("verl", "ours"))  # fmt: skip


def parent(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tokens 256, vocab 4096")
    args = p.parse_args(argv)
    tokens, vocab = (256, 4096) if args.quick else (2048, 32768)
    print(f"tokens {tokens}, hidden {HIDDEN}, vocab {vocab}, TP 2 (gloo), fp32, CPU")
    print(f"{'framework':<11} {'loss':<9} {'peak extra MiB':>15} {'loss value':>14}")
    losses = {}
    for framework, impl in ROWS:
        case = {"framework": framework, "impl": impl, "tokens": tokens, "vocab": vocab}
        out = run_children(__file__, case, world=2, timeout=900)
        if out["status"] != "ok":
            print(f"{framework:<11} {impl:<9} {out['status']}")
            return 1
        extra = max(r["extra"] for r in out["ranks"]) / 2**20
        value = out["ranks"][0]["loss"]
        print(f"{framework:<11} {impl:<9} {extra:>15.1f} {value:>14.6f}")
        losses.setdefault(framework, []).append(value)
    bad = [f for f, (a, b) in losses.items() if abs(a - b) > 1e-4 * max(1.0, abs(a))]
    if bad:
        print(f"losses differ: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(script_main(parent, child))
