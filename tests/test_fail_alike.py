"""Every rank fails alike, at once, and stays in step (two gloo ranks).

Rank 1 passes one refused argument (an option value, a tensor of the wrong length, a bad
``num_items_in_batch``), rank 0 a valid one, through each public entry: the loss (its
weight a DTensor too), the token statistics, the distillation loss, the loss module and
the LM head's three calls. Every rank must raise the same exception type at once (no wait
for the collective timeout), with a message that starts with the parameter's name (rank
0's also names rank 1 as the one that refused it), and the group must still be in step: a
valid call on both ranks right after it gives the right loss. Each case runs on its own
group with a short collective timeout, so that a rank left waiting fails its case in
seconds instead of hanging the suite.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from multirank import run_ranks

import vocab_parallel as vp

pytestmark = pytest.mark.slow

V, H, T = 20, 8, 6
FAST_S = 5.0  # a failing call that took longer waited for a collective
GROUP_TIMEOUT_S = 10  # what a rank left waiting in a collective waits before failing


def _inputs(rank: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    w = torch.randn(V, H, generator=g)
    tw = torch.randn(V, H, generator=g)
    y = torch.randint(0, V, (T,), generator=g)
    lo, hi = vp.shard_bounds(V, 2)[rank]
    return x, w[lo:hi].clone(), tw[lo:hi].clone(), y, lo


def _reference_loss() -> float:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    w = torch.randn(V, H, generator=g)
    torch.randn(V, H, generator=g)
    y = torch.randint(0, V, (T,), generator=g)
    return F.cross_entropy(x.double() @ w.double().T, y).item()


def _call(entry: str, group, rank: int, kwargs: dict):
    """One call of ``entry`` with ``kwargs`` on this rank's shard."""
    x, w, tw, y, lo = _inputs(rank)
    x.requires_grad_(True)
    w.requires_grad_(True)
    if entry == "loss":
        return vp.vocab_parallel_linear_cross_entropy(x, w, y, process_group=group, **kwargs)
    if entry == "stats":
        return vp.vocab_parallel_token_stats(x, w, y, process_group=group, **kwargs).logprobs
    if entry == "distill":
        return vp.vocab_parallel_distillation_loss(
            x, w, teacher_hidden=x.detach(), teacher_weight=tw, target=y,
            process_group=group, **kwargs,
        )  # fmt: skip
    if entry == "dtensor":  # the group is the weight's mesh's
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = DeviceMesh.from_group(group, "cpu")
        wd = DTensor.from_local(w, mesh, [Shard(0)], run_check=False)
        return vp.vocab_parallel_linear_cross_entropy(x, wd, y, **kwargs)
    if entry == "module":
        return vp.VocabParallelLinearCrossEntropy(process_group=group)(x, w, y, **kwargs)
    head = vp.VocabParallelLMHead.from_shard(torch.nn.Parameter(w.detach()), V, lo, group)
    if entry == "head":
        return head(x, y, **kwargs)
    if entry == "verl":  # verl's drop-in (vocab_parallel.integrations.verl)
        from vocab_parallel.integrations.verl import linear_cross_entropy

        return linear_cross_entropy(x, w, y, dist_process_group=group, **kwargs)[0]
    if entry == "head_stats":
        return head.token_stats(x, y, **kwargs).logprobs
    teacher = vp.VocabParallelLMHead.from_shard(torch.nn.Parameter(tw), V, lo, group)
    return head.distillation_loss(x, teacher, x.detach(), y, **kwargs)


def _rows(rank: int) -> int:
    lo, hi = vp.shard_bounds(V, 2)[rank]
    return hi - lo


