"""The parallel layer: shard layouts, the ranks' agreement, collectives, sequence
parallelism, DTensor and data-parallel-sharded weights, and the TP x DP process groups
(``docs/design.md``, "Layout")."""

from vocab_parallel.parallel.groups import ModelParallelUnit, init_parallel_groups

__all__ = ["ModelParallelUnit", "init_parallel_groups"]
