"""runner.run.private_api against the installed libraries and against the code: every entry's name still exists,
every use site carries its entry's `# private_api:` comment, and runner/ and hydra_plugins/ use no private name of a
library that the register does not list.

The scan is static (the AST of each file): a `_name` imported from, read from or patched on a library module or class;
a `_name` read on any object that the runner does not define itself (an instance of a library class); a string that is
such a name or a dotted library path with one (getattr, logger names, op names); a private method of a library class
the runner overrides. A `setattr` with a computed name is out of its reach: those patches are registered by hand.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import re
import sys

import pytest

from runner.run.private_api import BY_NAME, PRIVATE, Private
from tests.conftest import ROOT

SCANNED = ("runner", "hydra_plugins")
REGISTER = "runner/run/private_api.py"
LIBS = ("torch", "torchtitan", "torchao", "hydra", "omegaconf", "torchft", "submitit")
DOTTED = re.compile(rf"(?:{'|'.join(LIBS)})(?:\.\w+)+")
COMMENT = re.compile(r"#.*\bprivate_api: ([\w, ]+)")
ALLOWED = {
    "_replace": "a namedtuple's documented method",
    "_exit": "os._exit, documented",
    "_getframe": "sys._getframe, documented",
    "_target_": "Hydra's documented instantiate key",
    "_self_": "Hydra's documented defaults-list keyword",
    "_seed": "a suffix of the runner's own file names (runner.estimate.plan.RENAMED_SUFFIX)",
    "_quorum_": "the tag of torchft's dump folders: entry torchft_update_fr_path",
}
"""Private-looking names the scan finds that are no library's private API, each with its reason."""
UNSTABLE = {"prototype": "torchao's prototypes come with no compatibility promise: registered as private names are"}
"""Public-looking module names whose contents a library may change without notice; an import of one is registered."""


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _sources() -> dict[str, ast.Module]:
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text()) for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))}


# ---- every entry resolves ------------------------------------------------------------------------


def _installed(p: Private) -> str:
    dist = p.version.split()[0]
    if dist == "python":
        return f"installed: python {sys.version_info.major}.{sys.version_info.minor}"
    try:
        return f"installed: {dist} {importlib.metadata.version(dist)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{dist} is not installed"


def _sets_or_reads(cls: type, name: str) -> bool:
    """Whether a class of cls's MRO has `self.<name>` in its code (an attribute its instances get in __init__)."""
    pattern = re.compile(rf"\bself\.{re.escape(name)}\b")
    for c in inspect.getmro(cls):
        try:
            if pattern.search(inspect.getsource(c)):
                return True
        except (OSError, TypeError):  # a builtin or C++ class has no Python source
            continue
    return False


def _missing(p: Private) -> str | None:
    """What of p no longer exists; None when all of it does."""
    try:
        obj = importlib.import_module(p.module)
    except ImportError as e:
        return f"module {p.module} does not import: {e}"
    parts = p.attr.split(".") if p.attr else []
    for i, part in enumerate(parts[:-1] if p.instance else parts):
        if not hasattr(obj, part):
            return f"{p.module} has no {'.'.join(parts[: i + 1])}"
        obj = getattr(obj, part)
    if p.instance and not _sets_or_reads(obj, parts[-1]):
        return f"no class of {p.module}.{'.'.join(parts[:-1])}'s MRO uses self.{parts[-1]} any more"
    return None


@pytest.fixture(scope="module")
def all_modules_imported():
    """Every entry's module imported first, as in a run: an op a module registers (the functional collectives'
    `_wrap_tensor_autograd`) exists once that module is imported. A module that fails fails its own entries."""
    for p in PRIVATE:
        try:
            importlib.import_module(p.module)
        except ImportError:
            pass


