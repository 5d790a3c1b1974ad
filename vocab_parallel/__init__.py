"""vocab_parallel: vocabulary-parallel fused linear + cross entropy for PyTorch.

Public API:
    vocab_parallel_linear_cross_entropy   the sharded LM-head loss (SPEC.md sections 2 and 4)
    VocabParallelLinearCrossEntropy       its nn.Module form
    fused_linear_cross_entropy_loss_grad  the fused backward operator (SPEC.md section 3)
    pack_target_mask, unpack_target_mask  the bit-packed target mask format
"""

from vocab_parallel.loss import (
    VocabParallelLinearCrossEntropy,
    vocab_parallel_linear_cross_entropy,
)
from vocab_parallel.mask import pack_target_mask, unpack_target_mask
from vocab_parallel.ops import fused_linear_cross_entropy_loss_grad

__all__ = [
    "VocabParallelLinearCrossEntropy",
    "vocab_parallel_linear_cross_entropy",
    "fused_linear_cross_entropy_loss_grad",
    "pack_target_mask",
    "unpack_target_mask",
]
__version__ = "0.1.0"
