#!/usr/bin/env bash
# The Triton tests (interpreter) and the ahead-of-time compile on the OLDEST supported
# triton, 3.6.0, in .venv-triton36 (scripts/setup_triton36.sh); CI runs it after the
# whole suite (scripts/test.sh, newest triton). Extra arguments go to pytest.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_triton36.sh
PY="$ROOT/.venv-triton36/bin/python"
export TRITON_INTERPRET=1  # the AOT test removes it for its own subprocess
# The files with Triton tests that import nothing beyond this venv (torch, triton, numpy,
# pytest, pyyaml); -k triton picks their Triton cases, and the AOT compile test joins.
FILES=(
    tests/test_backward_op.py tests/test_options.py tests/test_loss_api.py
    tests/test_grad_in_forward.py tests/test_large_offsets.py tests/test_backend_policy.py
    tests/test_cpu_half_gemms.py tests/test_package.py tests/test_distillation.py
    tests/test_g_in_place.py tests/test_kept_g.py
)
# Marked slow (out of the maintainers' fast loop), run here on purpose: the multi-rank
# Triton tests. The ahead-of-time compile follows: the covering subset for sm_90, the
# device's GPU (H200, which runs triton 3.6), both specialisations.
SLOW_FILES=(tests/test_multirank.py)
echo "[test-triton36] pytest -m 'not slow' -k 'triton or compile' ${FILES[*]} $*"
rc=0
# Its interpreter's int() on 1-element arrays warns on every numpy < 2.4 call: silenced.
"$PY" -m pytest -q -p no:cacheprovider -m "not slow" -k "triton or compile" \
    -W "ignore:Conversion of an array with ndim > 0:DeprecationWarning" \
    "${FILES[@]}" "$@" || rc=$?
if [[ $rc -eq 0 ]]; then
    "$PY" -m pytest -q -p no:cacheprovider -k "triton or compile" \
        -W "ignore:Conversion of an array with ndim > 0:DeprecationWarning" \
        "${SLOW_FILES[@]}" "$@" || rc=$?
fi
if [[ $rc -eq 0 ]]; then
    echo "[test-triton36] scripts/aot_compile.py --cover --targets 90"
    log="$(mktemp)"
    env -u TRITON_INTERPRET "$PY" scripts/aot_compile.py --cover --targets 90 --jobs 2 \
        >"$log" 2>&1 || rc=$?
    grep -e "| NO:" "$log" || true  # the variants that failed a check, if any
    tail -n 4 "$log"
fi
if [[ $rc -eq 5 ]]; then
    echo "[test-triton36] error: pytest collected no tests (exit code 5)" >&2
    exit 1
fi
exit "$rc"