@pytest.mark.parametrize("p", PRIVATE, ids=[p.name for p in PRIVATE])
def test_private_name_still_exists(p: Private, all_modules_imported):
    if p.nccl:
        import torch.distributed as dist

        if not dist.is_nccl_available():
            pytest.skip(f"{p.name} exists only in torch builds with NCCL")
    missing = _missing(p)
    assert missing is None, (
        f"private API entry {p.name} (written for {p.version}; {_installed(p)}), used in {', '.join(p.where)}: {missing}. "
        f"It was used for: {p.why}. Find its replacement (a public API if there is one now), then update the entry in "
        "runner/run/private_api.py and its use sites."
    )


# ---- every use site names its entries ------------------------------------------------------------


def _defined(tree: ast.Module) -> set[str]:
    """Top-level functions, classes and assigned names, and Class.method."""
    out = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
            if isinstance(node, ast.ClassDef):
                out |= {f"{node.name}.{f.name}" for f in node.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


def _tagged() -> dict[str, set[str]]:
    """file -> the entry names its `# private_api:` comments give."""
    out: dict[str, set[str]] = {}
    for d in SCANNED:
        for path in sorted((ROOT / d).rglob("*.py")):
            for m in COMMENT.finditer(path.read_text()):
                out.setdefault(path.relative_to(ROOT).as_posix(), set()).update(n.strip() for n in m.group(1).split(",") if n.strip())
    return out


def test_use_sites_name_their_entries():
    assert len(BY_NAME) == len(PRIVATE), "two entries share a name"
    sources, tagged, problems = _sources(), _tagged(), []
    for p in PRIVATE:
        for where in p.where:
            path, _, function = where.partition(":")
            if path not in sources:
                problems.append(f"{p.name}: {path} is not a file of {', '.join(SCANNED)}")
            elif function not in _defined(sources[path]):
                problems.append(f"{p.name}: {path} defines no {function}")
            elif p.name not in tagged.get(path, set()):
                problems.append(f"{p.name}: {path} has no `# private_api: {p.name}` comment at its use")
    for path, names in tagged.items():
        for name in sorted(names):
            if name not in BY_NAME:
                problems.append(f"{path}: `# private_api: {name}` names no entry of runner/run/private_api.py")
            elif path not in {w.partition(":")[0] for w in BY_NAME[name].where}:
                problems.append(f"{path}: `# private_api: {name}`, but the entry's where does not list {path}")
    assert problems == []


# ---- no private name outside the register --------------------------------------------------------


def _own_names(trees) -> set[str]:
    """Names the runner defines itself: functions, classes, variables, arguments, attributes of self/cls."""
    out = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
            elif isinstance(node, ast.arg):
                out.add(node.arg)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name):
                if node.value.id in ("self", "cls"):
                    out.add(node.attr)
    return out


