"""Compile every Triton kernel variant the launchers can choose, ahead of time, for GPUs.

    python scripts/aot_compile.py                 # sm_80, sm_90, sm_100: a table
    python scripts/aot_compile.py --json out.json --jobs 2 --targets 90
    python scripts/aot_compile.py --match ENTROPY     # only the variants with that flag
    python scripts/aot_compile.py --cover             # a covering subset (what CI compiles)

No GPU is needed: ``triton.compile`` lowers each variant (kernel x input dtype x mode
constexprs x tile of that target, as listed by ``launch_variants`` next to each launcher)
to PTX and a cubin for ``GPUTarget("cuda", arch, 32)``, in the two specialisations a
contiguous launch gets at run time (``SPECS``: all sizes 16-divisible, or only H).
Checked per variant: it compiles, its shared memory (``metadata.shared``) fits the
target's per-block limit, and ``ptxas -v`` (Triton's bundled ptxas) reports no register
spills and fewer than 255 registers. Exit status 1 on any failure.

``--cover`` compiles a covering subset (:func:`cover`): per kernel, dtype and tile, the
variant with the most mode flags on, the one with the fewest, and for each flag the
heaviest variant with it on and with it off. The flags add work to the same tile loop,
so the heaviest variant of a tile is the likeliest to reach the register and shared
memory limits, and every flag value is still compiled once per tile. About a quarter of
the variants: what the test suite compiles on every run (the whole set takes about 15
minutes on 2 CPU cores; run it when a kernel or a tile table changes).

Triton's interpreter must be off here (TRITON_INTERPRET is removed before triton loads).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported, here or in a worker
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from vocab_parallel.kernels import backward, common, divergence, forward  # noqa: E402

TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# Arguments a contiguous launch passes as 1 (Triton turns them into constexprs).
UNIT_ARGS = {
    "stride_xk",
    "stride_wk",
    "stride_ln",
    "stride_tn",
    "stride_sn",
    "stride_gn",
    "stride_grad",
    "stride_ps",
}
FLOAT_ARGS = {"on_target", "smooth_all", "softcap"}
# In the input dtype; target_ptr is int64, the rest fp32.
INPUT_PTRS = {"x_ptr", "w_ptr", "b_ptr", "g_ptr"}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")  # maxnreg: only where a tile sets it
# How Triton specialises the int arguments of a launch (a value divisible by 16 gets a hint):
#   aligned: every size and stride (LLM shapes: BT, V_local, H all multiples of 16); the
#            deepest pipelines, hence the most shared memory;
#   odd:     only H and the input/weight row strides (any BT and V: a prime vocabulary,
#            an odd batch); scalar stores and masks, hence the most registers.
SPECS = ("aligned", "odd")
ALIGNED_HIDDEN = {"H", "stride_xm", "stride_wn"}


def variants(capability: tuple[int, int]) -> list[tuple[object, torch.dtype, dict]]:
    modules = (forward, backward, divergence)
    return [v for module in modules for v in module.launch_variants(capability)]


def _flags(meta: dict) -> list[str]:
    """The mode flags of a variant (upper-case bool constexprs), on or off."""
    return [k for k, v in meta.items() if k.isupper() and isinstance(v, bool)]


def cover(found: list[tuple[object, torch.dtype, dict]]) -> list[int]:
    """Indices of a covering subset of ``found`` (see the module's ``--cover``), in order."""
    groups: dict[tuple, list[int]] = {}
    for i, (kernel, dtype, meta) in enumerate(found):
        tile = tuple(meta.get(k) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", *LAUNCH_OPTIONS))
        groups.setdefault((kernel.__name__, dtype, tile), []).append(i)
    chosen = set()
    for members in groups.values():

        def on(i: int, flag: str) -> bool:
            return bool(found[i][2].get(flag))

        def weight(i: int) -> tuple[int, int]:  # flags on, then the first listed
            return sum(on(i, f) for f in _flags(found[i][2])), -i

        pick = {max(members, key=weight), min(members, key=weight)}
        for flag in sorted({f for i in members for f in _flags(found[i][2])}):
            for value in (True, False):
                if not any(on(i, flag) == value for i in pick):
                    with_value = [i for i in members if on(i, flag) == value]
                    if with_value:
                        pick.add(max(with_value, key=weight))
        chosen |= pick
    return sorted(chosen)


def source(kernel, dtype: torch.dtype, meta: dict, spec: str = "aligned") -> ASTSource:
    """The kernel specialised like a contiguous launch of ``dtype`` inputs (``SPECS``)."""
    constexprs = {k: v for k, v in meta.items() if k not in LAUNCH_OPTIONS}
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in UNIT_ARGS:
            signature[name] = "constexpr"
            constexprs[name] = 1
        elif name in FLOAT_ARGS:
            signature[name] = "fp32"
        elif name.endswith("_ptr"):
            if name in INPUT_PTRS:
                signature[name] = "*" + TYPES[dtype]
            else:
                signature[name] = "*i64" if name == "target_ptr" else "*fp32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:  # sizes and strides
            signature[name] = "i32"
            if spec == "aligned" or name in ALIGNED_HIDDEN:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)


def ptxas_path(arch: int) -> str:
    """Triton's bundled ptxas for ``arch`` (the Blackwell-capable one where it ships two)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        tool = get_ptxas(arch)
        return getattr(tool, "path", tool)
    except (ImportError, TypeError, AttributeError):
        from triton import knobs

        return knobs.nvidia.ptxas.path


def ptx_arch(ptx: str) -> str:
    return re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.M).group(1)


def ptxas_usage(ptx: str, arch: int) -> dict:
    """Registers and spills that ``ptxas -v`` reports for ``ptx``."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "k.ptx")
        src.write_text(ptx)
        cmd = [ptxas_path(arch), "-v", f"--gpu-name={ptx_arch(ptx)}", str(src), "-o"]
        out = subprocess.run([*cmd, str(Path(tmp, "k.o"))], capture_output=True, text=True)
    log = out.stdout + out.stderr
    if out.returncode != 0:
        raise RuntimeError(f"ptxas failed:\n{log}")

    def number(pattern: str) -> int:
        return sum(int(n) for n in re.findall(pattern, log))

    return {
        "registers": max(int(n) for n in re.findall(r"Used (\d+) registers", log)),
        "spill_stores": number(r"(\d+) bytes spill stores"),
        "spill_loads": number(r"(\d+) bytes spill loads"),
    }


def describe(kernel, dtype: torch.dtype, meta: dict) -> str:
    flags = [k for k, v in meta.items() if k.isupper() and isinstance(v, bool) and v]
    tile = "x".join(str(meta[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K") if k in meta)
    tile += f" w{meta['num_warps']} s{meta['num_stages']}"
    if "maxnreg" in meta:
        tile += f" r{meta['maxnreg']}"
    name = kernel.__name__.strip("_").removesuffix("_kernel")
    return f"{name} {TYPES[dtype]} {tile} {'+'.join(flags) or '-'}"


def compile_one(job: tuple[int, int, str]) -> dict:
    arch, index, spec = job
    capability = divmod(arch, 10)
    kernel, dtype, meta = variants(capability)[index]
    variant = f"{describe(kernel, dtype, meta)} [{spec}]"
    row = {"arch": arch, "variant": variant, "limit": common.smem_limit(capability)}
    t0 = time.time()
    try:
        options = {k: meta[k] for k in LAUNCH_OPTIONS if k in meta}
        compiled = triton.compile(
            source(kernel, dtype, meta, spec),
            target=GPUTarget("cuda", arch, 32),
            options=options,
        )
        row["shared"] = int(compiled.metadata.shared)
        row |= ptxas_usage(compiled.asm["ptx"], arch)
    except Exception as exc:  # reported as a failure of this variant
        row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    row["seconds"] = round(time.time() - t0, 2)
    problems = []
    if "error" in row:
        problems.append("does not compile")
    else:
        if row["shared"] > row["limit"]:
            problems.append(f"shared {row['shared']} > {row['limit']}")
        if row["spill_stores"] or row["spill_loads"]:
            problems.append("spills")
        if row["registers"] >= 255:
            problems.append("255 registers")
    row["problems"] = problems
    return row


@triton.jit
def _probe(x_ptr):
    tl.store(x_ptr, 1.0)


def toolchain_supports(arch: int) -> bool:
    """Whether the bundled toolchain compiles anything at all for ``arch``."""
    try:
        src = ASTSource(fn=_probe, signature={"x_ptr": "*fp32"})
        triton.compile(src, target=GPUTarget("cuda", arch, 32))
        return True
    except Exception:
        return False


def table(rows: list[dict]) -> str:
    head = "| arch | kernel dtype tile flags | shared B (limit) | regs | spills | s | ok |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            usage = "- | - | -"
        else:
            spills = f"{r['spill_stores']}/{r['spill_loads']}"
            usage = f"{r['shared']} ({r['limit']}) | {r['registers']} | {spills}"
        verdict = "yes" if not r["problems"] else "NO: " + ", ".join(r["problems"])
        lines.append(f"| sm_{r['arch']} | {r['variant']} | {usage} | {r['seconds']} | {verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    default_targets = [major * 10 + minor for major, minor in common.AOT_TARGETS]
    p.add_argument("--targets", nargs="+", type=int, default=default_targets)
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--json", help="also write the rows (and skipped targets) here")
    p.add_argument("--specs", nargs="+", choices=SPECS, default=list(SPECS))
    p.add_argument("--match", help="only variants whose description contains this (e.g. ENTROPY)")
    p.add_argument("--cover", action="store_true", help="a covering subset (see above)")
    args = p.parse_args(argv)

    skipped = [a for a in args.targets if a >= 100 and not toolchain_supports(a)]
    targets = [a for a in args.targets if a not in skipped]
    jobs = []
    for a in targets:
        found = variants(divmod(a, 10))
        keep = cover(found) if args.cover else range(len(found))
        jobs += [
            (a, i, spec)
            for i in keep
            if args.match is None or args.match in describe(*found[i])
            for spec in args.specs
        ]
    spawn = multiprocessing.get_context("spawn")  # no fork of a process with threads
    with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=spawn) as pool:
        rows = list(pool.map(compile_one, jobs))
    print(table(rows))
    for arch in skipped:
        print(f"sm_{arch}: skipped, the bundled toolchain cannot compile for it")
    failed = [r for r in rows if r["problems"]]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} variants ok (triton {triton.__version__})")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "skipped": skipped}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
