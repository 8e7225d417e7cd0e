"""parallelism.moe_comm_backend against the layout, the device and this machine (runner.estimate.moe_comm.BACKENDS says
what each backend needs). Torch-free; the table's CONFIG/LAYOUT rule and its MACHINE rule."""

from __future__ import annotations

import importlib.util

from runner.estimate import moe_comm, precision
from runner.schema import ActivationCheckpoint, DeviceType, DType, ExpertsPrecision, Mode, MoeCommBackend, RunConfig
from runner.schema.layout import Layout
from runner.schema.problems import Problem

FIELD = "parallelism.moe_comm_backend"
STANDARD = "use parallelism.moe_comm_backend=standard"
WHY = {
    MoeCommBackend.minimal_async_ep: "copies tokens to peers through CUDA symmetric memory (torch.distributed._symmetric_memory's "
    "CUDA backend) with Triton GPU kernels",
    MoeCommBackend.deepep: "runs DeepEP's CUDA kernels (the deep_ep library, built against NVSHMEM)",
    MoeCommBackend.hybridep: "runs DeepEP's HybridEP CUDA kernels (the deep_ep library's HybridEPBuffer, TMA)",
}


def check(cfg: RunConfig, lay: Layout | None, out: list[Problem]) -> None:
    """A backend other than standard: an EP layout, a CUDA cluster of the capability its kernels need, and what
    TorchTitan's update_ep_token_dispatcher_config / maybe_update_minimal_async_ep_config would refuse at start-up."""
    b = cfg.parallelism.moe_comm_backend
    if b == MoeCommBackend.standard:
        return
    need, c, v = moe_comm.BACKENDS[b], cfg.cluster, b.value
    if cfg.mode == Mode.dryrun:
        why = f"the dry run plays a rank on fake tensors, on which {v}'s kernels do not run; mode=plan counts its host reads"
        out.append(Problem(FIELD, v, why, f"{STANDARD} to rehearse the layout (the token exchange TorchTitan builds by default)"))
    if cfg.parallelism.ep < 2:
        out.append(
            Problem(
                FIELD,
                v,
                f"{v} exchanges tokens between expert-parallel ranks, and parallelism.ep = {cfg.parallelism.ep}",
                f"set parallelism.ep >= 2, or {STANDARD}",
            )
        )
    if c.device != DeviceType.cuda:
        why = f"{v} {WHY[b]}; cluster {c.name} computes on {c.device.value} with {c.backend.value}, which has none of them"
        out.append(Problem(FIELD, v, why, f"{STANDARD} here (torch all-to-all, gloo too); {v} validates against a CUDA cluster"))
        return
    cc = precision.parse_capability(c.compute_capability)
    if need.min_capability and cc is not None and cc < precision.parse_capability(need.min_capability):
        out.append(
            Problem(
                FIELD, v, f"{v}'s kernels need SM {need.min_capability} or newer; cluster {c.name} has SM {c.compute_capability}", STANDARD
            )
        )
    if need.full_ac and cfg.training.activation_checkpoint != ActivationCheckpoint.full:
        act = cfg.training.activation_checkpoint.value
        out.append(
            Problem(
                FIELD,
                v,
                f"TorchTitan runs {v} only with every block recomputed; training.activation_checkpoint = {act}",
                f"set training.activation_checkpoint=full, or {STANDARD}",
            )
        )
    if b == MoeCommBackend.minimal_async_ep and cfg.precision.param_dtype not in (DType.bfloat16, DType.float32):
        out.append(
            Problem(
                FIELD, v, f"its buffers hold bfloat16 or float32 rows; precision.param_dtype = {cfg.precision.param_dtype.value}", STANDARD
            )
        )
    if b in (MoeCommBackend.deepep, MoeCommBackend.minimal_async_ep) and cfg.precision.experts != ExpertsPrecision.high:
        why = (
            f"precision.experts = {cfg.precision.experts.value} pads each expert's token group, which only TorchAO's all-to-all "
            f"dispatcher and HybridEP do (TorchTitan's swap_token_dispatcher raises for {v}'s dispatcher)"
        )
        out.append(Problem(FIELD, v, why, "use parallelism.moe_comm_backend=hybridep or standard, or precision.experts=high"))
    if need.one_node and lay is not None:
        dpn = c.devices_per_node
        if dpn > 0 and (lay.ep > dpn or dpn % lay.ep):
            why = f"{v} maps its peers' buffers through CUDA IPC, inside one node; EP groups of {lay.ep} do not fit nodes of {dpn} devices"
            out.append(Problem(FIELD, v, why, f"use parallelism.ep dividing {dpn}, or {STANDARD}"))


def installed(cfg: RunConfig, out: list[Problem]) -> None:
    """MACHINE rule: at launch, the library the backend's kernels come from is importable on this node."""
    b = cfg.parallelism.moe_comm_backend
    lib = moe_comm.BACKENDS[b].library
    if cfg.cluster.device == DeviceType.cuda and lib and importlib.util.find_spec(lib) is None:
        fix = (
            "install DeepEP (github.com/deepseek-ai/DeepEP, built against NVSHMEM) on every node" if lib == "deep_ep" else f"install {lib}"
        )
        out.append(
            Problem(FIELD, b.value, f"{b.value} needs the {lib} library, which this node's Python cannot import", f"{fix}, or {STANDARD}")
        )
