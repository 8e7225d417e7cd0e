"""scripts/setup.sh on a machine whose package index has no CPU build of torch: the fallback index comes from
TORCH_INDEX_URL, never from an address written into the repository. Run against a stand-in .venv/bin/python
that records its arguments (no package is installed)."""

from __future__ import annotations

import re
import shutil
import subprocess

from tests.conftest import ROOT

FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "{calls}"
case "$*" in
  *"torch==2.13.0+cpu"*--extra-index-url*) exit 0 ;;
  *"torch==2.13.0+cpu"*) echo "ERROR: No matching distribution found for torch==2.13.0+cpu" >&2; exit 1 ;;
esac
exit 0
"""


def _setup(tmp_path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    calls, python = tmp_path / "calls.txt", tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON.format(calls=calls))
    python.chmod(0o755)
    path = "/usr/bin:/bin"  # no nvidia-smi: the CPU wheel
    argv = ["bash", str(tmp_path / "scripts" / "setup.sh")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={"PATH": path, **env})
    return proc, calls.read_text().splitlines() if calls.exists() else []


def test_cpu_torch_comes_from_torch_index_url(tmp_path):
    proc, calls = _setup(tmp_path, TORCH_INDEX_URL="https://mirror.example/torch-cpu")
    assert proc.returncode == 0, proc.stderr
    assert calls[:2] == [
        "-m pip install --quiet torch==2.13.0+cpu",
        "-m pip install --quiet torch==2.13.0+cpu --extra-index-url https://mirror.example/torch-cpu",
    ]


def test_without_torch_index_url_it_says_what_to_set(tmp_path):
    proc, calls = _setup(tmp_path)
    assert proc.returncode == 2
    assert "set TORCH_INDEX_URL to an index that has torch's CPU wheels (see the README's Setup)" in proc.stderr
    assert calls == ["-m pip install --quiet torch==2.13.0+cpu"]  # nothing installed from an index the repository chose


def test_setup_script_names_no_package_index():
    assert re.findall(r"https?://\S+", (ROOT / "scripts" / "setup.sh").read_text()) == []
    assert "# TORCH_INDEX_URL: the package index of torch's CPU wheels" in (ROOT / "scripts" / "setup.sh").read_text()


FAKE_CUDA_PYTHON = """#!/bin/sh
case "$*" in
  *"sys.exit"*) [ -e "{built}" ] ;;  # is_cuda_build: a CUDA build once the last torch install ran
  *"importlib.metadata"*) printf '%s\\n' 'nvidia-nccl-cu13==2.29.7; platform_system == "Linux"' 'sympy>=1.13.3' ;;
  *"import torch"*) echo "torch==2.13.0+cu130" ;;
  *"pip install"*)
    echo "$* | PIP_CONFIG_FILE=$PIP_CONFIG_FILE" >> "{calls}"
    case "$*" in
      *sympy*) [ -z "{fail}" ] || {{ echo "ERROR: No matching distribution found for sympy>=1.13.3" >&2; exit 1; }} ;;
      *"--no-cache-dir torch==2.13.0") touch "{built}" ;;
    esac
    case "$*" in *" -e "*) ;; *) echo "torch 2.13.0 requires sympy>=1.13.3, which is not installed." >&2 ;; esac ;;
esac
"""
PYPI = "-m pip install --quiet --progress-bar off --no-cache-dir"


def _setup_cuda(tmp_path, fail: bool) -> tuple[subprocess.CompletedProcess, list[str]]:
    (tmp_path / "scripts").mkdir()
    for name in ("setup.sh", "setup_cuda_rehearsal.sh"):
        shutil.copy(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    shim = tmp_path / "runner" / "run" / "dryrun" / "shim" / "build.sh"
    shim.parent.mkdir(parents=True)
    shim.write_text("echo shim built\n")
    calls, python = tmp_path / "calls.txt", tmp_path / ".venv-cuda" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_CUDA_PYTHON.format(calls=calls, built=tmp_path / "built", fail="1" if fail else ""))
    python.chmod(0o755)
    argv = ["bash", str(tmp_path / "scripts" / "setup.sh"), "--cuda-rehearsal"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    return proc, calls.read_text().splitlines() if calls.exists() else []


def test_cuda_torch_is_installed_a_requirement_at_a_time(tmp_path):
    """One pip call holds all of the CUDA build's downloads beside what it installs (7.3 GB at its peak, 5.7 GB a wheel
    at a time): torch's wheel, each of its requirements, then torch again, which installs nothing more; from PyPI with
    the machine's pip configuration bypassed. The incomplete set's warnings after each call are not shown."""
    proc, calls = _setup_cuda(tmp_path, fail=False)
    assert proc.returncode == 0, proc.stderr
    assert calls[:4] == [
        f"{PYPI} --no-deps torch==2.13.0 | PIP_CONFIG_FILE=/dev/null",
        f'{PYPI} nvidia-nccl-cu13==2.29.7; platform_system == "Linux" | PIP_CONFIG_FILE=/dev/null',
        f"{PYPI} sympy>=1.13.3 | PIP_CONFIG_FILE=/dev/null",
        f"{PYPI} torch==2.13.0 | PIP_CONFIG_FILE=/dev/null",
    ]
    assert proc.stderr.count("which is not installed") == 1  # the last call's, not the three before it


def test_a_failed_cuda_requirement_stops_the_setup_with_pips_words(tmp_path):
    proc, calls = _setup_cuda(tmp_path, fail=True)
    assert proc.returncode != 0
    assert "ERROR: No matching distribution found for sympy>=1.13.3" in proc.stderr
    assert [c.split(" | ")[0] for c in calls] == [
        f"{PYPI} --no-deps torch==2.13.0",
        f'{PYPI} nvidia-nccl-cu13==2.29.7; platform_system == "Linux"',
        f"{PYPI} sympy>=1.13.3",
    ]
