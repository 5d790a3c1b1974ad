"""Every rank agrees or every rank fails alike: ranks that disagree about options, dtypes,
gradient needs, tokens, targets or hidden states raise the same ``ValueError`` on every
rank (no silent wrong loss, no gloo abort, no hang), also when the head's layout is cached;
a rank whose own arguments are refused makes the others raise too. ``check_inputs=False``
skips the check."""

from __future__ import annotations

import pytest
import torch
from multirank import run_ranks

import vocab_parallel as vp

pytestmark = pytest.mark.slow

V, H = 50, 8


def _inputs(rank: int, tokens: int = 12, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, H, generator=g).to(dtype).requires_grad_(True)
    w = torch.randn(V, H, generator=g).to(dtype)
    y = torch.randint(0, V, (tokens,), generator=g)
    lo, hi = vp.shard_bounds(V, 2)[rank]
    return x, w[lo:hi].clone().requires_grad_(True), y


# What rank 1 does differently, and how the error every rank raises must start.
PROBES = {
    "label_smoothing": (dict(label_smoothing=0.1), "label_smoothing: "),
    "reduction": (dict(reduction="sum"), "reduction: "),
    "ignore_index": (dict(ignore_index=3), "ignore_index: "),
    "softcap": (dict(softcap=5.0), "softcap: "),
    "z_loss": (dict(z_loss=0.01), "z_loss: "),
    "mode": (dict(mode="high_performance"), "mode: "),
    "temperature": (dict(temperature=2.0), "temperature: "),
    "dtype": ("bf16", "hidden: the ranks of process_group pass different dtype"),
    "float64": ("float64", "hidden: the ranks of process_group pass different dtype"),
    "targets": ("targets", "target: "),
    "hidden": ("dropout", "hidden: the ranks of process_group pass different values"),
    "hidden_size": ("hidden_size", "hidden: the ranks of process_group pass different hidden"),
    "tokens": ("tokens", "hidden: the ranks of process_group pass different numbers of tokens"),
    "tokens_past_512": ("tokens", "hidden: the ranks of process_group pass different numbers"),
    "no_grad": ("no_grad", "hidden: the ranks of process_group pass different grad mode"),
    "requires_grad": ("frozen", "hidden: the ranks of process_group pass different requires"),
    "sequence_parallel": (dict(sequence_parallel=True), "sequence_parallel: "),
    "refused_on_one_rank": ("bad_target", "target: rank 1 of the group refused its argument"),
}


def _probe(group, name, check_inputs=True, head=False):
    rank = group.rank()
    change, _ = PROBES[name]
    tokens = 13 if name == "tokens" and rank == 1 else 12
    if name == "tokens_past_512":  # grad_in_forward chunks them differently
        tokens = 600 + 100 * rank
    change = None if name == "tokens_past_512" else change
    x, w, y = _inputs(rank, tokens)
    options = dict(process_group=group, check_inputs=check_inputs)
    grad_ctx = torch.enable_grad()
    if rank == 1:
        if isinstance(change, dict):
            options |= change
        elif change == "bf16":
            x, w = (t.detach().bfloat16().requires_grad_(True) for t in (x, w))
        elif change == "float64":
            x, w = (t.detach().double().requires_grad_(True) for t in (x, w))
        elif change == "targets":
            y = (y + 1) % V
        elif change == "dropout":
            x = torch.nn.functional.dropout(x, 0.1)
        elif change == "hidden_size":
            x = torch.randn(12, H + 1, requires_grad=True)
            w = torch.randn(w.shape[0], H + 1, requires_grad=True)
        elif change == "no_grad":
            grad_ctx = torch.no_grad()
        elif change == "frozen":
            x = x.detach()
        elif change == "bad_target":
            y = y[:5]
    try:
        with grad_ctx:
            if head:
                lm = vp.VocabParallelLMHead.from_shard(
                    torch.nn.Parameter(w.detach()), V, vp.shard_bounds(V, 2)[rank][0], group
                )
                loss = lm(x, y)
            else:
                loss = vp.vocab_parallel_linear_cross_entropy(x, w, y, **options)
        return ("ok", float(loss.detach().sum()))
    except Exception as exc:  # what each rank raised, compared by the test
        return (type(exc).__name__, str(exc))


@pytest.mark.parametrize("name", sorted(PROBES))
def test_every_rank_raises_the_same_value_error(name):
    results = run_ranks(_probe, 2, name, timeout=120)
    kinds = [kind for kind, _ in results]
    start = PROBES[name][1]
    assert kinds == ["ValueError", "ValueError"], results
    if name == "refused_on_one_rank":
        assert results[1][1].startswith("target: "), results  # its own error, naming target
        assert results[0][1].startswith(start), results
    else:
        assert results[0][1] == results[1][1], results  # the same message on every rank
        assert results[0][1].startswith(start), results


def test_cached_layout_still_checks_the_token_counts():
    """The head states its layout (cached after the first call); ranks passing different
    token counts still fail alike on CPU and GPU alike."""
    results = run_ranks(_probe, 2, "tokens", True, True, timeout=120)
    assert [k for k, _ in results] == ["ValueError", "ValueError"], results


def _agreeing(group):
    x, w, y = _inputs(group.rank())
    return float(vp.vocab_parallel_linear_cross_entropy(x, w, y, process_group=group))


def test_agreeing_ranks_pass_and_match_unsharded():
    got = run_ranks(_agreeing, 2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, H, generator=g)
    w = torch.randn(V, H, generator=g)
    y = torch.randint(0, V, (12,), generator=g)
    want = torch.nn.functional.cross_entropy(x.double() @ w.double().T, y).item()
    assert got[0] == got[1] and abs(got[0] - want) < 1e-5


def _other_objective(group):
    """Rank 0 calls the loss, rank 1 the token statistics of the same tensors."""
    rank = group.rank()
    x, w, y = _inputs(rank)
    try:
        if rank == 0:
            vp.vocab_parallel_linear_cross_entropy(x, w, y, process_group=group, reduction="none")
        else:
            vp.vocab_parallel_token_stats(x, w, y, process_group=group)
    except ValueError as err:
        return str(err)
    return None


def test_ranks_calling_different_objectives_raise_naming_them():
    got = run_ranks(_other_objective, 2, timeout=120)
    assert got[0] == got[1] and got[0] is not None
    assert got[0].startswith("process_group: the ranks of process_group pass different objective")
    assert "rank 0: cross entropy, rank 1: token statistics" in got[0]