def _imported(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted library path it is bound to, for every import of a library in the file."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names}
    return {k: v for k, v in out.items() if v.split(".")[0] in LIBS}


def _dotted(node: ast.expr, names: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in names:
        return ".".join([names[node.id], *reversed(parts)])
    return None


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


def _not_code(tree: ast.Module) -> set[int]:
    """ids of the string constants that are docstrings or parts of f-strings (messages, not names)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            out.add(id(node.value))
        elif isinstance(node, ast.JoinedStr):
            out |= {id(v) for v in node.values}
    return out


def _findings(tree: ast.Module, own: set[str]) -> list[tuple[int, str, str]]:
    """(line, private name, what) for each private name of a library used in the file; (line, name, ...) also for a
    library attribute the file assigns (a patch), private or not."""
    names, skip, out = _imported(tree), _not_code(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.module and not node.level):
            for a in node.names:
                path = a.name if isinstance(node, ast.Import) else f"{node.module}.{a.name}"
                if path.split(".")[0] in LIBS:
                    out += [(node.lineno, c, f"import {path}") for c in path.split(".") if _private(c) or c in UNSTABLE]
        elif isinstance(node, ast.Attribute):
            lib = _dotted(node, names)
            if isinstance(node.ctx, ast.Store) and lib is not None:
                out.append((node.lineno, node.attr, f"assigns {lib}"))
            elif _private(node.attr) and (lib is not None or (node.attr not in own and node.attr not in ALLOWED)):
                out.append((node.lineno, node.attr, ast.unparse(node)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            s = node.value
            if _private(s) and s.isidentifier() and s not in own and s not in ALLOWED:
                out.append((node.lineno, s, repr(s)))
            out += [(node.lineno, c, repr(t)) for t in s.split() if DOTTED.fullmatch(t) for c in t.split(".") if _private(c)]
        elif isinstance(node, ast.ClassDef):
            for base in (_dotted(b, names) for b in node.bases):
                cls = _resolve(base) if base is not None else None
                out += [
                    (f.lineno, f.name, f"{node.name} overrides {base}.{f.name}")
                    for f in node.body
                    if isinstance(f, ast.FunctionDef) and _private(f.name) and hasattr(cls, f.name)
                ]
    return out


def test_every_private_name_is_registered():
    """A private name of a library used in runner/ or hydra_plugins/ is a part of an entry (its module or attribute
    path) whose where lists that file; a library attribute the runner assigns likewise."""
    sources = _sources()
    own = _own_names(sources.values())
    covered: dict[str, set[str]] = {}
    for p in PRIVATE:
        for where in p.where:
            covered.setdefault(where.partition(":")[0], set()).update([*p.module.split("."), *p.attr.split(".")])
    unregistered = [
        f"{path}:{line}: {name} ({what})"
        for path, tree in sources.items()
        if path != REGISTER
        for line, name, what in sorted(set(_findings(tree, own)))
        if name not in covered.get(path, set())
    ]
    assert unregistered == [], (
        "private names of libraries (or library attributes assigned) with no entry in runner/run/private_api.py for their "
        "file: add one (module, attribute path, version, file:function, why) and a `# private_api: <name>` comment at the use"
    )


def test_scan_finds_what_it_should(tmp_path):
    """The scan itself: each kind of use it claims to find, in a file of its own."""
    code = """
import torch.distributed._functional_collectives as funcol
from torch.distributed.distributed_c10d import _world
from torchtitan.components.optimizer import OptimizersContainer
from torchao.prototype.mx_formats import MXLinear
import torch

class Mine(OptimizersContainer):
    def _build_param_groups(self): ...

def f(x, stage):
    funcol._resolve_group_name(x)
    stage._user_meta
    getattr(stage, "_stages", None)
    torch.UntypedStorage.resize_ = f
    x._replace(a=1)
    return "torch.utils._pytree"
"""
    found = {name for _, name, _ in _findings(ast.parse(code), own={"f", "x", "stage", "Mine"})}
    assert found == {
        "_functional_collectives",
        "_world",
        "_build_param_groups",
        "_resolve_group_name",
        "_user_meta",
        "_stages",
        "resize_",
        "_pytree",
        "prototype",
    }


def test_register_is_torch_free():
    """The register holds data only: the config layer and the CLI may name it without importing a library."""
    tree = ast.parse((ROOT / REGISTER).read_text())
    imports = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imports |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imports == {"__future__", "dataclasses"}


def test_the_fake_device_patches_what_the_register_lists():
    """The CUDA rehearsal's fake device (runner.run.dryrun.fake_cuda) replaces exactly the register's FAKE_DEVICE
    entries, which the main suite resolves above (test_private_name_still_exists), not only the CUDA tier."""
    from runner.run import private_api
    from runner.run.dryrun import fake_cuda

    listed = [p.name for p in private_api.at(private_api.FAKE_DEVICE)]
    assert len(listed) == 34 and "torch_cuda_is_available" in listed and "torch_tensor_pin_memory" in listed
    assert sorted(fake_cuda._replacements((9, 0), 80.0, "NVIDIA H100 80GB HBM3", 8)) == sorted(listed)
    assert all(p.why.startswith("patched for a CUDA rehearsal: ") for p in private_api.at(private_api.FAKE_DEVICE))
