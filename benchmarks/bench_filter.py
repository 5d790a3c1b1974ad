"""Benchmark: gradient filtering (issue 24) on a trained model's head, beside the peers.

Forward + backward of the mean cross entropy of ``hidden @ W.T`` on two workloads of the
same shapes: ``trained`` (the hidden states, targets and head of the main job's GPT after
300 steps on the embedded corpus, ``benchmarks/trained_workload.py``, cached under
``runs/cache`` and trained at the first run) and ``random`` (random hidden states, head
and targets: the worst case, where almost no tile is skipped):

    python benchmarks/bench_filter.py             # BT=2048 of the saved 4096 tokens, H=128,
                                                  # V 32768 and 131072, fp32 and bf16, 1 and 2 ranks
    python benchmarks/bench_filter.py --vocabs 32768 --dtypes fp32 --workloads trained
    python benchmarks/bench_filter.py --quick     # a tiny trained model (V 4096): a smoke run
    python benchmarks/bench_filter.py --d-model 512   # the same GPT 4x wider: H=512, where the
                                                  # GEMMs filtering thins are most of the time

Rows (``--impls``; every row one fresh group of processes, gloo ranks, vocabulary sharded
with ``vocab_parallel.shard_bounds``; single-rank peers run at 1 rank only):

    ours_exact     vocab_parallel_linear_cross_entropy, filter_eps=None (today's results)
    ours_filtered  the same with filter_eps="auto" (eps(input dtype) / 32): skipped fraction
                   of the tiles (vocab_parallel.gradient_filter_stats(), all ranks, the
                   timed calls) beside it
    ours_sorted    ours_filtered on the vocabulary relabelled once, outside the timing, in
                   descending order of the average logit over the workload's tokens within
                   each rank's shard (the head's rows permuted, the targets mapped): what
                   Cut Cross-Entropy's column ordering would buy, without its cost per call
    cce_tc         Cut Cross-Entropy linear_cross_entropy(impl="torch_compile"): its only
                   CPU path; it takes no filter_eps (only impl="cce" filters)
    cce_filtered   Cut Cross-Entropy impl="cce", filter_eps="auto" (its Triton kernels)
    liger_tp       Liger-Kernel liger_fused_linear_scaled_cross_entropy_tp (1 and 2 ranks)
    liger          Liger-Kernel LigerFusedLinearCrossEntropyLoss (1 rank)
    deepspeed      DeepSpeed vocab_parallel_linear_cross_entropy, chunk_size=--ds-chunk
    torch_lce      torch F.linear_cross_entropy (its default options; 1 rank)
    naive          F.cross_entropy(F.linear(x, W)): full logits (1 rank)

A row that fails says why in its status (the last line of the failed rank's error), the
run goes on; a failure already seen for the same implementation, ranks and dtype is not run
again ("as above").

Errors: the rows of ours also compute a float64 reference of the loss and both gradients
on the same (dtype-rounded) inputs, in blocks of tokens, outside the timing; "grad err" is
``max |grad - ref| / max |ref|``, the larger of hidden's and weight's (weight: this rank's
shard; several ranks: the largest rank). Every row's loss is checked against that
reference (``loss_report.LOSS_TOL``); a mismatch of a row of ours fails the run.

Timing and memory as in ``bench_loss.py``: one warm-up call, then ``--repeats`` timed ones
(fastest shown; several ranks: of the slowest rank per call), the cores split between the
ranks, peak extra memory (``benchmarks/memory.py``, CPU: ``VmHWM - VmRSS``) of the first
timed call, gradients included. "/ exact": time over ours_exact's at the same workload,
vocabulary, dtype and ranks (issue 24's target: filtered <= 0.7x on the trained workload).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks import harness, implementations, trained_workload
from benchmarks.loss_report import LOSS_TOL
from vocab_parallel import shard_bounds

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OURS = ("ours_exact", "ours_filtered", "ours_sorted")
FILTERED = ("ours_filtered", "ours_sorted")
# name: (description, world sizes it runs at)
IMPLS = {
    "ours_exact": ("ours exact (filter_eps=None)", (1, 2)),
    "ours_filtered": ('ours filtered (filter_eps="auto")', (1, 2)),
    "ours_sorted": ("ours filtered, vocabulary sorted by avg logit", (1, 2)),
    "cce_tc": ("CCE torch_compile (no filter)", (1,)),
    "cce_filtered": ('CCE impl="cce" filter_eps="auto"', (1,)),
    "liger_tp": ("Liger TP linear CE", (1, 2)),
    "liger": ("Liger fused linear CE", (1,)),
    "deepspeed": ("DeepSpeed vp_linear_ce", (1, 2)),
    "torch_lce": ("F.linear_cross_entropy", (1,)),
    "naive": ("F.cross_entropy(F.linear)", (1,)),
}
# Ours through benchmarks/implementations.py's names, for the rest of the harness.
PEER_NAME = {"liger_tp": "liger_tp", "liger": "liger", "deepspeed": "deepspeed"}
PEER_NAME |= {"torch_lce": "torch_lce_auto", "naive": "naive"}
WORKLOADS = ("trained", "random")
QUICK = dict(vocab=4096, d_model=64, steps=40, tokens=512)  # the --quick trained model
QUICK_TRAIN = {k: QUICK[k] for k in ("d_model", "steps", "tokens")}


# ----------------------------------------------------------------------------- the child


def filter_api():
    """``vocab_parallel.gradient_filter_stats`` or None where this checkout lacks it."""
    import vocab_parallel

    return getattr(vocab_parallel, "gradient_filter_stats", None)


def workload(case: dict) -> dict:
    """The case's workload, full shapes (every rank builds it, then keeps its shard)."""
    w = trained_workload.load(case["v"], case["cache_dir"], **case["train_options"])
    if case["workload"] == "random":
        w = trained_workload.random_like(w, case["seed"])
    n = case["bt"]
    hidden, weight, target = w["hidden"][:n], w["weight"], w["target"][:n]
    if case["impl"] == "ours_sorted":  # each shard's rows by descending average logit
        avg, order = hidden.mean(0) @ weight.t(), torch.empty(len(weight), dtype=torch.long)
        for lo, hi in shard_bounds(case["v"], case["world"]):
            order[lo:hi] = lo + torch.argsort(avg[lo:hi], descending=True, stable=True)
        relabel = torch.empty_like(order)
        relabel[order] = torch.arange(len(order))
        weight, target = weight[order], relabel[target]
    return {"hidden": hidden, "weight": weight, "target": target}


