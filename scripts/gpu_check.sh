#!/usr/bin/env bash
# One prepared check on a machine with one CUDA GPU; every step has a timeout, together
# at most 10 minutes:
#
#   1. the whole test suite on CUDA (Triton kernels compiled for the GPU, both backends,
#      the ahead-of-time compile of every kernel variant for sm_80/sm_90/sm_100);
#   2. launch/verify.py with configs/verify_gpu.yaml under torchrun (1 process, NCCL);
#   3. scripts/gpu_large_offsets.py: offsets past 2^31 (BT=16,800 x V=128,256 softmax,
#      a V x H > 2^31 weight), Triton against the torch backend;
#   4. the benchmarks at a Llama-3-8B head (BT 8192, H 4096, V 128,256, bf16).
#
# Prints one summary table (each step's full output is in its log) and exits non-zero
# if any step fails or mismatches.
#
#   bash scripts/gpu_check.sh                 # PY=/path/to/python to choose the interpreter
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [[ -z "${PY:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
LOG_DIR="${LOG_DIR:-${OUT:-/tmp}/gpu_check}"
mkdir -p "$LOG_DIR"
unset TRITON_INTERPRET                       # real kernels on the GPU
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"  # the CPU multi-rank tests use gloo

if ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_check: $PY sees no CUDA device" >&2
    exit 2
fi
"$PY" -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__},',
 torch.cuda.get_device_name(0))" | tee "$LOG_DIR/versions.log"

BENCH_SHAPE=(--device cuda --dtypes bf16 --bt 8192 --hidden 4096)
declare -a NAMES RESULTS SECONDS_TAKEN SUMMARIES
failed=0

# step NAME TIMEOUT_S SUMMARY_REGEX -- COMMAND...
step() {
    local name="$1" limit="$2" pattern="$3"
    shift 4
    local log="$LOG_DIR/$name.log" start rc summary
    start=$(date +%s)
    timeout "$limit" "$@" >"$log" 2>&1
    rc=$?
    summary="$(grep -E "$pattern" "$log" | tail -n 1 | cut -c1-90)"
    NAMES+=("$name")
    SECONDS_TAKEN+=("$(($(date +%s) - start))")
    if [[ $rc -eq 0 ]]; then
        RESULTS+=("ok")
    else
        [[ $rc -eq 124 ]] && summary="timed out after ${limit} s; $summary"
        RESULTS+=("FAIL ($rc)")
        failed=1
    fi
    SUMMARIES+=("${summary:-see $log}")
}

step tests 345 '(passed|failed|error)' -- "$PY" -m pytest -q -p no:cacheprovider --durations=15 tests
step verify 75 '(OK|FAILED):' -- "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
    launch/verify.py --config configs/verify_gpu.yaml
step large_offsets 60 '(OK|FAILED):' -- "$PY" scripts/gpu_large_offsets.py
step bench_backward 60 '.' -- "$PY" benchmarks/bench_backward.py "${BENCH_SHAPE[@]}" \
    --vocab 128256 --modes memory_saving high_performance --backends triton torch --repeats 5
step bench_loss 60 '.' -- "$PY" benchmarks/bench_loss.py "${BENCH_SHAPE[@]}" \
    --vocab 128256 --worlds 1 --impls naive ours_ms ours_hp torch_lce_auto liger cce --repeats 5

echo
echo "| step | result | seconds | summary |"
echo "|---|---|---|---|"
for i in "${!NAMES[@]}"; do
    echo "| ${NAMES[$i]} | ${RESULTS[$i]} | ${SECONDS_TAKEN[$i]} | ${SUMMARIES[$i]//|//} |"
done
echo
echo "logs: $LOG_DIR"
for i in "${!NAMES[@]}"; do
    if [[ "${RESULTS[$i]}" != "ok" ]]; then
        echo
        echo "---- last lines of $LOG_DIR/${NAMES[$i]}.log ----"
        tail -n 30 "$LOG_DIR/${NAMES[$i]}.log"
    fi
done
exit "$failed"
