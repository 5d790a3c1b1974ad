"""Each objective's math on the engine: the cross entropy's statistics, loss and ``G``
terms (``cross_entropy``, which the token statistics share), the token statistics' top-k
(``topk``) and distillation's divergences (``distill``) (``docs/design.md``, "The
engine")."""
