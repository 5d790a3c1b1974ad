"""Triton kernels, installed as ``vocab_parallel.kernels``.

Kernels only: each module holds its ``@triton.jit`` kernels, the constexprs of a launch
(``meta``) and every variant a launch can choose (``launch_variants``, what
``scripts/aot_compile.py`` compiles); ``common`` the shared tile code and tile tables.
They import triton, torch (for dtypes) and each other, nothing of the library: the
launchers that validate, allocate and launch are the Triton backend's
(``vocab_parallel.backends.triton_backend``).
Importing this package needs triton; nothing queries a device.
"""
