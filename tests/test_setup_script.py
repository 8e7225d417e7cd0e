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
