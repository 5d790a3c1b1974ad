"""Faults and bad input at the loss API: no silent wrong loss, no hang.

Every case here gave a wrong loss without a word, hung, or failed with an unrelated
message before: out-of-range targets, inconsistent shard layouts, ranks passing different
token counts, tensors on other devices, a process outside the group, a stopped rank.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.nn.functional as F
from multirank import run_ranks

import vocab_parallel as vp

# Multi-process (gloo ranks): out of the fast loop (-m "not slow").
pytestmark = pytest.mark.slow

V, H, BT = 23, 8, 12


def _problem(seed=0, bt=BT, v=V, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bt, H, generator=g).to(dtype)
    w = torch.randn(v, H, generator=g).to(dtype)
    y = torch.randint(0, v, (bt,), generator=g)
    return x, w, y


# --------------------------------------------------------------------------- targets


@pytest.mark.parametrize("bad", [V, V + 7, -1, -101, 255])
def test_out_of_range_target_raises_naming_it(bad):
    x, w, y = _problem()
    y[5] = bad
    with pytest.raises(ValueError, match=rf"^target: .*got {bad} at position 5"):
        vp.vocab_parallel_linear_cross_entropy(x, w, y)
    # F.cross_entropy refuses it too (that is what we match).
    with pytest.raises((IndexError, RuntimeError)):
        F.cross_entropy(F.linear(x, w), y)


def test_out_of_range_target_through_the_lm_head():
    head = vp.VocabParallelLMHead(H, V)
    x, _, y = _problem()
    y[0] = V
    with pytest.raises(ValueError, match="^target: "):
        head(x, y)


def test_ignore_index_is_not_out_of_range():
    x, w, y = _problem()
    y[::3] = -7
    loss = vp.vocab_parallel_linear_cross_entropy(x, w, y, ignore_index=-7)
    ref = F.cross_entropy(F.linear(x.double(), w.double()), y, ignore_index=-7)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)


def test_check_inputs_false_skips_the_target_check():
    x, w, y = _problem()
    y[0] = V + 1
    loss = vp.vocab_parallel_linear_cross_entropy(x, w, y, check_inputs=False)
    assert torch.isfinite(loss)


def _out_of_range_on_every_rank(group):
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    x, w, y = _problem()
    lo, hi = vp.shard_bounds(V, world)[rank]
    y[3] = V  # the same targets on every rank: every rank must raise alike
    try:
        vp.vocab_parallel_linear_cross_entropy(x, w[lo:hi], y, process_group=group)
    except ValueError as e:
        return str(e)
    return None


def test_out_of_range_target_raises_on_every_rank():
    messages = run_ranks(_out_of_range_on_every_rank, 2, timeout=120)
    assert all(m is not None and m.startswith("target: ") for m in messages), messages


# --------------------------------------------------------------------------- layouts


def _layout_case(group, case):
    import torch.distributed as dist

    rank = dist.get_rank(group)
    x, w, y = _problem(v=40)
    y.clamp_(max=19)
    start, size, global_size, bt = case[rank]
    kwargs = dict(vocab_start_index=start, global_vocab_size=global_size)
    t0 = time.perf_counter()
    try:
        vp.vocab_parallel_linear_cross_entropy(
            x[:bt], w[:size].clone(), y[:bt], process_group=group, **kwargs
        )
    except ValueError as e:
        return str(e), time.perf_counter() - t0
    return None, time.perf_counter() - t0


@pytest.mark.parametrize(
    "name, case, words",
    [
        ("overlap", [(0, 20, 40, BT), (0, 20, 40, BT)], "vocab_start_index: shards overlap"),
        ("gap", [(0, 20, None, BT), (25, 20, None, BT)], r"vocab_start_index: rows \[20, 25\)"),
        ("too-few-rows", [(0, 20, 50, BT), (20, 20, 50, BT)], "global_vocab_size: 50"),
        ("global-differs", [(0, 20, 40, BT), (20, 20, 41, BT)], "global_vocab_size: "),
        ("tokens", [(0, 20, 40, 12), (20, 20, 40, 10)], "hidden: .*rank 0: 12, rank 1: 10"),
        ("tokens-default-layout", [(None, 20, None, 12), (None, 20, None, 9)], "hidden: "),
    ],
)
def test_inconsistent_layout_raises_on_every_rank(name, case, words):
    results = run_ranks(_layout_case, 2, case, timeout=120)
    for rank, (message, seconds) in enumerate(results):
        assert message is not None, f"{name}: rank {rank} did not raise"
        assert __import__("re").search(words, message), (name, rank, message)
        assert seconds < 30, f"{name}: rank {rank} waited {seconds:.0f} s"


def _good_layout_then_shape_change(group):
    import torch.distributed as dist

    rank = dist.get_rank(group)
    head = vp.VocabParallelLMHead(H, 40, process_group=group)
    x, _, y = _problem(bt=12)
    y.clamp_(max=39)
    head(x, y).backward()  # the layout is checked once and remembered
    head(x, y).backward()
    bt = 12 if rank == 0 else 10  # then one rank's batch goes wrong
    try:
        head(x[:bt], y[:bt])
    except ValueError as e:
        return str(e)
    return None


def test_token_count_mismatch_after_good_steps():
    messages = run_ranks(_good_layout_then_shape_change, 2, timeout=120)
    assert all(m and m.startswith("hidden: ") for m in messages), messages


# --------------------------------------------------------------------------- tensors


def test_weight_on_another_device_raises():
    x, w, y = _problem()
    with pytest.raises(ValueError, match="^weight: .*meta"):
        vp.vocab_parallel_linear_cross_entropy(x, w.to("meta"), y)
    with pytest.raises(ValueError, match="^target: .*meta"):
        vp.vocab_parallel_linear_cross_entropy(x, w, y.to("meta"))


def test_single_process_without_rows_raises():
    x, w, y = _problem()
    with pytest.raises(ValueError, match="^weight: "):
        vp.vocab_parallel_linear_cross_entropy(x, w[:0], y.clamp(max=0))


@pytest.mark.parametrize("mode", ["memory_saving", "high_performance"])
def test_zero_hidden_size_is_log_v(mode):
    x = torch.zeros(BT, 0, requires_grad=True)
    w = torch.zeros(V, 0, requires_grad=True)
    y = torch.randint(0, V, (BT,))
    loss = vp.vocab_parallel_linear_cross_entropy(x, w, y, mode=mode)
    torch.testing.assert_close(loss, torch.tensor(float(torch.log(torch.tensor(float(V))))))
    loss.backward()
    assert x.grad.shape == (BT, 0) and w.grad.shape == (V, 0)


def _not_a_member(group):
    import torch.distributed as dist

    sub = dist.new_group([0, 1])
    if dist.get_rank() != 2:
        return None
    x, w, y = _problem()
    try:
        vp.vocab_parallel_linear_cross_entropy(x, w, y, process_group=sub)
    except ValueError as e:
        return str(e)
    return "no error"


def test_process_outside_the_group_raises():
    messages = run_ranks(_not_a_member, 3, timeout=120)
    assert messages[2].startswith("process_group: this process (global rank 2) is not a member")


# --------------------------------------------------------------------------- hangs


def _stalled_peer(group, timeout_s):
    import torch.distributed as dist

    from vocab_parallel.parallel.groups import init_parallel_groups

    groups = init_parallel_groups(2, timeout=datetime.timedelta(seconds=timeout_s))
    if dist.get_rank() == 1:
        time.sleep(timeout_s * 4)  # stands for a stopped rank: never joins
        return None
    x, w, y = _problem()
    lo, hi = vp.shard_bounds(V, 2)[0]
    t0 = time.perf_counter()
    try:
        vp.vocab_parallel_linear_cross_entropy(x, w[lo:hi], y, process_group=groups.tp_group)
    except RuntimeError as e:
        return str(e), time.perf_counter() - t0
    return "no error", 0.0


@pytest.mark.slow
def test_a_stalled_rank_gives_a_timeout_naming_the_collective():
    timeout_s = 4
    results = run_ranks(_stalled_peer, 2, timeout_s, timeout=120)
    message, seconds = results[0]
    assert "all-reduce" in message and "process_group" in message, message
    assert "ranks [0, 1]" in message, message
    assert seconds < timeout_s * 3, f"waited {seconds:.1f} s with a {timeout_s} s timeout"


def _group_timeouts(group):
    from vocab_parallel.parallel.groups import ModelParallelUnit, init_parallel_groups

    groups = init_parallel_groups(1, timeout=datetime.timedelta(seconds=7))
    mpu = ModelParallelUnit(groups)
    found = []
    # TP 1 x DP 2: the DP group and the mpu's one-rank TP groups are ours (WORLD is not).
    for g in (groups.dp_group, mpu.get_model_parallel_group()):
        found.append(g._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    return found


def test_created_groups_take_the_given_timeout():
    found = run_ranks(_group_timeouts, 2, timeout=120)
    assert found == [[7.0, 7.0], [7.0, 7.0]], found
