#!/usr/bin/env bash
# .venv-cuda for the CUDA rehearsal (`mode=dryrun dryrun.device=cuda`, `pytest -m cuda_rehearsal`):
# the CUDA build of the pinned torch, the project editable, and the fake-CUDA shim (built from C source
# with gcc). Called as `scripts/setup.sh --cuda-rehearsal`; idempotent, so CI can call it every time.
# torch comes from PyPI with the machine's pip configuration bypassed: a configured find-links folder or
# index holding the CPU wheel of the same version would otherwise win. Everything else uses the normal
# configuration, under a constraint that keeps the installed torch.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.13.0  # pyproject.toml's pin; fake_cuda.py's patches were written against it
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=.venv-cuda
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
is_cuda_build() { $VENV/bin/python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') and torch.version.cuda else 1)" 2>/dev/null; }
if ! is_cuda_build; then
  PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_CONSTRAINT= \
    $VENV/bin/python -m pip install --quiet --progress-bar off "torch==$TORCH_VERSION"
  is_cuda_build || { echo "setup.sh --cuda-rehearsal: PyPI's torch==$TORCH_VERSION is not a CUDA build here" >&2; exit 1; }
fi
constraint=$(mktemp)
trap 'rm -f "$constraint"' EXIT
$VENV/bin/python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" >"$constraint"
$VENV/bin/python -m pip install --quiet -c "$constraint" -e . pytest
bash runner/run/dryrun/shim/build.sh $VENV
$VENV/bin/python -c "import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda, '| rehearsal venv ready')"
