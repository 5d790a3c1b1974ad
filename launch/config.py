"""The training launcher's options: one table, read from a YAML file and from flags.

Every option is declared once, in :data:`OPTIONS` (default, type, help): the YAML config
may set any of them by name, the flag of the same name (``--steps 50``) overrides the
YAML, and ``--help`` lists them all. Keeping the table in one place is what makes a YAML
key and its flag impossible to drift apart. The options travel as a plain ``dict``
through the run (and into ``summary.json`` and each checkpoint's ``meta.json``).

Every value is checked when the options are parsed, wherever it comes from: its type
(:func:`coerce`: a YAML ``"no"`` for a boolean is false, a list for ``steps`` an error),
its range (:data:`RANGES`, :data:`CHOICES`) and the combinations that cannot work
(:func:`check_options`); anything wrong is argparse's usage error naming the option (exit
status 2), not a failure, or a silently wrong run, later. The YAML file itself is read
by :func:`load_yaml_config`, which ``verify.py`` shares.

The two functions of the options that more than one module needs live here too: the
learning-rate schedule (:func:`lr_at`, a function of the step alone, so that a resumed
run needs no scheduler state) and the DeepSpeed config (:func:`deepspeed_config`, used
by the engine and printed by the dry run).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch

from vocab_parallel.options import check_filter_eps

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
    "mode": ("auto", str, "our loss: auto | grad_in_forward | memory_saving | high_performance"),
    "sequence_parallel": (
        False,
        bool,
        "our head: hidden states and targets split along the "
        "sequence over the TP group (torch engine)",
    ),
    "tp_style": (
        "shards",
        str,
        "shards | dtensor: the head as our own shard parameter, or a "
        "ColwiseParallel DTensor nn.Linear turned into our head (torch engine)",
    ),
    "backend": ("auto", str, "our loss: auto | triton | torch"),
    "filter_eps": (
        None,
        str,
        "gradient filtering of our loss (changes the gradients): none (default, exact) | "
        "auto (eps(dtype) / 32) | a number >= 0",
    ),
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
    "overwrite": (False, bool, "start anew in a run_dir that holds checkpoints: delete them"),
    "stop_at": (0, int, "exit after this step without saving, as a crash would (tests)"),
    "log_every": (10, int, "log (and side-by-side table) every N steps"),
    "check_against_unsharded": (False, bool, "also train an unsharded-head copy and compare"),
    "zero_stage": (0, int, "deepspeed engine: ZeRO stage 0, 1 or 2"),
    "deepspeed": ({}, dict, "deepspeed engine: extra DeepSpeed config (YAML only)"),
    "timeout_s": (600, int, "collective timeout, seconds: a failed rank never hangs the others"),
    "dry_run": (False, bool, "print the plan (groups, parameters, memory) and exit"),
}


def load_yaml_config(path: str | os.PathLike, parser: argparse.ArgumentParser) -> dict:
    """The mapping a YAML config file holds (``{}`` for an empty file).

    Shared by the launcher's jobs (``train.py``, ``verify.py``): a file that is missing,
    unreadable, not YAML, or not a mapping of option names is a usage error that names
    the file (``parser.error``, exit status 2), never a traceback.
    """
    import yaml

    where = f"--config {path}"
    try:
        with open(path, encoding="utf-8") as f:
            loaded = yaml.safe_load(f)
    except FileNotFoundError:
        parser.error(f"{where}: no such file")
    except IsADirectoryError:
        parser.error(f"{where}: is a directory, not a YAML file")
    except OSError as exc:
        parser.error(f"{where}: cannot read it: {exc.strerror or exc}")
    except UnicodeDecodeError as exc:
        parser.error(f"{where}: not a UTF-8 text file ({exc.reason} at byte {exc.start})")
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        parser.error(f"{where}: malformed YAML: {detail}")
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        parser.error(
            f"{where}: expected a mapping of option names to values, got a "
            f"{type(loaded).__name__} ({loaded!r:.60})"
        )
    bad = [k for k in loaded if not isinstance(k, str)]
    if bad:
        parser.error(f"{where}: option names must be strings, got {bad!r}")
    return loaded


_TRUE, _FALSE = ("true", "yes", "on"), ("false", "no", "off")
_KIND_NAMES = {bool: "a boolean", int: "an int", float: "a number", str: "a string",
               dict: "a mapping"}  # fmt: skip


def coerce(value, kind: type, *, optional: bool = False):
    """``value`` (from YAML) as ``kind``, or ``ValueError`` saying what was expected.

    bool: a YAML boolean, or one of the strings true/false/yes/no/on/off in any case (a
    quoted ``"no"`` is false, not a non-empty string); int: an int, or a float or string
    of a whole number (YAML reads ``1e3`` as a string); float: a number or a numeric
    string (``3e-4``); str and dict: exactly that. ``None`` only where ``optional``.
    Booleans are never numbers here (YAML's ``yes`` is not 1).
    """
    if value is None:
        if optional:
            return None
        raise ValueError(f"expected {_KIND_NAMES[kind]}, got null")
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(f"expected a boolean (true/false, yes/no, on/off), got {value!r}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        number = value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                try:
                    number = float(value)
                except ValueError:
                    number = None
        if isinstance(number, float) and not isinstance(value, bool) and number.is_integer():
            return int(number)
        raise ValueError(f"expected an int, got {value!r}")
    if kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"expected a number, got {value!r}")
    if not isinstance(value, kind):
        raise ValueError(f"expected {_KIND_NAMES[kind]}, got {type(value).__name__} {value!r}")
    return value


def parse_args(argv: list[str] | None = None, description: str | None = None) -> dict:
    """The options: defaults, then the YAML ``--config``, then the flags given.

    ``description`` heads ``--help`` (the launcher passes the first paragraph of its
    docstring). Invalid options (a wrong type in the YAML, a value out of its range, a
    config file that cannot be read) exit with argparse's usage error, naming the option.
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
        loaded = load_yaml_config(config, p)
        unknown = set(loaded) - set(OPTIONS)
        if unknown:
            p.error(f"{config}: unknown keys {sorted(unknown)}")
        for key, value in loaded.items():
            default, kind, _ = OPTIONS[key]
            try:
                opts[key] = coerce(value, kind, optional=default is None)
            except ValueError as exc:
                p.error(f"{config}: {key}: {exc}")
    opts.update({k: v for k, v in args.items() if v is not None})
    opts["config"] = str(config) if config else None
    if opts["run_dir"] is None:
        opts["run_dir"] = str(Path("runs") / (Path(config).stem if config else "train"))
    check_options(opts, p)
    return opts


# The range of every numeric option: (low, high, low included, high included); None: unbounded.
RANGES: dict[str, tuple] = {
    "tp": (1, None, True, None),
    "world_size": (1, None, True, None),
    "steps": (1, None, True, None),
    "batch_size": (1, None, True, None),
    "context": (1, None, True, None),
    "d_model": (1, None, True, None),
    "n_layers": (1, None, True, None),
    "n_heads": (1, None, True, None),
    "mlp_ratio": (1, None, True, None),
    "vocab_size": (1, None, True, None),
    "label_smoothing": (0.0, 1.0, True, False),
    "lr": (0.0, None, False, None),
    "min_lr_ratio": (0.0, 1.0, True, True),
    "warmup_steps": (0, None, True, None),
    "weight_decay": (0.0, None, True, None),
    "beta1": (0.0, 1.0, True, False),
    "beta2": (0.0, 1.0, True, False),
    "grad_clip": (0.0, None, True, None),
    "seed": (0, 2**32, True, False),  # numpy's and torch's generators take it (and seed * 1e6)
    "val_fraction": (0.0, 1.0, False, False),
    "val_batches": (1, None, True, None),
    "eval_every": (0, None, True, None),
    "save_every": (0, None, True, None),
    "keep_checkpoints": (0, None, True, None),
    "stop_at": (0, None, True, None),
    "log_every": (1, None, True, None),
    "zero_stage": (0, 2, True, True),
    "timeout_s": (1, None, True, None),
}
CHOICES = {
    "engine": ("torch", "deepspeed"),
    "dtype": tuple(DTYPES),
    "mode": ("auto", "grad_in_forward", "memory_saving", "high_performance"),
    "backend": ("auto", "triton", "torch"),
    "tp_style": ("shards", "dtensor"),
}
# The byte-level BPE tokenizer starts from the 256 bytes and adds <|endoftext|>.
MIN_BPE_VOCAB = 257


def filter_eps(o: dict) -> float | str | None:
    """The loss's ``filter_eps`` from the option (a string on the command line): None for
    unset or "none", else "auto" or a number, checked by the library's own rule
    (``vocab_parallel.options.check_filter_eps``; ValueError otherwise)."""
    value = o.get("filter_eps")
    text = None if value is None else str(value).strip().lower()
    if text is None or text == "none":
        return None
    if text != "auto":
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"expected none, auto or a number >= 0, got {value!r}") from None
    return check_filter_eps(value)


