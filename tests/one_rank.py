"""One in-process gloo rank, set up as every CPU rank of the runner is (helpers for tests, not a test module)."""

from __future__ import annotations

import contextlib
import importlib
from pathlib import Path

SMALL = ["model.num_layers=2", "model.dim=64", "model.num_heads=4", "model.num_kv_heads=4", "model.ffn_hidden_dim=128"]
SMALL += ["model.vocab_size=512"]
"""The debug Llama 3 cut to 2 blocks of width 64 (150k parameters, not 6.2M; a step ~5x cheaper), for the in-process
tests whose assertions do not depend on the model's size. The vocabulary holds tests/text_assets' 300 tokens; 4 heads
split under tp2."""


@contextlib.contextmanager
def gloo_rank(cfg, store_dir: Path):
    """A one-rank gloo process group with the CPU rank's device globals patched (runner.run.titan.cpu), both undone on
    exit for the tests that share this process."""
    import torch.distributed as dist

    import runner.run.titan.cpu as cpu
    from runner.run import titan

    titan.quiet_torchao(cfg)
    mods = [importlib.import_module(name) for name in cpu._DEVICE_GLOBALS]
    saved = [(m, k, getattr(m, k)) for m in mods for k in ("device_type", "device_module") if hasattr(m, k)]
    cpu.patch_device_globals()
    dist.init_process_group("gloo", init_method=f"file://{store_dir / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for m, k, v in saved:
            setattr(m, k, v)
