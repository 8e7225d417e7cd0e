"""Shared helpers: run the CLI in a subprocess, compose configs in-process; the e2e mark's guard."""

from __future__ import annotations

import atexit
import contextlib
import copy
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

# The suite runs as on a fresh machine: HOME (the runner's cluster.peak_cache_dir, ~/.cache/runner, with the CPU
# peaks and the machine profiles `python -m runner.calibrate` stores) is a folder of its own, set before the zygote
# and every launch inherit it. With the user's cache, a cached machine profile puts predictions into every run.
_HOME = tempfile.mkdtemp(prefix="runner-tests-home-")
os.environ["HOME"] = _HOME
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)

from tests import zygote  # noqa: E402
from tests.multiruns import Multirun, multirun_status  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def _starts_no_process(item: pytest.Item):
    """A test without the e2e mark (its fixtures included) may not start a Python process or fork: that is
    what `pytest -m "not e2e"` leaves out. Short tools (git, sbatch's --help) stay allowed."""
    if item.get_closest_marker("e2e"):
        yield
        return
    popen, fork = subprocess.Popen.__init__, os.fork

    def refuse(what: str):
        raise AssertionError(f"{item.nodeid} starts {what}: mark it @pytest.mark.e2e (tests that start processes)")

    def guarded_popen(self, args, *a, **kw):
        argv = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
        head = os.path.basename(str(argv[0]).split()[0]) if argv else ""
        if head.startswith("python") or str(argv[0]) == sys.executable or head in ("torchrun", "srun", "sbatch"):
            refuse(" ".join(map(str, argv[:4])))
        popen(self, args, *a, **kw)

    subprocess.Popen.__init__, os.fork = guarded_popen, lambda: refuse("a forked process")
    zygote.REFUSE.append(refuse)  # run_cli's commands are forked by the zygote, out of the patches' sight
    try:
        yield
    finally:
        subprocess.Popen.__init__, os.fork = popen, fork
        zygote.REFUSE.remove(refuse)


def pytest_collection_modifyitems(config, items):
    """The CUDA tier (tests/test_cuda_rehearsal.py) runs in .venv-cuda, by `pytest -m cuda_rehearsal` only: any other
    selection leaves it out, so the main suite neither runs nor skips it."""
    if "cuda_rehearsal" in (config.option.markexpr or ""):
        return
    tier = [i for i in items if i.get_closest_marker("cuda_rehearsal")]
    if tier:
        config.hook.pytest_deselected(items=tier)
        items[:] = [i for i in items if not i.get_closest_marker("cuda_rehearsal")]


