#!/usr/bin/env bash
# Check the GPU path on this machine (one NVIDIA GPU, the pinned stack from scripts/setup.sh): the debug model
# through the runner in bf16 (eager, compiled) and FP8 tensorwise/rowwise/blockwise, beside TorchTitan's own
# trainer. Under 8 minutes; exits non-zero if a run fails or there is no GPU. See scripts/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "gpu_check: no .venv here; run scripts/setup.sh first" >&2; exit 2; }
exec "$PY" scripts/gpu_check.py "$@"
