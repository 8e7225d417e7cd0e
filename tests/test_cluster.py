"""Multi-node launch, torch-free parts: the SLURM submission (through Hydra's submitit
launcher) printed by mode=launch_plan, its validation, and the TP placement rule."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from runner.run import mesh
from runner.schema import layout
from tests.conftest import ROOT, run_cli, run_module

SLURM = ["cluster=slurm_h100", "cluster.slurm.partition=gpu", "precision=bf16"]  # a GPU cluster refuses the CPU default fp32
FIRST_NODE = "$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)"


def _no_traceback_exit2(proc):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.e2e
def test_launch_plan_two_nodes_prints_sbatch_and_node_command(tmp_path):
    run_dir, sweep = tmp_path / "plan", tmp_path / "sweep"
    image = "nvcr.io/nvidia/pytorch:25.01-py3"
    extra = ["cluster.num_nodes=2", "cluster.slurm.account=llm", f"cluster.slurm.container_image={image}", "cluster.slurm.constraint=h100"]
    args = [*SLURM, *extra, "parallelism=fsdp", "training.global_batch_size=32", "mode=launch_plan", f"hydra.sweep.dir={sweep}"]
    proc = run_cli(*args, run_dir=run_dir)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    job = sweep / "0"  # what `-m` would submit: job 0 of the sweep folder, submitit's files beside it
    assert f"submitted with -m, this command runs as job 0 in {job}; the paths below are that job's" in out
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=llm",
        "#SBATCH --constraint=h100",
        "#SBATCH --exclusive",
        "#SBATCH --time=240",
        "#SBATCH --job-name=runner",
        "#SBATCH --requeue",
        f"#SBATCH --container-image={image}",
    ):
        assert line in out, line
    assert not any(ln.startswith("#SBATCH --mem") or ln.startswith("#SBATCH --cpus-per-task") for ln in out)  # unset stays unset
    assert f"#SBATCH --output={sweep}/.submitit/%j/%j_0_log.out" in out
    assert any(ln.startswith("srun --unbuffered") and f"-m submitit.core._submit {sweep}/.submitit/%j" in ln for ln in out)
    (node,) = [ln.strip() for ln in out if "runner.launch" in ln]
    assert node == (
        f"python -m runner.launch --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint={FIRST_NODE}:29500 "
        f"--rdzv-id=$SLURM_JOB_ID --max-restarts=3 --monitor-interval=0.5 --shutdown-timeout=30 --log-dir={job / 'logs'} "
        f"--redirects=1:3,2:3,3:3,4:3,5:3,6:3,7:3 {job / 'frozen.yaml'}"
    )
    frozen = yaml.safe_load((run_dir / "frozen.yaml").read_text())
    assert frozen["cluster"]["launcher"] == "slurm" and frozen["cluster"]["num_nodes"] == 2 and frozen["mode"] == "launch_plan"
    assert frozen["provenance"]["world_size"] == 16


@pytest.mark.e2e
def test_launch_plan_128_nodes_for_the_worked_example(tmp_path):
    proc = run_cli("recipe=llama3_70b_h100x1024", *SLURM, "cluster.num_nodes=128", "mode=launch_plan", run_dir=tmp_path / "p")
    assert proc.returncode == 0, proc.stderr
    assert "launch plan: 1024 ranks = 128 nodes x 8 per node [pp=4 x dp_shard=32 x tp=8]" in proc.stdout
    assert "#SBATCH --nodes=128" in proc.stdout.splitlines()
    assert "python -m runner.launch --nnodes=128 --nproc-per-node=8 --rdzv-backend=c10d" in proc.stdout


def _fake_slurm(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """sbatch and srun on PATH that only record that they were called."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    for tool in ("sbatch", "srun"):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\nexit 1\n')
        (bin_dir / tool).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, calls


