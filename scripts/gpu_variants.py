"""Every Triton kernel variant on the GPU, against the torch backend.

    python scripts/gpu_variants.py                 # one CUDA GPU; --jobs processes
    python scripts/gpu_variants.py --dry-run       # CPU, Triton's interpreter, tiny sizes

The variants are what the kernel modules list for their launchers
(``vocab_parallel.kernels.forward.launch_variants``, ``...backward.launch_variants``:
kernel x dtype x mode constexprs x tile for this GPU). Each is reached through the public
loss, ``vocab_parallel_linear_cross_entropy``, with the options that select it: the three
dtypes, memory-saving and high-performance modes (which store the logits or the softmax),
bias, softcap, label smoothing (the logit sum) with a z-loss, at a few rows (the 64-row
tiles) and many, with an odd vocabulary and an odd number of rows (masked edges). Every
case runs forward and backward on both backends (``reduction="none"``, random upstream
gradients) and compares loss, ``grad_input``, ``grad_weight`` and ``grad_bias``: max
|triton - torch| / max |torch|.

The constexprs of every launch are recorded (the kernel modules' ``meta``, which the
launchers call), so the table ends with how many of the listed variants ran; a listed
variant that no case reached fails the run, as does any mismatch. The cases run in
``--jobs`` processes on the same GPU, so that Triton compiles the variants in parallel on
a machine without a warm kernel cache.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DTYPES = ("float32", "float16", "bfloat16")
MODES = ("memory_saving", "high_performance")
# max |triton - torch| / max |torch|: fp32 differs only in the order of fp32 sums; half
# inputs in where G rounds to the input dtype differently by one ulp.
TOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 2e-2}
LAUNCH_ONLY = ("num_warps", "num_stages")


def cases(dry_run: bool) -> list[dict]:
    """Every combination of the options that select a kernel variant."""
    shapes = [(7, 32, 67)] if dry_run else [(48, 256, 1001), (333, 256, 1001)]
    out = []
    for (bt, h, v), dtype, mode, bias, softcap, smooth, scaled in itertools.product(
        shapes, DTYPES, MODES, (False, True), (None, 20.0), (0.0, 0.1), (False, True)
    ):
        out.append(
            dict(bt=bt, h=h, v=v, dtype=dtype, mode=mode, bias=bias, softcap=softcap,
                 label_smoothing=smooth, z_loss=1e-3 if smooth else 0.0, scaled=scaled)
        )  # fmt: skip
    # Saved fp32 logits without a cap: only the operator takes them (``logits=``).
    for (bt, h, v), dtype, scaled in itertools.product(shapes, DTYPES, (False, True)):
        out.append(dict(bt=bt, h=h, v=v, dtype=dtype, mode="operator logits=", bias=False,
                        softcap=None, label_smoothing=0.1, z_loss=0.0,
                        scaled=scaled))  # fmt: skip
    # The token statistics (entropy; top-k stores each chunk of logits): their variants.
    for (bt, h, v), dtype, mode, bias, softcap, scaled, top_k in itertools.product(
        shapes, DTYPES, ("memory_saving", "high_performance"), (False, True), (None, 20.0),
        (False, True), (0, 3),
    ):  # fmt: skip
        out.append(dict(bt=bt, h=h, v=v, dtype=dtype, mode=f"token_stats {mode}", bias=bias,
                        softcap=softcap, label_smoothing=0.0, z_loss=0.0, scaled=scaled,
                        top_k=top_k))  # fmt: skip
    # grad_in_forward (a sum: a scalar loss): G of whole token chunks over their logits.
    for dtype, softcap, scaled in itertools.product(DTYPES, (None, 20.0), (False, True)):
        out.append(dict(bt=shapes[-1][0], h=shapes[-1][1], v=shapes[-1][2], dtype=dtype,
                        mode="grad_in_forward", bias=False, softcap=softcap,
                        label_smoothing=0.1, z_loss=1e-3, scaled=scaled))  # fmt: skip
    # Distillation to a dense teacher: the fused epilogue's kernels.
    for kind, dtype, scaled in itertools.product(("forward_kl", "reverse_kl", "jsd"), DTYPES,
                                                 (False, True)):  # fmt: skip
        out.append(dict(bt=shapes[-1][0], h=shapes[-1][1], v=shapes[-1][2], dtype=dtype,
                        mode=f"distill {kind}", bias=False, softcap=None, label_smoothing=0.0,
                        z_loss=0.0, scaled=scaled))  # fmt: skip
    # Half inputs with the kernels' own tile GEMM, as on a torch without half GEMMs of
    # fp32 output (the launchers' fallback; its variants), in every mode but the
    # operator's (given logits: no products to make).
    half = [
        c for c in out
        if c["dtype"] != "float32" and not c["mode"].startswith(("operator", "distill"))
    ]  # fmt: skip
    return out + [c | {"tile_gemm": True} for c in half]


def token_stats_outputs(c: dict, x, w, b, y, up, backend: str) -> list:
    """Log-probs, entropy, top-k and the gradients of ``up * (logprobs + entropy)``."""
    import vocab_parallel as vp

    leaves = [t.clone().requires_grad_(True) for t in (x, w) + ((b,) if c["bias"] else ())]
    out = vp.vocab_parallel_token_stats(
        leaves[0], leaves[1], y, bias=leaves[2] if c["bias"] else None, softcap=c["softcap"],
        temperature=_temperature(c, x) if c["scaled"] else 1.0, entropy=True,
        top_k=c["top_k"], mode=c["mode"].split()[1], backend=backend,
    )  # fmt: skip
    (up * (out.logprobs + out.entropy)).sum().backward()
    top = [out.topk_logprobs] if c["top_k"] else []
    return [out.logprobs.detach(), out.entropy.detach(), *top] + [t.grad for t in leaves]


def operator_grads(c: dict, x, w, y, up, backend: str) -> list:
    """``fused_linear_cross_entropy_loss_grad`` given the saved (uncapped) fp32 logits."""
    import torch

    import vocab_parallel as vp

    temp = _temperature(c, x)
    logits = x.float() @ w.float().T / temp[:, None]
    lmax = logits.max(dim=1).values
    sumexp = torch.exp(logits - lmax[:, None]).sum(dim=1)
    here = y >= 0
    mask = vp.pack_target_mask(~here)
    return list(
        vp.fused_linear_cross_entropy_loss_grad(
            up, x, w, mask, torch.where(here, y, 0), label_smoothing=c["label_smoothing"],
            logits_max=lmax, sum_exp_logits=sumexp, logits=logits, backend=backend,
            temperature=temp if c["scaled"] else 1.0,
        )
    )  # fmt: skip


def distill_grads(c: dict, x, w, y, up, backend: str) -> list:
    """The distillation loss to a dense teacher (grad_in_forward: the fused epilogue on
    the Triton backend) and the student's gradients, upstream ``up.mean()``."""
    import torch

    import vocab_parallel as vp

    gen = torch.Generator().manual_seed(c["v"] + 1)
    xt = torch.randn(c["bt"], c["h"] // 2, generator=gen).to(x.device, x.dtype)
    wt = (torch.randn(c["v"], c["h"] // 2, generator=gen) * 2 / c["h"] ** 0.5).to(w.device, w.dtype)
    leaves = [t.clone().requires_grad_(True) for t in (x, w)]
    loss = vp.vocab_parallel_distillation_loss(
        leaves[0], leaves[1], teacher_hidden=xt, teacher_weight=wt, target=y,
        divergence=c["mode"].split()[1], temperature=_temperature(c, x) if c["scaled"] else 1.0,
        mode="grad_in_forward", backend=backend,
    )  # fmt: skip
    loss.backward(up.mean())
    return [loss.detach()] + [t.grad for t in leaves]


def _temperature(c: dict, x):
    """The case's per-token temperature (ones unless ``scaled``)."""
    import torch

    if not c["scaled"]:
        return torch.ones(x.shape[0], device=x.device)
    gen = torch.Generator().manual_seed(c["bt"])
    return (torch.rand(x.shape[0], generator=gen) + 0.5).to(x.device)


def _class_weight(c: dict, w):
    import torch

    gen = torch.Generator().manual_seed(c["v"])
    return (torch.rand(w.shape[0], generator=gen) + 0.5).to(w.device)


def _key(kernel_name: str, dtype, meta: dict, with_tile: bool) -> tuple:
    keep = {k: v for k, v in meta.items() if with_tile or not k.startswith(("BLOCK_", "num_"))}
    return (kernel_name, str(dtype), tuple(sorted(keep.items())))


# The kernel modules' functions that make a launch's constexprs, by the name they record.
RECORDED = {
    "forward_stats": "meta",
    "logits_grad": "meta",
    "logits_grad_rows": "rows_meta",
    "stats_merge": "merge_meta",
    "divergence_stats": "stats_meta",
    "divergence_second": "second_meta",
    "divergence_grad": "grad_meta",
}


def _variant_name(module_name: str, kernel) -> str:
    """The recorded name of a listed variant's kernel."""
    name = getattr(kernel, "__name__", "").removesuffix("_kernel")
    if module_name == "divergence" or name in ("logits_grad_rows", "stats_merge"):
        return name  # a module of several kernels: each its own meta function
    return module_name


def _recording(module, name: str, seen: list):
    """Wrap the kernel module's function that makes a launch's constexprs
    (:data:`RECORDED`; its launcher in ``vocab_parallel.backends.triton_backend`` calls it)
    so that each launch's constexprs are recorded."""
    attr = RECORDED[name]
    original = getattr(module, attr)

    def meta(dtype, *args, **kwargs):
        out = original(dtype, *args, **kwargs)
        seen.append((name, str(dtype), out))
        return out

    setattr(module, attr, meta)


def rel(a, b) -> float:
    if a is None and b is None:
        return 0.0
    a, b = a.double(), b.double()
    if not bool(a.isfinite().all()):
        return float("inf")
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


def run_cases(job: tuple[list[dict], str]) -> tuple[list[dict], list]:
    """One worker: every case of ``job`` on both backends; rows and recorded launches."""
    batch, device = job
    import torch

    import vocab_parallel as vp
    from vocab_parallel.kernels import backward, divergence, forward

    seen: list = []
    _recording(forward, "forward_stats", seen)
    _recording(backward, "logits_grad", seen)
    _recording(backward, "logits_grad_rows", seen)
    _recording(forward, "stats_merge", seen)
    for name in ("divergence_stats", "divergence_second", "divergence_grad"):
        _recording(divergence, name, seen)
    from vocab_parallel.backends import triton_backend

    gemm_with_fp32_output = triton_backend._gemm_with_fp32_output
    rows = []
    for c in batch:
        triton_backend._gemm_with_fp32_output = (
            (lambda x: x.dtype == torch.float32) if c.get("tile_gemm") else gemm_with_fp32_output
        )
        dtype = getattr(torch, c["dtype"])
        gen = torch.Generator().manual_seed(c["bt"] * 7 + c["v"])
        x = torch.randn(c["bt"], c["h"], generator=gen).to(device, dtype)
        w = (torch.randn(c["v"], c["h"], generator=gen) * 2 / c["h"] ** 0.5).to(device, dtype)
        b = (torch.randn(c["v"], generator=gen)).to(device, dtype) if c["bias"] else None
        y = torch.randint(0, c["v"], (c["bt"],), generator=gen).to(device)
        y[::5] = -100
        up = (torch.rand(c["bt"], generator=gen) + 0.5).to(device)
        out = {}
        if c["mode"].startswith("operator"):
            out = {be: operator_grads(c, x, w, y, up, be) for be in ("triton", "torch")}
        elif c["mode"].startswith("distill"):
            out = {be: distill_grads(c, x, w, y, up, be) for be in ("triton", "torch")}
        elif c["mode"].startswith("token_stats"):
            out = {be: token_stats_outputs(c, x, w, b, y, up, be) for be in ("triton", "torch")}
        for backend in () if out else ("triton", "torch"):
            leaves = [t.clone().requires_grad_(True) for t in (x, w) + ((b,) if c["bias"] else ())]
            scalar = c["mode"] == "grad_in_forward"  # a sum, its upstream one number
            loss = vp.vocab_parallel_linear_cross_entropy(
                leaves[0], leaves[1], y, reduction="sum" if scalar else "none",
                mode=c["mode"], backend=backend,
                bias=leaves[2] if c["bias"] else None, softcap=c["softcap"],
                label_smoothing=c["label_smoothing"], z_loss=c["z_loss"],
                temperature=_temperature(c, x) if c["scaled"] else 1.0,
                class_weight=_class_weight(c, w) if c["scaled"] else None,
            )  # fmt: skip
            loss.backward(up.mean() if scalar else up)
            out[backend] = [loss.detach()] + [t.grad for t in leaves]
        errs = [rel(a, b_) for a, b_ in zip(out["triton"], out["torch"], strict=True)]
        rows.append(c | {"err": max(errs), "ok": max(errs) <= TOL[c["dtype"]]})
    triton_backend._gemm_with_fp32_output = gemm_with_fp32_output
    return rows, seen


def describe(c: dict) -> str:
    opts = [c["mode"], c["dtype"], f"BT {c['bt']}"]
    opts += ["bias"] * c["bias"] + ["softcap"] * (c["softcap"] is not None)
    opts += ["smoothing"] * (c["label_smoothing"] > 0) + ["z_loss"] * (c["z_loss"] > 0)
    scaled = "temperature" if c["mode"].startswith("token_stats") else "temperature+class_weight"
    opts += [scaled] * c["scaled"]
    opts += [f"top_k {c.get('top_k')}"] * bool(c.get("top_k"))
    opts += ["tile GEMM"] * bool(c.get("tile_gemm"))
    return " ".join(opts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny")
    p.add_argument("--jobs", type=int, help="worker processes (default 8; dry run 2)")
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, here and in workers
    import multiprocessing

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_variants: no CUDA device (--dry-run runs on CPU)", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    from vocab_parallel.kernels import backward, divergence, forward

    capability = None if args.dry_run else torch.cuda.get_device_capability()
    listed = set()
    modules = (("forward_stats", forward), ("logits_grad", backward), ("divergence", divergence))
    for name, module in modules:
        for kernel, dtype, meta in module.launch_variants(capability or (9, 0)):
            meta = {k: v for k, v in meta.items() if k not in LAUNCH_ONLY}
            if args.dry_run:  # the interpreter has one tile and its own DOT_FP32/ROUND_BF16
                meta = {k: v for k, v in meta.items() if k not in ("DOT_FP32", "ROUND_BF16")}
            listed.add(_key(_variant_name(name, kernel), dtype, meta, not args.dry_run))

    todo = cases(args.dry_run)
    jobs = max(1, min(args.jobs or (2 if args.dry_run else 8), len(todo)))
    batches = [(todo[i::jobs], device) for i in range(jobs)]
    t0 = time.time()
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=spawn) as pool:
        results = list(pool.map(run_cases, batches))
    rows = [r for rs, _ in results for r in rs]
    ran = set()
    for _, seen in results:
        for name, dtype, meta in seen:
            meta = {k: v for k, v in meta.items() if k not in LAUNCH_ONLY}
            if args.dry_run:
                meta = {k: v for k, v in meta.items() if k not in ("DOT_FP32", "ROUND_BF16")}
            ran.add(_key(name, dtype, meta, not args.dry_run))

    print("| case | max rel err (loss, grads) | ok |")
    print("|---|---|---|")
    for r in sorted(rows, key=describe):
        print(f"| {describe(r)} | {r['err']:.1e} | {'yes' if r['ok'] else 'NO'} |")
    missing = listed - ran
    for key in sorted(missing, key=str):
        print(f"not reached: {key}")
    bad = [r for r in rows if not r["ok"]]
    where = f"sm_{capability[0]}{capability[1]}" if capability else "interpreter"
    print(
        f"\n{'FAILED' if bad or missing else 'OK'}: {len(rows) - len(bad)}/{len(rows)} cases "
        f"agree with the torch backend; {len(listed & ran)}/{len(listed)} listed kernel "
        f"variants ran ({where}, {time.time() - t0:.0f} s)"
    )
    return 1 if bad or missing else 0


if __name__ == "__main__":
    sys.exit(main())
