"""Train a small GPT whose LM head is vocabulary-parallel, under torchrun (the main job).

    torchrun --nproc-per-node 2 launch/train.py                  # embedded default, 2 CPU ranks
    torchrun --nproc-per-node 2 launch/train.py --check-against-unsharded --steps 100
    torchrun --nproc-per-node 8 launch/train.py --config configs/train_llama3_8b_head_tp8.yaml
    python launch/train.py --config configs/train_two_nodes.yaml --dry-run   # plan only

Options come from a YAML file (``--config``, default ``configs/train_tiny_cpu.yaml``);
every key can be overridden by the flag of the same name (``--steps 50 --tp 1``).

The world of ``torchrun`` ranks is split into tensor-parallel groups of ``tp`` consecutive
ranks (the vocabulary of the head is sharded over each) and ``world / tp`` data-parallel
replicas. NCCL on GPUs, gloo otherwise; every collective has a timeout (``timeout_s``).

Data (default): the embedded public-domain corpus ``data/kjv.txt.gz``, tokenised by a
byte-level BPE tokenizer that rank 0 trains at the first run and caches (``cache_dir``);
the token ids are then sent to the other ranks, so multi-node runs need no shared disk
for the data. Batches are a function of ``(seed, step, dp_rank)`` only, and the last
``val_fraction`` of the corpus is held out for the validation loss.

Engines: ``torch`` (DP gradient averaging in fp32, TP-aware gradient clipping, AdamW; see
``vocab_parallel.training``) or ``deepspeed`` (``vocab_parallel.integrations.deepspeed``,
ZeRO stage ``zero_stage`` over the DP group).

Outputs, in ``run_dir`` (rank 0): ``train.log``, ``loss_curve.png``, ``summary.json``, and
``checkpoints/`` every ``save_every`` steps. ``--resume`` continues from the latest
checkpoint and reproduces the uninterrupted run's losses exactly (model, optimizer, step
and RNG are restored; data and learning rate are functions of the step).

``--check-against-unsharded`` trains, in lockstep on the same batches, the same model
with an ordinary full head and ``F.cross_entropy`` (same init, same optimizer), and
prints both loss curves side by side with their largest difference.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from vocab_parallel.distributed import init_from_env

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "configs" / "train_tiny_cpu.yaml"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# name: (default, type, help). A YAML config sets any of them, a flag overrides the YAML.
OPTIONS: dict[str, tuple] = {
    "engine": ("torch", str, "torch | deepspeed"),
    "tp": (2, int, "tensor-parallel size: vocabulary shards of the head (dp = world / tp)"),
    "world_size": (None, int, "world this config is written for: --dry-run plans for it"),
    "steps": (300, int, "optimizer steps in all (also the length of the LR schedule)"),
    "batch_size": (16, int, "sequences per data-parallel rank and step"),
    "context": (64, int, "tokens per sequence"),
    "d_model": (128, int, "model width"),
    "n_layers": (2, int, "transformer blocks"),
    "n_heads": (4, int, "attention heads"),
    "mlp_ratio": (4, int, "MLP width / d_model"),
    "vocab_size": (8192, int, "rows of the LM head; the BPE tokenizer is trained to this size"),
    "dtype": ("float32", str, "float32 | bfloat16 (parameters and activations)"),
    "mode": ("memory_saving", str, "our loss: memory_saving | high_performance"),
    "backend": ("auto", str, "our loss: auto | triton | torch"),
    "label_smoothing": (0.0, float, "label smoothing of the loss"),
    "lr": (3e-3, float, "peak learning rate"),
    "min_lr_ratio": (0.1, float, "final LR / peak LR of the cosine schedule"),
    "warmup_steps": (20, int, "linear LR warm-up steps"),
    "weight_decay": (0.1, float, "AdamW weight decay (matrices and embeddings only)"),
    "beta1": (0.9, float, "AdamW beta1"),
    "beta2": (0.95, float, "AdamW beta2"),
    "grad_clip": (1.0, float, "max global gradient norm (0: no clipping)"),
    "seed": (0, int, "seed of the initial weights and of the batches"),
    "data": ("data/kjv.txt.gz", str, "text corpus (.txt or .txt.gz)"),
    "tokenizer": (None, str, "an existing tokenizer.json instead of training a BPE"),
    "cache_dir": ("runs/cache", str, "where the trained tokenizer and token ids are cached"),
    "val_fraction": (0.02, float, "tail of the corpus held out for validation"),
    "val_batches": (8, int, "validation batches per DP rank"),
    "eval_every": (0, int, "validation every N steps (0: at the end only)"),
    "run_dir": (None, str, "outputs and checkpoints (default runs/<config name>)"),
    "save_every": (0, int, "checkpoint every N steps, and at the end (0: never)"),
    "keep_checkpoints": (2, int, "checkpoints kept (older ones are deleted; 0: keep all)"),
    "resume": (False, bool, "continue from the latest checkpoint in run_dir"),
    "stop_at": (0, int, "exit after this step without saving, as a crash would (tests)"),
    "log_every": (10, int, "log (and side-by-side table) every N steps"),
    "check_against_unsharded": (False, bool, "also train an unsharded-head copy and compare"),
    "zero_stage": (0, int, "deepspeed engine: ZeRO stage 0, 1 or 2"),
    "deepspeed": ({}, dict, "deepspeed engine: extra DeepSpeed config (YAML only)"),
    "timeout_s": (600, int, "collective timeout: a failed rank never hangs the others"),
    "dry_run": (False, bool, "print the plan (groups, parameters, memory) and exit"),
}
# Keys that must match between a checkpoint and the run resuming it.
RESUME_MUST_MATCH = (
    "engine", "tp", "d_model", "n_layers", "n_heads", "mlp_ratio", "vocab_size", "context",
    "dtype", "seed", "data", "tokenizer", "val_fraction", "batch_size", "check_against_unsharded",
    "zero_stage",
)  # fmt: skip

log = logging.getLogger("train")


# --------------------------------------------------------------------------- options


def parse_args(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Every option below can also be set in the YAML config, by its name.",
    )
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML file of options")
    for key, (_, kind, help_) in OPTIONS.items():
        flag = "--" + key.replace("_", "-")
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif kind is not dict:
            p.add_argument(flag, type=kind, default=None, help=help_)
    args = vars(p.parse_args(argv))
    opts = {key: default for key, (default, _, _) in OPTIONS.items()}
    config = args.pop("config")
    if config:
        import yaml

        with open(config) as f:
            loaded = yaml.safe_load(f) or {}
        unknown = set(loaded) - set(OPTIONS)
        if unknown:
            p.error(f"{config}: unknown keys {sorted(unknown)}")
        for key, value in loaded.items():
            kind = OPTIONS[key][1]
            # YAML reads `3e-4` (no dot) as a string and `1` as an int: take them as numbers.
            numeric = isinstance(value, str | int) and not isinstance(value, bool)
            if kind in (int, float) and numeric:
                try:
                    value = kind(value)
                except ValueError:
                    p.error(f"{config}: {key}: expected {kind.__name__}, got {value!r}")
            opts[key] = value
    opts.update({k: v for k, v in args.items() if v is not None})
    opts["config"] = str(config) if config else None
    if opts["run_dir"] is None:
        opts["run_dir"] = str(Path("runs") / (Path(config).stem if config else "train"))
    check_options(opts, p)
    return opts


def check_options(o: dict, p: argparse.ArgumentParser) -> None:
    if o["engine"] not in ("torch", "deepspeed"):
        p.error(f"engine: expected torch or deepspeed, got {o['engine']!r}")
    if o["dtype"] not in DTYPES:
        p.error(f"dtype: expected one of {sorted(DTYPES)}, got {o['dtype']!r}")
    for key in ("tp", "steps", "batch_size", "context", "d_model", "n_layers", "n_heads"):
        if not isinstance(o[key], int) or o[key] < 1:
            p.error(f"{key}: expected an int >= 1, got {o[key]!r}")
    if o["d_model"] % o["n_heads"]:
        p.error(f"d_model {o['d_model']} is not a multiple of n_heads {o['n_heads']}")
    if o["zero_stage"] not in (0, 1, 2):
        p.error(f"zero_stage: expected 0, 1 or 2, got {o['zero_stage']!r}")
    if not isinstance(o["deepspeed"], dict):
        p.error("deepspeed: expected a mapping of DeepSpeed config keys")


def resolve_data_path(path: str) -> Path:
    """The corpus as given, or under the repository root (runs from another folder)."""
    p = Path(path)
    return p if p.is_absolute() or p.exists() else ROOT / p


def lr_at(step: int, o: dict) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``steps``."""
    peak, warmup = o["lr"], o["warmup_steps"]
    if warmup and step <= warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(1, o["steps"] - warmup))
    floor = peak * o["min_lr_ratio"]
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def deepspeed_config(o: dict) -> dict:
    """DeepSpeed's config from our options; the YAML's ``deepspeed`` mapping goes on top."""
    config = {
        "train_micro_batch_size_per_gpu": o["batch_size"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": o["grad_clip"],
        "zero_optimization": {"stage": o["zero_stage"]},
        "bf16": {"enabled": o["dtype"] == "bfloat16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    for key, value in o["deepspeed"].items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


# --------------------------------------------------------------------------- set-up


def init_distributed(o: dict) -> tuple[str, torch.device]:
    """Process group from torchrun's environment: NCCL with GPUs, gloo otherwise."""
    backend, device = init_from_env(o["timeout_s"], default_port=29512)
    if o["engine"] == "deepspeed":
        # DeepSpeed adopts the process group above (and its timeout) rather than making one.
        deepspeed_integration().init_distributed(backend, timeout=o["timeout_s"])
    return backend, device


def deepspeed_integration():
    try:
        from vocab_parallel.integrations import deepspeed as integration
    except ImportError as exc:
        raise SystemExit(f"--engine deepspeed needs DeepSpeed and our integration: {exc}") from exc
    return integration


def setup_logging(run_dir: Path, rank: int, resume: bool) -> None:
    """Rank 0 logs to ``run_dir/train.log`` and, through tqdm, to the console."""
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False
    if rank != 0:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s"))
        log.addHandler(handler)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(run_dir / "train.log", mode="a" if resume else "w")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    log.addHandler(file_handler)

    class TqdmHandler(logging.Handler):
        def emit(self, record):
            if INTERACTIVE:  # above the progress bar
                from tqdm import tqdm

                tqdm.write(self.format(record), file=sys.stdout)
            else:
                print(self.format(record), flush=True)

    console = TqdmHandler()
    console.setFormatter(logging.Formatter("[train] %(message)s"))
    console.setLevel(logging.INFO)
    console.addFilter(lambda record: not getattr(record, "file_only", False))
    log.addHandler(console)


FILE_ONLY = {"extra": {"file_only": True}}
INTERACTIVE = sys.stdout.isatty()


class _BarLines:
    """Where the progress bar goes when stdout is not a terminal (CI, ``| tee``): each
    refresh as a line of its own instead of carriage-return redraws."""

    def write(self, s: str) -> None:
        s = s.replace("\r", "").strip()
        if s:
            print(s, flush=True)

    def flush(self) -> None:
        sys.stdout.flush()


def load_data(o: dict, rank: int, device: torch.device):
    """Rank 0 tokenises the corpus (training the tokenizer at the first run) and sends the
    token ids to every rank; the others wait in the broadcast, bounded by ``timeout_s``."""
    from vocab_parallel.data import TokenData, prepare_tokens

    payload = [None, None]
    if rank == 0:
        t0 = time.perf_counter()
        tokens, info = prepare_tokens(
            resolve_data_path(o["data"]), o["vocab_size"], o["cache_dir"], o["tokenizer"]
        )
        info["seconds"] = round(time.perf_counter() - t0, 2)
        if info["tokenizer_vocab_size"] > o["vocab_size"]:
            raise SystemExit(
                f"tokenizer has {info['tokenizer_vocab_size']} tokens, more than "
                f"vocab_size {o['vocab_size']}"
            )
        payload = [tokens, info]
    dist.broadcast_object_list(payload, src=0, device=device if device.type == "cuda" else None)
    tokens, info = payload
    return TokenData(tokens, o["val_fraction"]), info


def build_model(o: dict, head: str, groups, device: torch.device | str):
    from vocab_parallel.gpt import GPT, GPTConfig

    cfg = GPTConfig(
        vocab_size=o["vocab_size"],
        context=o["context"],
        d_model=o["d_model"],
        n_layers=o["n_layers"],
        n_heads=o["n_heads"],
        mlp_ratio=o["mlp_ratio"],
    )
    options = {"label_smoothing": o["label_smoothing"]}
    if head == "vocab_parallel":
        options.update(mode=o["mode"], backend=o["backend"])
    model = GPT(cfg, seed=o["seed"], head=head, tp_group=groups.tp_group, **options)
    # The torch engine trains the model in its dtype (fp32 master weights in the engine);
    # DeepSpeed converts an fp32 model itself when its bf16 mode is on.
    if o["engine"] == "torch":
        model = model.to(DTYPES[o["dtype"]])
    return model.to(device)


# --------------------------------------------------------------------------- engines


class TorchRunner:
    """The torch engine: ``vocab_parallel.training.TorchEngine`` around the model."""

    def __init__(self, model, groups, o: dict) -> None:
        from vocab_parallel.training import TorchEngine

        self.model = model
        self.engine = TorchEngine(
            model,
            groups,
            lr=o["lr"],
            betas=(o["beta1"], o["beta2"]),
            weight_decay=o["weight_decay"],
            grad_clip=o["grad_clip"],
        )

    def train_step(self, x, y, lr: float) -> tuple[torch.Tensor, float]:
        loss = self.model(x, y)
        loss.backward()
        return loss.detach().float(), self.engine.step(lr)

    def forward(self, x, y) -> torch.Tensor:
        return self.model(x, y)

    @property
    def module(self):
        return self.model

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "engine": self.engine.state_dict()}

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.engine.load_state_dict(state["engine"])


class DeepSpeedRunner:
    """The deepspeed engine, through ``vocab_parallel.integrations.deepspeed``.

    The optimizer is the same torch AdamW (with the same parameter groups) as the torch
    engine's; the LR is set on it every step, so no scheduler state needs saving.
    """

    def __init__(self, model, groups, o: dict) -> None:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": o["weight_decay"]},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=o["lr"],
            betas=(o["beta1"], o["beta2"]),
        )
        result = deepspeed_integration().initialize(
            model, groups, deepspeed_config(o), optimizer=optimizer
        )
        self.engine = result[0] if isinstance(result, tuple) else result

    def train_step(self, x, y, lr: float) -> tuple[torch.Tensor, float]:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return loss.detach().float(), float(norm) if norm is not None else float("nan")

    def forward(self, x, y) -> torch.Tensor:
        return self.engine(x, y)

    @property
    def module(self):
        return self.engine.module


def make_runner(model, groups, o: dict):
    return (DeepSpeedRunner if o["engine"] == "deepspeed" else TorchRunner)(model, groups, o)


# --------------------------------------------------------------------------- checkpoints


# Where each model's DeepSpeed checkpoints go, under checkpoints/ (the torch engine puts
# both models in the same file).
SUBDIR = {"main": ".", "unsharded": "unsharded"}


def checkpoint_root(o: dict) -> Path:
    return Path(o["run_dir"]) / "checkpoints"


def save_checkpoint(o, runners: dict, groups, step: int, history: dict) -> str:
    """Write ``checkpoints/step_XXXXXX`` (collective) and point ``checkpoints/latest`` at it.

    Torch engine: one file per TP rank, from DP rank 0 (the DP replicas are identical).
    DeepSpeed engine: its own ``save_checkpoint`` (the unsharded copy in ``unsharded/``).
    Both: the RNG state of every rank, and ``meta.json`` (step, loss history, options).
    A checkpoint is complete when ``latest`` names it: ``latest`` is written last.
    """
    root, tag, rank = checkpoint_root(o), f"step_{step:06d}", dist.get_rank()
    folder = root / tag
    if o["engine"] == "deepspeed":
        for name, runner in runners.items():
            # ``latest`` is ours to write, once the checkpoint is complete.
            runner.engine.save_checkpoint(str(root / SUBDIR[name]), tag=tag, save_latest=False)
    elif groups.dp_rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        state = {name: runner.state() for name, runner in runners.items()}
        torch.save(state, folder / f"model_tp{groups.tp_rank}.pt")
    # Training draws no random numbers (no dropout; batches have their own generators), but
    # a model that does would need its RNG back to resume exactly.
    folder.mkdir(parents=True, exist_ok=True)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, folder / f"rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        meta = {"step": step, "history": history, "options": o, "world": dist.get_world_size()}
        (folder / "meta.json").write_text(json.dumps(meta))
        for name in runners if o["engine"] == "deepspeed" else ["main"]:
            tmp = root / SUBDIR[name] / "latest.tmp"
            tmp.write_text(tag)
            os.replace(tmp, root / SUBDIR[name] / "latest")
        prune_checkpoints(root, o["keep_checkpoints"])
    dist.barrier()
    return tag


def prune_checkpoints(root: Path, keep: int) -> None:
    if keep <= 0:
        return
    for sub in (root, root / "unsharded"):
        tags = sorted(p for p in sub.glob("step_*") if p.is_dir())
        for old in tags[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(o, runners: dict, groups) -> tuple[int, dict]:
    """Restore the latest checkpoint; returns ``(step, history)``."""
    root = checkpoint_root(o)
    latest = root / "latest"
    if not latest.exists():
        raise SystemExit(f"--resume: no checkpoint in {root}")
    tag = latest.read_text().strip()
    meta = json.loads((root / tag / "meta.json").read_text())
    saved = meta["options"]
    different = {k: (saved.get(k), o[k]) for k in RESUME_MUST_MATCH if saved.get(k) != o[k]}
    if different:
        raise SystemExit(f"--resume: options differ from the checkpoint's: {different}")
    if meta["world"] != dist.get_world_size():
        raise SystemExit(f"--resume: checkpoint has {meta['world']} ranks, this run has "
                         f"{dist.get_world_size()}")  # fmt: skip
    if o["engine"] == "deepspeed":
        for name, runner in runners.items():
            save_dir = root / SUBDIR[name]
            path, _ = runner.engine.load_checkpoint(str(save_dir), tag=tag)
            if path is None:
                raise SystemExit(f"--resume: DeepSpeed could not load {save_dir / tag}")
    else:
        device = next(runners["main"].module.parameters()).device
        state = torch.load(
            root / tag / f"model_tp{groups.tp_rank}.pt", map_location=device, weights_only=True
        )
        for name, runner in runners.items():
            runner.load(state[name])
    rng = torch.load(root / tag / f"rng_rank{dist.get_rank()}.pt", weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    if saved.get("steps") != o["steps"]:
        log.info(f"resume: steps {saved.get('steps')} -> {o['steps']} (the LR schedule changes)")
    return meta["step"], meta["history"]


# --------------------------------------------------------------------------- measuring


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the most ever allocated by torch. CPU: the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


@torch.no_grad()
def evaluate(runner, batches, groups, device) -> float:
    """Mean validation loss over every DP rank's share of the validation set."""
    runner.module.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in batches:
        total[0] += runner.forward(x.to(device), y.to(device)).double()
        total[1] += 1
    runner.module.train()
    if groups.dp_size > 1:
        dist.all_reduce(total, group=groups.dp_group)
    return (total[0] / total[1]).item()


def side_by_side(history: dict, every: int) -> str:
    """The two loss curves as a table, every ``every`` steps and the last one."""
    rows = [" step | vocab-parallel |  unsharded | |difference|"]
    steps = history["step"]
    for i, step in enumerate(steps):
        if step % every == 0 or i == len(steps) - 1 or step == 1:
            a, b = history["loss"][i], history["ref_loss"][i]
            rows.append(f"{step:5d} | {a:14.6f} | {b:10.6f} | {abs(a - b):.2e}")
    return "\n".join(rows)


def plot(history: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    check = "ref_loss" in history
    fig, axes = plt.subplots(
        2 if check else 1, 1, figsize=(8, 6.5 if check else 4.5), squeeze=False,
        gridspec_kw={"height_ratios": [3, 1]} if check else None, sharex=True,
    )  # fmt: skip
    ax = axes[0][0]
    ax.plot(history["step"], history["loss"], lw=1.2, label="train, vocab-parallel head")
    if check:
        ax.plot(history["step"], history["ref_loss"], lw=1.0, ls="--",
                label="train, unsharded head (F.cross_entropy)")  # fmt: skip
    if history["val"]:
        vs = [v[0] for v in history["val"]]
        ax.plot(vs, [v[1] for v in history["val"]], "o-", ms=4, label="validation, vocab-parallel")
        if check:
            ax.plot(vs, [v[2] for v in history["val"]], "x--", ms=6, label="validation, unsharded")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    if check:
        diff = [abs(a - b) for a, b in zip(history["loss"], history["ref_loss"], strict=True)]
        axes[1][0].plot(history["step"], diff, lw=1.0, color="tab:red")
        axes[1][0].ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        axes[1][0].set_ylabel("|difference|")
        axes[1][0].grid(alpha=0.3)
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- dry run


def dry_run(o: dict) -> int:
    """Build groups and the model on the meta device for the planned world, in one process
    (a fake process group stands for the ranks), and print the plan."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from vocab_parallel.parallel import init_parallel_groups

    world = o["world_size"] or o["tp"]
    if world % o["tp"]:
        raise SystemExit(f"tp {o['tp']} does not divide world_size {world}")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    groups = init_parallel_groups(o["tp"])
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


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    o = parse_args(argv)
    if o["dry_run"]:
        return dry_run(o)
    from tqdm import tqdm

    from vocab_parallel.parallel import init_parallel_groups
    from vocab_parallel.training import replicas_in_sync

    wall0 = time.perf_counter()
    backend, device = init_distributed(o)
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = Path(o["run_dir"])
    setup_logging(run_dir, rank, o["resume"])
    groups = init_parallel_groups(o["tp"])
    if o["world_size"] and o["world_size"] != world:
        log.info(f"note: {o['config']} is written for {o['world_size']} ranks; running on {world}")
    log.info(
        f"world {world} = TP {groups.tp_size} x DP {groups.dp_size}, {backend} on {device.type}, "
        f"engine {o['engine']}, {o['dtype']}, run dir {run_dir}"
    )
    data, info = load_data(o, rank, device)
    log.info(
        f"data: {info['corpus']}, {info['tokens']:,} tokens ({len(data.train):,} train, "
        f"{len(data.val):,} validation), BPE vocabulary {info['tokenizer_vocab_size']:,} "
        f"({'cached' if info['cache_hit'] else 'trained'}: {info['tokenizer']}, "
        f"{info['seconds']} s)"
    )

    heads = {"main": "vocab_parallel"}
    if o["check_against_unsharded"]:
        heads["unsharded"] = "unsharded"
    runners = {name: make_runner(build_model(o, h, groups, device), groups, o)
               for name, h in heads.items()}  # fmt: skip
    model = runners["main"].module
    n_head = model.head.weight.numel()
    n_body = sum(p.numel() for p in model.parameters()) - n_head
    log.info(
        f"model: d_model {o['d_model']}, {o['n_layers']} layers, context {o['context']}, "
        f"vocab {o['vocab_size']:,}; rank 0 holds head rows {model.head.vocab_start_index:,}.."
        f"{model.head.vocab_end_index:,} ({n_head:,} parameters) and the body "
        f"({n_body:,} parameters, replicated over TP); {o['mode']} loss"
    )

    history = {"step": [], "loss": [], "grad_norm": [], "lr": [], "val": []}
    if o["check_against_unsharded"]:
        history["ref_loss"] = []
    start = 0
    if o["resume"]:
        start, history = load_checkpoint(o, runners, groups)
        log.info(f"resumed from step {start} ({checkpoint_root(o) / f'step_{start:06d}'})")
    val_batches = data.val_batches(
        dp_rank=groups.dp_rank,
        dp_size=groups.dp_size,
        batch_size=o["batch_size"],
        context=o["context"],
        max_batches=o["val_batches"],
    )

    def validate(step: int) -> None:
        losses = [evaluate(r, val_batches, groups, device) for r in runners.values()]
        history["val"] = [v for v in history["val"] if v[0] != step] + [[step, *losses]]
        extra = f" (unsharded {losses[1]:.4f})" if len(losses) > 1 else ""
        log.info(f"step {step}: validation loss {losses[0]:.4f}{extra}")

    tokens_per_step = o["batch_size"] * o["context"] * groups.dp_size
    term = shutil.get_terminal_size((0, 0))
    sized = term.columns > 0 and term.lines > 0
    bar = tqdm(
        total=o["steps"],
        initial=start,
        desc="train",
        disable=rank != 0,
        file=sys.stdout if INTERACTIVE else _BarLines(),
        mininterval=0.5 if INTERACTIVE else 30.0,
        # A terminal of unknown size (0 x 0, e.g. a pty without a window) would hide the bar.
        dynamic_ncols=INTERACTIVE and sized,
        ncols=None if INTERACTIVE and sized else 100,
        nrows=None if sized else 20,
    )
    timed_steps, timed_seconds = 0, 0.0
    if o["check_against_unsharded"] and start == 0:
        log.info("side by side (train loss, DP mean):\n" + side_by_side(history, 1).split("\n")[0])
    stopped = False
    for step in range(start + 1, o["steps"] + 1):
        x, y = data.batch(
            seed=o["seed"],
            step=step,
            dp_rank=groups.dp_rank,
            batch_size=o["batch_size"],
            context=o["context"],
        )
        x, y = x.to(device), y.to(device)
        lr = lr_at(step, o)
        t0 = time.perf_counter()
        results = [r.train_step(x, y, lr) for r in runners.values()]
        losses = torch.stack([loss for loss, _ in results]).double()
        if groups.dp_size > 1:
            dist.all_reduce(losses, group=groups.dp_group)
            losses /= groups.dp_size
        losses = losses.tolist()  # also waits for the GPU: the step time below is real
        seconds = time.perf_counter() - t0
        if step > start + 1 or o["steps"] == start + 1:  # the first step warms up
            timed_steps, timed_seconds = timed_steps + 1, timed_seconds + seconds
        history["step"].append(step)
        history["loss"].append(losses[0])
        history["grad_norm"].append(results[0][1])
        history["lr"].append(lr)
        if o["check_against_unsharded"]:
            history["ref_loss"].append(losses[1])
        if not math.isfinite(losses[0]):
            log.error(f"step {step}: loss is {losses[0]}, stopping")
            return 1
        tok_s = tokens_per_step * timed_steps / timed_seconds if timed_seconds else 0.0
        bar.set_postfix_str(
            f"loss={losses[0]:.4f}, tok/s={tok_s:,.0f}, mem={mib(peak_memory_bytes(device))}",
            refresh=False,
        )
        bar.update(1)
        if step % o["log_every"] == 0 or step == o["steps"] or step == 1:
            line = (
                f"step {step}/{o['steps']}: loss {losses[0]:.6f}, lr {lr:.2e}, "
                f"grad norm {results[0][1]:.3f}, {tok_s:,.0f} tok/s, "
                f"peak {mib(peak_memory_bytes(device))}"
            )
            if o["check_against_unsharded"]:
                a, b = losses
                log.info(f"{step:5d} | {a:14.6f} | {b:10.6f} | {abs(a - b):.2e}")
                line += f", unsharded {b:.6f}"
            log.info(line, **FILE_ONLY)
        if o["eval_every"] and step % o["eval_every"] == 0 and step != o["steps"]:
            validate(step)
        if o["save_every"] and (step % o["save_every"] == 0 or step == o["steps"]):
            tag = save_checkpoint(o, runners, groups, step, history)
            log.info(f"step {step}: saved checkpoint {checkpoint_root(o) / tag}", **FILE_ONLY)
        if o["stop_at"] and step == o["stop_at"] and step != o["steps"]:
            log.info(f"step {step}: stopping here without saving (--stop-at)")
            stopped = True
            break
    bar.close()
    if stopped:
        dist.destroy_process_group()
        return 0

    validate(o["steps"])
    in_sync = all(replicas_in_sync(r.module, groups.tp_group) for r in runners.values())
    peak = torch.tensor([peak_memory_bytes(device)], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        finish(o, history, info, groups, world, backend, device, timed_steps, timed_seconds,
               tokens_per_step, peak.item(), in_sync, time.perf_counter() - wall0)  # fmt: skip
    dist.destroy_process_group()
    return 0


def finish(o, history, info, groups, world, backend, device, timed_steps, timed_seconds,
           tokens_per_step, peak, in_sync, wall) -> None:  # fmt: skip
    """Rank 0: the loss-curve PNG, ``summary.json`` and the summary on the console."""
    run_dir = Path(o["run_dir"])
    tok_s = tokens_per_step * timed_steps / timed_seconds if timed_seconds else None
    val = history["val"][-1]
    summary = {
        "steps": o["steps"],
        "final_train_loss": history["loss"][-1],
        "final_val_loss": val[1],
        "tokens_per_s": tok_s,
        "tokens_per_step": tokens_per_step,
        "peak_memory_mib": peak / 2**20,
        "peak_memory_kind": "cuda_max_allocated" if device.type == "cuda" else "cpu_max_rss",
        "wall_time_s": wall,
        "world": world,
        "tp": groups.tp_size,
        "dp": groups.dp_size,
        "backend": backend,
        "device": device.type,
        "engine": o["engine"],
        "tp_replicas_in_sync": in_sync,
        "data": info,
        "options": o,
        "history": history,
    }
    check = "ref_loss" in history
    title = (
        f"GPT d{o['d_model']} L{o['n_layers']} V{o['vocab_size']}, TP {groups.tp_size} x "
        f"DP {groups.dp_size}, {o['engine']} engine, {o['dtype']}"
    )
    if check:
        diffs = [abs(a - b) for a, b in zip(history["loss"], history["ref_loss"], strict=True)]
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        summary.update(
            final_train_loss_unsharded=history["ref_loss"][-1],
            final_val_loss_unsharded=val[2],
            max_abs_loss_difference=diffs[worst],
            max_abs_loss_difference_step=history["step"][worst],
        )
    plot(history, run_dir / "loss_curve.png", title)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = [
        f"done: {o['steps']} steps in {wall:.1f} s wall (this run), {tok_s or 0:,.0f} tokens/s, "
        f"peak memory {mib(peak)} per rank"
        + (" (max RSS)" if device.type == "cpu" else " (CUDA max allocated)"),
        f"loss: train {history['loss'][0]:.4f} -> {history['loss'][-1]:.4f}, "
        f"validation {val[1]:.4f}",
    ]
    if check:
        lines.append(
            f"unsharded head: train {history['ref_loss'][-1]:.4f}, validation {val[2]:.4f}; "
            f"largest |difference| of the train losses {summary['max_abs_loss_difference']:.2e} "
            f"(step {summary['max_abs_loss_difference_step']}) over {len(diffs)} steps"
        )
        lines.append("side by side:\n" + side_by_side(history, max(1, o["steps"] // 10)))
    lines.append(f"replicated body bitwise equal on the TP ranks: {'yes' if in_sync else 'NO'}")
    lines.append(f"wrote {run_dir / 'loss_curve.png'}, {run_dir / 'summary.json'}, "
                 f"{run_dir / 'train.log'}")  # fmt: skip
    for line in lines:
        log.info(line)


if __name__ == "__main__":
    sys.exit(main())
