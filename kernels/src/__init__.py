"""Triton kernels, installed as ``vocab_parallel.kernels``.

They know nothing of torch.distributed or of input validation; each module exposes a
launcher that allocates and launches. Importing this package needs triton; nothing
queries a device at import time.
"""
