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
pypi=(env PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_CONSTRAINT= $VENV/bin/python -m pip install --quiet --progress-bar off --no-cache-dir)
if ! is_cuda_build; then
  # torch's wheel, then each of its requirements in its own pip call (pip's markers choose them): one call holds every
  # download beside what it installs, 7.3 GB of disk at its peak for a venv of 5.5 GB; a call per wheel, a wheel more
  # (measured 2026-12-05: 5.7 GB at the peak, the same packages). Until the last call torch's requirements are
  # incomplete, which pip reports after each call: those calls' stderr is shown only when one fails.
  log=$(mktemp)
  part() { "${pypi[@]}" "$@" 2>"$log" || { cat "$log" >&2; return 1; }; }
  part --no-deps "torch==$TORCH_VERSION"
  $VENV/bin/python -c "import importlib.metadata as m; print('\n'.join(m.requires('torch') or []))" |
    while IFS= read -r req; do part "$req"; done
  rm -f "$log"
  "${pypi[@]}" "torch==$TORCH_VERSION"  # installs nothing more: pip's own check that the set is complete
  is_cuda_build || { echo "setup.sh --cuda-rehearsal: PyPI's torch==$TORCH_VERSION is not a CUDA build here" >&2; exit 1; }
fi
constraint=$(mktemp)
trap 'rm -f "$constraint"' EXIT
$VENV/bin/python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" >"$constraint"
$VENV/bin/python -m pip install --quiet -c "$constraint" -e . pytest
bash runner/run/dryrun/shim/build.sh $VENV
$VENV/bin/python -c "import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda, '| rehearsal venv ready')"
