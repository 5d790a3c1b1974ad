#!/usr/bin/env bash
# Download, here, the wheels that scripts/gpu_check.sh installs on a GPU box that reaches
# no package registry (Python 3.12, x86-64 Linux, torch and triton already there):
#
#   bash scripts/gpu_wheels.sh            # into .whl/ (git-ignored); WHEEL_DIR to change
#
#   liger-kernel 0.8.5      the Liger-Kernel peer rows (FLCE, its TP function at TP 1)
#   cut-cross-entropy       the Cut Cross-Entropy peer row
#   numpy < 2.4             triton 3.6's interpreter calls int() on 1-element arrays,
#                           which numpy >= 2.4 refuses; the tests that run the
#                           interpreter in subprocesses need it even on a GPU
#
# --no-deps: their own requirements (torch, triton) are on the box already and must not
# be replaced; nothing else is required by them. Binary wheels only, for CPython 3.12.
# The folder stays well under 60 MiB (checked at the end).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PY:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
WHEEL_DIR="${WHEEL_DIR:-$ROOT/.whl}"
MAX_MIB=60
WHEELS=("liger-kernel==0.8.5" "cut-cross-entropy" "numpy>=2.0,<2.4")

mkdir -p "$WHEEL_DIR"
"$PY" -m pip --disable-pip-version-check download -q --dest "$WHEEL_DIR" --no-deps \
    --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any \
    "${WHEELS[@]}" 2> >(grep -v -e "is ignored: it is neither a file nor a directory" >&2)

# One wheel per project: an older download of the same project is dropped.
"$PY" - "$WHEEL_DIR" <<'EOF'
import re, sys
from pathlib import Path
newest = {}
for whl in sorted(Path(sys.argv[1]).glob("*.whl"), key=lambda p: p.stat().st_mtime):
    project = re.split(r"-\d", whl.name, maxsplit=1)[0].lower().replace("-", "_")
    if project in newest:
        newest[project].unlink()
    newest[project] = whl
EOF

size_mib=$(($(du -sk "$WHEEL_DIR" | cut -f1) / 1024))
ls -l "$WHEEL_DIR"/*.whl | awk '{printf "[gpu-wheels] %8.1f MiB  %s\n", $5 / 1048576, $NF}'
echo "[gpu-wheels] $WHEEL_DIR: ${size_mib} MiB in all"
if ((size_mib > MAX_MIB)); then
    echo "[gpu-wheels] error: over ${MAX_MIB} MiB: it must travel with the working tree" >&2
    exit 1
fi
