"""A trained model's LM-head inputs, the realistic workload of gradient filtering (issue 24).

On random weights almost no tile of ``G = softmax - onehot`` is below a filtering eps;
on a trained model's peaked distributions most are. This script trains the main job's
GPT (``launch/model.py``: 2 layers, ``d_model`` 128, context 64, on the embedded corpus
``data/kjv.txt.gz`` with the launcher's BPE tokenizer, ``launch/data.py``) at a head
vocabulary ``V``, in one process, and saves what the head sees on held-out text:

    python benchmarks/trained_workload.py                 # V 32768 and 131072: the cache files
    python benchmarks/trained_workload.py --stats         # and the statistics below
    python benchmarks/trained_workload.py --vocab 32768 --steps 300 --stats

Each file ``runs/cache/trained_head_V{V}_d{d}_s{steps}_seed{seed}.pt`` (gitignored: 17 MiB
for V 32768, 65 MiB for 131072, too large to commit) holds ``hidden`` ``[N, d]`` (the
final norm's output on ``N`` validation tokens: consecutive windows of the held-out tail),
``target`` ``[N]`` (their next tokens), ``weight`` ``[V, d]`` (the trained head, fp32),
the training losses and the options. :func:`load` makes it at the first call and reads
it afterwards: everything is a function of the seed (model init, batches), so a rerun on
the same machine and thread count makes the same file; training takes about 1.5 minutes
(V 32768) and 4 minutes (V 131072) on 2 busy CPU cores, printed when it runs.

The tokenizer saturates at about 21.5k tokens on this corpus, whatever ``V``: the head's
other rows are never targets, and training pushes their logits down, as for the padded
or unused rows of real vocabularies (Llama-3's reserved tokens, padded TP shards). The
statistics therefore report the rows the tokenizer uses apart from the others.

Statistics (``--stats``), per vocabulary, of ``G = softmax(hidden @ W.T) - onehot`` in
fp64 (the upstream gradient of the mean loss taken as 1, per token): the fraction of
entries with ``|G|`` below 2^-12 (``eps(bf16) / 32``, the "auto" eps for bf16) and below
2^-28 (``eps(fp32) / 32``), and the fraction of 128-token x 128-column tiles whose max
``|G|`` is below each, with the columns in id order and sorted by their average logit over
the tokens (descending, as Cut Cross-Entropy orders them), and of 128-token x 1-column
tiles (the library's, whatever the order). docs/design.md describes the
filtering itself.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "runs" / "cache"
VOCABS = (32768, 131072)
EPS = {"bf16": 2.0**-12, "fp32": 2.0**-28}  # torch.finfo(dtype).eps / 32
TILE = 128  # tokens and columns of a tile

# The main job's model (configs/train_tiny_cpu.yaml) and a short run of it at TP 1;
# vocabularies above base_vocab continue the base_vocab model for extra_steps (see load).
DEFAULTS = dict(d_model=128, n_layers=2, n_heads=4, context=64, batch_size=8, steps=300)
DEFAULTS |= dict(lr=3e-3, warmup=20, min_lr_ratio=0.1, weight_decay=0.1, seed=0, tokens=4096)
DEFAULTS |= dict(base_vocab=32768, extra_steps=100)
TOKENIZER_VOCAB = 32768  # one tokenizer for every V (it saturates at ~21.5k anyway)


def run_name(vocab: int, o: dict) -> str:
    steps = f"s{o['steps']}"
    if vocab > o["base_vocab"]:
        steps = f"V{o['base_vocab']}s{o['steps']}+{o['extra_steps']}"
    return f"V{vocab}_d{o['d_model']}_b{o['batch_size']}_{steps}_n{o['tokens']}_seed{o['seed']}"


def cache_path(vocab: int, o: dict, cache_dir: Path = CACHE) -> Path:
    return Path(cache_dir) / f"trained_head_{run_name(vocab, o)}.pt"


def lr_at(step: int, steps: int, o: dict) -> float:
    """Linear warm-up, then cosine down to ``min_lr_ratio * lr`` (as launch/loop.py)."""
    if step < o["warmup"]:
        return o["lr"] * (step + 1) / o["warmup"]
    frac = (step - o["warmup"]) / max(1, steps - o["warmup"])
    cosine = 0.5 * (1 + math.cos(math.pi * frac))
    return o["lr"] * (o["min_lr_ratio"] + (1 - o["min_lr_ratio"]) * cosine)


def train(vocab: int, o: dict, cache_dir: Path = CACHE, log=print) -> dict:
    """Train the GPT at head vocabulary ``vocab`` and return the workload (see the module)."""
    from launch.data import TokenData, prepare_tokens
    from launch.model import GPT, GPTConfig

    t0 = time.perf_counter()
    tok_vocab = min(TOKENIZER_VOCAB, vocab)
    tokens, info = prepare_tokens(ROOT / "data" / "kjv.txt.gz", tok_vocab, cache_dir)
    data = TokenData(tokens, val_fraction=0.02)
    cfg = GPTConfig(vocab_size=vocab, context=o["context"], d_model=o["d_model"],
                    n_layers=o["n_layers"], n_heads=o["n_heads"])  # fmt: skip
    model = GPT(cfg, seed=o["seed"], head="vocab_parallel")  # TP 1, the library's head
    steps, first = o["steps"], 0
    if vocab > o["base_vocab"]:  # continue the base model; its rows, the new ones as inited
        base = load(o["base_vocab"], cache_dir, log, **o)
        state = model.state_dict()
        for name, value in base["model"].items():
            if state[name].shape != value.shape:  # the embedding and the head: V rows
                value = torch.cat([value, state[name][len(value) :]])
            state[name] = value
        model.load_state_dict(state)
        steps, first = o["extra_steps"], o["steps"]  # new batches, a new schedule cycle
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": o["weight_decay"]}]
    groups += [{"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=o["lr"], betas=(0.9, 0.95))
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, o)
        x, y = data.batch(seed=o["seed"], step=first + step, dp_rank=0,
                          batch_size=o["batch_size"], context=o["context"])  # fmt: skip
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            log(f"#   V={vocab} step {first + step}: loss {loss.item():.3f} "
                f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    n_windows = o["tokens"] // o["context"]
    (xv, yv), *_ = data.val_batches(dp_rank=0, dp_size=1, batch_size=n_windows,
                                    context=o["context"], max_batches=1)  # fmt: skip
    with torch.no_grad():
        hidden = model.hidden_states(xv).flatten(0, 1).contiguous()
        val_loss = model(xv, yv).item()
    return {
        "hidden": hidden,
        "target": yv.flatten().contiguous(),
        "weight": model.head.weight.detach().float().contiguous(),
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "train_losses": losses,
        "val_loss": val_loss,
        "tokenizer_vocab_size": info["tokenizer_vocab_size"],
        "options": dict(o, vocab=vocab, name=run_name(vocab, o)),
        "train_seconds": round(time.perf_counter() - t0, 1),
        "threads": torch.get_num_threads(),
    }


def load(vocab: int, cache_dir: Path = CACHE, log=print, **overrides) -> dict:
    """The workload of ``vocab`` from the cache, trained (and cached) at the first call."""
    o = DEFAULTS | overrides
    path = cache_path(vocab, o, cache_dir)
    if path.exists():
        return torch.load(path, weights_only=True)
    log(f"# trained workload V={vocab}: not cached, training -> {path}")
    w = train(vocab, o, cache_dir, log)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(w, tmp)
    os.replace(tmp, path)
    log(f"# trained workload V={vocab}: {w['train_seconds']} s, validation loss "
        f"{w['val_loss']:.3f}, saved {path.stat().st_size / 2**20:.0f} MiB")  # fmt: skip
    return w


def random_like(w: dict, seed: int = 0) -> dict:
    """The worst case of the same shapes: random hidden states, head and targets (logits of
    a few units, as benchmarks/bench_loss.py draws them)."""
    gen = torch.Generator().manual_seed(seed)
    n, d = w["hidden"].shape
    v = w["weight"].shape[0]
    return {
        "hidden": torch.randn(n, d, generator=gen),
        "weight": torch.randn(v, d, generator=gen).mul_(2.0 / math.sqrt(d)),
        "target": torch.randint(0, v, (n,), generator=gen),
    }


# ----------------------------------------------------------------------------- statistics


def grad_block(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``|softmax - onehot|`` in fp64 of these tokens, ``[n, V]``."""
    g = torch.softmax(hidden.double() @ weight.double().t(), dim=1)
    g[torch.arange(len(target)), target] -= 1.0
    return g.abs_()


