"""The documentation's shape, without running it (tests/test_readme.py runs its blocks):
the README stays short, no commit hash, every relative link resolves, and every block that
needs a framework says so on its first line."""

from __future__ import annotations

import pytest
from doc_blocks import (
    ALL_DOCS,
    ALWAYS_THERE,
    COMMIT_HASH,
    DOCS,
    README_MAX_LINES,
    all_python_blocks,
    anchor,
    broken_links,
    imported_packages,
    read,
    requirements,
)

BLOCKS = all_python_blocks()


def test_the_readme_reads_in_ten_minutes():
    lines = read("README.md").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


@pytest.mark.parametrize("path", DOCS)
def test_no_commit_hashes(path):
    found = [
        f"line {read(path).count(chr(10), 0, m.start()) + 1}: {m.group()}"
        for m in COMMIT_HASH.finditer(read(path))
    ]
    assert not found, f"{path} names commits: {found}"


def test_the_commit_hash_pattern():
    """What counts as a commit: 7 to 40 hex digits with a digit and a letter, a whole word."""
    for text in ("at 54854c8", "a189395 on", "(2cc35ea/b725051)", "7fc34a6", "E9EB6FE"):
        assert COMMIT_HASH.search(text), text
    for text in ("0.000244140625", "1048576", "deadbeef", "5e-07", "bf16", "0x7fc34a6f", "abc123"):
        assert not COMMIT_HASH.search(text), text


@pytest.mark.parametrize("path", ALL_DOCS)
def test_relative_links_resolve(path):
    assert not broken_links(path), f"{path}: {broken_links(path)}"


def test_anchors_are_githubs():
    assert anchor("Trying `patch_verl()` without ray") == "trying-patch_verl-without-ray"
    assert anchor("grad_in_forward: BT=4096, H=1024") == "grad_in_forward-bt4096-h1024"


def test_the_readme_has_an_example_per_objective_and_python_blocks():
    readme = read("README.md")
    for call in (
        "vocab_parallel_linear_cross_entropy(",
        "VocabParallelLMHead(",
        ".token_stats(",
        "vocab_parallel_distillation_loss(",
    ):
        assert call in readme, call
    assert sum(1 for path, _, _ in BLOCKS if path == "README.md") >= 3


@pytest.mark.parametrize(
    "path, index, code", BLOCKS, ids=[f"{path}:{index}" for path, index, _ in BLOCKS]
)
def test_blocks_say_which_frameworks_they_need(path, index, code):
    """A block may import a framework only if its first line says ``# requires:`` it: then
    tests/test_readme.py skips it, naming the module, where that is not installed."""
    declared = {name.split(".")[0] for name in requirements(code)}
    undeclared = imported_packages(code) - ALWAYS_THERE - declared
    assert not undeclared, f"{path} block {index} imports {sorted(undeclared)}: add '# requires:'"
    for name in requirements(code):  # the names are importable module paths
        assert all(part.isidentifier() for part in name.split(".")), name


def test_a_requires_line_is_read():
    assert requirements("# requires: deepspeed, megatron.core\nimport os\n") == [
        "deepspeed",
        "megatron.core",
    ]
    assert requirements("import os\n# requires: deepspeed\n") == []
