"""The one table of rules (runner.config.validate.RULES): every rule is in it or called by a rule in it, and
validation, search and the preflight all walk it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from runner.config import search, validate
from runner.schema import Mode
from runner.schema.problems import ConfigError, Problem

PACKAGE = Path(validate.__file__).parent


def _module_name(path: Path) -> str:
    return "runner.config.validate" + ("" if path.stem == "__init__" else f".{path.stem}")


def _aliases(tree: ast.Module, here: str) -> dict[str, str]:
    """Local name -> module, for `import a.b as x` and `from a import b as x` where b is a module of the package."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            out |= {a.asname or a.name: a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                out[a.asname or a.name] = full if (PACKAGE / f"{a.name}.py").exists() and node.module == "runner.config.validate" else here
    return out


def _graph() -> tuple[dict[tuple[str, str], set[tuple[str, str]]], set[tuple[str, str]]]:
    """(function -> the functions of the package it calls, the functions that take `out: list[Problem]`)."""
    calls, takes_out = {}, set()
    for path in sorted(PACKAGE.glob("*.py")):
        here = _module_name(path)
        tree = ast.parse(path.read_text())
        aliases = _aliases(tree, here)
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            key = (here, fn.name)
            if any(a.arg == "out" and a.annotation is not None and ast.unparse(a.annotation) == "list[Problem]" for a in fn.args.args):
                takes_out.add(key)
            callees = calls.setdefault(key, set())
            for c in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                if isinstance(c.func, ast.Name):
                    callees.add((here, c.func.id))
                elif isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name) and c.func.value.id in aliases:
                    callees.add((aliases[c.func.value.id], c.func.attr))
    return calls, takes_out


def test_every_rule_is_in_the_table_or_called_by_one():
    calls, takes_out = _graph()
    seen, todo = set(), [(r.check.__module__, r.check.__name__) for r in validate.RULES]
    while todo:
        f = todo.pop()
        if f not in seen:
            seen.add(f)
            todo.extend(calls.get(f, ()))
    assert len(takes_out) > 40  # the scan sees the package's rules (48 when the table was made)
    walker = {("runner.config.validate", "walk"), ("runner.config.validate", "apply")}  # walk the table
    assert sorted(takes_out - seen - walker) == []


def test_the_table_says_why_search_skips_a_rule():
    names = [r.name for r in validate.RULES]
    assert len(names) == len(set(names))
    launch = (validate.Needs.FILES, validate.Needs.MACHINE)
    files = [r for r in validate.RULES if r.needs in launch]
    assert files and all(r.search_skips for r in files)  # search starts nothing
    skipped = {r.name for r in validate.RULES if r.search_skips and r.needs not in launch}
    assert skipped == {"world size", "batch, microbatches and pipeline schedule", "dry-run ranks", "device memory"}


@pytest.mark.parametrize("needs", list(validate.Needs))
def test_a_new_rule_reaches_every_caller_of_its_kind(compose, monkeypatch, tmp_path, needs):
    """A rule added to the table once is applied by validation (CONFIG, LAYOUT), search (CONFIG once, LAYOUT per
    candidate) and the preflight (FILES; MACHINE in a launch's, not in mode=validate's): nothing else lists rules."""
    seen: list[int | None] = []

    def rule(ctx: validate.Context, out: list[Problem]) -> None:
        seen.append(ctx.ws)
        out.append(Problem("optimizer.lr", ctx.cfg.optimizer.lr, "the new rule", "the fix"))

    extra = validate.Rule("new rule", rule, needs, reads=("ctx",))
    monkeypatch.setattr(validate, "RULES", (*validate.RULES, extra))
    cfg = compose(["mode=search", "search.top_k=1", "cluster.devices_per_node=4"])
    if needs in (validate.Needs.FILES, validate.Needs.MACHINE):
        validate.check(cfg)  # not a config rule
        with pytest.raises(ConfigError, match="the new rule"):
            validate.preflight(cfg, tmp_path)
        cfg.mode = Mode.validate
        if needs == validate.Needs.MACHINE:
            validate.preflight(cfg, tmp_path)  # mode=validate checks a config for its cluster, not for this machine
        else:
            with pytest.raises(ConfigError, match="the new rule"):
                validate.preflight(cfg, tmp_path)
        return
    with pytest.raises(ConfigError, match="the new rule"):
        validate.check(cfg)
    validate.preflight(cfg, tmp_path)  # not a launch rule
    seen.clear()
    if needs == validate.Needs.CONFIG:
        with pytest.raises(ConfigError, match="the new rule"):
            search.run(cfg)
        assert seen == [4]  # once, with the world size searched
    else:
        res = search.run(cfg)
        assert res.ranked == [] and len(seen) == len(list(search.layouts(cfg, 4)))  # every candidate layout, refused


def _files_cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """A config that each FILES rule of the table refuses, and the field its problem names."""
    blocker, shared = tmp_path / "a-file", tmp_path / "shared"
    blocker.write_text("")
    text = ["data=text", f"data.files=[{tmp_path / 'nope.jsonl'}]", f"data.tokenizer={tmp_path / 'tok.json'}"]
    return {
        "folders the run writes": (["checkpoint=local", f"checkpoint.local.folder={blocker}"], "checkpoint.local.folder"),
        "data files and tokenizer": (text, "data.files"),
        "held-out files": ([*text, "eval.interval=5", f"data.eval_files=[{tmp_path / 'val.jsonl'}]"], "data.eval_files"),
        "Hugging Face folder to start from": (["parallelism=single", f"model.init_from={tmp_path / 'nowhere'}"], "model.init_from"),
        # the case of issue 54: mode=validate said "config OK", the launch refused it
        "checkpoint storage and what to resume": (
            ["checkpoint=local", f"checkpoint.folder={shared}", f"checkpoint.local.folder={shared}"],
            "checkpoint.local.folder",
        ),
        "checkpoint to start from": (["parallelism=single", f"checkpoint.init_from={tmp_path / 'nowhere'}"], "checkpoint.init_from"),
    }


def test_every_preflight_refusal_is_a_validate_refusal(compose, monkeypatch, capsys, tmp_path):
    """mode=validate runs the launch's preflight (the FILES rules): what `python -m runner` refuses before it starts a
    process is refused by `python -m runner mode=validate` in the same words (exit 2, no run folder left)."""
    from tests.in_process import cli as _here

    cases = _files_cases(tmp_path)
    assert set(cases) == {r.name for r in validate.RULES if r.needs == validate.Needs.FILES}  # a new FILES rule needs a case
    for name, (overrides, field) in cases.items():
        cfg = compose(overrides)
        with pytest.raises(ConfigError) as e:
            validate.preflight(cfg, tmp_path / "train", validate.check(cfg))  # mode=train's, before it launches
        refused = [str(p) for p in e.value.problems]
        assert any(p.startswith(f"{field} = ") for p in refused), (name, refused)
        code, err = _here(monkeypatch, capsys, *overrides, "mode=validate", f"hydra.run.dir={tmp_path / 'validate'}")
        assert code == 2 and all(p in err for p in refused) and "config OK" not in err, (name, err)
        assert not (tmp_path / "validate").exists()
