"""The Triton kernel variants compile for real GPUs, ahead of time, without a GPU.

``scripts/aot_compile.py --cover`` compiles a covering subset of the variants the
launchers can choose (kernel x fp16/bf16/fp32 x mode constexprs x the tiles of each
target: per tile the heaviest and the lightest variant, and every flag on and off), for
sm_90 specialised for aligned and for odd sizes, for sm_80 and (when the bundled
toolchain supports it) sm_100 for aligned sizes, and checks shared memory against the
target's per-block limit and ``ptxas -v`` for register spills and 255 registers. It runs in a
subprocess: the interpreter (switched on by conftest.py without CUDA) must be off there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

# Multi-process (or compiling every kernel variant): out of the fast loop (-m "not slow").
pytestmark = pytest.mark.slow

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")  # the NVIDIA backend with its bundled ptxas

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code_or_args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, *code_or_args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


# The covering subset of each target's variants (scripts/aot_compile.py --cover): sm_90,
# the GPU the project runs on (H200), in both specialisations; sm_80 and sm_100 in the
# aligned one (the deepest pipelines: their shared memory limits differ most). The whole
# set (python scripts/aot_compile.py) takes about 15 minutes on 2 CPU cores.
RUNS = [((90,), ("aligned", "odd")), ((80, 100), ("aligned",))]  # (targets, specs)


def test_every_kernel_variant_compiles_for_sm80_sm90_sm100(tmp_path):
    rows, skipped, n_specs = [], [], {}
    for targets, specs in RUNS:
        report = tmp_path / f"aot_{'_'.join(map(str, targets))}.json"
        cmd = ["scripts/aot_compile.py", "--cover", "--json", str(report), "--jobs", "2"]
        cmd += ["--targets", *map(str, targets), "--specs", *specs]
        out = _run(cmd, timeout=900)
        print(out.stdout)
        assert out.returncode == 0, f"{out.stdout[-6000:]}\n{out.stderr[-4000:]}"
        result = json.loads(report.read_text())
        rows += result["rows"]
        skipped += result["skipped"]
        n_specs |= dict.fromkeys(targets, len(specs))
    assert all(arch >= 100 for arch in skipped), skipped  # sm_80 and sm_90 always compile
    by_arch: dict[int, list[dict]] = {}
    for row in rows:
        by_arch.setdefault(row["arch"], []).append(row)
    assert {80, 90} <= set(by_arch)

    # Every variant of the covering subset was compiled, and each passed its checks; the
    # subset keeps every kernel, dtype and tile of the launchers' lists.
    check = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, "scripts")
        import aot_compile
        found = aot_compile.variants(divmod(int(sys.argv[1]), 10))
        chosen = aot_compile.cover(found)
        tiles = lambda idx: {aot_compile.describe(*found[i]).rsplit(" ", 1)[0] for i in idx}
        print(len(chosen), tiles(chosen) == tiles(range(len(found))))
        """
    )
    for arch, arch_rows in by_arch.items():
        listed = _run(["-c", check, str(arch)], timeout=120)
        assert listed.returncode == 0, listed.stderr
        n_cover, all_tiles = listed.stdout.split()[-2:]
        assert all_tiles == "True", "the covering subset lost a kernel, dtype or tile"
        assert len(arch_rows) == n_specs[arch] * int(n_cover)
        for row in arch_rows:
            assert not row["problems"], row
            assert row["shared"] <= row["limit"], row
            assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row
            assert row["registers"] < 255, row
    # Every kernel, all three dtypes and every mode flag appear on each target.
    for arch_rows in by_arch.values():
        text = " ".join(r["variant"] for r in arch_rows)
        kernels = ("forward_stats", "logits_grad")
        for word in (*kernels, "fp16", "bf16", "fp32"):
            assert word in text, word
        for flag in ("STORE_LOGITS", "LOGIT_SUM", "HAS_SOFTMAX", "DOT_FP32"):
            assert flag in text, flag


def test_tile_tables_fit_every_target_and_query_no_device_at_import():
    code = textwrap.dedent(
        """
        import torch

        def boom(*args, **kwargs):
            raise AssertionError("a device was queried at import time")

        torch.cuda.get_device_capability = boom
        torch.cuda.get_device_properties = boom
        from vocab_parallel.kernels import backward, common, forward  # noqa: F401

        kernels = common.MATMUL_KERNELS + common.STREAM_KERNELS
        for capability in common.SMEM_LIMIT:
            for kernel in kernels:
                for dtype in (torch.float16, torch.bfloat16, torch.float32):
                    for tile in common.tile_configs(kernel, dtype, capability):
                        need = tile.smem_bound(torch.empty((), dtype=dtype).element_size())
                        assert need <= common.smem_limit(capability), (capability, tile)
        print("ok")
        """
    )
    out = _run(["-c", code], timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr
