"""One row of `metrics.jsonl`: what the step loop logs per step, as a dataclass whose fields are the file's keys.

docs/outputs.md lists the same keys (a test keeps the two equal), and the two the metrics.jsonl sink adds to each row it
writes (`attempt`, `repeat`: runner.run.metrics.JsonlSink.KEYS): the fields without a default of None are in every
row; a field that is None is left out of the row as written (its key appears only when what it reports happened, or
the feature that reports it is on). To add a key, add a field here (optional ones `X | None = None`) and its line to
docs/outputs.md; a collaborator of the step loop that returns a mapping of entries (`StepRow.add`) may only name
fields that exist.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class StepRow:
    # --- every row -----------------------------------------------------------------------------------------------
    step: int
    loss: float
    grad_norm: float
    step_time_s: float
    """Seconds from the step's start until the device finished it (its one read waits for it)."""
    tokens_per_s: float
    lr: float
    mfu: float
    mfu_6n: float
    mfu_of_gemm_peak: float
    memory_gb: float
    skipped_steps: int
    """Steps the loss guard left out so far."""
    straggler_windows: int
    integrity_checks: int
    replay_checks: int
    data_hash: str
    """A digest of every sample the job read in the step, equal across layouts."""
    data_s: float
    """How long the step waited for its batch."""
    host_syncs: int = 0
    """The step's host synchronizations with the device (set once the step is over)."""
    # --- only when it applies ------------------------------------------------------------------------------------
    hfu: float | None = None
    compile_s: float | None = None
    stragglers: list[dict[str, Any]] | None = None
    verdict: str | None = None
    verdict_ranks: list[int] | None = None
    profiled: bool | None = None
    spike: str | None = None
    action: str | None = None
    integrity: list[dict[str, Any]] | None = None
    rewound_to: int | None = None
    bad_steps: list[int] | None = None
    eval_loss: float | None = None
    eval_ppl: float | None = None
    eval_s: float | None = None
    checkpoint_s: float | None = None
    checkpoint_tier: str | None = None
    preempted: str | None = None
    slurm_restart: int | None = None
    gc_s: float | None = None
    moe: dict[str, Any] | None = None
    moe_flags: list[dict[str, Any]] | None = None
    layers: dict[str, list[Any]] | None = None
    """Per-block statistics (runner.observe.layer_stats): one list per field, block b at index b."""
    ft_replica_id: int | None = None
    ft_live_groups: int | None = None
    ft_committed: bool | None = None
    ft_trained: bool | None = None
    samples_trained: int | None = None
    tokens_trained: int | None = None
    samples_skipped: int | None = None
    ft_checksum: int | None = None
    ft_replicas_agree: bool | None = None

    def add(self, entries: dict[str, Any]) -> StepRow:
        """Set the entries a collaborator reports (evaluation, torchft, the experts' load); a key that is no field is a
        bug of the runner, named here."""
        unknown = sorted(set(entries) - FIELDS)
        if unknown:
            raise KeyError(f"metrics row: no field {unknown}; add it to runner.formats.metrics_row.StepRow and docs/outputs.md")
        for key, value in entries.items():
            setattr(self, key, value)
        return self

    def as_json(self) -> dict[str, Any]:
        """The row as metrics.jsonl holds it: every field that is set, in the order above."""
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None or f.name in ALWAYS}


FIELDS = frozenset(f.name for f in dataclasses.fields(StepRow))
ALWAYS = frozenset(f.name for f in dataclasses.fields(StepRow) if f.default is not None or f.default_factory is not dataclasses.MISSING)
"""The keys of every row: fields with no default, or a default that is not None."""
