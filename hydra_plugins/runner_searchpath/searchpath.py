"""Adds the project root to Hydra's search path, so `recipes/` and `sweeps/` are config
groups: `python -m runner +recipes=<name>`, `python -m runner -m +sweeps=<name>`."""

from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class RunnerSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="runner", path=f"file://{Path(__file__).resolve().parents[2]}")
