"""Every documented `python -m runner` command composes and validates: the ones in README.md, in docs/*.md and in
`--help` (conf/config.yaml's hydra.help.header).

In-process, no subprocess: each command is composed as `python -m runner` composes it (runner.config.compose) and
validated as its mode validates it (`validate.check`; `mode=search` only checks the rules that read no layout, as
the CLI does). A multirun (`-m`, a comma list, `choice(...)`, a `sweep=` file) is checked point by point.
Placeholders (`<run folder>`, `outputs/<date>/<time>`, ...) are filled from PLACEHOLDERS with files this module
writes: a frozen run to replay, a search's top-k sweep, a corpus, a tokenizer, prepared folders, a machine profile.
"""

from __future__ import annotations

import itertools
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from runner.config import freeze, search, validate
from runner.config.compose import CONF, register, to_object
from runner.schema import Mode
from tests import composing, import_graph, text_assets
from tests.conftest import ROOT

COMMAND = re.compile(r"^python -m runner(\s|$)")  # not runner.compare, runner.calibrate, runner.data
MIN_COMMANDS, MIN_POINTS = 60, 100
"""Lower bounds (the docs held 79 commands, 124 points, when this was written): a parser that finds nothing fails."""

RUN = "{work}/run"
PLACEHOLDERS = {
    "outputs/<date>/<time>": RUN,
    "multirun/<date>/<time>": RUN,
    "<run folder>": RUN,
    "<stopped run>": RUN,
    "<folder>": RUN,
}
"""Placeholder -> what fills it ({work}: the folder the commands run in). A frozen run of `checkpoint=local` and a
search's top-k sweep (`<run folder>/search`) are written into RUN; an unknown `<...>` fails the command."""

PRINT_ONLY = {"--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--shell-completion", "-sc"}
"""Hydra flags that print and run nothing: the rest of the command must still compose (schema-checked), not validate."""
TAKES_VALUE = {"--cfg", "-c", "--package", "-p", "--info", "-i", "--shell-completion", "-sc"}
"""Hydra flags followed by a word of their own (`--cfg job`, `--package training`; `--info` optionally)."""


@dataclass(frozen=True)
class Doc:
    where: str
    """file:line of the command (`--help:<line>` for the help header)."""
    line: str


