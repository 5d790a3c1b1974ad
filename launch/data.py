"""Training data for ``launch/train.py``: a text corpus, a byte-level BPE tokenizer, batches.

    tokens, info = prepare_tokens("data/kjv.txt.gz", vocab_size=8192, cache_dir="runs/cache")
    data = TokenData(tokens, val_fraction=0.02)
    x, y = data.batch(seed=0, step=7, dp_rank=1, batch_size=16, context=64)

The tokenizer is trained with the ``tokenizers`` package on the corpus itself the first
time (a few seconds for the embedded 4 MB corpus), so the default run needs no network and
no download; tokenizer and token ids are cached under a name that hashes the corpus and
the recipe, so a changed corpus or vocabulary size never reuses a stale cache.

Batches are a pure function of ``(seed, step, dp_rank)``: a resumed run draws exactly the
batches the uninterrupted run would have, with no sampler state to save. The validation
slice is the tail of the corpus, never sampled for training.

In a distributed run only rank 0 reads the corpus and tokenises it (:func:`load_data`);
the token ids reach the other ranks through a broadcast, so multi-node runs need no
shared disk for the data and no two ranks ever train the tokenizer at the same time.

``tokenizers`` is imported only when a tokenizer has to be trained or loaded (the
``train`` extra), so importing this module (the tests do, for :class:`TokenData`) does
not need it.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from launch.config import ROOT
from launch.dist_env import RunRefused, collective

# Bump when the tokenizer recipe or the token file format changes: it is part of the
# cache key, so old caches are ignored rather than misread.
RECIPE_VERSION = 1
END_OF_TEXT = "<|endoftext|>"


def read_text(path: str | os.PathLike) -> str:
    """The corpus as one string (``.gz`` files are decompressed)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read()


def train_bpe(text: str, vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2 style) trained on ``text``.

    Byte level: every string is encodable (no unknown token), whatever the corpus. The
    vocabulary may come out smaller than ``vocab_size`` when the corpus has fewer distinct
    merges to offer (the 4 MB embedded corpus saturates at about 21.5k); token ids are then
    simply below ``vocab_size`` and the model's extra rows are never targets.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[END_OF_TEXT],
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer)
    return tokenizer


def encode(tokenizer, text: str) -> np.ndarray:
    """Token ids of ``text`` (line by line, newlines kept), in the smallest integer dtype."""
    lines = text.splitlines(keepends=True)
    ids = [i for enc in tokenizer.encode_batch(lines) for i in enc.ids]
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 2**16 else np.uint32
    return np.asarray(ids, dtype=dtype)


def _atomic_write(path: Path, write) -> None:
    """``write(tmp_path)`` then rename: a crashed or concurrent writer never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def prepare_tokens(
    corpus: str | os.PathLike,
    vocab_size: int,
    cache_dir: str | os.PathLike,
    tokenizer_path: str | os.PathLike | None = None,
) -> tuple[np.ndarray, dict]:
    """Token ids of ``corpus``, training (or loading) the tokenizer and caching both.

    ``tokenizer_path``: an existing ``tokenizer.json`` (e.g. a Llama-3 tokenizer) to use
    instead of training one. Returns ``(tokens, info)``; ``info`` says where the tokenizer
    is, its vocabulary size and whether the cache was hit. Run it on one rank only.
    """
    from tokenizers import Tokenizer

    corpus = Path(corpus)
    raw = corpus.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()[:12]
    if tokenizer_path is not None:
        tok_digest = hashlib.sha256(Path(tokenizer_path).read_bytes()).hexdigest()[:12]
        key = f"{corpus.stem.split('.')[0]}-{digest}-tok{tok_digest}-r{RECIPE_VERSION}"
    else:
        key = f"{corpus.stem.split('.')[0]}-{digest}-bpe{vocab_size}-r{RECIPE_VERSION}"
    cache = Path(cache_dir)
    tok_file = Path(tokenizer_path) if tokenizer_path is not None else cache / f"{key}.json"
    ids_file = cache / f"{key}.npy"

    hit = ids_file.exists() and tok_file.exists()
    if hit:
        tokenizer = Tokenizer.from_file(str(tok_file))
        tokens = np.load(ids_file)
    else:
        text = read_text(corpus)
        if tokenizer_path is not None:
            tokenizer = Tokenizer.from_file(str(tok_file))
        else:
            tokenizer = train_bpe(text, vocab_size)
            _atomic_write(tok_file, lambda tmp: tokenizer.save(tmp))
        tokens = encode(tokenizer, text)

        def save_npy(tmp):
            with open(tmp, "wb") as f:
                np.save(f, tokens)

        _atomic_write(ids_file, save_npy)
    info = {
        "corpus": str(corpus),
        "tokenizer": str(tok_file),
        "tokenizer_vocab_size": tokenizer.get_vocab_size(),
        "tokens": int(tokens.size),
        "cache_hit": bool(hit),
    }
    return tokens, info


def decode(tokenizer_file: str | os.PathLike, ids) -> str:
    """Text of ``ids`` (for a look at the data, e.g. in logs)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_file)).decode(list(map(int, ids)))


