"""mode=search: every layout TorchTitan can run for a model, a cluster, a global batch and a sequence length,
rejected by validation's own rules and the plan's memory model, ranked by predicted step time.

Torch-free, and no Hydra composition per candidate: each candidate is the composed config with its
parallelism and training fields replaced (dataclasses.replace). The space (tp, cp, pp, dp_replicate x dp_shard, ep,
schedule and stages per rank, microbatch size, activation checkpointing, resharding) and its bounds are
runner/config/search/space.py.

Pruning, each counted under its reason: a rule that fails for a layout rejects every candidate under it; a layout
and schedule whose lightest setting (full AC, resharding, that microbatch) does not fit rejects its settings by
memory; and a candidate is dominated when the same candidate with less recomputation, or with gathered weights
kept (never), fits: it cannot be faster (recomputation and re-gathering only add time).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from runner.config import validate
from runner.config.search.space import bounds, debug_defaults, layouts, reshard_policies, schedules  # noqa: F401  (the space)
from runner.config.validate import pipeline_rules as pipeline_rules
from runner.estimate import flops, host_memory, memory, pipeline, precision
from runner.estimate.predict import steptime
from runner.schema import ActivationCheckpoint, DeviceType, Fp8Recipe, ReshardPolicy, RunConfig, layout
from runner.schema.layout import Layout, label
from runner.schema.problems import ConfigError, Problem

AC = ActivationCheckpoint
AC_TIERS = ((AC.none,), (AC.selective_op, AC.selective_layer), (AC.full,))  # least recomputation first
MEMORY = "memory"
DOMINATED = "dominated"
UNPRICED = "unpriced"
TIED = "tied"


class Candidate(NamedTuple):
    tp: int
    cp: int
    pp: int
    dp_replicate: int
    dp_shard: int
    ep: int
    schedule: str
    v: int
    microbatch_size: int
    ac: ActivationCheckpoint
    reshard: ReshardPolicy

    def layout(self) -> Layout:
        return Layout(pp=self.pp, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, cp=self.cp, tp=self.tp, ep=self.ep)

    def config(self, base: RunConfig) -> RunConfig:
        """The composed config with this candidate's fields: shallow copies of the typed config (the fast form of
        dataclasses.replace, which would re-run every __init__), never a Hydra composition."""
        p, t, cfg = _copy(base.parallelism), _copy(base.training), _copy(base)
        p.__dict__.update(
            name="search",
            tp=self.tp,
            cp=self.cp,
            pp=self.pp,
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            ep=self.ep,
            pp_schedule=self.schedule,
            pp_virtual_stages=self.v,
            fsdp_reshard_after_forward=self.reshard,
        )
        t.__dict__.update(microbatch_size=self.microbatch_size, activation_checkpoint=self.ac)
        cfg.parallelism, cfg.training = p, t
        return cfg

    def overrides(self) -> dict[str, object]:
        """The fields a sweep point sets (a Hydra override each)."""
        return {
            "parallelism.tp": self.tp,
            "parallelism.cp": self.cp,
            "parallelism.pp": self.pp,
            "parallelism.dp_replicate": self.dp_replicate,
            "parallelism.dp_shard": self.dp_shard,
            "parallelism.ep": self.ep,
            "parallelism.pp_schedule": self.schedule,
            "parallelism.pp_virtual_stages": self.v,
            "parallelism.fsdp_reshard_after_forward": self.reshard.value,
            "training.microbatch_size": self.microbatch_size,
            "training.activation_checkpoint": self.ac.value,
        }


def _copy(obj):
    """A shallow copy of a schema dataclass: copy.copy's result, without its trip through __reduce_ex__ (a search
    copies three objects per candidate priced)."""
    out = object.__new__(type(obj))
    out.__dict__.update(obj.__dict__)
    return out


@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    label: str
    step_s: float
    terms: dict[str, float]
    binding: str
    memory_gb: float
    mfu: float | None
    recompute: float
    """Share of the forward recomputed (runner.estimate.flops): at equal predicted time, less is better."""
    also: tuple[str, ...] = ()
    """Schedules of the candidates that differ from this one only in the schedule and are predicted exactly alike (time,
    recomputation, memory): the predictor prices a zero-bubble schedule's bubble as its plain twin's, so they are listed
    once, here."""
    fp8_speed_up: float | None = None
    """Under an FP8 recipe: the same candidate's predicted step time in param_dtype (bf16) over this one's
    (steptime.fp8_speed_up); None without FP8."""

    def key(self) -> tuple[float, float, float]:
        return (self.step_s, self.recompute, self.memory_gb)


@dataclass
class Result:
    world_size: int
    bounds: list[str]
    candidates: int = 0
    rejected: Counter = field(default_factory=Counter)
    """Candidates rejected per reason: a config field (validation's rule), MEMORY or DOMINATED."""
    examples: dict[str, Problem] = field(default_factory=dict)
    """One problem per rule, as validation words it."""
    ranked: list[Ranked] = field(default_factory=list)
    predictions: int = 0
    seconds: float = 0.0
    source: str = steptime.DATASHEET
    warning: str | None = None
    """debug_defaults' warning, printed once above the report."""


def world_size(cfg: RunConfig) -> int:
    """The cluster's devices; a cluster sized by its layout (local_cpu) needs cluster.devices_per_node first."""
    c = cfg.cluster
    if layout.sized_by_layout(c) or c.devices_per_node < 1 or c.num_nodes is None or c.num_nodes < 1:
        raise ConfigError(
            [
                Problem(
                    "cluster.devices_per_node",
                    c.devices_per_node,
                    f"mode=search searches the layouts of a fixed number of devices, and cluster {c.name} takes it from the layout",
                    "set cluster.num_nodes and cluster.devices_per_node (e.g. cluster.devices_per_node=4 on this machine)",
                )
            ]
        )
    return c.num_nodes * c.devices_per_node


def check_base(cfg: RunConfig, ws: int) -> None:
    """The rules that do not read the layout, once (validate.RULES' CONFIG rules that search applies)."""
    out: list[Problem] = []
    validate.walk(validate.Context(cfg, ws), out, (validate.Needs.CONFIG,), in_search=True)
    if out:
        raise ConfigError(out)


def capacity_gb(cfg: RunConfig, ws: int) -> float | None:
    """Memory of one device: the cluster's, or this machine's RAM shared by the ranks of a CPU cluster."""
    c = cfg.cluster
    if c.device == DeviceType.cpu and c.device_memory_gb <= 0:
        return host_memory.machine_memory_gb() / ws
    return c.device_memory_gb or None


class _Search:
    """One search: the rules' verdicts cached by the fields they read, the best candidates so far."""

    def __init__(self, cfg: RunConfig, keep: int):
        self.cfg, self.keep = cfg, keep
        self.ws = world_size(cfg)
        self.cap = capacity_gb(cfg, self.ws)
        self.res = Result(self.ws, bounds(cfg, self.ws))
        self.best: list[Ranked] = []
        self._batch: dict[tuple, list[Problem]] = {}
        self._peak: dict[tuple, float] = {}
        self._over: set[tuple] = set()
        """Keys of peak_gb whose memory is known to exceed the capacity (a stage over it was found; the rest not priced)."""
        self._pred: dict[Candidate, steptime.StepPrediction] = {}
        self._pricer = steptime.Pricer(cfg, self.ws)

    def reject(self, reason: str, n: int, example: Problem | None = None) -> None:
        self.res.rejected[reason] += n
        if example and reason not in self.res.examples:
            self.res.examples[reason] = example

    def layout_problems(self, cfg: RunConfig, lay: Layout) -> list[Problem]:
        """validate.RULES' LAYOUT rules that search applies (TP against heads and node, EP, FP8 shapes, sequence, async TP)."""
        out: list[Problem] = []
        validate.walk(validate.Context(cfg, self.ws, lay), out, (validate.Needs.LAYOUT,), in_search=True)
        return out

    def batch_problems(self, cand: Candidate, dp: int, mbs: int) -> list[Problem]:
        """validate_pipeline.batch, cached on the only fields it reads (dp, pp, schedule, v, microbatch)."""
        key = (dp, cand.pp, cand.schedule, cand.v, mbs)
        bad = self._batch.get(key)
        if bad is None:
            bad = []
            pipeline_rules.batch(cand._replace(microbatch_size=mbs).config(self.cfg), cand.layout(), True, bad)
            self._batch[key] = bad
        return bad

    @staticmethod
    def _peak_key(cfg: RunConfig, lay: Layout) -> tuple:
        p, t = cfg.parallelism, cfg.training
        return (lay, p.pp_schedule, p.pp_virtual_stages, p.fsdp_reshard_after_forward, t.microbatch_size, t.activation_checkpoint)

    def peak_gb(self, cfg: RunConfig, lay: Layout) -> float:
        """The memory model's largest stage (memory.memory's verdict), once per candidate."""
        key = self._peak_key(cfg, lay)
        if key not in self._peak:
            self._peak[key] = max(self._stage_gb(cfg, lay))
        return self._peak[key]

    @staticmethod
    def _stage_gb(cfg: RunConfig, lay: Layout):
        """The stages' totals, GB, one at a time. Outside the V schedules a middle stage never exceeds stage 1 (fewer
        microbatches in flight, no more layers), so stages 0, 1 and the last suffice."""
        micro = cfg.training.global_batch_size // (lay.dp * cfg.training.microbatch_size)
        v_shape = pipeline.SCHEDULES[cfg.parallelism.pp_schedule].style == "v"
        stages = range(lay.pp) if v_shape or lay.pp <= 3 else (0, 1, lay.pp - 1)
        return (memory.stage(cfg, lay, micro, s)["total"] / 1e9 for s in stages)

    def fits(self, cfg: RunConfig, lay: Layout) -> bool:
        """peak_gb <= the capacity; most candidates that do not fit exceed it on their first stage, so the stages after
        the first one over it are not priced (the verdict is the same; the peak of a candidate that fits is kept)."""
        if self.cap is None:
            return True
        key = self._peak_key(cfg, lay)
        if key in self._peak:
            return self._peak[key] <= self.cap
        if key in self._over:
            return False
        peak = float("-inf")
        for gb in self._stage_gb(cfg, lay):
            if gb > self.cap:
                self._over.add(key)
                return False
            peak = max(peak, gb)
        self._peak[key] = peak
        return True

    def predict(self, cand: Candidate) -> steptime.StepPrediction:
        """steptime.predict of a candidate, once per what it reads: the predictor prices a schedule only by its stages
        per rank (v; a zero-bubble schedule's bubble as its plain twin's), so the schedules of one v share it (and tie:
        Ranked.also)."""
        key = cand._replace(schedule="")
        pred = self._pred.get(key)
        if pred is None:
            pred = self._pred[key] = self._pricer.predict(cand.config(self.cfg), cand.layout())
        return pred

    def bar(self) -> tuple[float, float, float]:
        """The (step time, recompute, memory) a candidate must beat to enter the kept list."""
        return self.best[-1].key() if len(self.best) >= self.keep else (float("inf"),) * 3

    def add(self, cand: Candidate, cfg: RunConfig, lay: Layout, pred: steptime.StepPrediction) -> None:
        """Keep the candidate if it beats the bar (the kept list is sorted by Ranked.key); count the one displaced.
        Memory, the last part of the key, is computed only for a candidate whose time and recomputation can enter."""
        self.res.predictions += 1
        self.res.source = pred.source
        t = cfg.training
        recompute = flops.recompute_fraction(cfg.model, t.activation_checkpoint, t.ac_layer_frequency)
        if (pred.step_s, recompute) > self.bar()[:2]:
            self.reject("slower", 1)
            return
        r = Ranked(
            cand,
            label(lay, cfg.parallelism),
            pred.step_s,
            pred.terms,
            pred.binding,
            self.peak_gb(cfg, lay),
            mfu(cfg, pred.step_s),
            recompute,
        )
        if self._merge(r):
            return
        if r.key() >= self.bar():
            self.reject("slower", 1)
            return
        self.best.append(r)
        self.best.sort(key=Ranked.key)
        self.reject("slower", len(self.best[self.keep :]))  # displaced from the kept list
        del self.best[self.keep :]

    def _merge(self, r: Ranked) -> bool:
        """Add r's schedule to the kept candidate it ties exactly and differs from only in the schedule (counted TIED)."""
        same = r.candidate._replace(schedule="")
        for i, b in enumerate(self.best):
            if b.key() == r.key() and b.candidate._replace(schedule="") == same:
                self.best[i] = dataclasses.replace(b, also=(*b.also, r.candidate.schedule))
                self.reject(TIED, 1)
                return True
        return False

    def settings(self, cand: Candidate) -> None:
        """AC and resharding of one layout, schedule and microbatch: bounded by the fastest setting's prediction,
        rejected by the lightest setting's memory, each kept only if nothing with less recomputation fits."""
        lay, cfg, reshards = cand.layout(), self.cfg, reshard_policies(cand.dp_shard)
        n = len(AC) * len(reshards)
        fastest = cand._replace(ac=AC.none, reshard=reshards[0])  # no recompute, no re-gathers
        bound = self.predict(fastest)
        if bound.step_s is None:
            self.reject(UNPRICED, n)
            return
        if bound.step_s > self.bar()[0]:
            self.reject("slower", n)
            return
        if not self.fits(cand._replace(ac=AC.full, reshard=reshards[-1]).config(cfg), lay):
            self.reject(MEMORY, n)
            return
        for i, tier in enumerate(AC_TIERS):
            kept = [c for c in (self._fitting(cand._replace(ac=ac), reshards) for ac in tier) if c is not None]
            for c in kept:
                c_cfg = c.config(cfg)
                pred = self.predict(c)
                if pred.step_s is None:
                    self.reject("slower", 1)
                else:
                    self.add(c, c_cfg, lay, pred)
            if kept:
                self.reject(DOMINATED, sum(len(t) for t in AC_TIERS[i + 1 :]) * len(reshards))
                return

    def _fitting(self, cand: Candidate, reshards: tuple[ReshardPolicy, ...]) -> Candidate | None:
        """The first resharding policy (keeping gathered weights first) under which the candidate fits; the ones
        before it are rejected by memory, the ones after it dominated (the same memory or less, more gathers)."""
        for i, r in enumerate(reshards):
            c = cand._replace(reshard=r)
            if self.fits(c.config(self.cfg), c.layout()):
                self.reject(DOMINATED, len(reshards) - 1 - i)
                return c
            self.reject(MEMORY, 1)
        return None

    def layout(self, degrees: tuple[int, ...]) -> None:
        tp, cp, pp, dpr, dps, ep = degrees
        s, reshards = self.cfg.search, reshard_policies(dps)
        scheds = schedules(pp, s.max_virtual_stages)
        per = len(AC) * len(reshards)
        self.res.candidates += len(scheds) * s.max_microbatch_size * per
        base = Candidate(tp, cp, pp, dpr, dps, ep, "1F1B", 1, 1, AC.none, reshards[0])
        lay = base.layout()
        bad = self.layout_problems(base.config(self.cfg), lay)
        if bad:
            self.reject(bad[0].field, len(scheds) * s.max_microbatch_size * per, bad[0])
            return
        for sched, v in scheds:
            cand = base._replace(schedule=sched, v=v)
            for mbs in range(1, s.max_microbatch_size + 1):
                bad = self.batch_problems(cand, dpr * dps, mbs)
                if bad:
                    self.reject(bad[0].field, per, bad[0])
                else:
                    self.settings(cand._replace(microbatch_size=mbs))


def mfu(cfg: RunConfig, step_s: float | None) -> float | None:
    """Model FLOPs of a step over what the devices' dense peak could do in step_s (the plan's convention: the
    param_dtype peak, bf16 on GPUs, whatever dtype the GEMMs run in, so FP8 and bf16 candidates compare)."""
    peak = cfg.cluster.peak_tflops.get(precision.mfu_peak(cfg))
    t = cfg.training
    fpt = flops.flops_per_token(cfg.model, t.seq_len, cfg.plan.flops_convention)
    return flops.utilisation(t.global_batch_size * t.seq_len, step_s, fpt, peak and world_size(cfg) * peak * 1e12).mfu


def _with_fp8_speed_up(cfg: RunConfig, r: Ranked) -> Ranked:
    """A kept candidate with its FP8 speed-up over the same candidate in bf16 (one more prediction each, kept ones only)."""
    if cfg.precision.fp8 == Fp8Recipe.none:
        return r
    pred = steptime.StepPrediction(r.step_s, r.terms, r.binding)
    return dataclasses.replace(r, fp8_speed_up=steptime.fp8_speed_up(r.candidate.config(cfg), r.candidate.layout(), pred))


def run(cfg: RunConfig, keep: int = 10) -> Result:
    """Search the space; keep the best max(keep, search.top_k) candidates, fastest first. Raises ConfigError on a
    base config no layout could fix (the model, the ranges, the cluster)."""
    t0 = time.perf_counter()
    check_base(cfg, world_size(cfg))
    search = _Search(cfg, max(keep, cfg.search.top_k))
    for degrees in layouts(cfg, search.ws):
        search.layout(degrees)
    res = search.res
    res.ranked, res.warning = [_with_fp8_speed_up(cfg, r) for r in search.best], debug_defaults(cfg)
    res.seconds = time.perf_counter() - t0
    return res
