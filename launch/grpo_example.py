"""A GRPO-style policy update from token statistics, beside the same from full logits.

    torchrun --standalone --nproc-per-node 2 launch/grpo_example.py            # 8 steps
    torchrun --standalone --nproc-per-node 2 launch/grpo_example.py --steps 20 --vocab 8192

The small GPT of ``launch/model.py`` is the policy, its LM head's vocabulary sharded over
the ranks (a :class:`~vocab_parallel.lm_head.VocabParallelLMHead`); a frozen copy is the
reference model. Every step: ``groups`` prompts with ``samples`` responses each (random
tokens: the rollouts are not what this shows), a verifiable reward per response (the
fraction of its tokens in the lower half of the vocabulary), group-normalised advantages,
then two policy updates of the clipped surrogate

    loss = -mean(min(r A, clip(r, 1 - eps, 1 + eps) A)) - c_H mean(H) + c_KL mean(k3)

with ``r = exp(logp - logp_old)``, ``k3 = exp(ref - logp) - (ref - logp) - 1``, means over
the response tokens, the log-probs and the entropy ``H`` of the sampled tokens at the
rollout temperature. Ours: :meth:`VocabParallelLMHead.token_stats` (log-probs and
differentiable entropy, no logits); beside it, the same model with an unsharded head and
the statistics from materialised ``log_softmax``. Rank 0 prints both losses per step and
their difference; the exit status is 1 if they differ by more than ``--tol``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from launch.dist_env import init_from_env  # noqa: E402
from launch.model import GPT, GPTConfig  # noqa: E402

CLIP, ENTROPY_COEF, KL_COEF = 0.2, 0.01, 0.05


def rollouts(step: int, groups: int, samples: int, prompt: int, response: int, vocab: int):
    """``(ids [N, T], targets [N, T], advantages [N])`` of one step (seeded by the step):
    targets are the next tokens of the response, -100 on the prompt."""
    g = torch.Generator().manual_seed(1000 + step)
    n, t = groups * samples, prompt + response
    ids = torch.randint(0, vocab, (n, t + 1), generator=g)
    targets = ids[:, 1:].clone()
    targets[:, : prompt - 1] = -100
    reward = (ids[:, prompt:] < vocab // 2).float().mean(dim=1).view(groups, samples)
    adv = (reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6)
    return ids[:, :-1], targets, adv.reshape(-1)


def full_logits_stats(model: GPT, hidden: torch.Tensor, targets: torch.Tensor, temp: float):
    """Log-probs and entropy of the targets from the materialised ``[N, T, V]`` logits."""
    logits = (hidden @ model.head.weight.T).float() / temp
    logp = torch.log_softmax(logits, dim=-1)
    ignored = targets == -100
    picked = logp.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return picked.masked_fill(ignored, 0.0), entropy.masked_fill(ignored, 0.0)


def policy_loss(logp, entropy, old, ref, adv, mask):
    """The clipped surrogate with an entropy bonus and a k3 KL to the reference."""
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - CLIP, 1 + CLIP) * a)
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    per_token = -surrogate - ENTROPY_COEF * entropy + KL_COEF * kl
    return (per_token * mask).sum() / mask.sum()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4099, help="odd: uneven shards")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--prompt", type=int, default=8)
    p.add_argument("--response", type=int, default=24)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--tol", type=float, default=1e-4)
    args = p.parse_args(argv)

    backend, device = init_from_env(timeout_s=120.0)
    group = dist.group.WORLD if dist.is_initialized() else None
    rank = dist.get_rank() if group is not None else 0
    cfg = GPTConfig(vocab_size=args.vocab, context=args.prompt + args.response)
    models = {
        "ours": GPT(cfg, seed=0, process_group=group, device=device).to(device),
        "full logits": GPT(cfg, seed=0, head="unsharded").to(device),
    }
    refs = {k: GPT(cfg, seed=0, process_group=group if k == "ours" else None,
                   head="vocab_parallel" if k == "ours" else "unsharded").to(device)
            for k in models}  # fmt: skip
    opts = {k: torch.optim.SGD(m.parameters(), lr=args.lr) for k, m in models.items()}
    temp = args.temperature

    def stats(name: str, model: GPT, ids, targets):
        hidden = model.hidden_states(ids)
        if name == "ours":
            out = model.head.token_stats(hidden, targets, entropy=True, temperature=temp)
            return out.logprobs, out.entropy
        return full_logits_stats(model, hidden, targets, temp)

    worst, seconds = 0.0, {k: 0.0 for k in models}
    if rank == 0:
        print(f"GRPO-style update, vocab {args.vocab} over {dist.get_world_size() if group else 1}"
              f" rank(s) ({backend}); loss per step (2 updates), ours vs full logits")  # fmt: skip
        print(f"{'step':>4} {'ours':>12} {'full logits':>12} {'|diff|':>9} {'entropy':>8}")
    for step in range(args.steps):
        ids, targets, adv = (t.to(device) for t in rollouts(
            step, args.groups, args.samples, args.prompt, args.response, args.vocab))  # fmt: skip
        mask = (targets != -100).float()
        losses, entropies = {}, {}
        for name, model in models.items():
            t0 = time.perf_counter()
            with torch.no_grad():
                old, _ = stats(name, model, ids, targets)
                ref, _ = stats(name, refs[name], ids, targets)
            for _ in range(2):
                logp, entropy = stats(name, model, ids, targets)
                loss = policy_loss(logp, entropy, old, ref, adv.to(logp.dtype), mask)
                opts[name].zero_grad(set_to_none=True)
                loss.backward()
                opts[name].step()
            seconds[name] += time.perf_counter() - t0
            losses[name] = float(loss.detach())
            entropies[name] = float((entropy.detach() * mask).sum() / mask.sum())
        diff = abs(losses["ours"] - losses["full logits"])
        worst = max(worst, diff)
        if rank == 0:
            print(f"{step:>4} {losses['ours']:>12.6f} {losses['full logits']:>12.6f} "
                  f"{diff:>9.2e} {entropies['ours']:>8.4f}")  # fmt: skip
    ok = worst <= args.tol
    if rank == 0:
        ratio = seconds["ours"] / max(seconds["full logits"], 1e-9)
        print(
            f"worst |diff| {worst:.2e} (tol {args.tol:g}): {'ok' if ok else 'MISMATCH'}; "
            f"time ours / full logits: {ratio:.2f}x (CPU, noisy)"
        )
    if group is not None:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
