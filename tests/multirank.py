"""Spawn gloo ranks for a test, with timeouts so that a failing rank never hangs the suite.

``run_ranks(fn, world, *args)`` starts ``world`` processes (forked from a server that
has imported torch, see ``_context``), each initialising a
gloo group through a FileStore, and returns the list of ``fn(group, *args)`` results in
rank order. A rank that raises makes the call fail with that rank's traceback; the
others are terminated (they would otherwise wait in a collective until gloo's timeout).
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import traceback

import pytest
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60


def _worker(rank, world, store_path, fn, args, results):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        try:
            results.put((rank, True, fn(dist.group.WORLD, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


# Modules every rank imports, loaded once in the fork server (below).
PRELOAD = ["torch", "torch.distributed", "vocab_parallel"]


def _context():
    """Rank processes forked from a server that has imported torch and the library once
    (``forkserver``): a rank starts in well under a second where a fresh interpreter
    (``spawn``) spends seconds importing torch, per rank and per test. The server has
    imported modules and nothing else (no thread pool, no process group), so a fork of it
    is as clean as a spawn; the environment is the suite's when the server starts (the
    first multi-rank test, after conftest.py)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_ranks(fn, world: int, *args, timeout: float = 600.0) -> list:
    """Run ``fn(group, *args)`` on ``world`` gloo ranks; results in rank order.

    On a CUDA machine with fewer GPUs than ``world`` the test is skipped: its ranks would
    share one device, and gloo has no CUDA version of several collectives the loss uses
    (CPU machines run these tests on gloo).
    """
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        pytest.skip(
            f"{world} ranks need {world} GPUs, this machine has {torch.cuda.device_count()}; "
            "the CPU suite runs them on gloo"
        )
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world, store_path, fn, args, results))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        out: dict[int, object] = {}
        try:
            while len(out) < world:
                try:
                    rank, ok, value = results.get(timeout=timeout)
                except queue.Empty:
                    raise TimeoutError(
                        f"ranks {sorted(set(range(world)) - set(out))} gave no result "
                        f"within {timeout} s"
                    ) from None
                if not ok:
                    raise AssertionError(f"rank {rank} of {world} failed:\n{value}")
                out[rank] = value
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.terminate()
                    p.join()
    return [out[r] for r in range(world)]