@dataclass
class TokenData:
    """A token stream split into a training part and a held-out validation tail."""

    tokens: np.ndarray
    val_fraction: float = 0.02

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction: expected 0 < f < 1, got {self.val_fraction!r}")
        n_val = max(1, int(len(self.tokens) * self.val_fraction))
        self.train = torch.from_numpy(self.tokens[:-n_val].astype(np.int64))
        self.val = torch.from_numpy(self.tokens[-n_val:].astype(np.int64))

    def batch(
        self, *, seed: int, step: int, dp_rank: int, batch_size: int, context: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets ``[batch_size, context]`` for one step of one DP rank.

        Random windows of the training part, drawn from a generator seeded with
        ``(seed, step, dp_rank)`` alone: reproducible, independent of what ran before, and
        different on every DP rank (tensor-parallel ranks of one DP rank get the same batch,
        as they must).
        """
        if len(self.train) < context + 2:
            raise ValueError(f"corpus too short ({len(self.train)} tokens) for context {context}")
        rng = np.random.default_rng([seed, 1, step, dp_rank])  # 1: the training stream
        starts = torch.from_numpy(rng.integers(0, len(self.train) - context - 1, batch_size))
        window = starts[:, None] + torch.arange(context + 1)
        chunk = self.train[window]
        return chunk[:, :-1], chunk[:, 1:]

    def val_batches(
        self, *, dp_rank: int, dp_size: int, batch_size: int, context: int, max_batches: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This DP rank's share of the fixed validation set: consecutive, non-overlapping
        windows of the validation tail, dealt round-robin to the DP ranks, whole batches only
        (every rank gets the same number, so the collectives of the loss line up)."""
        n_windows = (len(self.val) - 1) // context
        per_rank = min(max_batches, n_windows // (dp_size * batch_size))
        if per_rank < 1:
            raise ValueError(
                f"validation slice ({len(self.val)} tokens) too short for {dp_size} DP rank(s) "
                f"x batch {batch_size} x context {context}; raise val_fraction"
            )
        starts = torch.arange(per_rank * dp_size * batch_size) * context
        mine = starts[dp_rank::dp_size].view(per_rank, batch_size)
        window = mine[..., None] + torch.arange(context + 1)
        chunks = self.val[window]
        return [(c[:, :-1], c[:, 1:]) for c in chunks]


def resolve_data_path(path: str) -> Path:
    """The corpus as given, or under the repository root (runs from another folder)."""
    p = Path(path)
    return p if p.is_absolute() or p.exists() else ROOT / p


def load_data(o: dict, rank: int, device: torch.device) -> tuple[TokenData, dict]:
    """Rank 0 tokenises the corpus (training the tokenizer at the first run) and sends the
    token ids to every rank; the others wait in the broadcast, bounded by ``timeout_s``.

    Where rank 0 cannot (no corpus, an unreadable tokenizer, a vocabulary too large...),
    it sends the reason instead, and every rank exits with it: none waits for data that
    will never come."""
    payload = [None, None]
    if rank == 0:
        t0 = time.perf_counter()
        try:
            tokens, info = prepare_tokens(
                resolve_data_path(o["data"]), o["vocab_size"], o["cache_dir"], o["tokenizer"]
            )
            info["seconds"] = round(time.perf_counter() - t0, 2)
            if info["tokenizer_vocab_size"] > o["vocab_size"]:
                payload = [None, f"tokenizer has {info['tokenizer_vocab_size']} tokens, more "
                                 f"than vocab_size {o['vocab_size']}"]  # fmt: skip
            else:
                payload = [tokens, info]
        except Exception as exc:  # sent to every rank, which all exit with it
            payload = [None, f"cannot prepare the tokens of data {o['data']!r} (cache_dir "
                             f"{o['cache_dir']!r}, tokenizer {o['tokenizer']!r}): "
                             f"{type(exc).__name__}: {exc}"]  # fmt: skip
    with collective("broadcast of the token ids", None):
        dist.broadcast_object_list(payload, src=0, device=device if device.type == "cuda" else None)
    tokens, info = payload
    if tokens is None:
        raise RunRefused(f"data: {info}")
    return TokenData(tokens, o["val_fraction"]), info
