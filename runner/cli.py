"""`python -m runner`: compose (Hydra), validate, then run the mode the config names.

Torch-free until the ranks are launched: `--cfg job`, `--help`, `--info` and validation never import
torch. The modes that start no training are runner/modes.py; training a point of a run or sweep, and
recording the points that fail, is runner/sweep.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from runner import modes, sweep
from runner.config import compose, compose_errors, freeze, validate
from runner.run import console, known_warnings
from runner.schema import Mode
from runner.schema.wording import count

compose.register()

MODES = {
    Mode.validate: modes.validate,
    Mode.plan: modes.plan,
    Mode.launch_plan: modes.launch_plan,
    Mode.dryrun: modes.dryrun,
    Mode.search: modes.search,
}
"""The modes that start no training; mode=train launches (runner.sweep.train)."""
FIX_OVERRIDE = "Fix the override or config file named above; `python -m runner --help` lists the groups."


@hydra.main(version_base="1.3", config_path=str(compose.CONF), config_name="config")
def main(dcfg: DictConfig) -> float | None:
    """The Hydra task: returns the config's objective (a float an optimizing sweeper minimizes; +inf for an
    invalid or failed point) where the mode has one."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    sweep.STATE.begin_task(run_dir)
    cfg = None
    try:
        cfg = compose.to_object(dcfg)
        lay = None if cfg.mode == Mode.search else validate.check(cfg)  # search: the configured layout need not fit
        for w in validate.warnings(cfg):
            print(f"WARNING: {w}", file=sys.stderr)
        if cfg.mode in (Mode.validate, Mode.train):  # one preflight: mode=validate refuses what a launch would
            validate.preflight(cfg, run_dir, lay)
        if cfg.optimizer.param_groups and cfg.mode not in (Mode.plan, Mode.search):
            _param_groups(cfg)
        if cfg.mode != Mode.train:  # library lines and warnings as a training run's console shows them
            with console.routed(cfg.logging.verbose), known_warnings.applied():
                return MODES[cfg.mode](cfg, lay, dcfg, run_dir)
    except (validate.ConfigError, OmegaConfBaseException) as e:
        if sweep.multirun():
            return sweep.invalid_point(e, run_dir)
        sweep.fail(str(e) if isinstance(e, validate.ConfigError) else f"Invalid config: {e}", run_dir)
    except KeyboardInterrupt:  # Ctrl-C before a launch (composing, validating, a mode that trains nothing)
        sweep.discard(run_dir)  # as a refusal: nothing half-written left behind
        mode = f"mode={cfg.mode.value} " if cfg is not None else ""
        _interrupted(f"interrupted: {mode}stopped before it finished; nothing was started")
    return sweep.train(cfg, lay, run_dir)


def _interrupted(line: str) -> None:
    """Ctrl-C: one line and exit 130 (as `python -m runner.data prepare` and a training run, runner.run.node_launch)."""
    print(line, file=sys.stderr)
    sys.exit(130)


def _param_groups(cfg) -> None:
    """Each optimizer.param_groups entry must take a parameter under TorchTitan's first-match rule, which needs the
    model's parameter names: built on the meta device (torch; the torch-free modes plan and search leave it out)."""
    import importlib.util

    from runner.config import families

    package = families.FAMILIES[cfg.model.name].kernel_package if cfg.model.name in families.FAMILIES else ""
    if package and importlib.util.find_spec(package) is None:
        return  # the family's model module needs a GPU kernel package absent here: the launch, on a GPU machine, checks
    from runner.run.titan import optim

    unmatched = optim.unmatched(cfg, optim.parameter_names(cfg))
    if unmatched is not None:
        raise unmatched


def _word_config_errors() -> None:
    """Hydra reports what fails while it composes through `run_and_report`, with its traceback hint: a YAML syntax
    error as its traceback, a value of the wrong type as OmegaConf's raw text, a key the schema lacks or a group option
    that does not exist in its own words. Word those (runner.config.compose_errors), keep Hydra's words for its other
    composition and override-grammar errors (they name the override) without the hint, and exit 2; leave everything
    else to Hydra, and everything to it when HYDRA_FULL_ERROR=1 asks for the full traceback."""
    # private_api: hydra_run_and_report, hydra_is_env_set
    from hydra._internal import utils

    report = utils.run_and_report
    if getattr(report, "worded", False):  # once per process (the tests call cli() more than once)
        return

    def run_and_report(func):
        def worded():
            try:
                return func()
            except Exception as e:
                if utils._is_env_set("HYDRA_FULL_ERROR"):
                    raise
                p = compose_errors.problem(e, *_overrides_and_dirs())
                msg = compose_errors.yaml_message(e) or (str(validate.ConfigError([p])) if p else None)
                if msg is None and isinstance(e, ConfigCompositionException | OverrideParseException):
                    msg = f"{e}\n{FIX_OVERRIDE}"  # Hydra's own words (they name the override), not its traceback hint
                if msg is None:
                    raise
                print(msg, file=sys.stderr)
                sys.exit(2)

        return report(worded)

    run_and_report.worded = True
    utils.run_and_report = run_and_report


def _overrides_and_dirs() -> tuple[list[str], list[Path]]:
    """The command line's overrides and the config search path's folders (`--config-dir`, conf/, hydra.searchpath)."""
    # private_api: hydra_get_args_parser
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(sys.argv[1:])
    return args.overrides, compose_errors.search_dirs(args.overrides, compose.CONF, args.config_dir)


def refuse_cut_replay(argv: list[str]) -> None:
    """Exit 2 before Hydra composes a frozen file given as the primary config (`--config-dir <run folder>
    --config-name frozen`) that was cut short (Hydra would fill what it lost with the schema's defaults) or cannot be
    read at all (random bytes, not a mapping, a value of the wrong type): one message naming the file."""
    # private_api: hydra_get_args_parser
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(argv)
    if args.config_dir and args.config_name:
        why = freeze.refusal(Path(args.config_dir) / f"{args.config_name.removesuffix('.yaml')}.yaml")
        if why is not None:
            print(why, file=sys.stderr)
            sys.exit(2)


def cli() -> None:
    refuse_cut_replay(sys.argv[1:])
    _word_config_errors()
    try:
        main()
    except KeyboardInterrupt:  # outside what main() words: Hydra reading the command line or composing, a launch's edges
        print("interrupted", file=sys.stderr)
        if "torch" in sys.modules:
            _fast_exit(130)
        sys.exit(130)
    except SystemExit as e:
        if e.code == 1 and not sweep.STATE.entered:  # Hydra rejected the command line or a config file
            print(FIX_OVERRIDE, file=sys.stderr)
            sys.exit(2)
        if "torch" in sys.modules and isinstance(e.code, int):
            _fast_exit(e.code)
        raise
    code = 0
    if sweep.STATE.failed:
        failed = sweep.STATE.failed
        print(f"{count(len(failed), 'sweep point')} failed (failed.json in each run folder): " + "; ".join(failed), file=sys.stderr)
        code = 1
    if "torch" in sys.modules:  # a launch: skip the interpreter's ~3 s teardown of torch and TorchTitan
        _fast_exit(code)
    sys.exit(code)


def _fast_exit(code: int) -> None:
    from runner.run import procs

    procs.exit_now(code)


if __name__ == "__main__":
    cli()