def pytest_runtest_teardown(item, nextitem):
    """What a test leaves alive (composed configs cached for the next tests, imported modules, models) goes out of the
    cyclic collector's reach: its full collections walked the session's whole, growing heap again and again, 23 s of
    the 130 s of `pytest -m "not e2e"`, 5 s after (measured with gc.callbacks). The price: cyclic garbage left by a
    test stays until the session ends (0.5 GB more at the peak of `pytest -m "not e2e"`)."""
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    """Hand everything back to the collector, so that the interpreter's shutdown frees it (nanobind counts what is not
    freed as a leak of its bindings, and says so)."""
    gc.unfreeze()
    gc.collect()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _starts_no_process(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _starts_no_process(item):
        yield


def run_cli(
    *args: str, run_dir: Path | None = None, cwd: Path = ROOT, timeout: int = 600, env: dict[str, str] | None = None, while_running=None
) -> subprocess.CompletedProcess:
    """`python -m runner <args>` (from the project root unless `cwd`); `run_dir` pins Hydra's output folder."""
    run_dir_arg = [] if run_dir is None else [f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "WANDB_SILENT": "true"} if env is None else env
    return run_module("runner", *args, *run_dir_arg, cwd=cwd, timeout=timeout, env=env, while_running=while_running)


def run_module(
    module: str, *args: str, cwd: Path = ROOT, timeout: float = 600, env: dict[str, str] | None = None, while_running=None
) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` (environment: this one's unless `env`), captured as subprocess.run(text=True) would. Run by
    a child of the session's zygote (tests/zygote.py), which has a launch's imports done: its own process (group), argv,
    folder, environment and output, without paying the imports again. `while_running(pid, stdout path)` is called once
    it started (to send it a signal, say)."""
    argv = [sys.executable, "-m", module, *map(str, args)]
    for refuse in zygote.REFUSE:
        refuse(" ".join(map(str, argv[:4])))
    return zygote.client().run(argv, cwd, dict(os.environ) if env is None else env, timeout, while_running)


def multirun(points: dict[str, list[str]], common: list[str], sweep: Path) -> Multirun:
    """Train several configurations in one Hydra multirun: one process, so torch and TorchTitan are
    imported once instead of once per launch (~11 s each). Each point is an option of a config group
    `point` in a config folder of its own (Hydra's experiment pattern): `-m +point=a,b,...`.
    Returns each point's run folder, its part of the console and whether it failed (multirun_status)."""
    from runner.config import points as point_files

    folder = sweep.parent / f"{sweep.name}-points"
    names = point_files.write(points, folder, common)
    proc = run_cli("-m", *point_files.argv(names, folder), f"hydra.sweep.dir={sweep}", timeout=1800)  # many points, a slow machine
    return multirun_status(names, sweep, proc)


def dcp_metadata() -> bytes:
    """The `.metadata` DCP writes for an empty state (a pickle of its Metadata): what a fake checkpoint needs for the
    preflight, which opens every checkpoint's metadata (runner.formats.checkpoint.metadata_problem)."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    return pickle.dumps(Metadata(state_dict_metadata={}))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="session")
def compose():
    """compose(overrides) -> typed RunConfig, through the same Hydra search path as the CLI. Each list of overrides
    is composed once per session, its group selections once per set (tests/composing.py: Hydra's composition is most of
    a config test's time), and every call gets its own copy to change. A list that fails to compose raises every time."""
    from tests import composing

    composed = {}

    def _compose(overrides: list[str]):
        key = tuple(overrides)
        if key not in composed:
            composed[key] = composing.compose(list(overrides))
        return copy.deepcopy(composed[key])

    return _compose


@pytest.fixture(scope="session")
def budget(compose):
    """budget(overrides) -> the plan's figures (runner.estimate.plan.compute) of the composed, validated config."""
    from runner.config import validate
    from runner.estimate import plan

    def _budget(overrides: list[str]) -> dict:
        cfg = compose(overrides)
        return plan.compute(cfg, validate.check(cfg))

    return _budget


@pytest.fixture(scope="session")
def refusal(compose):
    """refusal(overrides) -> the message of the ConfigError that validation (runner.config.validate.check) raises on
    the composed config; a config it passes fails the test."""
    from runner.config import validate

    def _refusal(overrides: list[str]) -> str:
        with pytest.raises(validate.ConfigError) as e:
            validate.check(compose(overrides))
        return str(e.value)

    return _refusal


@dataclass
class SlurmCluster:
    """The localhost SLURM cluster of scripts/slurm_local/ (two nodes, n1 and n2)."""

    state: Path
    env: dict[str, str]
    """The environment that reaches it: SLURM_CONF of this cluster, the sacct stand-in on PATH."""

    def run(self, *argv: str, timeout: int = 60) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=self.env, check=True)


SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel")


def _free_port(span: int = 1) -> int:
    """A free TCP port p on 127.0.0.1 with p .. p+span-1 all free."""
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + span < 65536 and all(_port_free(p) for p in range(port, port + span)):
            return port
    raise RuntimeError("no free port range")


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """Start the localhost SLURM cluster once per session and stop it, by the PIDs its start recorded, at the end.
    Without SLURM installed the tests skip (fail under CI=true, where .ci/run installs it)."""
    missing = [t for t in SLURM_TOOLS if shutil.which(t) is None]
    why = f"SLURM tools missing: {', '.join(missing)}" if missing else ("the local SLURM cluster runs as root" if os.getuid() else None)
    if why:
        message = f"{why}. Fix: scripts/setup.sh --with-slurm (as root)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    state = tmp_path_factory.mktemp("slurm")
    scripts = ROOT / "scripts" / "slurm_local"
    ports = {"SLURM_LOCAL_CTLD_PORT": str(_free_port()), "SLURM_LOCAL_NODE_PORT0": str(_free_port(3))}
    start = subprocess.run([str(scripts / "start.sh"), str(state)], capture_output=True, text=True, timeout=120, env=os.environ | ports)
    assert start.returncode == 0, start.stdout + start.stderr
    env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf"), "PATH": f"{scripts / 'bin'}:{os.environ['PATH']}", "WANDB_SILENT": "true"}
    try:
        yield SlurmCluster(state, env)
    finally:
        stop = subprocess.run([str(scripts / "stop.sh"), str(state)], capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop.stdout + stop.stderr


@pytest.fixture(scope="session")
def text_files(tmp_path_factory) -> tuple[Path, Path]:
    """The corpus and tokenizer of tests/text_assets.py that test_checkpoint and its shared runs read."""
    from tests import text_assets

    return text_assets.make(tmp_path_factory.mktemp("assets"))


@pytest.fixture(scope="session")
def token_folders(tmp_path_factory) -> SimpleNamespace:
    """The prepared token folders (tests/text_assets.py's token_folders) that test_tokens and its shared runs read."""
    from tests import text_assets

    return text_assets.token_folders(tmp_path_factory.mktemp("tokens"))


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory) -> dict[str, Path]:
    """Each tiny transformers model of tests/hf_models.py saved (save_pretrained) into a folder of its own: the Hugging
    Face parity points start from them. {name: its folder}."""
    from tests import hf_models

    folder = tmp_path_factory.mktemp("hf_models")
    return {name: hf_models.save(name, folder / name) for name in hf_models.TINY}


@pytest.fixture(scope="session")
def titan_text(tmp_path_factory, hf_folders) -> tuple[Path, Path]:
    """(a copy of the llama3 folder with a word-level tokenizer naming BOS and EOS, a jsonl of documents of varied length):
    the real-data point both the runner and TorchTitan's Trainer train (bench/runner_vs_titan.text_assets)."""
    from bench.runner_vs_titan import text_assets

    folder = tmp_path_factory.mktemp("titan_text")
    hf = Path(shutil.copytree(hf_folders["llama3"], folder / "hf"))
    return hf, text_assets(folder, hf, num_docs=40)


@pytest.fixture(scope="session")
def hf_round_trip(tmp_path_factory) -> dict[str, Path]:
    """The checkpoint folder each HF_ROUND_TRIP parity point (tests/points.py) saves into. {point: its folder}."""
    from tests import points

    folder = tmp_path_factory.mktemp("hf_round_trip")
    return {name: folder / name for name in points.HF_ROUND_TRIP}


@pytest.fixture(scope="session")
def parity(compose, tmp_path_factory, hf_folders, hf_round_trip, titan_text) -> tuple[dict[str, dict], dict[int, str]]:
    """The parity points of tests/points.py (test_parallel's, test_family_train's, test_titan's, the Hugging Face
    tests' and test_runner_vs_titan's), each with its section's common overrides, in one launch per rank count: a
    launch imports torch and TorchTitan and starts a process group (~10 s), so the modules share theirs.
    (parity_runs, parity_consoles)."""
    from tests import points

    launches = points.parity_launches(hf_folders, tmp_path_factory.mktemp("hf_ckpt") / "ckpt", hf_round_trip, titan_text)
    return parity_launches(compose, launches, [], lambda nproc: tmp_path_factory.mktemp(f"parity{nproc}"))


@pytest.fixture(scope="session")
def parity_runs(parity) -> dict[str, dict]:
    """Each parity point's layout_parity.json by name, with its run folder as "run_dir"."""
    return parity[0]


@pytest.fixture(scope="session")
def parity_consoles(parity) -> dict[int, str]:
    """The console (stdout) of each rank count's parity launch."""
    return parity[1]


@pytest.fixture(scope="session")
def shared_runs(request, tmp_path_factory) -> Multirun:
    """The training points (tests/points.py) of test_train, test_checkpoint, test_local_checkpoint, test_tokens and
    test_slurm, of those this session runs tests of, in one Hydra multirun: each launch imports torch and TorchTitan
    (~11 s), so the modules share one. Points run in that module order, each module's in its own order (a point may
    resume from an earlier one's checkpoint); names are unique. A point that failed fails only the tests that read it (point)."""
    from tests import points

    found = {item.module.__name__.rsplit(".", 1)[-1] for item in request.session.items if getattr(item, "module", None)}
    chosen: dict[str, list[str]] = {}
    if "test_train" in found:
        chosen |= points.TRAIN
    if "test_checkpoint" in found:
        chosen |= points.checkpoint(request.getfixturevalue("text_files"))
    if "test_local_checkpoint" in found:
        chosen |= points.checkpoint(request.getfixturevalue("text_files")) | points.local_tier(request.getfixturevalue("text_files"))
    if "test_tokens" in found:
        folders = request.getfixturevalue("token_folders")
        chosen |= points.tokens(folders.a, folders.b, tmp_path_factory.mktemp("tok_ckpt") / "ckpt")
    if "test_slurm" in found:
        chosen |= points.SLURM
    return multirun(chosen, [], tmp_path_factory.mktemp("runs") / "2026-11-29" / "sweep")


@pytest.fixture(scope="session")
def dry_runs(tmp_path_factory) -> Multirun:
    """The mode=dryrun points (DRYRUNS of tests/points.py) of test_dryrun and test_plan_memory in one Hydra multirun:
    a dry run imports torch and TorchTitan (~10 s), then forks its simulated ranks, so the points share one process."""
    from tests import points

    return multirun(points.DRYRUNS, ["mode=dryrun"], tmp_path_factory.mktemp("dryruns") / "sweep")


def parity_launches(
    compose, launches: dict[int, dict[str, list[str]]], common: list[str], folder
) -> tuple[dict[str, dict], dict[int, str]]:
    """Train each launch's points one after another in one `python -m runner.parity <nproc>` process group (validated
    first) and return every point's layout_parity.json by name, with its run folder as "run_dir", and each launch's
    console (stdout) by rank count; `folder(nproc)` gives a fresh folder per launch."""
    from runner.config import validate
    from runner.formats import runfiles
    from runner.run import layout_parity

    out, consoles = {}, {}
    for nproc, points in launches.items():
        cfgs = {name: compose([*common, *overrides]) for name, overrides in points.items()}
        for cfg in cfgs.values():
            validate.check(cfg)
        paths = layout_parity.prepare(cfgs, folder(nproc))
        proc = run_module("runner.parity", str(nproc), *paths, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        consoles[nproc] = proc.stdout
        for name, path in zip(points, paths, strict=True):
            out[name] = json.loads((path.parent / runfiles.PARITY).read_text()) | {"run_dir": path.parent}
    return out, consoles
