"""The backends: the one interface (``interface``), the registry that picks one
(``registry``, the only module that knows their names), the chunked PyTorch backend and
the Triton backend's launchers of ``vocab_parallel.kernels`` (``docs/design.md``, "The
engine")."""
