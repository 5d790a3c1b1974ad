"""What the benchmark scripts share: child processes, timing, the machine, the report.

Each measurement runs in fresh Python processes (the peak RSS of a process is then one
measurement's alone, and the ranks of a group are real processes). The parent runs a
script again as ``script --child JSON`` (``run_children``); the child measures and prints
one line ``RESULT + json`` (``script_main``), which the parent parses. A group that runs
past its timeout is killed; a rank that fails ends its group at once.

    from benchmarks import harness

    def run_case(case: dict) -> dict: ...  # in each child: measure, return a JSON-able dict

    def main(argv) -> int:  # in the parent
        res = harness.run_children(__file__, case, world=2, timeout=300)
        # {"status": "ok", "ranks": [run_case's dict of rank 0, of rank 1]},
        # {"status": "timeout"} or {"status": "error: <the failed rank's last line>"}

    if __name__ == "__main__":
        sys.exit(harness.script_main(main, run_case))
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable

import torch

from benchmarks.memory import PeakMemory

MIB = 1024 * 1024
RESULT = "BENCH-RESULT "  # a child's result line: this marker, then its JSON


# ----------------------------------------------------------------------------- the machine


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except (OSError, AttributeError):
        return "n/a"


def threads_per_rank(world: int, cuda: bool) -> int:
    """CPU threads of each of ``world`` ranks: the cores split between them (1 on CUDA)."""
    return 1 if cuda else max(1, cores() // world)


def pick_device(name: str) -> tuple[str, str]:
    """``--device auto|cpu|cuda``: ``"cpu"`` or ``"cuda"`` (exits if CUDA is missing), and
    the device in words for the report."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        sys.exit("bench: --device cuda requested but CUDA is not available")
    if name == "cuda":
        return name, torch.cuda.get_device_name()
    cpu = platform.processor() or platform.machine()
    return name, f"{cpu}, {cores()} cores, {torch.get_num_threads()} torch threads"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ----------------------------------------------------------------------------- timing


def timed_calls(
    call: Callable[[], object],
    device: torch.device,
    repeats: int,
    before: Callable[[], None] | None = None,
    keep: Callable[[object], object] | None = None,
) -> dict:
    """``repeats`` (at least 1) timed calls of ``call``; the first also measures memory.

    ``before()`` runs ahead of every call, outside the timing (reset gradients, a barrier).
    The first call runs inside ``PeakMemory``; ``keep(output)`` then says what to keep of
    its output, which is dropped before the next call (later calls reuse its memory).
    Returns ``times_s`` (wall seconds per call), ``cpu_s`` (CPU seconds of the whole
    process per call, all threads: steadier than wall time when other work shares the
    cores), ``peak`` (the ``PeakMemory`` of the first call) and ``kept``.
    """
    times, cpu_times, peak, kept = [], [], None, None
    for i in range(max(1, repeats)):
        if before is not None:
            before()
        sync(device)
        with PeakMemory(device) if i == 0 else contextlib.nullcontext() as measured:
            t0, c0 = time.perf_counter(), time.process_time()
            out = call()
            sync(device)
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
        if i == 0:
            peak = measured
            kept = keep(out) if keep is not None else None
        del out
    return {"times_s": times, "cpu_s": cpu_times, "peak": peak, "kept": kept}


# ----------------------------------------------------------------------------- child processes


def script_main(parent: Callable[[list[str]], int], child: Callable[[dict], dict]) -> int:
    """A script's entry point: ``script --child JSON`` is a child, which runs ``child`` on
    the case and prints its result line; any other command line goes to ``parent``."""
    argv = sys.argv[1:]
    if argv[:1] != ["--child"]:
        return parent(argv)
    case = json.loads(argv[1])
    if case.get("threads"):
        torch.set_num_threads(case["threads"])
    print(RESULT + json.dumps(child(case)), flush=True)
    return 0


def report_partial(result: dict) -> None:
    """In a child: print its result so far as a result line. The parent keeps a child's
    last result line; after a timeout ``run_children`` returns the partial results too."""
    print(RESULT + json.dumps(result), flush=True)