def _commands(text: str, source: str) -> list[Doc]:
    """Lines that start with `python -m runner` once leading spaces and a `$ ` prompt are stripped; a line ending
    in a backslash continues on the next."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        start, line = i + 1, lines[i].strip().removeprefix("$ ")
        i += 1
        if not COMMAND.match(line):
            continue
        while line.endswith("\\") and i < len(lines):
            line, i = line[:-1] + " " + lines[i].strip(), i + 1
        out.append(Doc(f"{source}:{start}", line))
    return out


def documented() -> list[Doc]:
    docs = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        docs += _commands(path.read_text(), str(path.relative_to(ROOT)))
    header = yaml.safe_load((CONF / "config.yaml").read_text())["hydra"]["help"]["header"]
    docs += _commands(header, "--help")
    # the data-flow diagram of docs/ARCHITECTURE.md (`python -m runner ...   runner/__main__.py -> ...`) is no command
    return [d for d in docs if shlex.split(d.line, comments=True)[3:4] != ["..."]]


DOCS = documented()


@dataclass
class Command:
    overrides: list[str] = field(default_factory=list)
    config_dir: Path | None = None
    config_name: str = "config"
    multirun: bool = False
    print_only: bool = False


def parse(doc: Doc, work: Path) -> Command:
    line = doc.line
    for placeholder, value in PLACEHOLDERS.items():
        line = line.replace(placeholder, value.format(work=work))
    left = re.findall(r"<[^>]+>", line)
    assert not left, f"{doc.where}: placeholder {left} has no entry in PLACEHOLDERS: {doc.line}"
    args, cmd = shlex.split(line, comments=True)[3:], Command()
    while args:
        a = args.pop(0)
        if a in ("-m", "--multirun"):
            cmd.multirun = True
        elif a in ("--config-dir", "-cd"):
            cmd.config_dir = Path(args.pop(0))
        elif a in ("--config-name", "-cn"):
            cmd.config_name = args.pop(0)
        elif a in PRINT_ONLY or a in TAKES_VALUE or a == "--resolve":
            cmd.print_only = cmd.print_only or a in PRINT_ONLY
            if a in TAKES_VALUE and args and not args[0].startswith("-") and "=" not in args[0]:
                args.pop(0)
        elif a.startswith("-"):
            raise AssertionError(f"{doc.where}: the test does not know the flag {a}: teach parse() what it means")
        elif not a.lstrip("+~").startswith(("hydra.", "hydra/")):  # Hydra's own settings (sweeper, run dir) type no field
            cmd.overrides.append(a)
    return cmd


def _split(value: str) -> list[str]:
    """Split at the commas outside brackets, braces, parentheses and quotes (Hydra's sweep syntax)."""
    parts, depth, quote, cur = [], 0, None, ""
    for ch in value:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            parts, cur = [*parts, cur], ""
            continue
        cur += ch
    return [*parts, cur]


def _values(value: str) -> list[str]:
    m = re.fullmatch(r"(choice|range)\((.*)\)", str(value))
    if m and m.group(1) == "choice":
        return [v.strip() for v in _split(m.group(2))]
    if m:
        return [str(v) for v in range(*(int(v) for v in _split(m.group(2))))]
    return _split(str(value))


def points(cmd: Command) -> list[list[str]]:
    """The override lists the command runs: one, or one per point of its multirun (`-m` lists, a sweep file's params)."""
    axes: list[list[str]] = []
    fixed = []
    for o in cmd.overrides:
        key, eq, value = o.partition("=")
        if cmd.multirun and eq and len(_values(value)) > 1:
            axes.append([f"{key}={v}" for v in _values(value)])
        else:
            fixed.append(o)
    for o in cmd.overrides:
        if o.startswith("sweep="):
            name = o.partition("=")[2]
            files = [f for d in (cmd.config_dir, CONF) if d and (f := d / "sweep" / f"{name}.yaml").is_file()]
            assert files, f"no sweep file {name}.yaml in {cmd.config_dir or ''} {CONF}"
            sweep = yaml.safe_load(files[0].read_text())
            for key, value in sweep["hydra"]["sweeper"]["params"].items():
                axes.append([f"{key}={v}" for v in _values(value)])
    return [fixed + list(p) for p in itertools.product(*axes)]


def _replay(folder: Path, overrides: list[str]):
    """`--config-dir <folder> --config-name frozen [overrides]`: the frozen file as the primary config, conf/ behind it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register()
    with initialize_config_dir(version_base="1.3", config_dir=str(folder)):
        return to_object(hydra_compose(config_name="frozen", overrides=[f"hydra.searchpath=[file://{CONF}]", *overrides]))


def check(cmd: Command, overrides: list[str]) -> None:
    """Compose and validate one point as `python -m runner` would; raise what it would report."""
    if cmd.config_name == "frozen":
        cfg = _replay(cmd.config_dir, overrides)
    else:
        assert cmd.config_name == "config", f"no composition known for --config-name {cmd.config_name}"
        extra = [f"hydra.searchpath=[file://{cmd.config_dir}]"] if cmd.config_dir else []
        cfg = composing.compose([*extra, *overrides])  # as runner.config.compose.compose, its group selections once per set
    if cmd.print_only:
        return
    if cfg.mode == Mode.search:  # the CLI searches before validating a layout: only the rules that read none
        search.check_base(cfg, search.world_size(cfg))
    else:
        validate.check(cfg)


_CHECKED: dict[tuple, str | None] = {}
"""Outcome of each point already checked (several docs show the same command): None, or the error."""


def _checked(cmd: Command, overrides: list[str]) -> str | None:
    key = (cmd.config_dir, cmd.config_name, cmd.print_only, tuple(overrides))
    if key not in _CHECKED:
        try:
            check(cmd, overrides)
            _CHECKED[key] = None
        except Exception as e:  # ConfigError, Hydra's and OmegaConf's errors: whatever `python -m runner` would report
            _CHECKED[key] = f"{type(e).__name__}: {e}"
    return _CHECKED[key]


def _profile(path: Path) -> Path:
    from runner.estimate.predict import machine_profile

    entry = {"threads": 1, "matmul_tflops": 0.1, "gemm_half_dim": 32.0, "attention_tflops": 0.02, "memory_gbs": 10.0, "gemms": []}
    link = {"latency_s": 1e-3, "gbs": 1.0}
    body = {
        "machine": {"cpu": "test cpu", "cores": 2, "device": "cpu", "backend": "gloo", "torch": "2.13", "dtype": "float32"},
        "by_ranks": {"1": {**entry, "threads": 2}, "2": dict(entry), "4": dict(entry)},
        "collectives": {n: {f"{op}@2": link for op in ("all_gather", "reduce_scatter", "all_reduce", "send_recv")} for n in ("2", "4")},
        "constants": {
            name: machine_profile.constant(name, value)
            for name, value in (("layer_overhead_s", 1e-3), ("collective_fixed_s", 1e-3), ("comm_overlap", 0.0))
        },
    }
    return machine_profile.write(body, path)


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    """The folder the documented commands run in, with every file they name."""
    from runner.config.search import render as search_render
    from runner.data.prepare import Request, prepare

    work = tmp_path_factory.mktemp("docs")
    corpus, tok = text_assets.make(work / "tok")
    (work / "corpus.jsonl").write_text(corpus.read_text())
    docs = corpus.read_text().splitlines(keepends=True)
    (work / "train.jsonl").write_text("".join(docs[:250]))
    (work / "val.jsonl").write_text("".join(docs[250:]))
    for name, lines in (("web", docs[:150]), ("code", docs[150:])):
        (work / f"{name}.jsonl").write_text("".join(lines))
        prepare(Request(inputs=[work / f"{name}.jsonl"], tokenizer=tok, out=work / "prepared" / name), say=lambda _: None)
    profile = _profile(work / "machine_profile.json")

    run = Path(RUN.format(work=work))
    run.mkdir()
    stopped = composing.compose(["checkpoint=local"])
    frozen = freeze.write(stopped, validate.check(stopped), run)
    assert _replay(run, []) == freeze.load(frozen), "a replay composes what the frozen file holds"
    overrides = ["mode=search", "cluster=local_cpu", "cluster.devices_per_node=2", f"cluster.profile={profile}", "training.seq_len=128"]
    base = composing.compose(overrides)
    search_render.write_sweep(base, search.run(base), run, overrides)
    return work


@pytest.mark.parametrize("doc", DOCS, ids=[d.where for d in DOCS])
def test_documented_command_validates(doc, work, monkeypatch):
    monkeypatch.chdir(work)  # relative data paths resolve where the command runs
    cmd = parse(doc, work)
    failed = [f"{' '.join(overrides)}:\n{error}" for overrides in points(cmd) if (error := _checked(cmd, overrides))]
    assert not failed, f"{doc.where}: `{doc.line}` does not validate:\n" + "\n".join(failed)


def test_commands_are_found_in_every_source(work):
    sources = {d.where.rsplit(":", 1)[0] for d in DOCS}
    assert {"README.md", "--help"} <= sources, sorted(sources)
    n_points = sum(len(points(parse(d, work))) for d in DOCS)
    assert len(DOCS) >= MIN_COMMANDS and n_points >= MIN_POINTS, (len(DOCS), n_points)


def test_architecture_lists_every_module():
    """docs/ARCHITECTURE.md names every module under runner/ by its path there (`run/step_loop.py`); a module added
    without a row fails here."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    modules = sorted(p.relative_to(ROOT / "runner").as_posix() for p in (ROOT / "runner").rglob("*.py"))
    trivial = {m for m in modules if m.endswith("__init__.py") and len((ROOT / "runner" / m).read_text().splitlines()) <= 8}
    missing = [m for m in modules if m not in trivial and f"`{m}`" not in doc]
    assert missing == [], f"add a row to docs/ARCHITECTURE.md for {missing}"


TOP_DIRS = ("runner", "conf", "docs", "tests", "scripts", "bench", "recipes", "sweeps", "hydra_plugins")
PACKAGES = tuple(p.name for p in (ROOT / "runner").iterdir() if (p / "__init__.py").exists())
PATH = re.compile(r"(?<![\w./<-])((?:[\w.-]+/)+(?:[\w.-]+\.(?:py|md|csv|yaml|sh|c|h))?)(?![\w/])")
DOTTED = re.compile(r"(?<![\w./])(?!runner\.log\b)runner(?:\.\w+)+")
"""`runner.log`, the run folder's console file, is a file name, not a module."""


def stale_paths(text: str) -> list[str]:
    """The repository paths (`run/step_loop.py`, `runner/config/`, `scripts/setup.sh`; a module's path may leave out
    `runner/`) and dotted names (`runner.run.device`, `runner.estimate.flops.mfu`) of a text that name nothing there."""
    stale = []
    for path in PATH.findall(text):
        first = path.split("/")[0]
        if first in TOP_DIRS + PACKAGES and not (ROOT / path).exists() and not (ROOT / "runner" / path).exists():
            stale.append(path)
    known = import_graph.modules()
    for name in DOTTED.findall(text):
        parts = name.split(".")
        module = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in known), "")
        rest = parts[len(module.split(".")) :]
        if rest and rest[0] not in import_graph.defined_names(known[module]):
            stale.append(name)
    return stale


