"""A warm `python -m runner` for the tests (tests/conftest.py's run_cli): this process imports what a launch imports
(Hydra, the config layer, torch, TorchTitan, the rank code) once, then forks one child per command it is sent, and
the child runs runner/__main__.py as `python -m runner` would, with the command's argv, folder, environment and
output files. A launch pays its ~10 s of imports once per test session instead of once per command. Nothing here
runs a tensor op before forking, so no child inherits an OpenMP pool (runner.run.titan.preload's rule).

    python -m tests.zygote <fd>    # requests: one JSON line each on stdin; answers: JSON lines on <fd>
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import traceback

import runner.cli  # noqa: F401  Hydra, OmegaConf, the config layer
import runner.run.launch  # noqa: F401  torch and the launcher
import runner.run.worker  # noqa: F401  TorchTitan and the rank code

WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


def _exit_code(code: object) -> int:
    """The exit status Python gives SystemExit(code)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _child(req: dict) -> None:
    """`python -m runner <args>` in this forked process; never returns."""
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], WRITE), (2, req["stderr"], WRITE)):
        f = os.open(path, flags, 0o644)
        os.dup2(f, fd)  # the same sys.stdout and sys.stderr objects (and any a module keeps) now write there
        os.close(f)
    sys.argv = ["-m", *req["args"]]  # runpy puts runner/__main__.py in argv[0], as `python -m` does
    try:
        runpy.run_module("runner", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:  # noqa: BLE001 - printed as Python would, exit status 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(answers: int) -> None:
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()  # nothing of this process's buffers may reach the child's files
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        os.write(answers, (json.dumps({"pid": pid}) + "\n").encode())
        _, status = os.waitpid(pid, 0)
        os.write(answers, (json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n").encode())


if __name__ == "__main__":
    main(int(sys.argv[1]))
