"""Benchmarks of vocab_parallel (not part of the installed package).

    bench_loss.py        the loss, forward + backward, against other implementations
    bench_backward.py    the backward operator against a naive PyTorch implementation
    implementations.py   the loss implementations bench_loss.py compares
    loss_report.py       bench_loss.py's table, legend and target verdicts
    harness.py           what both scripts share: child processes, timing, the report
    memory.py            PeakMemory: peak extra memory of a block on CUDA or CPU

Run the scripts from anywhere (``python benchmarks/bench_loss.py --help``); results and how
to reproduce them are in docs/benchmarks.md.
"""
