"""Bit-packed target masks: bit k of byte b is row ``8*b + k`` (least-significant bit first).

The packed form is what the operator's seed document specifies (one bit per token,
an eighth of a bool tensor); both forms are accepted everywhere.
"""

from __future__ import annotations

import torch

_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def pack_target_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a 1-D bool mask of length n into ``ceil(n / 8)`` uint8 bytes, LSB first.

    Tail bits of the last byte are zero.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask: expected a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask: expected dtype torch.bool, got {mask.dtype}")
    if mask.dim() != 1:
        raise ValueError(f"mask: expected a 1-D tensor, got shape {tuple(mask.shape)}")
    n = mask.shape[0]
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask.device)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_target_mask(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Unpack the first ``n`` bits of a uint8 mask into a 1-D bool tensor."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed: expected a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed: expected dtype torch.uint8, got {packed.dtype}")
    if packed.dim() != 1:
        raise ValueError(f"packed: expected a 1-D tensor, got shape {tuple(packed.shape)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n: expected a non-negative int, got {n!r}")
    if packed.shape[0] * 8 < n:
        raise ValueError(
            f"packed: {packed.shape[0]} bytes hold {packed.shape[0] * 8} bits, fewer than n={n}"
        )
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed[:, None] >> shifts) & 1
    return bits.reshape(-1)[:n].to(torch.bool)