@pytest.mark.e2e
def test_launch_plan_under_multirun_prints_the_one_array_job_and_submits_nothing(tmp_path):
    env, calls = _fake_slurm(tmp_path)
    sweep = tmp_path / "my sweep"  # a space: submitit quotes the folder, so must the preview
    args = [*SLURM, "cluster.num_nodes=2", "parallelism=fsdp", "training.global_batch_size=32,64", "mode=launch_plan"]
    argv = [sys.executable, "-m", "runner", "-m", *args, f"hydra.sweep.dir={sweep}"]
    proc = run_module("runner", *argv[3:], env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert not calls.exists(), calls.read_text()
    out = proc.stdout.splitlines()
    assert proc.stdout.count("#!/bin/bash") == 1  # submitit submits the sweep as one array job
    assert "#SBATCH --array=0-1%2" in out and "#SBATCH --requeue" in out
    assert f"#SBATCH --output='{sweep}/.submitit/%A_%a/%A_%a_0_log.out'" in out
    (srun,) = [shlex.split(ln) for ln in out if ln.startswith("srun ")]
    assert srun[-1] == f"{sweep}/.submitit/%j"
    assert out[out.index("array tasks ($SLURM_ARRAY_TASK_ID: the sweep point it runs):") + 1 :][:2] == [
        "  0: job 0: training.global_batch_size=32",
        "  1: job 1: training.global_batch_size=64",
    ]
    for num in (0, 1):  # each point prints its own job's paths, all in the one sweep folder
        assert shlex.quote(f"--log-dir={sweep / str(num) / 'logs'}") + " " in proc.stdout
        assert (sweep / str(num) / "frozen.yaml").is_file()
    assert not (sweep / ".submitit").exists()


@pytest.mark.e2e
def test_slurm_sweep_mixing_previews_and_submissions_is_refused(tmp_path):
    env, calls = _fake_slurm(tmp_path)
    sweep = f"hydra.sweep.dir={tmp_path / 's'}"
    argv = [sys.executable, "-m", "runner", "-m", *SLURM, "cluster.num_nodes=2", "mode=launch_plan,train", sweep]
    proc = run_module("runner", *argv[3:], env=env, timeout=120)
    _no_traceback_exit2(proc)
    assert "mixes mode=launch_plan previews with points to submit" in proc.stderr
    assert not calls.exists() and not (tmp_path / "s").exists()


@pytest.mark.e2e
def test_slurm_config_missing_fields_is_rejected(tmp_path):
    proc = run_cli("cluster=slurm_h100", "mode=launch_plan", run_dir=tmp_path / "p")
    _no_traceback_exit2(proc)
    assert "cluster.num_nodes = None: cluster slurm_h100 leaves the node count to the job. Fix: set cluster.num_nodes=N." in proc.stderr
    assert "cluster.slurm.partition = None: SLURM needs a partition to submit to. Fix: set cluster.slurm.partition=<name>." in proc.stderr
    assert not (tmp_path / "p").exists()
    proc = run_cli(*SLURM, "cluster.num_nodes=2", "cluster.devices_per_node=16", "mode=launch_plan", run_dir=tmp_path / "q")
    _no_traceback_exit2(proc)
    assert "cluster.devices_per_node = 16: a node of partition gpu has 8 GPUs (cluster.slurm.gpus_per_node_max)" in proc.stderr


def _path_without_slurm(tmp_path: Path) -> str:
    """A PATH with this interpreter's folder and the basic tools only, so that no sbatch the machine has is found."""
    bin_dir = tmp_path / "nobin"
    bin_dir.mkdir()
    for tool in ("sh", "env", "uname"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    return f"{Path(sys.executable).parent}:{bin_dir}"


@pytest.mark.e2e
def test_submission_without_sbatch_says_so(tmp_path):
    sweep = tmp_path / "sweep"
    argv = [sys.executable, "-m", "runner", "-m", *SLURM, "cluster.num_nodes=2", "parallelism=fsdp", "training.global_batch_size=32"]
    env = {**os.environ, "PATH": _path_without_slurm(tmp_path)}
    proc = run_module("runner", *argv[3:], f"hydra.sweep.dir={sweep}", env=env, timeout=120)
    _no_traceback_exit2(proc)
    assert "hydra.launcher = submitit_slurm: sbatch and srun not found on this machine" in proc.stderr
    assert "add mode=launch_plan to print the sbatch script" in proc.stderr
    assert not sweep.exists()


@pytest.mark.e2e
def test_scheduler_refusing_the_submission_is_reported_as_such(tmp_path):
    """sbatch exists but no controller answers: its command, its message, exit 3, no traceback, no sweep folder."""
    bin_dir, sweep = tmp_path / "bin", tmp_path / "sweep"
    bin_dir.mkdir()
    said = "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)"
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho "{said}" >&2\nexit 1\n')
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    for tool in ("sbatch", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    argv = [sys.executable, "-m", "runner", "-m", *SLURM, "cluster.num_nodes=2", "parallelism=fsdp", "training.global_batch_size=32"]
    proc = run_module("runner", *argv[3:], f"hydra.sweep.dir={sweep}", env=env, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr and "Fix the override" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("scheduler error: ")]
    assert line.startswith(f"scheduler error: `sbatch {sweep}/.submitit/.submission_file_")
    assert line.endswith(f"` exited with status 1: {said}")
    assert "Nothing was submitted. Fix: check that the SLURM controller answers" in proc.stderr
    assert not sweep.exists()


@pytest.mark.e2e
def test_starting_a_cluster_run_here_points_to_the_right_command(tmp_path):
    proc = run_cli(*SLURM, "cluster.num_nodes=2", "parallelism=fsdp", "training.global_batch_size=32", run_dir=tmp_path / "a")
    _no_traceback_exit2(proc)
    assert "cluster.launcher = slurm: a SLURM cluster is submitted, not started on this machine. Fix: add -m" in proc.stderr
    proc = run_cli("cluster.num_nodes=2", "cluster.devices_per_node=2", run_dir=tmp_path / "b")
    _no_traceback_exit2(proc)
    assert "cluster.num_nodes = 2: `python -m runner` starts the ranks of one node" in proc.stderr
    assert "use mode=launch_plan" in proc.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _launcher(cluster: list[str], sweep: Path) -> dict:
    """hydra.launcher of `python -m runner -m <cluster> hydra.sweep.dir=<sweep>`, resolved as Hydra's submitit launcher receives it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from runner.config import compose as runner_compose

    runner_compose.register()
    with initialize_config_dir(version_base="1.3", config_dir=str(runner_compose.CONF)):
        cfg = compose("config", [*cluster, f"hydra.sweep.dir={sweep}"], return_hydra_config=True)
    return OmegaConf.to_container(cfg.hydra.launcher, resolve=True)


def _submitits_file(launcher: dict, num_jobs: int, monkeypatch) -> str:
    """The sbatch file submitit itself writes for these parameters, as hydra-submitit-launcher's launch() and
    submitit's map_array (one array job for several points) set its executor up; no srun needed."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf
    from submitit.slurm import slurm as submitit_slurm

    monkeypatch.setattr(submitit_slurm.SlurmExecutor, "affinity", classmethod(lambda cls: 2))  # "srun is here"
    params = {k: v for k, v in launcher.items() if k != "_target_"}
    auto = submitit.AutoExecutor(cluster="slurm", folder=params.pop("submitit_folder"), slurm_max_num_timeout=params.pop("max_num_timeout"))
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    auto.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    executor = auto._executor
    if num_jobs > 1:
        executor.parameters["map_count"] = num_jobs
    return executor._make_submission_file_text(executor._submitit_command_str, "uid")


@pytest.mark.parametrize("cluster", [[*SLURM, "cluster.num_nodes=2"], ["cluster=slurm_local"]], ids=["slurm_h100", "slurm_local"])
@pytest.mark.parametrize("num_jobs", [1, 3])
def test_preview_is_submitits_own_sbatch_file_for_a_sweep_folder_with_a_space(tmp_path, monkeypatch, cluster, num_jobs):
    from runner.config import slurm

    sweep = tmp_path / "my sweep"
    launcher = _launcher(cluster, sweep)
    script = slurm.sbatch_script(launcher, num_jobs)
    assert script == _submitits_file(launcher, num_jobs, monkeypatch)
    lines = script.splitlines()
    (srun,) = [shlex.split(ln) for ln in lines if ln.startswith("srun ")]
    assert srun[-4:] == ["-u", "-m", "submitit.core._submit", f"{sweep}/.submitit/%j"]  # one argument, space and all
    assert "#SBATCH --requeue" in lines  # requeue after preemption whatever the site's JobRequeue
    assert ("#SBATCH --array=0-2%3" in lines) == (num_jobs == 3)


def test_array_preview_lists_each_task_by_what_sets_its_point_apart(tmp_path):
    from runner.config import slurm

    jobs = [["cluster=slurm_local", f"training.global_batch_size={b}", "mode=launch_plan"] for b in (8, 16)]
    text = slurm.array_preview(_launcher(["cluster=slurm_local"], tmp_path), jobs, 0).splitlines()
    assert text[0] == (
        "sbatch script (what hydra-submitit-launcher submits for `python -m runner -m ...`: one array job of 2 tasks, "
        "one per sweep point; nothing is submitted):"
    )
    assert "#SBATCH --array=0-1%2" in text
    assert text[-3:] == [
        "array tasks ($SLURM_ARRAY_TASK_ID: the sweep point it runs):",
        "  0: job 0: training.global_batch_size=8",
        "  1: job 1: training.global_batch_size=16",
    ]


def test_tp_groups_must_not_span_nodes():
    lay = layout.Layout(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=2)
    assert mesh.tp_groups(lay) == [[0, 1], [2, 3]]
    block = [("node0", 0), ("node0", 1), ("node1", 0), ("node1", 1)]
    assert mesh.split_tp_groups(lay, block) == []
    round_robin = [("node0", 0), ("node1", 0), ("node0", 1), ("node1", 1)]
    assert mesh.split_tp_groups(lay, round_robin) == [
        "TP group [0, 1] spans 2 nodes: rank 0 on node0 (local rank 0), rank 1 on node1 (local rank 0)",
        "TP group [2, 3] spans 2 nodes: rank 2 on node0 (local rank 1), rank 3 on node1 (local rank 1)",
    ]


@pytest.mark.parametrize("names,expected", [("a,b,c,d", "c"), ("", None)])
def test_node_identity_override(monkeypatch, names, expected):
    monkeypatch.setenv(mesh.NODE_NAMES_ENV, names)
    monkeypatch.setenv(mesh.NODE_NAME_ENV, "solo")
    assert mesh.node_name(2) == (expected or "solo")


@pytest.mark.e2e
def test_the_node_command_runs_the_same_preflight(tmp_path):
    """`python -m runner.launch` (what mode=launch_plan prints for each node) refuses what `python -m runner` refuses."""
    huge = "cluster.rank_overhead_gb=1000000"  # no machine holds 4 ranks of a million GB
    direct = run_cli(huge, run_dir=tmp_path / "direct")
    _no_traceback_exit2(direct)
    assert "4 ranks x 1000000." in direct.stderr
    run_dir = tmp_path / "plan"
    proc = run_cli(huge, "mode=launch_plan", run_dir=run_dir)
    assert proc.returncode == 0, proc.stderr
    (node,) = [ln.split() for ln in proc.stdout.splitlines() if "runner.launch" in ln]
    assert node[1] == "-m"
    launched = run_module(node[2], *node[3:], timeout=120)
    _no_traceback_exit2(launched)
    assert "4 ranks x 1000000." in launched.stderr
    assert not (run_dir / "logs").exists()  # no rank was started


def test_cluster_table_is_generated_from_every_cluster_file():
    """scripts/gen_clusters.py renders the cluster table from conf/cluster/, and docs/clusters.md carries it
    (regenerate: python scripts/gen_clusters.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_clusters", ROOT / "scripts" / "gen_clusters.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = gen.table()
    assert gen.doc_text(text) == gen.DOC.read_text(), "run .venv/bin/python scripts/gen_clusters.py"
    options = [ln.split("|")[1].strip().strip("`") for ln in text.splitlines()[2:]]
    assert options == sorted(p.stem for p in (ROOT / "conf" / "cluster").glob("*.yaml"))  # a100_node, h100_96gb_node, slurm_local too
    (local,) = [ln for ln in text.splitlines() if ln.startswith("| `slurm_local` |")]
    assert "| 2 x 2 | cpu (gloo) | measured at start-up | the machine's RAM | SLURM: `python -m runner -m` submits it |" in local


@pytest.mark.parametrize("recipe", ["llama3_70b_h100x1024", "gpt_oss_120b_h100x64"])
def test_preflight_starts_pipeline_recipes_on_cuda(compose, monkeypatch, recipe):
    """The pipeline step passes FlexAttention's block masks (runner.run.titan.step.batch_masks), so a node with an
    NVIDIA driver starts the PP recipes: no launch-time rule refuses them any more."""
    from runner.config import validate
    from runner.config.validate import host_rules as launch_rules
    from runner.schema.problems import ConfigError

    cfg = compose([f"recipe={recipe}"])
    lay = validate.check(cfg)
    assert lay.pp > 1
    real = os.path.exists
    monkeypatch.setattr(launch_rules.os.path, "exists", lambda path: path == "/proc/driver/nvidia/version" or real(path))
    out = []
    launch_rules.this_machine(cfg, lay, True, out)
    assert out == []
    cfg.eval.cpu_flex_attention = True  # the test-only switch of runner.run.layout_parity is refused in a launch
    launch_rules.this_machine(cfg, lay, True, out)
    assert [(p.field, p.value) for p in out] == [("eval.cpu_flex_attention", True)]
    with pytest.raises(ConfigError, match="eval.cpu_flex_attention"):
        validate.preflight(cfg, Path("/nonexistent-run"), lay, node=True)