def reference(x, w, y, lo: int, hi: int, block: int = 256) -> dict:
    """Float64 loss, grad of x and grad of this rank's rows ``[lo, hi)`` of ``w`` (mean
    over the tokens), ``block`` tokens at a time (a V 131072 block is 256 MiB)."""
    x, w = x.double(), w.double()
    n = len(y)
    loss, gx, gw = 0.0, torch.empty_like(x), torch.zeros(hi - lo, w.shape[1], dtype=torch.float64)
    for s in range(0, n, block):
        logits = x[s : s + block] @ w.t()
        lse = torch.logsumexp(logits, dim=1)
        rows = torch.arange(len(logits))
        loss += (lse - logits[rows, y[s : s + block]]).sum().item()
        g = torch.softmax(logits, dim=1)
        g[rows, y[s : s + block]] -= 1.0
        g /= n
        gx[s : s + block] = g @ w
        gw += g[:, lo:hi].t() @ x[s : s + block]
    return {"loss": loss / n, "gx": gx, "gw": gw}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-300)).item()


def make_loss(case: dict, y, bounds, group, device):
    impl, world = case["impl"], case["world"]
    if impl in OURS:
        from vocab_parallel import vocab_parallel_linear_cross_entropy

        options = dict(
            process_group=group if world > 1 else None,
            vocab_start_index=bounds[0],
            global_vocab_size=case["v"],
            mode=case["mode"],
        )
        if impl in FILTERED:
            if filter_api() is None:
                raise RuntimeError("this vocab_parallel has no filter_eps (issue 24 not merged)")
            options |= dict(filter_eps=case["filter_eps"], filter_grads=case["filter_grads"])
        return lambda x, w: vocab_parallel_linear_cross_entropy(x, w, y, **options)
    if impl in ("cce_tc", "cce_filtered"):
        from cut_cross_entropy import linear_cross_entropy

        if impl == "cce_tc":
            return lambda x, w: linear_cross_entropy(x, w, y, impl="torch_compile")
        return lambda x, w: linear_cross_entropy(x, w, y, impl="cce", filter_eps="auto")
    peer = PEER_NAME[impl]
    return implementations.make_loss(peer, case | {"impl": peer}, y, bounds, group, device)


