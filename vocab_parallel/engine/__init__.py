"""The engine under every objective: the entries' preparation (``entry``), what an
objective tells it (``objective``), the token-chunk walker (``grad_in_forward``) and the
column walker (``chunking``), the autograd Functions of the cross entropy (``autograd``),
the precision and memory policies (``precision``, ``memory_policy``), reductions and
gradient filtering (``docs/design.md``, "The engine")."""
