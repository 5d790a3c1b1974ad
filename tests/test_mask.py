"""The bit-packed target mask format: bit k of byte b is row 8*b + k (LSB first)."""

from __future__ import annotations

import pytest
import torch

from vocab_parallel import pack_target_mask, unpack_target_mask


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 37])
@pytest.mark.parametrize("pattern", ["random", "all", "none", "alternate"])
def test_round_trip(n, pattern):
    if pattern == "random":
        mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.5
    elif pattern == "all":
        mask = torch.ones(n, dtype=torch.bool)
    elif pattern == "none":
        mask = torch.zeros(n, dtype=torch.bool)
    else:
        mask = torch.arange(n) % 2 == 1
    packed = pack_target_mask(mask)
    assert packed.dtype == torch.uint8
    assert packed.shape == ((n + 7) // 8,)
    # Popcount is preserved: no bit is lost or invented, tail bits are zero.
    ones = sum(bin(b).count("1") for b in packed.tolist())
    assert ones == int(mask.sum())
    out = unpack_target_mask(packed, n)
    assert out.dtype == torch.bool and out.shape == (n,)
    assert torch.equal(out, mask)


def test_pack_is_lsb_first():
    rows = [0, 9, 10, 15, 16]
    mask = torch.zeros(17, dtype=torch.bool)
    mask[rows] = True
    # byte 0: row 0 -> bit 0 = 1; byte 1: rows 9, 10, 15 -> bits 1, 2, 7 = 2 + 4 + 128;
    # byte 2: row 16 -> bit 0 = 1 (other bits: unused tail, zero).
    assert pack_target_mask(mask).tolist() == [1, 134, 1]


def test_pack_all_ones_fills_bytes_and_zeroes_the_tail():
    assert pack_target_mask(torch.ones(8, dtype=torch.bool)).tolist() == [255]
    assert pack_target_mask(torch.ones(37, dtype=torch.bool)).tolist() == [255] * 4 + [31]


def test_unpack_is_lsb_first():
    packed = torch.tensor([0b10100101, 0b00000010], dtype=torch.uint8)
    expected = [True, False, True, False, False, True, False, True, False, True]
    assert unpack_target_mask(packed, 10).tolist() == expected


def test_unpack_ignores_tail_and_extra_bytes():
    packed = torch.tensor([0b11111110, 0xFF, 0xFF], dtype=torch.uint8)
    assert unpack_target_mask(packed, 3).tolist() == [False, True, True]
    assert unpack_target_mask(packed, 0).shape == (0,)


def test_unpack_non_contiguous():
    buf = torch.tensor([0b00000001, 0xFF, 0b10000000, 0xFF], dtype=torch.uint8)
    packed = buf[::2]
    assert not packed.is_contiguous()
    assert unpack_target_mask(packed, 16).nonzero().flatten().tolist() == [0, 15]


def test_pack_non_contiguous():
    buf = torch.zeros(18, dtype=torch.bool)
    buf[0::2] = torch.tensor([1, 0, 0, 1, 0, 0, 0, 0, 1], dtype=torch.bool)
    mask = buf[::2]
    assert not mask.is_contiguous()
    assert pack_target_mask(mask).tolist() == [0b00001001, 1]


@pytest.mark.parametrize(
    "arg, exc, word",
    [
        ([True, False], TypeError, "mask"),
        (torch.zeros(4, dtype=torch.uint8), TypeError, "mask"),
        (torch.zeros(4), TypeError, "mask"),
        (torch.zeros(2, 2, dtype=torch.bool), ValueError, "mask"),
        (torch.tensor(True), ValueError, "mask"),
    ],
    ids=["list", "uint8", "float", "2d", "0d"],
)
def test_pack_errors(arg, exc, word):
    with pytest.raises(exc, match=word) as info:
        pack_target_mask(arg)
    assert type(info.value) is exc


@pytest.mark.parametrize(
    "arg, n, exc, word",
    [
        ([1, 2], 8, TypeError, "packed"),
        (torch.zeros(2, dtype=torch.bool), 2, TypeError, "packed"),
        (torch.zeros(2, dtype=torch.int32), 2, TypeError, "packed"),
        (torch.zeros(2, 2, dtype=torch.uint8), 2, ValueError, "packed"),
        (torch.zeros(2, dtype=torch.uint8), 17, ValueError, "packed"),
        (torch.zeros(0, dtype=torch.uint8), 1, ValueError, "packed"),
        (torch.zeros(2, dtype=torch.uint8), -1, ValueError, "n"),
        (torch.zeros(2, dtype=torch.uint8), 3.0, ValueError, "n"),
        (torch.zeros(2, dtype=torch.uint8), True, ValueError, "n"),
    ],
    ids=["list", "bool", "int32", "2d", "too-short", "empty-short", "n-neg", "n-float", "n-bool"],
)
def test_unpack_errors(arg, n, exc, word):
    with pytest.raises(exc, match=rf"\b{word}\b") as info:
        unpack_target_mask(arg, n)
    assert type(info.value) is exc
