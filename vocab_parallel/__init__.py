"""vocab_parallel: vocabulary-parallel fused linear + cross entropy for PyTorch.

Public API:
    vocab_parallel_linear_cross_entropy   the sharded LM-head loss (docs/design.md)
    VocabParallelLinearCrossEntropy       its nn.Module form
    VocabParallelLMHead                   an LM head that owns its shard and computes the loss
    vocab_parallel_token_stats, TokenStats  per-token log-probs, entropy, top-k (RL)
    vocab_parallel_distillation_loss      KL / JSD between a student and a teacher head
    fused_linear_cross_entropy_loss_grad  the fused backward operator (docs/design.md)
    pack_target_mask, unpack_target_mask  the bit-packed target mask format
    shard_bounds                          the default contiguous (uneven) shard layout
    LossOptions, LossOutput               the options value, the result with return_lse
    gradient_filter_stats                 what gradient filtering left out (filter_eps)
"""

from vocab_parallel import _moved
from vocab_parallel.distillation import vocab_parallel_distillation_loss
from vocab_parallel.engine.filtering import GradientFilterStats, gradient_filter_stats
from vocab_parallel.lm_head import VocabParallelLMHead
from vocab_parallel.loss import (
    LossOutput,
    VocabParallelLinearCrossEntropy,
    vocab_parallel_linear_cross_entropy,
)
from vocab_parallel.mask import pack_target_mask, unpack_target_mask
from vocab_parallel.ops import fused_linear_cross_entropy_loss_grad
from vocab_parallel.options import LossOptions
from vocab_parallel.parallel.layout import shard_bounds
from vocab_parallel.token_stats import TokenStats, vocab_parallel_token_stats

__all__ = [
    "LossOptions",
    "LossOutput",
    "TokenStats",
    "VocabParallelLMHead",
    "VocabParallelLinearCrossEntropy",
    "vocab_parallel_linear_cross_entropy",
    "vocab_parallel_token_stats",
    "vocab_parallel_distillation_loss",
    "fused_linear_cross_entropy_loss_grad",
    "pack_target_mask",
    "unpack_target_mask",
    "shard_bounds",
    "gradient_filter_stats",
    "GradientFilterStats",
]
__version__ = "0.1.0"

_moved.install()  # the old flat module paths keep working (with a DeprecationWarning)
