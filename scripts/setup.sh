#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv (repo root) with torch and this
# package installed editable with its test extras.
#
#   PYTHON=python3.11 bash scripts/setup.sh     # choose the interpreter (default python3)
#
# torch: if $PYTHON already imports torch, the venv sees it (--system-site-packages) and
# pip is pinned to it, so it is never replaced. Otherwise a GPU box (nvidia-smi works) gets
# `pip install torch` (a CUDA build) and any other machine the CPU build torch==2.13.0,
# never a multi-GB CUDA build it could not use.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
STAMP="$VENV/.setup-stamp"
CPU_TORCH="torch==2.13.0"

log() { echo "[setup] $*"; }

# Re-run pip only when the venv is new or pyproject.toml / this script changed.
want_stamp="$(cat pyproject.toml scripts/setup.sh | cksum | cut -d' ' -f1)"
if [[ -x "$VPY" && -f "$STAMP" && "$(cat "$STAMP")" == "$want_stamp" ]] &&
    "$VPY" -c "import torch, vocab_parallel" 2>/dev/null; then
    log "up to date ($VENV)"
    exit 0
fi

if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "[setup] error: '$PYTHON' not found; set PYTHON to a Python >= 3.10" >&2
    exit 1
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "[setup] error: $PYTHON is $("$PYTHON" -V 2>&1); need Python >= 3.10" >&2
    exit 1
fi

system_torch=""
if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    system_torch="$("$PYTHON" -c "import torch; print(torch.__version__)")"
fi

if [[ ! -x "$VPY" ]]; then
    rm -rf "$VENV"
    if [[ -n "$system_torch" ]]; then
        log "creating .venv with --system-site-packages (reusing torch $system_torch)"
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        log "creating .venv"
        "$PYTHON" -m venv "$VENV"
    fi || {
        echo "[setup] error: '$PYTHON -m venv' failed (Debian/Ubuntu: apt-get install python3-venv)" >&2
        exit 1
    }
fi

# pip, quiet; notices about unusable index locations of a local mirror are dropped.
pip_q() {
    "$VPY" -m pip --disable-pip-version-check -q "$@" \
        2> >(grep -v -e "is ignored: it is neither a file nor a directory" >&2)
}
CONSTRAINTS="$VENV/torch-constraint.txt"

# Whatever torch the venv ends up with is pinned for the install of the package, so pip
# can never swap it for another build.
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
        log "GPU found (nvidia-smi): pip install torch"
        pip_q install torch numpy
    else
        log "no GPU: pip install $CPU_TORCH (CPU build)"
        pip_q install "$CPU_TORCH" numpy
    fi
fi
torch_version="$("$VPY" -c "import torch; print(torch.__version__)")"
echo "torch==$torch_version" >"$CONSTRAINTS"

# DeepSpeed (for its plug-in and tests) is installed without pre-building its C++ ops
# (DS_BUILD_OPS=0): the few it uses are JIT-compiled on first use and cached.
log "pip install -e '.[test,deepspeed]' (torch $torch_version)"
DS_BUILD_OPS=0 pip_q install -c "$CONSTRAINTS" -e '.[test,deepspeed]'

# The frameworks of the Megatron-core and torchtitan plug-ins, for their tests, without the
# dependencies their trainers need (a few seconds): megatron-core declares Python >= 3.12
# but runs on 3.10+ (its wheel, no dependencies but numpy and packaging); torchtitan's
# model code needs spmd_types, tyro, torchdata and tokenizers, not datasets, wandb... (pip
# then reports torchtitan's other requirements as not installed: expected).
# verl: its package only (--no-deps), for the references of the verl plug-in's tests
# (its torch and Megatron functions need nothing more; its package __init__ imports ray,
# which the tests step around: tests/framework_shims.py).
log "pip install megatron-core==0.19.2, torchtitan==0.3.0, verl==0.9.1 (--no-deps, and their small deps)"
pip_q install -c "$CONSTRAINTS" --no-deps --ignore-requires-python \
    megatron-core==0.19.2 torchtitan==0.3.0 verl==0.9.1
pip_q install -c "$CONSTRAINTS" numpy packaging spmd_types==0.2.3 tyro torchdata tokenizers

"$VPY" -c "import torch, vocab_parallel"
echo "$want_stamp" >"$STAMP"
log "done: $("$VPY" -c 'import torch, sys
cuda = torch.cuda.is_available()
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda={cuda}")')"
