"""scripts/gen_models.py loaded as a module (it is a script, not a package): the tests read TorchTitan's registries
through it. A helper module: test modules import it, never each other."""

from __future__ import annotations

import importlib.util

from tests.conftest import ROOT


def gen():
    spec = importlib.util.spec_from_file_location("gen_models", ROOT / "scripts" / "gen_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
