"""Typed schema of every config group, registered in Hydra's ConfigStore.

Torch-free: this module is imported by `--cfg job`, validation and planning.
Every default lives here so that the frozen YAML shows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from runner.schema.choices import (
    ActivationCheckpoint,
    Backend,
    DataSource,
    DeviceType,
    DType,
    ExpertsPrecision,
    FaultTolerance,
    Fp8Recipe,
    GuardAction,
    HostGroup,
    InitFormat,
    Launcher,
    LRDecay,
    MismatchAction,
    Mode,
    MoeCommBackend,
    Objective,
    OptimizerImpl,
    OptimizerName,
    ReshardPolicy,
    TextFormat,
    WandbMode,
    WorkerStart,
)
from runner.schema.monitoring import (
    InjectConfig,
    IntegrityConfig,
    LossGuardConfig,
    MoeLoadConfig,
    MonitorConfig,
    StragglerConfig,
)
from runner.schema.operations import (
    CheckpointConfig,
    ClusterConfig,
    DistributedConfig,
    FaultToleranceConfig,
    FlightRecorderConfig,
    LocalCheckpointConfig,
    LoggingConfig,
    ProfileConfig,
    SlurmConfig,
    WandbConfig,
)
from runner.schema.training import (
    DataConfig,
    DryrunConfig,
    EvalConfig,
    LRSchedulerConfig,
    MixSource,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    ParamGroup,
    PlanConfig,
    PrecisionConfig,
    SearchConfig,
    TrainingConfig,
)

__all__ = [
    "ActivationCheckpoint",
    "Backend",
    "CheckpointConfig",
    "LocalCheckpointConfig",
    "ClusterConfig",
    "DType",
    "DataConfig",
    "DataSource",
    "DeviceType",
    "DistributedConfig",
    "FaultTolerance",
    "FaultToleranceConfig",
    "DryrunConfig",
    "EvalConfig",
    "FlightRecorderConfig",
    "ExpertsPrecision",
    "Fp8Recipe",
    "GuardAction",
    "MismatchAction",
    "HostGroup",
    "InitFormat",
    "InjectConfig",
    "IntegrityConfig",
    "Launcher",
    "LoggingConfig",
    "LRDecay",
    "LRSchedulerConfig",
    "OptimizerConfig",
    "OptimizerImpl",
    "OptimizerName",
    "ParamGroup",
    "MixSource",
    "LossGuardConfig",
    "Mode",
    "ModelConfig",
    "Objective",
    "MoeLoadConfig",
    "MonitorConfig",
    "ParallelismConfig",
    "PlanConfig",
    "PrecisionConfig",
    "ProfileConfig",
    "MoeCommBackend",
    "ReshardPolicy",
    "RunConfig",
    "SearchConfig",
    "SlurmConfig",
    "StragglerConfig",
    "TextFormat",
    "TrainingConfig",
    "WandbConfig",
    "WandbMode",
    "WorkerStart",
    "register",
]


@dataclass
class RunConfig:
    mode: Mode = Mode.train
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    dryrun: DryrunConfig = field(default_factory=DryrunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    objective: Objective = Objective.step_time
    """The float `python -m runner` returns to a Hydra sweeper (Optuna minimizes it); +inf for an invalid or failed point."""
    provenance: dict[str, Any] = field(default_factory=dict)
    """Filled by the runner in frozen.yaml (versions, git commit, layout); ignored on input."""


def register() -> None:
    """Register the top-level schema. The primary config lists it first, so every group
    option merges into a typed node: unknown keys and wrong types fail at composition."""
    ConfigStore.instance().store(name="base_config", node=RunConfig)
