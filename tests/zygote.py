"""A warm `python -m runner` for the tests (tests/conftest.py's run_cli and run_module): this process imports what a
launch imports (Hydra, the config layer, torch, TorchTitan, the rank code) once, then forks one child per command it
is sent, and the child runs the command's module (`runner`, `runner.parity`, ...) as `python -m` would, with the
command's argv, folder, environment and output files. A launch pays its ~10 s of imports once per test session
instead of once per command. Nothing here runs a tensor op before forking, so no child inherits an OpenMP pool
(runner.run.titan.preload's rule).

    python -m tests.zygote <fd>    # requests: one JSON line each on stdin; answers: JSON lines on <fd>
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
REFUSE: list = []
"""conftest's guard while a test without the e2e mark runs: the zygote's children are out of its patches' sight.
(Here, not in conftest: pytest imports conftest.py as `conftest`, the tests as `tests.conftest`; this module once.)"""


def _exit_code(code: object) -> int:
    """The exit status Python gives SystemExit(code)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _child(req: dict, answers: int) -> None:
    """`python -m <module> <args>` in this forked process, a process group of its own with its ranks (a signal to the
    group is Ctrl-C in a terminal); never returns."""
    os.setsid()
    os.close(answers)  # the zygote's channel is not the command's (nor its ranks')
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], WRITE), (2, req["stderr"], WRITE)):
        f = os.open(path, flags, 0o644)
        os.dup2(f, fd)  # the same sys.stdout and sys.stderr objects (and any a module keeps) now write there
        os.close(f)
    sys.argv = ["-m", *req["args"]]  # runpy puts the module's file in argv[0], as `python -m` does
    try:
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
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
    import runner.cli  # noqa: F401  Hydra, OmegaConf, the config layer
    import runner.run.node_launch  # noqa: F401  torch and the launcher
    import runner.run.per_rank  # noqa: F401  TorchTitan and the rank code

    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()  # nothing of this process's buffers may reach the child's files
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req, answers)
        os.write(answers, (json.dumps({"pid": pid}) + "\n").encode())
        _, status = os.waitpid(pid, 0)
        os.write(answers, (json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n").encode())
    os._exit(0)  # the session ended: skip the interpreter's teardown of torch (seconds)


class Client:
    """`python -m tests.zygote`, started at the first command of the session and ended with it (the tests' side)."""

    def __init__(self) -> None:
        import atexit
        import tempfile

        self.folder = Path(tempfile.mkdtemp(prefix="zygote-"))
        read, write = os.pipe()
        log = open(self.folder / "zygote.log", "w")  # noqa: SIM115 - kept open for the process's life
        env = {**os.environ, "WANDB_SILENT": "true"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", str(write)], cwd=ROOT, stdin=subprocess.PIPE, stdout=log, stderr=log,
            pass_fds=(write,), env=env, text=True,
        )  # fmt: skip
        os.close(write)
        self.answers, self.pending, self.count = read, b"", 0
        atexit.register(self.close)

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float, while_running=None) -> subprocess.CompletedProcess:
        """`while_running(pid, stdout path)`, if given, is called once the command started (to signal it, say)."""
        import time

        self.count += 1
        out, err = self.folder / f"{self.count}.out", self.folder / f"{self.count}.err"
        req = {"module": argv[2], "args": argv[3:], "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        pid = self._answer(deadline + 60)["pid"]
        if while_running is not None:
            while_running(pid, out)
        try:
            code = self._answer(deadline)["returncode"]
        except TimeoutError:
            os.kill(pid, 9)
            self._answer(time.monotonic() + 60)
            raise subprocess.TimeoutExpired(argv, timeout, out.read_bytes(), err.read_bytes()) from None
        return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())

    def _answer(self, deadline: float) -> dict:
        import select
        import time

        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.answers], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(self.answers, 4096)
            assert chunk, f"the zygote ended: {(self.folder / 'zygote.log').read_text()[-3000:]}"
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_CLIENT: list[Client] = []


def client() -> Client:
    if not _CLIENT or _CLIENT[0].proc.poll() is not None:
        _CLIENT[:] = [Client()]
    return _CLIENT[0]


if __name__ == "__main__":
    main(int(sys.argv[1]))
