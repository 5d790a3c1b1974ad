"""The checks of ``vocab_parallel.parallel.sharded`` in one process, on stand-ins for a ZeRO-3
parameter (the attributes DeepSpeed sets: an empty tensor and ``ds_shape``); the real
frameworks are in ``tests/test_zero3.py`` and ``tests/test_fsdp2.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vocab_parallel import VocabParallelLMHead, vocab_parallel_linear_cross_entropy
from vocab_parallel.integrations.heads import head_from_autotp
from vocab_parallel.parallel.sharded import check_gathered, full_shape, zero3_partitioned


def _zero3_like(linear: nn.Linear) -> nn.Parameter:
    """``linear.weight`` as ZeRO-3 leaves it outside a gather: empty, ``ds_shape`` whole."""
    weight = linear.weight
    weight.ds_shape = weight.shape
    weight.ds_id = 0
    weight.data = torch.empty(0)
    return weight


def test_a_partition_is_refused_naming_zero3_and_the_fix():
    linear = nn.Linear(8, 37, bias=False)
    whole = linear.weight.detach().clone()
    weight = _zero3_like(linear)
    assert zero3_partitioned(weight) and full_shape(weight) == (37, 8)
    x, y = torch.randn(5, 8), torch.randint(0, 37, (5,))
    with pytest.raises(ValueError, match=r"^weight: a DeepSpeed ZeRO-3 partition") as info:
        vocab_parallel_linear_cross_entropy(x, weight, y)
    assert "(0,)" in str(info.value) and "inside the forward" in str(info.value)
    with pytest.raises(ValueError, match=r"^bias: a DeepSpeed ZeRO-3 partition"):
        check_gathered("bias", _zero3_like(nn.Linear(1, 37)))

    # a head on the layer takes the whole shape; gathered (data whole again), it computes
    head = head_from_autotp(linear)
    assert head.weight is weight and (head.vocab_size, head.hidden_size) == (37, 8)
    with pytest.raises(ValueError, match="ZeRO-3"):
        head(x, y)
    weight.data = whole
    assert not zero3_partitioned(weight)
    torch.testing.assert_close(head(x, y), F.cross_entropy(x @ whole.T, y))


def test_whole_tensors_pass():
    t = torch.randn(3, 4)
    assert not zero3_partitioned(t) and full_shape(t) == (3, 4)
    check_gathered("weight", t)
    check_gathered("weight", None)
    head = VocabParallelLMHead(4, 11)  # a plain head on a whole weight computes
    x, y = torch.randn(2, 4), torch.tensor([0, 10])
    torch.testing.assert_close(head(x, y), F.cross_entropy(x @ head.weight.detach().T, y))