def test_architecture_names_no_stale_path():
    """Every path and dotted name docs/ARCHITECTURE.md gives exists: a module moved or renamed without its row fails
    here, as a module added without one fails test_architecture_lists_every_module."""
    assert stale_paths((ROOT / "docs" / "ARCHITECTURE.md").read_text()) == []


def test_stale_paths_are_found():
    text = "run/step_loop.py, `runner/config/nope.py`, runner/estimate/, runner.estimate.flops.mfu_of, tokens/s, conf/nope/"
    assert stale_paths(text) == ["runner/config/nope.py", "conf/nope/", "runner.estimate.flops.mfu_of"]


WHERE = {
    "where is goodput computed",
    "where does the Hugging Face export live",
    "what happens in one step",
    "where is torchft wired in",
    "checkpoint save and resume",
    "where is MFU computed",
    "straggler detection",
    "the data loader",
}
"""The questions docs/ARCHITECTURE.md's "Where to find it" answers, each with one path."""


def test_where_to_find_it_gives_one_true_path_each():
    """Each question: one module path that exists, and the names in parentheses after it defined there."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = doc.split("## Where to find it\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([^|`]+) \| `(runner/[\w/]+\.py)`(?: \(([^)]*)\))? \|$", section, re.M)
    assert {q for q, _, _ in rows} == WHERE and len(rows) == len(WHERE), section
    wrong = []
    for question, path, names in rows:
        if not (ROOT / path).is_file():
            wrong.append(f"{question}: no {path}")
            continue
        defined = import_graph.defined_names(ROOT / path)
        wrong += [f"{question}: {path} defines no {n}" for n in re.findall(r"`(\w+)", names) if n not in defined]
    assert wrong == []


NOT_PATHS = {
    "docs/performance.md": "TorchTitan's document (docs/clusters.md cites it for the Grand Teton host)",
    "runner.comm": "the name of the profiler's span around each collective (docs/profiling.md), no module",
}
"""Path-like words of the user docs that name something outside this repository, each with its reason."""


def test_user_docs_name_no_stale_path():
    """README.md and every docs/*.md: the paths and `runner.` names they give exist (a moved module's old path fails)."""
    stale = {
        p.relative_to(ROOT).as_posix(): bad
        for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        if (bad := [s for s in stale_paths(p.read_text()) if s not in NOT_PATHS])
    }
    assert stale == {}
