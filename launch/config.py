"""The training launcher's options: one table, read from a YAML file and from flags.

Every option is declared once, in :data:`OPTIONS` (default, type, help): the YAML config
may set any of them by name, the flag of the same name (``--steps 50``) overrides the
YAML, and ``--help`` lists them all. Keeping the table in one place is what makes a YAML
key and its flag impossible to drift apart. The options travel as a plain ``dict``
through the run (and into ``summary.json`` and each checkpoint's ``meta.json``).

The two functions of the options that more than one module needs live here too: the
learning-rate schedule (:func:`lr_at`, a function of the step alone, so that a resumed
run needs no scheduler state) and the DeepSpeed config (:func:`deepspeed_config`, used
by the engine and printed by the dry run).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

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


def parse_args(argv: list[str] | None = None, description: str | None = None) -> dict:
    """The options: defaults, then the YAML ``--config``, then the flags given.

    ``description`` heads ``--help`` (the launcher passes the first paragraph of its
    docstring). Invalid options exit with argparse's usage error.
    """
    p = argparse.ArgumentParser(
        description=description,
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
    """Reject what would fail later, or silently misbehave, with a usage error now."""
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
