#!/usr/bin/env bash
# One prepared check on a bare machine with one CUDA GPU (Python 3.12, torch and triton
# installed, no package registry). At most 8 minutes in all: every step has a timeout,
# and none may run past the overall deadline (BUDGET_S, default 460 s).
#
#   install         the package offline (pip -e ., no index, no build isolation) and the
#                   wheels of .whl/ (scripts/gpu_wheels.sh, run beforehand on a machine
#                   with a registry) into a --target folder put on PYTHONPATH
#   variants        scripts/gpu_variants.py: every kernel variant the launchers list for
#                   this GPU, Triton against the torch backend
#   llama_fp64      scripts/gpu_llama_accuracy.py: loss, grad_input, grad_weight vs float64
#                   at BT 8192, H 4096, V 128,256, bf16, in every mode
#   large_offsets   scripts/gpu_large_offsets.py: offsets past 2^31
#   bench_loss      time and peak memory at the same shape: ours in every mode, naive,
#                   F.linear_cross_entropy (when torch has it), Liger-Kernel (FLCE and its
#                   TP function at TP 1), Cut Cross-Entropy (default and exact), all in ONE
#                   process (--in-process: a fresh process each took 12-16 s of start-up
#                   and inputs), with the floor measured in it (the three GEMMs as plain
#                   cuBLAS calls) and each row's time / floor
#   verify          launch/verify.py, configs/verify_gpu.yaml, torchrun with 1 process
#                   (120 cases at H 256: sized to finish in its step, see the config)
#   tests           the Triton tests of the suite on CUDA (multi-rank ones skip: one GPU)
#   bench_heads     benchmarks/bench_heads.py: log-probs + entropy, forward KL and JSD to
#                   a dense teacher at 4096 x 4096 x 128256, ours against materialised
#                   logits (and Liger's fused linear JSD), in one process; last, in what
#                   the budget leaves
#
# The summary table is printed as the steps finish, first to last, and each row is also
# appended to $LOG_DIR/summary.md at once (LOG_DIR defaults to $OUT/gpu_check), so a run
# cut short still leaves its rows. Exit status 1 if any step fails or times out.
#
#   bash scripts/gpu_check.sh                     # PY=/path/to/python to choose it
#   GPU_CHECK_DRY_RUN=1 bash scripts/gpu_check.sh # every step on CPU, interpreter, tiny
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DRY="${GPU_CHECK_DRY_RUN:-0}"
[[ "$DRY" == "0" || -z "$DRY" ]] && DRY=""
if [[ -z "${PY:-}" ]]; then
    if [[ -n "$DRY" && -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
LOG_DIR="${LOG_DIR:-${OUT:-/tmp}/gpu_check}"
SITE="${GPU_SITE:-${TMPDIR:-/tmp}/vocab_parallel_gpu_site}"  # the wheels' --target
WHEEL_DIR="${WHEEL_DIR:-$ROOT/.whl}"
BUDGET_S="${BUDGET_S:-460}"
mkdir -p "$LOG_DIR"
: >"$LOG_DIR/summary.md"
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
if [[ -n "$DRY" ]]; then
    export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""   # CPU only, kernels interpreted
    # The torch backend's exact fp32 upcast of half inputs on CPUs (as the tests pin it):
    # the interpreted kernels compute that way, so both backends agree to fp32 rounding.
    export VOCAB_PARALLEL_CPU_HALF_GEMMS="${VOCAB_PARALLEL_CPU_HALF_GEMMS:-0}"
    DRY_FLAG=(--dry-run)
else
    unset TRITON_INTERPRET                               # real kernels on the GPU
    DRY_FLAG=()
    if ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
        echo "gpu_check: $PY sees no CUDA device (GPU_CHECK_DRY_RUN=1 runs on CPU)" >&2
        exit 2
    fi
fi
"$PY" -c "import sys, torch; print(f'python {sys.version.split()[0]}, torch {torch.__version__},',
 torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU (dry run)')" |
    tee "$LOG_DIR/versions.log"

start_all=$SECONDS
failed=0
declare -a FAILED_LOGS=()

row() {
    echo "$1" | tee -a "$LOG_DIR/summary.md"
}

# step NAME TIMEOUT_S SUMMARY_REGEX -- COMMAND...   (the timeout is cut to the deadline)
step() {
    local name="$1" limit="$2" pattern="$3"
    shift 4
    local log="$LOG_DIR/$name.log" start rc summary result left
    left=$((BUDGET_S - (SECONDS - start_all)))
    ((limit > left)) && limit=$left
    if ((limit < 5)); then
        row "| $name | FAIL (no time left) | 0 | the ${BUDGET_S} s budget was spent |"
        failed=1
        return
    fi
    start=$SECONDS
    timeout --kill-after=5 "$limit" "$@" >"$log" 2>&1
    rc=$?
    summary="$(grep -E "$pattern" "$log" | tail -n 1 | cut -c1-110)"
    if [[ $rc -eq 0 ]]; then
        result="ok"
    else
        [[ $rc -eq 124 || $rc -eq 137 ]] && summary="timed out after ${limit} s; $summary"
        result="FAIL ($rc)"
        failed=1
        FAILED_LOGS+=("$log")
    fi
    summary="${summary:-see $log}"
    row "| $name | $result | $((SECONDS - start)) | ${summary//|//} |"
}

install() {
    # The package: editable, offline. A dry run only resolves it (pip --dry-run): the venv
    # it runs in already has it.
    local pip=("$PY" -m pip --disable-pip-version-check install --no-index --no-deps)
    if [[ -n "$DRY" ]]; then
        "${pip[@]}" --dry-run --no-build-isolation -e . || return 1
    elif ! "$PY" -c "import vocab_parallel.kernels" 2>/dev/null; then
        "${pip[@]}" -q --no-build-isolation -e . || return 1
    fi
    # The peers' wheels (and a numpy that triton 3.6's interpreter accepts), in a folder
    # of their own on PYTHONPATH: the machine's site-packages stay as they are.
    shopt -s nullglob
    local wheels=("$WHEEL_DIR"/*.whl)
    if [[ -n "$DRY" ]]; then  # this CPU's Python may not be 3.12: the pure wheels only
        wheels=("$WHEEL_DIR"/*-py3-none-any.whl)
    fi
    if ((${#wheels[@]})); then
        rm -rf "$SITE"
        "${pip[@]}" -q --target "$SITE" "${wheels[@]}" || return 1
        echo "installed into $SITE: ${wheels[*]##*/}"
    elif [[ -z "$DRY" ]]; then
        echo "no wheels in $WHEEL_DIR: run scripts/gpu_wheels.sh first" >&2
        return 1
    fi
    "$PY" - <<'EOF'
import importlib, numpy, triton, vocab_parallel.kernels
peers = []
for module in ("liger_kernel.transformers", "cut_cross_entropy"):
    try:
        importlib.import_module(module)
        peers.append(module.split(".")[0])
    except ImportError as exc:
        peers.append(f"{module.split('.')[0]} MISSING ({exc})")
print(f"installed: triton {triton.__version__}, numpy {numpy.__version__}, {', '.join(peers)}")
EOF
}

if [[ -n "$DRY" ]]; then
    BENCH=(--device cpu --dtypes bf16 --bt 64 --hidden 32 --vocab 500 --repeats 1)
    HEADS=(--device cpu --tokens 64 --hidden 32 --vocab 500 --repeats 1)
    VERIFY_SHAPE=(--tokens 7 --hidden 16 --vocab 67 --dtypes float32 bfloat16)
    TESTS_DRY=(--collect-only)
else
    BENCH=(--device cuda --dtypes bf16 --bt 8192 --hidden 4096 --vocab 128256 --repeats 5)
    HEADS=(--device cuda --tokens 4096 --hidden 4096 --vocab 128256 --repeats 5)
    VERIFY_SHAPE=()
    TESTS_DRY=()
fi
export -f install
export PY DRY WHEEL_DIR SITE
PEERS=(naive ours_gif ours_ms ours_hp torch_lce_auto liger liger_tp cce cce_exact)

echo
row "| step | result | seconds | summary |"
row "|---|---|---|---|"
step install 40 'installed' -- bash -c install
step variants 90 '(OK|FAILED):' -- "$PY" scripts/gpu_variants.py "${DRY_FLAG[@]}"
step llama_fp64 60 '(OK|FAILED):' -- "$PY" scripts/gpu_llama_accuracy.py "${DRY_FLAG[@]}"
step large_offsets 50 '(OK|FAILED):' -- "$PY" scripts/gpu_large_offsets.py "${DRY_FLAG[@]}"
# One bf16 process for every row (the reference losses are computed in it too). Its
# --timeout leaves the parent 15 s to print the rows it got (a row not reached reads
# "timeout") within the step's 100 s, or within what is left of the budget.
bench_timeout=$((BUDGET_S - (SECONDS - start_all) - 15))
((bench_timeout > 85)) && bench_timeout=85
((bench_timeout < 1)) && bench_timeout=1
step bench_loss 100 'TFLOP|LOSS MISMATCH|did not run' -- "$PY" benchmarks/bench_loss.py \
    "${BENCH[@]}" --worlds 1 --in-process --impls "${PEERS[@]}" --timeout "$bench_timeout"
step verify 60 '(OK|FAILED):' -- "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
    launch/verify.py --config configs/verify_gpu.yaml "${VERIFY_SHAPE[@]}"
step tests 70 '(passed|failed|error|tests collected)' -- "$PY" -m pytest -q -p no:cacheprovider \
    -m "not slow" -k triton "${TESTS_DRY[@]}" tests
step bench_heads 45 '(OK|FAILED):' -- "$PY" benchmarks/bench_heads.py "${HEADS[@]}"

echo
echo "total $((SECONDS - start_all)) s (budget ${BUDGET_S} s); logs and summary.md: $LOG_DIR"
for log in "${FAILED_LOGS[@]}"; do
    echo
    echo "---- last lines of $log ----"
    tail -n 30 "$log"
done
exit "$failed"