def run_case(case: dict) -> dict:
    """One rank of one row: warm-up, timed fwd+bwd calls, then (ours) the errors."""
    rank, world = int(os.environ.get("RANK", "0")), case["world"]
    device = torch.device("cpu")
    peer = PEER_NAME.get(case["impl"], case["impl"])
    group = None
    if world > 1 or peer == "liger_tp":  # liger_tp wants a group at TP 1 too
        group = implementations.init_distributed(case | {"impl": peer}, rank, device)
    barrier = (lambda: torch.distributed.barrier(group)) if world > 1 else (lambda: None)

    full = workload(case)
    lo, hi = shard_bounds(case["v"], world)[rank]
    dt = DTYPES[case["dtype"]]
    hidden = full["hidden"].to(dt).requires_grad_(True)
    weight = full["weight"][lo:hi].to(dt).clone().requires_grad_(True)
    y = full["target"]
    loss_fn = make_loss(case, y, (lo, hi), group, device)
    stats = filter_api() if case["impl"] in FILTERED else None

    def fwd_bwd():
        hidden.grad = weight.grad = None
        loss = loss_fn(hidden, weight)
        loss.backward()
        return loss

    def before():
        hidden.grad = weight.grad = None
        barrier()

    def keep(loss):
        return loss.item(), hidden.grad.clone(), weight.grad.clone()

    fwd_bwd()  # warm-up: set-up, thread pools, compilation
    if stats is not None:
        stats(reset=True)  # the counter of the timed calls alone
    res = harness.timed_calls(fwd_bwd, device, case["repeats"], before=before, keep=keep)
    loss_value, gx, gw = res["kept"]
    out = {
        "rank": rank,
        "times_s": res["times_s"],
        "peak_bytes": res["peak"].extra_bytes,
        "mem_method": res["peak"].method,
        "loss": loss_value,
        "threads": torch.get_num_threads(),
    }
    if stats is not None:
        s = stats()
        # The filtered products' tiles (each tile of G counts once per filtered product).
        out |= {"tiles": s.input_tiles + s.weight_tiles, "skipped": s.skipped}
    if case["impl"] in OURS and case["grad_check"]:
        # On the dtype-rounded inputs, as the row saw them.
        ref = reference(full["hidden"].to(dt), full["weight"].to(dt), y, lo, hi)
        out |= {"ref_loss": ref["loss"], "err_gx": rel_err(gx, ref["gx"])}
        out["err_gw"] = rel_err(gw, ref["gw"])
    if group is not None:
        torch.distributed.destroy_process_group()
    return out


# ----------------------------------------------------------------------------- the parent


def summarise(res: dict) -> dict:
    ranks = res["ranks"]
    per_call = [max(r["times_s"][i] for r in ranks) for i in range(len(ranks[0]["times_s"]))]
    out = res | {
        "time_s": min(per_call),
        "peak_bytes": max(r["peak_bytes"] for r in ranks),
        "loss": ranks[0]["loss"],
        "threads": ranks[0]["threads"],
        "mem_method": ranks[0]["mem_method"],
    }
    if "tiles" in ranks[0]:
        tiles = sum(r["tiles"] for r in ranks)
        out["skipped_fraction"] = sum(r["skipped"] for r in ranks) / tiles if tiles else 0.0
    if "err_gx" in ranks[0]:
        out["err_gx"] = max(r["err_gx"] for r in ranks)
        out["err_gw"] = max(r["err_gw"] for r in ranks)
        out["ref_loss"] = ranks[0]["ref_loss"]
    return out


def _eps(text: str) -> float | str:
    return text if text == "auto" else float(text)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Gradient filtering on a trained model's head vs exact and the peers.",
        epilog="Defaults: BT=2048 of the trained workload, V 32768 and 131072; --quick: a "
        "tiny trained model (V 4096, H 64, 512 tokens).",
    )
    harness.add_common_args(p, DTYPES, "timed calls after the warm-up (default 3; --quick 1)")
    p.add_argument("--bt", type=int, help="tokens (default 2048, at most 4096; --quick 512)")
    p.add_argument("--vocabs", nargs="+", type=int, help="head vocabularies (default 32768 131072)")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--worlds", nargs="+", type=int, choices=(1, 2), default=[1, 2])
    p.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS))
    p.add_argument("--mode", default="auto", help="our loss's mode (default auto)")
    p.add_argument("--filter-grads", default="both", choices=("both", "weight", "input"))
    p.add_argument("--filter-eps", default="auto", type=_eps,
                   help='the filtered rows\' filter_eps ("auto": eps(dtype) / 32)')  # fmt: skip
    p.add_argument("--no-grad-check", dest="grad_check", action="store_false",
                   help="skip the float64 reference of our rows (saves its time)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per process group")
    p.add_argument("--ds-chunk", type=int, default=512, help="DeepSpeed chunk_size on CPU")
    p.add_argument("--cache-dir", default=str(trained_workload.CACHE))
    p.add_argument("--d-model", type=int, help="the trained GPT's width, the head's H "
                   "(default 128, the main job's; another trains its own workload)")  # fmt: skip
    args = p.parse_args(argv)
    args = harness.fill_defaults(args, bt=(2048, 512), repeats=(3, 1))
    args.vocabs = args.vocabs or ([QUICK["vocab"]] if args.quick else list(trained_workload.VOCABS))
    return args


