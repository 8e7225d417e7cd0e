"""The routed experts' precision (precision.experts): an MoE model, a device that runs the recipe's scaled grouped
GEMMs (or the CPU emulation), and expert GEMM dims the kernels take. Torch-free; called by validate.check."""

from __future__ import annotations

from runner.estimate import flops, precision
from runner.schema import DeviceType, ExpertsPrecision, RunConfig
from runner.schema.problems import Problem

FIELD = "precision.experts"


def device(cfg: RunConfig, out: list[Problem]) -> None:
    """An MoE model, and the cluster's device runs the recipe: SM capability on CUDA, the emulation on CPU."""
    e, c = cfg.precision.experts, cfg.cluster
    if e == ExpertsPrecision.high:
        return
    if not flops.is_moe(cfg.model):
        out.append(
            Problem(
                FIELD,
                e.value,
                f"model {cfg.model.name} {cfg.model.flavor} is dense: it has no routed experts",
                f"set {FIELD}=high, or train an MoE model",
            )
        )
        return
    req = precision.EXPERT_RECIPES[e]
    if c.device == DeviceType.cpu:
        if req.on_cpu == "rejected":
            why = f"needs {req.hardware}: its E8M0-scaled grouped GEMMs exist only there, and the runner has no CPU emulation of them"
            out.append(
                Problem(FIELD, e.value, why, f"use {FIELD}=fp8_rowwise (emulated on CPU), or a Blackwell cluster (mode=validate here)")
            )
        return
    cc = precision.parse_capability(c.compute_capability)
    if cc is None:
        fix = 'set it as "major.minor", e.g. cluster.compute_capability="9.0" for H100'
        out.append(
            Problem(
                "cluster.compute_capability",
                repr(c.compute_capability),
                f"{FIELD}={e.value} needs {req.hardware}, and the cluster does not say its GPUs' capability",
                fix,
            )
        )
    elif cc < req.min_sm:
        ok = [name.value for name, q in precision.EXPERT_RECIPES.items() if q.min_sm <= cc]
        why = f"needs {req.hardware}; cluster {c.name} has SM {c.compute_capability}"
        out.append(Problem(FIELD, e.value, why, f"use {FIELD} in {['high', *ok]} or a newer cluster"))


def shapes(cfg: RunConfig, out: list[Problem]) -> None:
    """Each expert GEMM's dims on one rank (TP shards the hidden dim without EP) must be multiples of the recipe's
    divisor (torchao's scaled grouped GEMMs assert it). Token groups need no rule: TorchTitan's TorchAOTokenDispatcher
    pads every expert's group to the recipe's token_pad."""
    e, m, p = cfg.precision.experts, cfg.model, cfg.parallelism
    if e == ExpertsPrecision.high or not flops.is_moe(m):
        return
    div = precision.EXPERT_RECIPES[e].divisor
    bad = sorted({d for kn in precision.expert_gemm_dims(m, p.tp, p.ep) for d in kn if d % div})
    if bad:
        hidden = f"model.moe_hidden_dim {m.moe_hidden_dim}" + (f" / tp {p.tp}" if p.ep == 1 and p.tp > 1 else "")
        why = f"the experts' grouped GEMMs multiply model.dim {m.dim} by {hidden}; {e.value} needs every dim divisible by {div}, not {bad}"
        out.append(
            Problem(
                FIELD,
                e.value,
                why,
                f"set {FIELD}=high, or use a layout (parallelism.tp, parallelism.ep) whose expert shards are multiples of {div}",
            )
        )
