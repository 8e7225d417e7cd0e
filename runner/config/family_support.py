"""What each TorchTitan family's runtime supports, by device: training on CPU ranks, context parallelism,
FP8. Facts, each with its evidence (a test or scripts/repro_cpu_families.py), read by validation through one
hook (validate_model.check calls `check`) so that a config which validates also starts.

Torch-free. A family missing here has no runtime support claims: validate_model rejects unknown families.
"""

from __future__ import annotations

from dataclasses import dataclass

from runner.config.compose import CONF
from runner.formats import hf_folder
from runner.schema import DeviceType, Mode, RunConfig
from runner.schema.problems import Problem

CONF_MODEL = CONF / "model"
REPRO = "scripts/repro_cpu_families.py"
"""The minimal reproductions of the CPU rejections below (`python scripts/repro_cpu_families.py <case>`)."""


@dataclass(frozen=True)
class Support:
    cpu: str = ""
    """Why the family cannot train on CPU ranks; "" = it trains there (tests/test_family_train.py)."""
    cp_cpu: str = ""
    """Why context parallelism fails on CPU ranks (where the family trains there); "" = CP runs there."""
    cp: str = ""
    """Why context parallelism is unsupported on every device (TorchTitan refuses it); "" = it is supported."""
    registry_only: str = ""
    """Why the runner builds the family only as its registry flavor (no model.* architecture overrides); "" = it rebuilds
    the model from model.* through the family's layer builders (runner.run.titan.model)."""
    dryrun_cpu: str = ""
    """Why `mode=dryrun dryrun.device=cpu` cannot play the family (it runs the CPU ranks' attention path on fake
    tensors); "" = it can. The CUDA rehearsal (dryrun.device=cuda) plays the GPU path."""
    fp8: str = "every recipe converts every plain Linear layer (attention, dense and shared-expert FFN, head)"
    """What the FP8 recipes convert (the routed experts follow precision.experts: runner.estimate.precision.EXPERT_RECIPES)."""


_MLA_CP_CPU = (
    "on CPU, ring attention covers the fused SDPA kernel; latent attention's query/key heads (qk_nope + qk_rope dims) "
    "differ from its value heads, which CPU SDPA computes another way, and CP fails in it "
    "(RuntimeError: aten.add.Tensor got mixed torch.Tensor and DTensor)"
)

SUPPORT: dict[str, Support] = {
    "llama3": Support(),
    "qwen3": Support(),
    "deepseek_v3": Support(cp_cpu=_MLA_CP_CPU),
    "kimi_k2_7": Support(
        cp="TorchTitan 0.3.0's Kimi parallelize raises NotImplementedError for CP (its vision scatter needs the whole sequence)"
    ),
    "gpt_oss": Support(
        cpu="its attention sinks and sliding window need TorchTitan's FlexAttention, which has no backward on CPU "
        "(NotImplementedError: FlexAttention does not support backward on CPU), and the SDPA attention CPU ranks use "
        f"ignores the sinks and the window (`python {REPRO} gpt_oss`)",
        dryrun_cpu="the CPU dry run plays the CPU ranks' SDPA attention, which has no sinks and no sliding window, so "
        "it would measure another model (runner.run.titan.cpu.use_sdpa refuses it)",
        fp8="every recipe converts the plain Linear layers; the attention output (ScaledBiasRowwiseLinear, its bias "
        "divided by the TP degree) has no FP8 twin and stays in high precision",
    ),
    "qwen3_5": Support(
        cpu="its Gated DeltaNet layers run only as flash-linear-attention's Triton kernels, which need a GPU: Triton "
        f"launches no kernel without a GPU driver (`python {REPRO} qwen3_5`)",
        dryrun_cpu="its model module imports flash-linear-attention's Triton kernels, a GPU package the CPU dry run lacks",
        registry_only="its Gated DeltaNet blocks need flash-linear-attention, absent here, so no layer builder of the "
        "runner's is tested: a GPU run builds TorchTitan's registry flavor as it is",
    ),
}