def _child_env(rank: int, world: int, threads: int | None, env: dict | None) -> dict:
    out = os.environ | {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",  # unused (FileStore), but some libraries read it
        "GLOO_SOCKET_IFNAME": "lo",
    }
    if threads:
        out |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return out | (env or {})


def _wait(procs: list[subprocess.Popen], timeout: float) -> str | None:
    """Wait for all; kill the rest on timeout or when one rank fails. The failure, or None."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        status = None
        if time.monotonic() > deadline:
            status = "timeout"
        elif any(p.poll() not in (None, 0) for p in procs):
            status = "error"  # one rank failed: do not wait for the others' timeouts
        if status:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            return status
        time.sleep(0.2)
    return None


def run_children(
    script: str, case: dict, world: int = 1, timeout: float = 3600.0, env: dict | None = None
) -> dict:
    """Run ``script --child JSON(case)`` as ``world`` fresh processes (ranks 0..world-1).

    Each rank gets the usual torch.distributed environment variables, ``env`` on top, and
    ``case["store"]``, a file for a FileStore shared by the group; with ``case["threads"]``
    also that many OpenMP/MKL threads. Returns ``{"status": "ok", "ranks": [results]}``
    (each rank's last result line), ``{"status": "timeout"}`` after ``timeout`` seconds
    (with ``"ranks"`` when every rank had reported a partial result, ``report_partial``),
    or ``{"status": "error: ..."}`` (the failed ranks' output tails go to stderr).
    """
    threads = case.get("threads")
    with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
        case = case | {"store": os.path.join(tmp, "store")}
        cmd = [sys.executable, os.path.abspath(script), "--child", json.dumps(case)]
        procs, logs = [], []
        for rank in range(world):
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")  # noqa: SIM115
            child_env = _child_env(rank, world, threads, env)
            procs.append(subprocess.Popen(cmd, env=child_env, stdout=log, stderr=subprocess.STDOUT))
            logs.append(log)
        status = _wait(procs, timeout)
        results, tails = [], []
        for p, log in zip(procs, logs, strict=True):
            log.seek(0)
            text = log.read()
            log.close()
            found = [ln for ln in text.splitlines() if ln.startswith(RESULT)]
            if found:
                results.append(json.loads(found[-1][len(RESULT) :]))
            elif p.returncode not in (0, None) and status != "timeout":
                tails.append(f"rank exit {p.returncode}: " + text.strip()[-2000:])
    if status == "timeout":
        # What each rank reported before (``report_partial``), when every one did.
        return {"status": "timeout"} | ({"ranks": results} if len(results) == world else {})
    if len(results) != world:
        sys.stderr.write("\n".join(tails) + "\n")
        last = (tails[-1].strip().splitlines() or ["?"])[-1] if tails else "no result"
        return {"status": "error: " + last[:120]}
    return {"status": "ok", "ranks": results}


# ----------------------------------------------------------------------------- command line


def add_common_args(p: argparse.ArgumentParser, dtypes: Iterable[str], repeats_help: str):
    """The options every script has (shape options are the script's own)."""
    p.add_argument("--quick", action="store_true", help="a small shape (seconds, not minutes)")
    p.add_argument("--dtypes", nargs="+", choices=sorted(dtypes), default=["fp32", "bf16"])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--repeats", type=int, help=repeats_help)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the raw results to this file")


def fill_defaults(args: argparse.Namespace, **defaults: tuple) -> argparse.Namespace:
    """``name=(default, quick default)``: set each option the command line left out."""
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


# ----------------------------------------------------------------------------- the report


def print_load_before() -> str:
    load = loadavg()
    print(f"# load average before: {load} (other work on the machine skews the times)")
    return load


def print_progress(what: str, t_start: float) -> None:
    elapsed = time.perf_counter() - t_start
    print(f"#   {what} ({elapsed:.0f} s elapsed, load {loadavg()})", flush=True)


def print_load_after(t_start: float) -> None:
    print(f"# load average after: {loadavg()}, {time.perf_counter() - t_start:.0f} s in all")


def markdown_table(head: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def write_json(path: str | None, info: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(info | {"load_after": loadavg()}, f, indent=1)