def describe_range(low, high, low_in, high_in, kind: type) -> str:
    what = "an int" if kind is int else "a finite number"
    if high is None:
        return f"{what} {'>=' if low_in else '>'} {low}"
    return f"{what} in {'[' if low_in else '('}{low}, {high}{']' if high_in else ')'}"


def check_options(o: dict, p: argparse.ArgumentParser) -> None:
    """Reject what would fail later, or silently misbehave, with a usage error now: every
    option's type and range, and the combinations that cannot work."""

    def name(key: str) -> str:
        return f"{key} (--{key.replace('_', '-')})"

    for key, (default, kind, _) in OPTIONS.items():  # flags are typed; values set in code too
        value = o[key]
        if value is None and default is None:
            continue
        ok = (
            isinstance(value, int | float) and not isinstance(value, bool)
            if kind is float
            else isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        )
        if not ok:
            p.error(f"{name(key)}: expected {_KIND_NAMES[kind]}, got {value!r}")
    try:
        filter_eps(o)
    except ValueError as exc:
        p.error(f"{name('filter_eps')}: {exc}")
    for key, (low, high, low_in, high_in) in RANGES.items():
        value, kind = o[key], OPTIONS[key][1]
        if value is None:
            continue
        inside = (
            math.isfinite(value)
            and (value >= low if low_in else value > low)
            and (high is None or (value <= high if high_in else value < high))
        )
        if not inside:
            p.error(f"{name(key)}: expected {describe_range(low, high, low_in, high_in, kind)}, "
                    f"got {value!r}")  # fmt: skip
    for key, choices in CHOICES.items():
        if o[key] not in choices:
            p.error(f"{name(key)}: expected one of {', '.join(choices)}, got {o[key]!r}")
    for key in ("data", "cache_dir", "run_dir", "tokenizer"):
        if o[key] is not None and not o[key].strip():
            p.error(f"{name(key)}: expected a path, got an empty string")
    if o["d_model"] % o["n_heads"]:
        p.error(f"d_model {o['d_model']} is not a multiple of n_heads {o['n_heads']}")
    if o["tokenizer"] is None and o["vocab_size"] < MIN_BPE_VOCAB:
        p.error(
            f"{name('vocab_size')}: the byte-level BPE tokenizer has at least {MIN_BPE_VOCAB} "
            f"tokens (256 bytes and {'<|endoftext|>'}), got {o['vocab_size']}"
        )
    if o["resume"] and o["overwrite"]:
        p.error("--resume and --overwrite: give one or the other (continue the run in run_dir, "
                "or delete its checkpoints and start anew)")  # fmt: skip
    if o["dry_run"] and o["world_size"] and o["world_size"] % o["tp"]:
        p.error(f"tp {o['tp']} does not divide world_size {o['world_size']}")
    if o["tp_style"] == "dtensor" and o["tp"] == 1:
        p.error(f"{name('tp_style')}: dtensor needs tp > 1 (a DeviceMesh over the "
                "tensor-parallel group); use shards with tp 1")  # fmt: skip
    if o["engine"] == "deepspeed":
        for key, default in (("sequence_parallel", False), ("tp_style", "shards")):
            if o[key] != default:
                p.error(f"{name(key)}: {o[key]!r} needs the torch engine; engine deepspeed "
                        f"takes only the default ({default!r})")  # fmt: skip
    if not all(isinstance(k, str) for k in o["deepspeed"]):
        p.error("deepspeed: expected a mapping of DeepSpeed config keys (strings)")


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
