"""Hydra's basic sweeper, composing each point of a sweep once instead of twice, and never
submitting a SLURM preview.

Select it with `hydra/sweeper=runner` (conf/config.yaml does). Hydra finds plugins only in the
`hydra_plugins` namespace package, hence this folder beside `runner/`.
"""

import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# private_api: hydra_basic_launcher, hydra_basic_sweeper, hydra_basic_sweeper_conf
from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper, BasicSweeperConf
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser

from runner.config import slurm


class RunnerSweeper(BasicSweeper):
    """BasicSweeper composes every point of a batch up front, so that a bad override fails the
    sweep before any job runs, and the launcher then composes each point again to run it: two
    compositions per point, about 60 % of the time of a plan sweep. Composition can only fail
    on one override's own value (unknown option, key or type); a bad combination of values is
    the runner's validation, which records the point as invalid and lets the sweep go on. So
    composing one point per new override value keeps the early failure at a fraction of the cost.

    Hydra's submitit launcher submits in its `launch()`, before the task function (and so before
    `mode=launch_plan`) is seen. With that launcher the sweeper reads each point's mode first: a
    sweep of previews prints the one array job submitit would submit and runs the points here with
    Hydra's basic launcher (same sweep folder, same job numbers, so the printed paths are those of
    the real submission); a real submission is checked for sbatch/srun before anything is written.
    """

    def setup(self, *, hydra_context, task_function, config) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self._task_function = task_function

    def sweep(self, arguments: list[str]) -> Any:
        if self.config.hydra.launcher.get("_target_") == slurm.SLURM_LAUNCHER:
            self._choose_slurm_launcher(arguments)
            if not isinstance(self.launcher, BasicLauncher):
                return self._submit(arguments)
        return super().sweep(arguments)

    def _submit(self, arguments: list[str]) -> Any:
        """Submit through Hydra's submitit launcher; a scheduler that refuses (sbatch failed) is reported as
        such, with sbatch's own message and exit status 3, and the sweep folder this submission made is removed."""
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        existed = sweep_dir.exists()
        try:
            return super().sweep(arguments)
        except Exception as e:
            error = slurm.scheduler_error(e)
            if error is None:
                raise
            print(error, file=sys.stderr)
            if not existed:
                shutil.rmtree(sweep_dir, ignore_errors=True)
            sys.exit(slurm.SCHEDULER_ERROR_EXIT)

    def _modes(self, arguments: list[str]) -> list[str]:
        """Each point's `mode`, from its composed config (the launcher composes it again to run)."""
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        # private_api: hydra_parse_config
        overrides = parser.parse_overrides([*self._parse_config(), *arguments])
        points = [p for batch in self.split_arguments(overrides, None) for p in batch]
        loader = self.hydra_context.config_loader
        return [loader.load_sweep_config(self.config, list(p)).mode.value for p in points]

    def _choose_slurm_launcher(self, arguments: list[str]) -> None:
        modes = self._modes(arguments)
        previews = sum(m == "launch_plan" for m in modes)
        if previews and previews < len(modes):
            print(
                f"mode = {sorted(set(modes))}: this SLURM sweep mixes mode=launch_plan previews with points to submit. "
                "Fix: preview and submit in two commands (the preview submits nothing).",
                file=sys.stderr,
            )
            sys.exit(2)
        if previews:  # print the array job, then each point's node command here; submit nothing
            launcher = ArrayPreview(self.launcher.params)
            launcher.setup(hydra_context=self.hydra_context, task_function=self._task_function, config=self.config)
            self.launcher = launcher
            return
        problem = slurm.submission_problem()
        if problem:
            print(problem, file=sys.stderr)
            sys.exit(2)

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        seen: set[str] = set()
        sample = []
        for overrides in batch:
            if not seen.issuperset(overrides):
                seen.update(overrides)
                sample.append(overrides)
        super().validate_batch_is_legal(sample)


class ArrayPreview(BasicLauncher):
    """Hydra's basic launcher, printing first what the submitit launcher would submit for each batch of points:
    one array job (submitit's map_array), the same sbatch script for every point."""

    def __init__(self, params: dict[str, Any]) -> None:
        super().__init__()
        self.params = params  # the submitit launcher's, resolved against the sweep's config as it would submit them

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
        print(slurm.array_preview(self.params, [list(o) for o in job_overrides], initial_job_idx), flush=True)
        return super().launch(job_overrides, initial_job_idx)


@dataclass
class RunnerSweeperConf(BasicSweeperConf):
    _target_: str = "hydra_plugins.runner_sweeper.RunnerSweeper"


ConfigStore.instance().store(group="hydra/sweeper", name="runner", node=RunnerSweeperConf, provider="runner")
