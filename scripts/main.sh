#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the project's main job on its embedded default:
# train a small GPT whose LM head is vocabulary-parallel over 2 ranks (gloo on CPUs, NCCL
# on GPUs) on the embedded corpus, beside an identical unsharded model for comparison.
# Extra arguments go to launch/train.py:
#   bash scripts/main.sh --steps 50 --engine deepspeed --zero-stage 1
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"
exec "$ROOT/.venv/bin/python" -m torch.distributed.run --standalone --nproc-per-node 2 \
    launch/train.py --check-against-unsharded "$@"
