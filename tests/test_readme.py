"""Every Python block of the documentation runs as pasted: README.md and docs/*.md but
docs/design.md, each block from the repository root, a block that starts a process group
under ``torchrun`` on 2 gloo ranks, any other in a plain interpreter (``text`` blocks are
signatures and fragments, not programs; the conventions: tests/doc_blocks.py).

A block whose first line is ``# requires: MODULE, ...`` is skipped, naming the module,
where one is not installed. A block that prints ``loss A, unsharded B`` (or ``loss A, from
full logits B``) must print it once per rank, with equal values."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
from doc_blocks import ROOT, all_python_blocks, requirements, starts_a_group

pytestmark = pytest.mark.slow

BLOCKS = all_python_blocks()
COMPARES = re.compile(r"(unsharded|from full logits) \{")
COMPARED = re.compile(r"loss (\S+), (?:unsharded|from full logits) (\S+)")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def test_the_documentation_has_python_blocks():
    assert sum(1 for path, _, _ in BLOCKS if path == "README.md") >= 3
    assert sum(1 for path, _, _ in BLOCKS if path != "README.md") >= 3


@pytest.mark.parametrize(
    "path, index, code", BLOCKS, ids=[f"{path}:{index}" for path, index, _ in BLOCKS]
)
def test_block_runs_as_pasted(path, index, code, tmp_path):
    missing = [name for name in requirements(code) if not _installed(name)]
    if missing:
        pytest.skip(f"{path} block {index} requires {', '.join(missing)}: not installed")
    script = tmp_path / f"block_{index}.py"
    script.write_text(code)
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)
    logs = tmp_path / "logs"
    ranks = 2 if starts_a_group(code) else 1
    if ranks > 1:
        # Each rank's stdout to its own file: two ranks printing to one pipe can interleave
        # within a line.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", str(ranks), "--redirects", "1", "--log-dir", str(logs)]
        cmd += [str(script)]
    else:
        cmd = [sys.executable, str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    printed = out.stdout + "".join(f.read_text() for f in sorted(logs.rglob("stdout.log")))
    assert out.returncode == 0, printed[-3000:] + out.stderr[-3000:]
    if COMPARES.search(code):  # the loss equals the unsharded (full-logits) loss on every rank
        pairs = COMPARED.findall(printed)
        assert len(pairs) == ranks, printed[-3000:]
        assert all(abs(float(a) - float(b)) < 1e-5 for a, b in pairs), pairs
