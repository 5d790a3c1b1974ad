#!/usr/bin/env bash
# Idempotent set-up of a second virtual environment, .venv-triton36, with the OLDEST
# supported triton (3.6.0): the kernels must compile and run on it as on the newest.
#
#   bash scripts/setup_triton36.sh          # PYTHON=python3.12 to choose the interpreter
#
# It holds only what the Triton tests and the ahead-of-time compile need: torch (the CPU
# build, torch==2.13.0, as in .venv: CI has no torch 2.11 CPU wheel), triton==3.6.0,
# numpy < 2.4, pytest and this package (editable, no dependencies).
#
# numpy < 2.4: triton 3.6's interpreter calls int() on 1-element numpy arrays, which
# numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars");
# the pin belongs to this test environment only, never to the package.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
VENV="$ROOT/.venv-triton36"
VPY="$VENV/bin/python"
STAMP="$VENV/.setup-stamp"
PINS=("torch==2.13.0" "triton==3.6.0" "numpy<2.4" "pytest>=8" "pyyaml")

log() { echo "[setup-triton36] $*"; }

want_stamp="$(cat pyproject.toml scripts/setup_triton36.sh | cksum | cut -d' ' -f1)"
if [[ -x "$VPY" && -f "$STAMP" && "$(cat "$STAMP")" == "$want_stamp" ]] &&
    "$VPY" -c "import torch, triton, vocab_parallel.kernels" 2>/dev/null; then
    log "up to date ($VENV)"
    exit 0
fi
if [[ ! -x "$VPY" ]]; then
    rm -rf "$VENV"
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
pip_q() {
    "$VPY" -m pip --disable-pip-version-check -q "$@" \
        2> >(grep -v -e "is ignored: it is neither a file nor a directory" >&2)
}
log "pip install ${PINS[*]}"
pip_q install "${PINS[@]}"
log "pip install --no-deps -e ."
pip_q install --no-deps -e .
"$VPY" -c "import torch, triton, numpy, vocab_parallel.kernels"
echo "$want_stamp" >"$STAMP"
log "done: $("$VPY" -c 'import numpy, torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, numpy {numpy.__version__}")')"
