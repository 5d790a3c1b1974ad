"""Sampling replay: the trainer's log-probs of what a rollout engine sampled with top-p 0.9 /
top-k 50, with and without replaying its truncation, on a vocabulary-sharded head.

    torchrun --standalone --nproc-per-node 2 launch/sampling_replay.py
    torchrun --standalone --nproc-per-node 2 launch/sampling_replay.py --top-p 0.95 --top-k 20

The "rollout engine" draws each token from the truncated distribution vLLM's V1 sampler
uses (temperature, min-p, top-k, top-p) of the same head, on the full logits (an engine's
own view); it records the log-prob of each draw under that distribution. The trainer holds
only its rank's rows of the head and computes the log-prob of the same tokens twice:
plainly (what a trainer computes today: the untruncated softmax) and with
``sample_top_k`` / ``sample_top_p`` (the sampler's distribution, no logits, no all-gather
of the vocabulary). Rank 0 prints the mean and largest gap to the engine's log-probs, and
the mean ``kept_logmass`` (the untruncated gap is ``-kept_logmass`` per token). The exit
status is 1 if the replayed log-probs are off the engine's by more than ``--tol``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import vocab_parallel as vp  # noqa: E402
from launch.dist_env import init_from_env  # noqa: E402


def engine_sample(logits: torch.Tensor, top_k: int, top_p: float, temperature: float, gen):
    """``(tokens, logprobs)`` drawn from vLLM's truncated distribution of ``logits``
    ``[N, V]`` (temperature, top-k, then top-p), float64."""
    z = logits.double() / temperature
    kth = z.topk(top_k, dim=-1).values[:, -1:]
    z = z.masked_fill(z < kth, float("-inf"))
    ordered, idx = z.sort(dim=-1, descending=True)
    probs = torch.softmax(ordered, dim=-1)
    above = probs.cumsum(dim=-1) - probs  # mass ranked strictly above (no ties here)
    ordered = ordered.masked_fill(above >= top_p, float("-inf"))
    logq = torch.full_like(z, float("-inf")).scatter(1, idx, torch.log_softmax(ordered, -1))
    tokens = torch.multinomial(logq.exp(), 1, generator=gen)[:, 0]
    return tokens, logq.gather(1, tokens[:, None])[:, 0]


def run(group, tokens=512, hidden=64, vocab=4099, top_k=50, top_p=0.9, temperature=1.0,
        device="cpu"):  # fmt: skip
    """Every rank: ``(gap without replay, gap with replay, kept log-mass)`` per token."""
    seed = 0
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * 0.5  # a peaked, trained-like head
    ids, logp_engine = engine_sample(h @ w.T, top_k, top_p, temperature, gen)
    lo, hi = vp.shard_bounds(vocab, world)[rank]
    h, w, ids = h.to(device), w.to(device), ids.to(device)
    plain = vp.vocab_parallel_token_stats(
        h, w[lo:hi], ids, process_group=group, temperature=temperature
    )
    replay = vp.vocab_parallel_token_stats(
        h, w[lo:hi], ids, process_group=group, temperature=temperature,
        sample_top_k=top_k, sample_top_p=top_p,
    )  # fmt: skip
    gap_plain = (plain.logprobs.double().cpu() - logp_engine).abs()
    gap_replay = (replay.logprobs.double().cpu() - logp_engine).abs()
    return gap_plain, gap_replay, replay.kept_logmass.cpu()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4099)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--tol", type=float, default=1e-4)
    args = p.parse_args(argv)
    _, device = init_from_env(timeout_s=120)
    plain, replay, kept = run(
        dist.group.WORLD, args.tokens, 64, args.vocab, args.top_k, args.top_p, args.temperature,
        device,
    )  # fmt: skip
    ok = float(replay.max()) <= args.tol
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks, {args.tokens} tokens, vocabulary {args.vocab}, "
              f"top-k {args.top_k}, top-p {args.top_p}, T {args.temperature}")  # fmt: skip
        print(f"trainer vs engine log-prob, untruncated: mean gap {float(plain.mean()):.4f}, "
              f"largest {float(plain.max()):.4f}")  # fmt: skip
        print(f"trainer vs engine log-prob, replayed:    mean gap {float(replay.mean()):.2e}, "
              f"largest {float(replay.max()):.2e}")  # fmt: skip
        print(f"mean kept_logmass {float(kept.mean()):.4f} (the untruncated gap is -kept_logmass)")
        print("OK" if ok else f"FAILED: the replayed log-probs are off by more than {args.tol}")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