def plan(args):
    """``(workload, v, dtype, world, impl)`` of every row, in table order."""
    for wl in args.workloads:
        for v in args.vocabs:
            for dtype in [d for d in DTYPES if d in args.dtypes]:
                for world in sorted(args.worlds):
                    for impl in IMPLS:
                        if impl in args.impls and world in IMPLS[impl][1]:
                            yield wl, v, dtype, world, impl


def skip_reason(impl: str) -> str | None:
    """Why ``impl`` cannot even start here (None: run it, and its own error is the row's)."""
    modules = {"cce_tc": ("cut_cross_entropy",), "cce_filtered": ("cut_cross_entropy",)}
    if impl in PEER_NAME:
        modules[impl] = implementations.IMPLS[PEER_NAME[impl]][2]
    if any(not implementations._installed(m) for m in modules.get(impl, ())):
        return "not installed"
    if impl == "torch_lce" and not hasattr(torch.nn.functional, "linear_cross_entropy"):
        return f"not in torch {torch.__version__}"
    return None


def table(rows: list[dict], filter_eps: float | str = "auto") -> str:
    head = ["workload", "V", "dtype", "ranks", "implementation", "best ms", "/ exact"]
    head += ["peak extra MiB", "skipped tiles", "err hidden", "err W", "loss", "status"]
    exact = {r["key"]: r["time_s"] for r in rows if r["impl"] == "ours_exact" and "time_s" in r}
    body = []
    for r in rows:
        label = IMPLS[r["impl"]][0]
        if r["impl"] in FILTERED and filter_eps != "auto":  # the eps the row ran with
            label = label.replace('"auto"', f"{filter_eps:g}")
        cells = [r["workload"], str(r["v"]), r["dtype"], str(r["world"]), label]
        if r["status"] != "ok":
            body.append(cells + [""] * 7 + [r["status"]])
            continue
        base = exact.get(r["key"])
        skipped = r.get("skipped_fraction")
        cells += [
            f"{r['time_s'] * 1e3:.0f}",
            f"{r['time_s'] / base:.2f}" if base else "-",
            f"{r['peak_bytes'] / harness.MIB:.0f}",
            "-" if skipped is None else f"{skipped:.1%}",
            f"{r['err_gx']:.1e}" if "err_gx" in r else "-",
            f"{r['err_gw']:.1e}" if "err_gw" in r else "-",
            f"{r['loss']:.5f}" + (" MISMATCH" if r.get("mismatch") else ""),
            "ok",
        ]
        body.append(cells)
    return harness.markdown_table(head, body)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        sys.exit("bench_filter: CPU only for now (the peers' CUDA rows are bench_loss.py's)")
    train_options = dict(QUICK_TRAIN) if args.quick else {}
    if args.d_model:
        train_options["d_model"] = args.d_model
    _, where = harness.pick_device("cpu")
    print(f"# bench_filter: cpu ({where}), torch {torch.__version__}, python {sys.executable}")
    h = train_options.get("d_model", trained_workload.DEFAULTS["d_model"])
    print(f"# BT={args.bt}, H={h}, V={args.vocabs}, workloads {args.workloads}; fastest of "
          f"{args.repeats} fwd+bwd calls after a warm-up; mode {args.mode}, filter_eps "
          f"{args.filter_eps!r}, filter_grads {args.filter_grads}")  # fmt: skip
    if filter_api() is None:
        print("# note: this vocab_parallel has no filter_eps yet (issue 24): filtered rows fail")
    for v in args.vocabs:  # train and cache the workloads first (the children only load)
        w = trained_workload.load(v, args.cache_dir, log=print, **train_options)
        print(f"# trained workload V={v}: {w['options']['name']}, "
              f"validation loss {w['val_loss']:.3f}")  # fmt: skip
        if args.bt > len(w["target"]):
            sys.exit(f"bench_filter: --bt {args.bt} > the workload's {len(w['target'])} tokens")
    load_before = harness.print_load_before()
    base = {"bt": args.bt, "seed": args.seed, "repeats": args.repeats, "mode": args.mode}
    base |= {"filter_grads": args.filter_grads, "filter_eps": args.filter_eps}
    base |= {"grad_check": args.grad_check}
    base |= {"ds_chunk": args.ds_chunk, "coll_timeout": max(60, int(args.timeout))}
    base |= {"cache_dir": args.cache_dir, "train_options": train_options, "device": "cpu"}
    env = {"DS_ACCELERATOR": "cpu"}
    rows, failed, t_start = [], {}, time.perf_counter()
    for wl, v, dtype, world, impl in plan(args):
        row = {"workload": wl, "v": v, "dtype": dtype, "world": world, "impl": impl}
        row["key"] = (wl, v, dtype, world)
        reason = skip_reason(impl)
        if reason is None and (impl, world, dtype) in failed and impl not in OURS:
            reason = failed[(impl, world, dtype)] + " (as above)"
        if reason:
            rows.append(row | {"status": reason, "skipped": True})
            continue
        case = base | {k: row[k] for k in ("workload", "v", "dtype", "world", "impl")}
        case["threads"] = harness.threads_per_rank(world, cuda=False)
        res = harness.run_children(__file__, case, world, args.timeout, env)
        if res["status"] == "ok":
            res = summarise(res)
        else:
            failed[(impl, world, dtype)] = res["status"]
        rows.append(row | res)
        shown = f"{res['time_s'] * 1e3:.0f} ms" if res["status"] == "ok" else ""
        harness.print_progress(f"{wl} V={v} {dtype} {world} rank(s) {impl}: {res['status']} "
                               f"{shown}", t_start)  # fmt: skip
    harness.print_load_after(t_start)

    # Every row's loss against the float64 reference of its workload, vocabulary and dtype.
    refs = {r["key"][:3]: r["ref_loss"] for r in rows if "ref_loss" in r}
    mismatches = []
    for r in rows:
        ref = refs.get(r["key"][:3])
        if (
            r["status"] == "ok"
            and ref is not None
            and abs(r["loss"] - ref) > LOSS_TOL[r["dtype"]] * abs(ref)
        ):
            r["mismatch"] = True
            mismatches.append(f"{r['impl']} {r['key']}: {r['loss']} vs {ref}")
    print()
    print(table(rows, args.filter_eps))
    print()
    print(legend(args, rows))
    for line in target_lines(rows):
        print("  " + line)
    info = {"args": vars(args), "device": where, "load_before": load_before}
    harness.write_json(args.json, info | {"rows": [r | {"key": list(r["key"])} for r in rows]})
    broken = [f"{r['impl']} {r['key']}: {r['status']}" for r in rows
              if r["impl"] == "ours_exact" and r["status"] != "ok"]  # fmt: skip
    ours_bad = [m for m in mismatches if m.split()[0] in OURS]
    if mismatches:
        print("\nLOSS MISMATCH against the float64 reference:\n" + "\n".join(mismatches))
    if broken:
        print("\nOurs did not run:\n" + "\n".join(broken))
    return 1 if ours_bad or broken else 0


