#!/usr/bin/env bash
# Create .venv and install the runner with its pinned torch/torchtitan/torchao.
# Without CUDA it installs the CPU build of torch 2.13.0 (a plain `pip install torch`
# would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  "${pip[@]}" torch==2.13.0
elif ! "${pip[@]}" torch==2.13.0+cpu; then  # the CPU wheel on local disk (pip's find-links), its dependencies from PyPI
  "${pip[@]}" torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
fi
"${pip[@]}" -e ".[dev]"
.venv/bin/python -c "import torch, torchtitan; print('torch', torch.__version__, '| cuda' if torch.cuda.is_available() else '| cpu')"
