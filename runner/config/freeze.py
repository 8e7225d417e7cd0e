"""The frozen run file: the whole resolved config plus provenance, loadable by Hydra.

Torch-free. `python -m runner --config-dir <run folder> --config-name frozen` replays a
run from this one file: it starts from the schema (`base_config`) and sets every field.
Its last line (END) says the file is whole: a replay refuses a copy cut short.
A resumed run is frozen with the checkpoint it started from (`checkpoint.resume_from`,
also `provenance.resumed_from` and a comment), so its replay resumes from that same step; a new phase, with the
checkpoint whose weights it started from (`checkpoint.init_from`, `checkpoint.init_record`).
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import importlib.metadata
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf._utils import get_omega_conf_dumper  # private_api: omegaconf_yaml_dumper
from omegaconf.errors import OmegaConfBaseException

from runner.config import compose, compose_errors
from runner.formats import runfiles
from runner.formats.user_files import UnreadableFile, read_text
from runner.schema import RunConfig
from runner.schema.layout import Layout

ROOT = Path(__file__).resolve().parent.parent


def pin(cfg: RunConfig, run_dir: Path) -> None:
    """Write into `cfg` what its frozen file needs to replay the same run from any directory: the data and
    held-out paths made absolute, and a resume's checkpoint (the given one, else the newest intact one in
    checkpoint.folder) as an absolute checkpoint.resume_from, so a replay resumes from that step and not from
    whatever is newest then. Called after the preflight, which refuses a resume with nothing to resume from."""
    import os

    import runner.config.validate.checkpoint_rules as checkpoint_rules  # here: validation is not needed to load a frozen file
    from runner.formats import checkpoint

    d = cfg.data
    d.files = [os.path.abspath(f) for f in d.files]
    d.eval_files = [os.path.abspath(f) for f in d.eval_files]
    d.tokenizer = os.path.abspath(d.tokenizer) if d.tokenizer else d.tokenizer
    d.path = os.path.abspath(d.path) if d.path else d.path
    for m in d.mix:
        m.path = os.path.abspath(m.path) if m.path else m.path
    _pin_init(cfg)
    _pin_weights(cfg)
    c = cfg.checkpoint
    if c.enable and c.resume:
        pick = checkpoint_rules.resume_point(cfg, checkpoint.folder(c, run_dir), [], warn=False)
        if pick is not None:
            c.resume_from = os.path.abspath(pick)


def _pin_init(cfg: RunConfig) -> None:
    """model.init_from made absolute, and (on the first freeze, not a replay's) the folder's fingerprint in
    model.init_record: sha256 of config.json and the index, each shard's size and header hash."""
    import os

    from runner.formats import hf_folder

    m = cfg.model
    if m.init_from:
        m.init_from = os.path.abspath(m.init_from)
        if not m.init_record:
            m.init_record = hf_folder.record(Path(m.init_from))


def _pin_weights(cfg: RunConfig) -> None:
    """checkpoint.init_from pinned to the absolute `<folder>/step-<n>` it names (a run or checkpoint folder: its newest
    intact one, so a replay starts from that step and not from whatever is newest then), and (on the first freeze) that
    checkpoint's record in checkpoint.init_record: its step and the sha256 of its COMPLETE.json file list."""
    import os

    from runner.formats import checkpoint

    c = cfg.checkpoint
    if c.init_from and not cfg.model.init_from:
        pick, _ = checkpoint.weights_source(Path(c.init_from))  # the preflight refused a folder without one
        if pick is not None:
            c.init_from = os.path.abspath(pick)
            if not c.init_record:
                c.init_record = checkpoint.weights_record(pick)


@functools.cache  # a multirun freezes every point in one process
def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@functools.cache
def git_commit() -> str:
    """Commit of the project checkout, with '+dirty' for uncommitted changes; 'unknown' outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def provenance(cfg: RunConfig, lay: Layout) -> dict[str, Any]:
    prev = cfg.provenance or {}
    out = {
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "argv": list(sys.argv[1:]),
        "runner_version": _version("runner"),
        "torch_version": _version("torch"),
        "torchtitan_version": _version("torchtitan"),
        "torchao_version": _version("torchao"),
        "git_commit": git_commit(),
        "world_size": lay.world_size,
        "layout": lay.describe(),
        "degrees": {"pp": lay.pp, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "cp": lay.cp, "tp": lay.tp, "ep": lay.ep},
        "seed": cfg.training.seed,
    }
    if prev.get("run_dir"):
        out["replay_of"] = prev["run_dir"]
    if cfg.checkpoint.resume and cfg.checkpoint.resume_from:
        out["resumed_from"] = cfg.checkpoint.resume_from
    return out


HEADER = "# Replay: python -m runner --config-dir <this folder> --config-name frozen"
END = "# end of frozen.yaml (a replay refuses a copy without this line)"
"""The last line of every frozen file. A copy cut at a line boundary is still valid YAML, and Hydra would fill the
fields it lost with the schema's defaults; a comment rather than a digest, so that a file edited by hand replays."""


def _header(cfg: RunConfig) -> str:
    lines = [HEADER]
    c = cfg.checkpoint
    if c.resume and c.resume_from:  # pinned by the pre-launch check (runner.config.validate.checkpoint_rules)
        lines += [
            f"# This run resumed from {c.resume_from} (checkpoint.resume_from). Replaying it resumes from that same",
            "# checkpoint, which must still exist and be intact, and writes its checkpoints into checkpoint.folder again.",
        ]
    if c.init_from and c.init_record:  # pinned by freeze.pin
        lines.append(f"# This run started from the model weights of {c.init_from} (checkpoint.init_from, checkpoint.init_record).")
    return "\n".join(lines) + "\n"


def to_container(cfg: Any) -> Any:
    """Plain dict of the typed config, enums as their names: what `OmegaConf.to_container(
    OmegaConf.structured(cfg), resolve=True, enum_to_str=True)` gives, without re-typing the
    whole tree (0.1 s of a plan). The typed config is already resolved by `to_object`."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_container(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, enum.Enum):
        return cfg.name
    if isinstance(cfg, dict):
        return {k: to_container(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [to_container(v) for v in cfg]
    return cfg


def write(cfg: RunConfig, lay: Layout, run_dir: Path) -> Path:
    """Write frozen.yaml into run_dir and return its path."""
    body = to_container(cfg)
    body["provenance"] = {**provenance(cfg, lay), "run_dir": str(run_dir.resolve())}
    # OmegaConf's own YAML dumper (what OmegaConf.to_yaml uses): strings that read back as numbers stay quoted
    text = yaml.dump(
        {"defaults": ["base_config", "_self_"], **body},
        Dumper=get_omega_conf_dumper(),
        default_flow_style=False,
        allow_unicode=True,
        sort_keys=False,
    )
    path = run_dir / runfiles.FROZEN
    tmp = path.with_suffix(".tmp")
    tmp.write_text(_header(cfg) + text + END + "\n")
    tmp.replace(path)
    return path


FIX = f"copy the whole {runfiles.FROZEN} from its run folder again"


def cut_short(path: Path) -> str | None:
    """`file:line:column: what` and a fix for a frozen file that lacks its END line, where the file ends; None for a
    whole one, a missing file (Hydra names that), and a config that is no frozen file (neither named frozen.yaml nor
    starting with its HEADER)."""
    if not path.is_file():
        return None
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()  # not UTF-8: read() says so
    if path.name != runfiles.FROZEN and (not lines or lines[0] != HEADER):
        return None
    if END in (line.rstrip() for line in lines):
        return None
    where = f"{len(lines)}:{len(lines[-1]) + 1}" if lines else "1:1"
    return (
        f"{path}:{where}: the file ends here, without the line that ends every frozen file ({END!r}): it was cut short, "
        "and a replay would fill what it lost with the schema's defaults\n"
        "Fix: copy the whole file from its run folder again (a whole file written before frozen files had that line: add it at the end)."
    )


def refusal(path: Path) -> str | None:
    """Why the frozen file `path`, the primary config of a replay, cannot be read (`read`'s refusal), before Hydra
    composes it; None for a readable one, a missing file (Hydra names that) and a config that is no frozen file."""
    if not (path.is_file() and (path.name == runfiles.FROZEN or _starts_with_header(path))):
        return None
    try:
        read(path)
    except UnreadableFile as e:
        return str(e)
    return None


def _starts_with_header(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(len(HEADER)) == HEADER.encode()
    except OSError:
        return False


def read(path: str | Path) -> DictConfig:
    """A frozen.yaml merged onto the schema; UnreadableFile naming the file when it is not one whole frozen file: not
    there, not UTF-8 text, cut short, not YAML, not a mapping, or holding a value the schema refuses."""
    path = Path(path)
    read_text(path, FIX)
    cut = cut_short(path)
    if cut is not None:
        raise UnreadableFile(path, "was cut short", FIX, message=cut)
    try:
        raw = OmegaConf.load(path)
    except (yaml.YAMLError, OSError) as e:  # OSError: OmegaConf's for a document that is a single value
        why = f"is not the YAML mapping of a run's config ({' '.join(str(e).split())})"
        raise UnreadableFile(path, why, FIX, message=compose_errors.yaml_message(e)) from e
    if not isinstance(raw, DictConfig):
        raise UnreadableFile(path, "holds a YAML list where the mapping of a run's config is expected", FIX)
    raw.pop("defaults", None)
    try:
        return OmegaConf.merge(OmegaConf.structured(RunConfig), raw)
    except OmegaConfBaseException as e:
        p = compose_errors.problem(e)
        if p is None:
            raise UnreadableFile(path, f"does not fit the run config's schema ({str(e).splitlines()[0]})", FIX) from e
        raise UnreadableFile(path, f"has {p.field} = {p.value}: {p.why}", p.fix) from e


def load(path: str | Path) -> RunConfig:
    """Read a frozen.yaml back into the typed config (used by every rank and `python -m runner.launch`); UnreadableFile
    (a ValueError) for one that cannot be read (`read`), ConfigError for a value no config may have."""
    return compose.to_object(read(path))
