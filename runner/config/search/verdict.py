"""What mode=search's ranking can and cannot tell: no candidate left, and candidates closer than the predictor's error.

The error band: with cluster.profile, the RMS error of the calibration's own runs as the finished profile predicts them
(the profile's `residuals`); on the datasheet model, its RMS error over the published reference runs
(machine.REFERENCE_ERROR). Candidates predicted within the band of #1 are one tier: the predictor cannot order them,
only a measurement can (search.verify). Torch-free, like the search.
"""

from __future__ import annotations

from dataclasses import dataclass

from runner.config.search import MEMORY, UNPRICED, Result, capacity_gb
from runner.estimate import precision
from runner.estimate.predict import machine as steptime_machine
from runner.estimate.predict import machine_profile as steptime_profile
from runner.schema import Launcher, RunConfig
from runner.schema.problems import ConfigError, Problem


@dataclass(frozen=True)
class Tier:
    ranks: list[int]
    """1-based ranks of the candidates predicted within the band of #1 (#1 first)."""
    band: float
    """The predictor's relative error (RMS)."""
    source: str
    """Where the band comes from, in words."""
    spread: float
    """The slowest of the tier over #1, minus one."""


def error_band(cfg: RunConfig) -> tuple[float, str] | None:
    """(the predictor's RMS relative error, where it comes from) for the machine figures the search priced with; None
    for a profile that records no calibration residuals (written before they were)."""
    if cfg.cluster.profile is None:
        return steptime_machine.REFERENCE_ERROR, "the datasheet model's RMS error over the published reference runs"
    prof = steptime_profile.load(cfg.cluster.profile)
    band = steptime_profile.error_band(prof)
    if band is None:
        return None
    return band, f"RMS error of the {len(prof['residuals'])} calibration runs of {cfg.cluster.profile}"


def tier(cfg: RunConfig, res: Result, shown: int) -> Tier | None:
    """The first `shown` candidates predicted within the error band of #1, when there are two or more."""
    found = error_band(cfg) if len(res.ranked) > 1 else None
    if found is None:
        return None
    band, source = found
    best = res.ranked[0].step_s
    ranks = [i + 1 for i, r in enumerate(res.ranked[:shown]) if r.step_s <= best * (1 + band)]
    if len(ranks) < 2:
        return None
    return Tier(ranks, band, source, res.ranked[ranks[-1] - 1].step_s / best - 1)


def tier_line(cfg: RunConfig, t: Tier) -> str:
    """The tier in words, and how to order it: search.verify where the cluster starts here, else the sweep on the cluster."""
    k, s, c = len(t.ranks), cfg.search, cfg.cluster
    head = (
        f"tier: #1-#{k} are predicted within {100 * t.spread:.1f} % of #1, inside the predictor's error band of "
        f"+/-{100 * t.band:.1f} % ({t.source}): it cannot order them; "
    )
    if c.launcher != Launcher.local or c.num_nodes != 1:
        return head + f"train the written sweep's top {k} briefly on the cluster (search.top_k={max(k, s.top_k)}) to order them"
    if s.verify >= k:
        return head + f"search.verify={s.verify} measures them below"
    return head + f"measure them here with search.verify={k}" + (f" search.top_k={k}" if s.top_k < k else "")


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
