"""The shard layout without tensor parallelism (no process group, or a group of one).

The one shard is then the whole vocabulary: ``vocab_start_index`` 0 and
``global_vocab_size`` the weight's rows. Anything else leaves rows to no rank, whose logits
would be missing from every softmax, silently (a 10-row weight at ``vocab_start_index=5``
of 15 computed the loss over rows [5, 15) as if the vocabulary had 10 tokens). Every entry
that takes the layout refuses it with a ``ValueError`` naming the layout parameter, as the
ranks of a group do (``vocab_parallel.parallel.layout``); ``check_inputs=False`` takes a stated
layout (both given) as it is.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from multirank import run_ranks

import vocab_parallel as vp

BT, H, V = 6, 8, 10


def _problem(start: int = 0):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BT, H, generator=g)
    w = torch.randn(V, H, generator=g) / H**0.5
    y = torch.randint(0, V, (BT,), generator=g) + start  # ids on the weight's rows
    return x, w, y


def _loss(start, size, **kw):
    x, w, y = _problem(0 if start is None else start)
    layout = dict(vocab_start_index=start, global_vocab_size=size)
    return vp.vocab_parallel_linear_cross_entropy(x, w, y, **layout, **kw)


GAP = r"but rows \[0, 5\) belong to no rank"


@pytest.mark.parametrize(
    "start, size, message",
    [
        (5, 15, r"^vocab_start_index: 5, " + GAP),  # the weight is rows [5, 15) of 15
        (5, None, r"^vocab_start_index: 5, " + GAP),  # [5, 15), and no rank holds [0, 5)
        (0, 15, r"^global_vocab_size: 15, but rows \[10, 15\) belong to no rank"),
        (None, 15, r"^global_vocab_size: 15, but rows \[10, 15\) belong to no rank"),
        (None, 8, r"^global_vocab_size: 8 is smaller than vocab_start_index 0 \+ 10"),
        (5, 12, r"^global_vocab_size: 12 is smaller than vocab_start_index 5 \+ 10"),
    ],
)
def test_an_uncovered_layout_is_refused(start, size, message):
    with pytest.raises(ValueError, match=message) as info:
        _loss(start, size)
    if "belong to no rank" in message:  # it says what the rule is and how to opt out
        assert "the weight is the whole vocabulary" in str(info.value)
        assert "check_inputs=False" in str(info.value)


@pytest.mark.parametrize("start, size", [(None, None), (0, None), (None, V), (0, V)])
def test_the_whole_vocabulary_in_any_form_gives_the_plain_loss(start, size):
    x, w, y = _problem()
    loss = _loss(start, size)
    ref = F.cross_entropy(x.double() @ w.double().T, y)
    assert abs(loss.item() - ref.item()) < 1e-6
    assert torch.equal(loss, _loss(None, None))


def _entries():
    """Every public entry that takes the layout, called with a 10-row weight stated as
    rows [5, 15) of 15 and no group."""
    x, w, y = _problem(5)
    layout = dict(vocab_start_index=5, global_vocab_size=15)
    ids = torch.stack([y, torch.full_like(y, 14)], dim=1)  # distinct global ids
    logprobs = torch.log(torch.tensor([[0.6, 0.3]])).expand(BT, 2)
    head = vp.VocabParallelLMHead(H, 15, vocab_start_index=5, vocab_end_index=15)
    teacher = vp.VocabParallelLMHead(H, 15, vocab_start_index=5, vocab_end_index=15)
    return {
        "loss": lambda: vp.vocab_parallel_linear_cross_entropy(x, w, y, **layout),
        "loss-none": lambda: vp.vocab_parallel_linear_cross_entropy(
            x, w, y, reduction="none", **layout
        ),
        "module": lambda: vp.VocabParallelLinearCrossEntropy(**layout)(x, w, y),
        "token_stats": lambda: vp.vocab_parallel_token_stats(
            x, w, y, entropy=True, top_k=2, argmax=True, **layout
        ),
        "distill-dense": lambda: vp.vocab_parallel_distillation_loss(
            x, w, teacher_hidden=x, teacher_weight=w, **layout
        ),
        "distill-sparse": lambda: vp.vocab_parallel_distillation_loss(
            x, w, teacher_topk_ids=ids, teacher_topk_logprobs=logprobs, **layout
        ),
        "head": lambda: head(x, y),
        "head.token_stats": lambda: head.token_stats(x, y, entropy=True),
        "head.distillation_loss": lambda: head.distillation_loss(x, teacher, x, y),
    }


@pytest.mark.parametrize("entry", list(_entries()))
def test_every_entry_refuses_an_uncovered_layout(entry):
    with pytest.raises(ValueError, match=r"^vocab_start_index: 5, " + GAP):
        _entries()[entry]()


def test_a_stated_layout_is_trusted_with_check_inputs_false():
    """check_inputs=False takes a stated layout as it is (no check, on one rank as on
    several): the loss of the 10 rows alone, as stated; a layout only half stated is not
    a stated one and is still checked."""
    x, w, y = _problem(5)
    loss = _loss(5, 15, check_inputs=False)
    ref = F.cross_entropy(x.double() @ w.double().T, y - 5)
    assert abs(loss.item() - ref.item()) < 1e-6
    with pytest.raises(ValueError, match=r"^vocab_start_index: 5, " + GAP):
        _loss(5, None, check_inputs=False)
    with pytest.raises(ValueError, match=r"^global_vocab_size: 12 is smaller"):
        _loss(5, 12, check_inputs=False)


def _group_of_one(group, start, size):
    try:
        _loss(start, size, process_group=group)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.slow
def test_a_group_of_one_rank_refuses_it_too():
    (message,) = run_ranks(_group_of_one, 1, 5, 15, timeout=120)
    assert message is not None and message.startswith("vocab_start_index: 5, but rows [0, 5)")
    (fine,) = run_ranks(_group_of_one, 1, 0, V, timeout=120)
    assert fine is None