def tile_max(g: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    """Max over each block of ``tile`` columns of ``g`` ``[n, V]``, the last one partial:
    ``[n, ceil(V / tile)]`` (zeros pad it: never the max of ``|G|``)."""
    n, v = g.shape
    return torch.nn.functional.pad(g, (0, -v % tile)).view(n, -1, tile).amax(dim=2)


def statistics(w: dict, tile: int = TILE) -> dict:
    """The fractions of the module's docstring (entries, tiles in id order, tiles sorted),
    ``tile`` tokens at a time (a V 131072 row block in fp64 is 128 MiB)."""
    hidden, weight, target = w["hidden"], w["weight"], w["target"]
    n, v = len(target), weight.shape[0]
    used = w.get("tokenizer_vocab_size")
    # The average logit of each column over the tokens: mean(hidden) @ W.T (it is linear).
    order = torch.argsort(hidden.double().mean(0) @ weight.double().t(), descending=True)
    below = {name: 0 for name in EPS}
    tiles = {key: [] for key in ("id", "sorted", "id_used", "column")}
    for lo in range(0, n, tile):
        g = grad_block(hidden[lo : lo + tile], weight, target[lo : lo + tile])
        for name, eps in EPS.items():
            below[name] += int((g < eps).sum())
        tiles["id"].append(tile_max(g, tile).amax(0))
        tiles["sorted"].append(tile_max(g[:, order], tile).amax(0))
        tiles["column"].append(g.amax(0))  # the library's tiles: one column, any order
        if used:  # the columns the tokenizer uses (ids below its size), apart
            tiles["id_used"].append(tile_max(g[:, :used], tile).amax(0))
    out = {"tokens": n, "vocab": v}
    for name, eps in EPS.items():
        out[f"entries<{name}"] = below[name] / (n * v)
        for key, maxima in tiles.items():
            if maxima:
                out[f"tiles_{key}<{name}"] = (torch.stack(maxima) < eps).double().mean().item()
    return out


def print_statistics(rows: list[tuple[str, dict]]) -> None:
    from benchmarks.harness import markdown_table

    head = ["workload", "V", "tokens"]
    for name in EPS:
        head += [f"entries < {name} eps", f"tiles < {name} eps (id order)",
                 "(sorted by avg logit)", "(id order, used columns only)",
                 f"{TILE} x 1 tiles < {name} eps"]  # fmt: skip
    body = []
    for label, s in rows:
        cells = [label, str(s["vocab"]), str(s["tokens"])]
        for name in EPS:
            for key in ("entries", "tiles_id", "tiles_sorted", "tiles_id_used", "tiles_column"):
                val = s.get(f"{key}<{name}")
                cells.append("-" if val is None else f"{val:.1%}")
        body.append(cells)
    print(markdown_table(head, body))
    print(f"eps: bf16 2^-12, fp32 2^-28 (eps(dtype) / 32); tiles {TILE} tokens x {TILE} "
          f"columns (CCE's), or x 1 column (the library's, before its rule that a row block "
          "keeping 3/4 of its columns runs whole); |softmax - onehot| in fp64 per unit "
          "upstream gradient; used columns: ids below the tokenizer's vocabulary "
          "size.")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, nargs="+", default=list(VOCABS))
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    p.add_argument("--d-model", type=int, default=DEFAULTS["d_model"],
                   help="the GPT's width, the head's H (default 128, the main job's)")  # fmt: skip
    p.add_argument("--cache-dir", default=str(CACHE))
    p.add_argument("--stats", action="store_true", help="print the workload's statistics")
    args = p.parse_args(argv)
    rows = []
    for v in args.vocab:
        w = load(v, Path(args.cache_dir), steps=args.steps, seed=args.seed, d_model=args.d_model)
        print(f"# V={v}: {w['options']['name']}, trained in {w['train_seconds']} s "
              f"({w['threads']} threads), final train loss {w['train_losses'][-1]:.3f}, "
              f"validation loss {w['val_loss']:.3f}, tokenizer "
              f"{w['tokenizer_vocab_size']} tokens")  # fmt: skip
        if args.stats:
            rows.append(("trained", statistics(w)))
            rows.append(("random", statistics(random_like(w, args.seed))))
    if rows:
        print_statistics(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
