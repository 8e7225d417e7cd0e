"""What mode=search's ranking can and cannot tell: no candidate left, and candidates closer than the predictor's error.

Torch-free, like the search.
"""

from __future__ import annotations

from runner.config import precision
from runner.config.problems import ConfigError, Problem
from runner.config.schema import RunConfig
from runner.config.search import MEMORY, UNPRICED, Result, capacity_gb


def nothing_survived(cfg: RunConfig, res: Result) -> ConfigError:
    """No candidate left: the reason that rejected the most candidates (the binding one), as the problem of the field
    that would change it (mode=search exits 2 with it; the report above it counts every reason)."""
    reason, n = res.rejected.most_common(1)[0]
    share = f"no candidate of mode=search survived: {n:,} of the {res.candidates:,} were rejected"
    c = cfg.cluster
    if reason == UNPRICED:
        why = f"{share} as unpriced: cluster {c.name} has no {precision.matmul_peak(cfg)[0]} peak or link bandwidth to predict with"
        fix = "set cluster.profile to a profile of this machine (python -m runner.calibrate), or cluster.peak_tflops and the bandwidths"
        return ConfigError([Problem("cluster.profile", c.profile, why, fix)])
    if reason == MEMORY:
        cap = capacity_gb(cfg, res.world_size)
        why = f"{share} by memory: even the lightest setting (full recomputation, resharding) needs more than a device's {cap:.3g} GB"
        fix = "search more devices (cluster.num_nodes), or a shorter training.seq_len"
        return ConfigError([Problem("cluster.device_memory_gb", c.device_memory_gb, why, fix)])
    p = res.examples[reason]
    return ConfigError([Problem(p.field, p.value, f"{share} by this rule, e.g. {p.why}", p.fix)])
