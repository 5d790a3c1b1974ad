#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the project's main job on its embedded default:
# train a small GPT whose LM head is vocabulary-parallel over 2 ranks (gloo on CPUs, NCCL
# on GPUs) on the embedded corpus, beside an identical unsharded model for comparison.
# Extra arguments go to launch/train.py:
#   bash scripts/main.sh --steps 50 --engine deepspeed --zero-stage 1
#
# A run that ends with an error (refused before training, a failed collective, ...) says
# why; torchrun then prints its own report of the failed ranks (a ChildFailedError
# traceback). The reason is printed again after it, so that it is what the user reads last:
# the ranks append it to the file VOCAB_PARALLEL_ERROR_FILE names (launch/report.py).
# The exit status is torchrun's.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"
errors="$(mktemp "${TMPDIR:-/tmp}/vocab_parallel_errors.XXXXXX")"
trap 'rm -f "$errors"' EXIT
status=0
VOCAB_PARALLEL_ERROR_FILE="$errors" "$ROOT/.venv/bin/python" -m torch.distributed.run \
    --standalone --nproc-per-node 2 launch/train.py --check-against-unsharded "$@" || status=$?
if [[ $status -ne 0 && -s "$errors" ]]; then
    echo >&2
    echo "[main.sh] the run failed (exit status $status):" >&2
    awk '!seen[$0]++' "$errors" >&2
fi
exit "$status"
