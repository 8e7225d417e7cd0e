"""Where the CUDA rehearsal runs (mode=dryrun dryrun.device=cuda), torch-free: .venv-cuda's interpreter, the shim
`scripts/setup.sh --cuda-rehearsal` built into it, and the process started there with the shim preloaded
(runner.run.dryrun.cuda_rehearse). runner.modes calls `launch` from any environment; a machine that cannot run the
rehearsal gets a ConfigError (exit 2) naming the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SHIM = "libfake_c10_cuda.so"


def shim_dir(prefix: str | os.PathLike = sys.prefix) -> Path:
    """Where scripts/setup.sh --cuda-rehearsal built the shim: inside the venv."""
    return Path(prefix) / "fake_cuda"


def gpu_visible() -> bool:
    """A GPU is visible: the rehearsal refuses to fake one over a real one."""
    return Path("/dev/nvidiactl").exists() or Path("/dev/nvidia0").exists()


def unavailable(python: str) -> str | None:
    """Why `python` cannot run the rehearsal (None: it can): not a CUDA build of torch, no shim, or a visible GPU."""
    if gpu_visible():
        return "a GPU is visible here: run mode=dryrun dryrun.device=cuda on a machine without one (a login node), or mode=train"
    probe = "import torch, sys; sys.exit(0 if torch.version.cuda else 3)"
    try:
        rc = subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python} does not start ({e})"
    if rc != 0:
        return f"torch under {python} is not a CUDA build"
    lib = shim_dir(Path(python).parent.parent) / SHIM
    if not lib.exists():
        return f"the shim {lib} is not built"
    return None


def environment(python: str, capability: str, memory_gb: float, name: str) -> dict[str, str]:
    """The environment of a rehearsal process under `python`: the shim preloaded, the libcuda.so.1 stand-in first on
    the library path, the rehearsed GPU's properties for the shim."""
    d = shim_dir(Path(python).parent.parent)
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(x for x in (str(d / SHIM), env.get("LD_PRELOAD", "")) if x)
    env["LD_LIBRARY_PATH"] = ":".join(x for x in (str(d / "libcuda"), env.get("LD_LIBRARY_PATH", "")) if x)
    env |= {"FAKE_CUDA_CAPABILITY": capability, "FAKE_CUDA_MEMORY_GB": str(memory_gb), "FAKE_CUDA_NAME": name}
    env["CUDA_VISIBLE_DEVICES"] = ""  # nothing real to find, whatever the shim says
    return env


def shim_loaded() -> bool:
    return SHIM in os.environ.get("LD_PRELOAD", "")


def find_python(root: Path) -> str | None:
    """The rehearsal's interpreter: .venv-cuda/bin/python of the repository, or this one when it is a CUDA build."""
    cand = root / ".venv-cuda" / "bin" / "python"
    if cand.exists():
        return str(cand)
    return None


def setup_command() -> str:
    return "bash scripts/setup.sh --cuda-rehearsal"


def gpu(cluster: Any) -> dict[str, Any]:
    """The rehearsed GPU, from the cluster config."""
    cap = cluster.compute_capability or "9.0"
    return {
        "capability": cap,
        "memory_gb": cluster.device_memory_gb or 80.0,
        "name": f"{cluster.name} GPU sm{cap} (fake)",
        "devices_per_node": cluster.devices_per_node,
    }


def launch(jobs: list[dict[str, Any]], root: Path, work: Path) -> list[dict[str, Any]]:
    """Run the rehearsal jobs ({"frozen", "ranks", "run_dir", "gpu"}) in one process under .venv-cuda's interpreter
    with the shim preloaded; their results in order. ConfigError (exit 2) where the rehearsal cannot run here."""
    from runner.schema.problems import ConfigError, Problem

    python = find_python(root)
    why = unavailable(python) if python else f"no {root / '.venv-cuda'}"
    if why:
        raise ConfigError(
            [
                Problem(
                    "dryrun.device",
                    "cuda",
                    f"the CUDA rehearsal needs a CUDA build of torch, its shim and no visible GPU: {why}",
                    f"run `{setup_command()}` once (about 2.7 GB of download, several GB on disk); python -m runner then runs the "
                    "rehearsal under .venv-cuda/bin/python by itself",
                )
            ]
        )
    work.mkdir(parents=True, exist_ok=True)
    for i, job in enumerate(jobs):
        job["out"] = str(work / f"cuda_rehearsal_{i}.json")
    path = work / "cuda_rehearsal_jobs.json"
    path.write_text(json.dumps(jobs, indent=1))
    env = environment(python, **{k: jobs[0]["gpu"][k] for k in ("capability", "memory_gb", "name")})
    cmd = [python, "-m", "runner.run.dryrun.cuda_rehearse", str(path)]
    rc = subprocess.run(cmd, env=env, cwd=root).returncode
    out = []
    for job in jobs:
        got = Path(job["out"])
        res = json.loads(got.read_text()) if got.exists() else {"error": f"{' '.join(cmd)} exited {rc} without a result"}
        out.append(res)
    return out
