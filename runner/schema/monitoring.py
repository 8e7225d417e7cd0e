"""The monitors of a running job (`monitor.*`): stragglers, the loss-spike guard, silent-corruption checks, MoE expert
load and test-only fault injection."""

from __future__ import annotations

from dataclasses import dataclass, field

from runner.schema.choices import GuardAction, MismatchAction


@dataclass
class StragglerConfig:
    enable: bool = True
    """Time forward, backward and optimizer (with PP: stage compute and wait) on every rank, and its own work: the step
    less its waits inside collectives (runner.observe.waits)."""
    interval: int = 10
    """Steps per window: every this many steps the per-rank medians are gathered and judged."""
    factor: float = 1.3
    """A rank is slow in a phase when its window median exceeds the median over ranks by this factor."""
    windows: int = 3
    """Consecutive slow windows before a rank is reported as a straggler."""
    min_seconds: float = 0.005
    """Phases whose median over ranks is below this many seconds are not judged (timer noise)."""
    min_excess_s: float = 0.005
    """A rank is slow in a phase only if it exceeds the phase's median over ranks by at least this many seconds ..."""
    min_step_frac: float = 0.02
    """... and by at least this fraction of the median step time (docs/monitoring.md: why these floors)."""
    arrival: bool = True
    """Also judge arrival: each step every rank stamps (wall clock) its arrival at the step's one host collective,
    after the step's read of its loss (runner.run.step_sync); the rank its peers wait for arrives last."""
    last_frac: float = 0.5
    """Arrival straggler: last to arrive in at least this fraction of a window's steps (on an oversubscribed
    machine every rank is descheduled now and then and arrives last by chance, 1 / ranks of the steps on average) ..."""
    min_late_s: float = 0.02
    """... and later than the median of its peers by at least this many seconds, median over the window's steps
    (a median, so the odd descheduled step of a healthy rank does not count)."""


@dataclass
class LossGuardConfig:
    enable: bool = True
    """Detect loss / gradient-norm spikes. Non-finite values are always caught, even when off."""
    factor: float = 3.0
    """Spike: loss or global grad norm above this factor times its running median."""
    window: int = 20
    """Accepted steps in the running median."""
    warmup_steps: int = 5
    """Accepted steps before spike detection starts (non-finite values are caught from step 1); at most
    `window`, since the running median never holds more."""
    action: GuardAction = GuardAction.skip
    """What a spike does: skip the batch, or skip and rewind to the last checkpoint after repeated spikes."""
    max_consecutive: int = 3
    """Finite spikes in a row the guard skips at most: the next one is accepted and restarts the running medians from
    it (action=skip: a lasting level shift, not a spike), or rewinds to the last checkpoint (action=rewind).
    Non-finite losses and norms are always skipped."""


@dataclass
class InjectConfig:
    """TEST-ONLY fault injection; every switch is off by default. Never set these in a real run."""

    delay_rank: int = -1
    """Rank whose forward is slowed (-1: none)."""
    delay_frac: float = 0.5
    """Extra forward time on delay_rank, as a fraction of its measured forward time."""
    hang_rank: int = -1
    """Rank that sleeps at the start of a forward (-1: none), so its peers wait in a collective."""
    hang_at_step: int = 0
    """Step (1-based) at which hang_rank sleeps."""
    hang_s: float = 3600.0
    """Seconds hang_rank sleeps."""
    corrupt_steps: list[int] = field(default_factory=list)
    """Steps whose batch is corrupted: every rank's loss of that batch is multiplied by corrupt_scale."""
    corrupt_scale: float = 1e4
    """Loss multiplier of a corrupted batch (1e4: an exploding batch; nan: a non-finite one)."""
    kill_rank: int = -1
    """Rank that kills itself with SIGKILL at the start of `kill_at_step` in the first attempt only (-1: none)."""
    kill_at_step: int = 0
    """Step (1-based) at which kill_rank dies; ranks restarted by the elastic agent do not die again."""
    flip_rank: int = -1
    """Rank that flips one bit of its first parameter's local shard (-1: none), as silent data corruption would."""
    flip_at_step: int = 0
    """Step (1-based) at whose start flip_rank flips the bit."""
    replay_rank: int = -1
    """Rank whose replayed forward scales its loss by (1 + 1e-6), a non-reproducible computation (-1: none)."""
    fault_rank: int = -1
    """Rank whose loss at fault_at_step is multiplied by corrupt_scale on the first pass only (-1: none): a transient
    arithmetic fault that the spike's attribution replay does not reproduce (a hardware verdict)."""
    fault_at_step: int = 0
    """Step (1-based) of fault_rank's fault; it fires once (not again when a rewind trains the step again)."""
    norm_shift_step: int = 0
    """From this step (1-based) on, the loss guard sees the global gradient norm times norm_shift_scale, a lasting
    level shift (0: none)."""
    norm_shift_scale: float = 4.0
    """Multiplier of the gradient norm the guard sees from norm_shift_step on."""
    node_names: list[str] = field(default_factory=list)
    """The node name of every rank, by global rank (simulated nodes on one machine, as RUNNER_NODE_NAMES); [] = the host's."""
    lose_local: str = ""
    """At a restart, before the local tier is read, rank 0 destroys part of it: `node:<name>` deletes that node's local
    folder, `shard:<rank>` every copy of that rank's newest local shard, `flip:<rank>` one byte of that rank's own copy."""


@dataclass
class IntegrityConfig:
    interval: int = 100
    """Steps between replica checks: replicas of each parameter shard compare checksums (0: off)."""
    replay_interval: int = 500
    """Steps between replay checks: every rank recomputes the step's forward/backward on the same batch and RNG
    state and compares loss and gradient norm bitwise (0: off)."""
    on_mismatch: MismatchAction = MismatchAction.stop
    """What a replica mismatch does: stop the run, or rewind to the newest checkpoint (needs checkpoint=local)."""


@dataclass
class MoeLoadConfig:
    enable: bool = True
    """Measure the routed experts' load at logged steps (MoE models only): tokens per expert and per EP rank, summed
    over the steps since the last logged one (a window), in metrics.jsonl's `moe`, and judge it (docs/monitoring.md)."""
    hot_factor: float = 2.0
    """An expert is hot when its tokens in a window exceed this many times the mean over its layer's experts: it then
    does twice the GEMM work of a balanced expert and its EP rank's all-to-all waits for it."""
    rank_factor: float = 1.25
    """An EP rank is hot when its experts' share of a layer's tokens exceeds this many times the fair share 1 / ep
    (the all-to-all and the grouped GEMMs of every EP rank wait for the busiest one: 1.25 costs ~25 % of the layer)."""
    windows: int = 3
    """Consecutive windows an expert or EP rank must be hot, or an expert receive no token, before it is named."""
    min_tokens: int = 16
    """Windows with fewer routed tokens per expert than this (on average) are not judged: a handful of tokens spreads
    unevenly by chance."""


@dataclass
class MonitorConfig:
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    guard: LossGuardConfig = field(default_factory=LossGuardConfig)
    inject: InjectConfig = field(default_factory=InjectConfig)
    integrity: IntegrityConfig = field(default_factory=IntegrityConfig)
    moe_load: MoeLoadConfig = field(default_factory=MoeLoadConfig)
    layer_stats: bool = True
    """Per transformer block, at logged steps and on every step the loss guard flags: the gradient norm, the largest
    absolute output activation and weight, and non-finite counts (metrics.jsonl's `layers`; docs/monitoring.md)."""