def cpu_families() -> list[str]:
    """The families whose debug flavors train on CPU ranks."""
    return [name for name, s in SUPPORT.items() if not s.cpu]


MOE_SP_ONE_SAMPLE = (
    "on CPU, MoE blocks under TP with sequence parallelism compute gradients off one rank's with one sample per "
    "microbatch (step-1 float64 gradient norm: Qwen3 MoE 2.7 %, DeepSeek-V3 3.1e-6 relative; losses agree), while "
    "sequence_parallel=false or 2 samples match to 1e-8"
)
"""Measured by tests/test_family_train.py's layouts (2 blocks, 64 tokens); the cause is not found yet."""


def check(cfg: RunConfig, out: list[Problem]) -> None:
    """The family must train on the cluster's device with the layout's CP degree; kept valid for GPU clusters."""
    s = SUPPORT.get(cfg.model.name)
    if s is None or any(p.field == "model.name" for p in out):  # an unknown or unimportable family is reported already
        return
    on_cpu, cp = cfg.cluster.device == DeviceType.cpu, cfg.parallelism.cp
    gpu_fix = "mode=validate and mode=plan check it for a GPU cluster (e.g. cluster=h100_node precision=bf16)"
    if on_cpu and s.cpu:
        out.append(
            Problem("model.name", cfg.model.name, f"cannot train on CPU ranks: {s.cpu}", f"{gpu_fix}; here use one of {cpu_families()}")
        )
    elif cp > 1 and s.cp:
        out.append(Problem("parallelism.cp", cp, s.cp, f"use cp=1 with {cfg.model.name}"))
    elif cp > 1 and on_cpu and s.cp_cpu:
        out.append(Problem("parallelism.cp", cp, s.cp_cpu, f"use cp=1 with {cfg.model.name} here; {gpu_fix}"))
    if cfg.mode == Mode.dryrun and cfg.dryrun.device == DeviceType.cpu and s.dryrun_cpu:
        out.append(
            Problem(
                "dryrun.device",
                cfg.dryrun.device.value,
                f"cannot play {cfg.model.name}: {s.dryrun_cpu}",
                "use dryrun.device=cuda (the CUDA rehearsal on fake CUDA tensors; scripts/setup.sh --cuda-rehearsal sets it "
                "up), or mode=plan for the memory estimate alone",
            )
        )
    if s.registry_only:
        _registry_flavor(cfg, s, out)
    p = cfg.parallelism
    if on_cpu and cfg.model.num_experts > 0 and p.tp > 1 and p.sequence_parallel and cfg.training.microbatch_size == 1:
        fix = "use training.microbatch_size >= 2 or parallelism.sequence_parallel=false"
        out.append(Problem("training.microbatch_size", 1, MOE_SP_ONE_SAMPLE, fix))


def _registry_flavor(cfg: RunConfig, s: Support, out: list[Problem]) -> None:
    """A registry-only family's model.* must equal its flavor's generated option file (conf/model/, from the registry)."""
    import dataclasses
    import re

    import yaml

    m = cfg.model
    name = re.sub(r"[.\-]", "_", f"{m.name}_{m.flavor}").lower()
    path = CONF_MODEL / f"{name}.yaml"
    if not path.is_file():
        why = f"is not a {m.name} flavor with an option file ({path.name})"
        out.append(Problem("model.flavor", m.flavor, why, f"use one of the model={m.name}_... options"))
        return
    want = {**{f.name: f.default for f in dataclasses.fields(m)}, **yaml.safe_load(path.read_text())}
    for f in dataclasses.fields(m):
        got = getattr(m, f.name)
        if f.name not in ("name", "flavor", *hf_folder.INIT_FIELDS) and got != want[f.name]:  # init_*: where weights start
            fix = f"drop the override (model={name} gives {want[f.name]!r})"
            out.append(Problem(f"model.{f.name}", got, f"cannot be changed for {m.name}: {s.registry_only}", fix))