def legend(args, rows: list[dict]) -> str:
    method = next((r["mem_method"] for r in rows if r["status"] == "ok"), "-")
    return (
        f"best ms: fastest of {args.repeats} fwd+bwd calls after a warm-up (several ranks: "
        "of the slowest rank per call); / exact: against ours exact at the same workload, V, "
        f"dtype and ranks; peak extra MiB: {method} of one call, largest rank, gradients "
        "included; skipped tiles: of the timed calls, all ranks (gradient_filter_stats); "
        "err hidden / err W: max |grad - float64 reference| / max |reference| of hidden's "
        "and of weight's gradient (W: the worst rank's shard). CCE's torch_compile impl takes "
        'no filter_eps (only impl="cce", its Triton kernels, filters). DeepSpeed '
        f"chunk_size={args.ds_chunk}."
    )


def target_lines(rows: list[dict]):
    """Issue 24's target: filtered <= 0.7x exact on the trained workload."""
    exact = {r["key"]: r for r in rows if r["impl"] == "ours_exact" and r["status"] == "ok"}
    for r in rows:
        if r["impl"] not in FILTERED or r["status"] != "ok" or r["workload"] != "trained":
            continue
        e = exact.get(r["key"])
        if e is None:
            continue
        ratio = r["time_s"] / e["time_s"]
        yield (
            f"{'PASS' if ratio <= 0.7 else 'FAIL'}: {r['impl']} {ratio:.2f}x exact (<= 0.7), "
            f"V={r['v']} {r['dtype']} {r['world']} rank(s), {r['skipped_fraction']:.1%} tiles "
            f"skipped, err hidden / W {_errs(r)} (exact {_errs(e)})"
        )


def _errs(r: dict) -> str:
    nan = float("nan")
    return f"{r.get('err_gx', nan):.1e} / {r.get('err_gw', nan):.1e}"


if __name__ == "__main__":
    sys.exit(harness.script_main(main, run_case))