# name: (entry, kwargs of both ranks, kwargs rank 1 adds, exception, parameter). Rank 0's
# arguments are valid: it must raise because rank 1 refused its own.
CASES = {
    "label_smoothing": ("loss", {}, dict(label_smoothing=2.0), "ValueError", "label_smoothing"),
    "label_smoothing_type": ("loss", {}, dict(label_smoothing="0.1"), "TypeError",
                             "label_smoothing"),
    "filter_eps": ("loss", {}, dict(filter_eps=-1), "ValueError", "filter_eps"),
    "reduction": ("loss", {}, dict(reduction="avg"), "ValueError", "reduction"),
    "temperature": ("loss", {}, dict(temperature=0.0), "ValueError", "temperature"),
    "check_inputs": ("loss", {}, dict(check_inputs="yes"), "TypeError", "check_inputs"),
    "class_weight": ("loss", {}, "class_weight", "ValueError", "class_weight"),
    "bias": ("loss", {}, "bias", "ValueError", "bias"),
    "num_items_inf": ("loss", dict(reduction="sum"), dict(num_items_in_batch=float("inf")),
                      "ValueError", "num_items_in_batch"),
    "num_items_bool": ("loss", dict(reduction="sum"), dict(num_items_in_batch=True),
                       "TypeError", "num_items_in_batch"),
    "dtensor_label_smoothing": ("dtensor", {}, dict(label_smoothing=2.0), "ValueError",
                                "label_smoothing"),
    "stats_top_k": ("stats", {}, dict(top_k=-1), "ValueError", "top_k"),
    "stats_temperature": ("stats", {}, dict(temperature=0.0), "ValueError", "temperature"),
    "distill_teacher_bias": ("distill", {}, "teacher_bias", "ValueError", "teacher_bias"),
    "distill_hard_label_weight": ("distill", {}, dict(hard_label_weight=1.5), "ValueError",
                                  "hard_label_weight"),
    "distill_beta": ("distill", dict(divergence="jsd"), dict(beta=2), "ValueError", "beta"),
    "distill_temperature": ("distill", {}, dict(temperature=0.0), "ValueError", "temperature"),
    "module_class_weight": ("module", {}, "class_weight", "ValueError", "class_weight"),
    "module_bias_type": ("module", {}, dict(bias=[0.0]), "TypeError", "bias"),
    "head_reduction": ("head", {}, dict(reduction="avg"), "ValueError", "reduction"),
    "head_num_items": ("head", {}, dict(num_items_in_batch=-2), "ValueError",
                       "num_items_in_batch"),
    "verl_temperature": ("verl", {}, dict(temperature=0.0), "ValueError", "temperature"),
    "verl_reduction": ("verl", {}, dict(reduction="avg"), "ValueError", "reduction"),
    "head_stats_top_k": ("head_stats", {}, dict(top_k=-1), "ValueError", "top_k"),
    "head_stats_temperature": ("head_stats", {}, dict(temperature=0.0), "ValueError",
                               "temperature"),
    "head_distill_beta": ("head_distill", dict(divergence="jsd"), dict(beta=2), "ValueError",
                          "beta"),
    "head_distill_temperature": ("head_distill", {}, dict(temperature=0.0), "ValueError",
                                 "temperature"),
}  # fmt: skip

# Both ranks pass the same or differing values that are refused alike (no rank refuses
# alone): every rank raises the same message.
BOTH = {
    # a count differing between the ranks: each rank's loss would be scaled differently
    "num_items_differ": ("loss", dict(reduction="sum"), "differ", "ValueError",
                         "num_items_in_batch"),
    # 0 items with tokens that count: the undivided sum, silently, before
    "num_items_zero_tensor": ("loss", dict(reduction="sum", num_items_in_batch=torch.tensor(0)),
                              {}, "ValueError", "num_items_in_batch"),
}  # fmt: skip


def _bad_kwargs(name: str, rank: int, both: dict, change) -> dict:
    kwargs = dict(both)
    if change == "differ":
        return kwargs | dict(num_items_in_batch=4 + rank)
    if rank != 1:
        return kwargs
    if change in ("class_weight", "bias", "teacher_bias"):
        return kwargs | {change: torch.ones(_rows(rank) + 1)}
    return kwargs | change


def _one_case(name: str, spec: tuple, rank: int) -> dict:
    """The case on a fresh group with a short timeout, then a valid call on it."""
    entry, both, change, _, _ = spec
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    kwargs = _bad_kwargs(name, rank, both, change)
    start = time.monotonic()
    try:
        out = _call(entry, group, rank, kwargs)
        result = ("ok", float(out.detach().float().sum()))
    except Exception as exc:  # what each rank raised, compared by the test
        result = (type(exc).__name__, str(exc))
    elapsed = time.monotonic() - start
    try:
        follow = float(_call("loss", group, rank, {}))
    except Exception as exc:
        follow = f"{type(exc).__name__}: {exc}"
    return dict(result=result, elapsed=elapsed, follow=follow)


def _all_cases(group, cases: dict) -> dict:
    rank = group.rank()
    return {name: _one_case(name, spec, rank) for name, spec in cases.items()}


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return run_ranks(_all_cases, 2, CASES | BOTH, timeout=900)


def _check_in_step(per_rank: list[dict]) -> None:
    want = _reference_loss()
    for r, out in enumerate(per_rank):
        assert out["elapsed"] < FAST_S, f"rank {r} took {out['elapsed']:.1f} s: {out}"
        follow = out["follow"]
        assert isinstance(follow, float) and abs(follow - want) < 1e-5, (r, follow, want)


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_rank_refusing_makes_every_rank_raise_naming_the_parameter(outcomes, name):
    _, _, _, kind, param = CASES[name]
    per_rank = [outcomes[r][name] for r in range(2)]
    (kind0, message0), (kind1, message1) = (out["result"] for out in per_rank)
    assert (kind0, kind1) == (kind, kind), per_rank
    assert message1.startswith(f"{param}: "), message1  # its own error
    assert message0.startswith(f"{param}: rank 1 of the group refused its argument"), message0
    _check_in_step(per_rank)


@pytest.mark.parametrize("name", sorted(BOTH))
def test_arguments_refused_on_every_rank_raise_the_same_error(outcomes, name):
    _, _, _, kind, param = BOTH[name]
    per_rank = [outcomes[r][name] for r in range(2)]
    results = [out["result"] for out in per_rank]
    assert results[0] == results[1], results
    assert results[0][0] == kind and results[0][1].startswith(f"{param}: "), results
    _check_in_step(per_rank)
