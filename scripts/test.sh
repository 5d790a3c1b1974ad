#!/usr/bin/env bash
# Set up (scripts/setup.sh), then lint, check formatting, and run the tests.
# Extra arguments go to pytest:  bash scripts/test.sh -k mask -x
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
PY="$ROOT/.venv/bin/python"

echo "[test] ruff check"
"$PY" -m ruff check .
echo "[test] ruff format --check"
"$PY" -m ruff format --check .

# Without a GPU the Triton kernels run in Triton's interpreter; it must be switched on
# before triton is imported (tests/conftest.py does the same).
if ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
fi

echo "[test] pytest $* (TRITON_INTERPRET=${TRITON_INTERPRET:-0})"
rc=0
# The slowest tests' times close the log: what to look at when CI nears its 30 minutes.
"$PY" -m pytest --durations=25 "$@" || rc=$?
if [[ $rc -eq 5 ]]; then
    echo "[test] error: pytest collected no tests (exit code 5)" >&2
    exit 1
fi
exit "$rc"
