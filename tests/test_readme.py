"""Every Python block of the README runs as pasted: a block that starts a process group
under ``torchrun`` runs on 2 gloo ranks, any other in a plain interpreter (``text``
blocks are signatures, not programs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "README.md")) as f:
    BLOCKS = re.findall(r"```python\n(.*?)```", f.read(), re.S)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs_as_pasted(index, tmp_path):
    code = BLOCKS[index]
    script = tmp_path / f"block_{index}.py"
    script.write_text(code)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    logs = tmp_path / "logs"
    if "init_process_group" in code:
        # Each rank's stdout to its own file: two ranks printing to one pipe can interleave
        # within a line.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", "2", "--redirects", "1", "--log-dir", str(logs), str(script)]
    else:
        cmd = [sys.executable, str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    printed = out.stdout + "".join(f.read_text() for f in sorted(logs.rglob("stdout.log")))
    assert out.returncode == 0, printed[-3000:] + out.stderr[-3000:]
    if "unsharded" in code:  # the loss equals the unsharded loss on every rank
        pairs = re.findall(r"loss (\S+), unsharded (\S+)", printed)
        assert len(pairs) == 2 and all(abs(float(a) - float(b)) < 1e-5 for a, b in pairs)
