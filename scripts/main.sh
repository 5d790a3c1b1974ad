#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the project's main job on its embedded default.
# For now the main job is launch/demo.py: the backward operator against the float64
# reference, with a small timing table. Extra arguments go to it:
#   bash scripts/main.sh --dtypes fp32 --bt 1024
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
exec "$ROOT/.venv/bin/python" launch/demo.py "$@"
