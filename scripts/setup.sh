#!/usr/bin/env bash
# Create .venv and install the runner with its pinned torch/torchtitan/torchao.
# Without CUDA it installs the CPU build of torch 2.13.0 (a plain `pip install torch`
# would pull a multi-GB CUDA build).
#   scripts/setup.sh                  Python packages only; never a system package
#   scripts/setup.sh --with-slurm     also Debian's slurm-wlm and munge (apt-get, as root), which the
#                                     localhost SLURM cluster of the tests needs (scripts/slurm_local/)
#   scripts/setup.sh --cuda-rehearsal only .venv-cuda: the CUDA build of the pinned torch from PyPI (about
#                                     2.7 GB of download, 5.5 GB on disk), the project editable, and the
#                                     fake-CUDA shim built with gcc; `mode=dryrun dryrun.device=cuda` and
#                                     `pytest -m cuda_rehearsal` run there (docs/dryrun.md)
# TORCH_INDEX_URL: the package index of torch's CPU wheels, asked only when pip's configured index has
# no torch==2.13.0+cpu (the README's Setup says what to set it to).
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_SLURM=0
for arg in "$@"; do
  case "$arg" in
    --with-slurm) WITH_SLURM=1 ;;
    --cuda-rehearsal) exec bash scripts/setup_cuda_rehearsal.sh ;;
    *) echo "usage: scripts/setup.sh [--with-slurm | --cuda-rehearsal]" >&2; exit 2 ;;
  esac
done
if [ "$WITH_SLURM" = 1 ]; then
  missing=()
  for tool in slurmctld slurmd sbatch munged; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || { echo "setup.sh --with-slurm: ${missing[*]} missing; run as root to apt-get install slurm-wlm munge" >&2; exit 1; }
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge
  fi
fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  "${pip[@]}" torch==2.13.0
elif ! "${pip[@]}" torch==2.13.0+cpu; then  # from pip's configured index or find-links, if either has the CPU wheel
  if [ -z "${TORCH_INDEX_URL:-}" ]; then
    echo "setup.sh: torch==2.13.0+cpu is not on this machine's package index; set TORCH_INDEX_URL to an index that has" \
      "torch's CPU wheels (see the README's Setup) and run it again" >&2
    exit 2
  fi
  "${pip[@]}" torch==2.13.0+cpu --extra-index-url "$TORCH_INDEX_URL"  # its dependencies from the configured index
fi
"${pip[@]}" -e ".[dev]"
.venv/bin/python -c "import torch, torchtitan; print('torch', torch.__version__, '| cuda' if torch.cuda.is_available() else '| cpu')"
