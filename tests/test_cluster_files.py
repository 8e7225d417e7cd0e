"""The cluster files as written, not as composed: each GPU's datasheet is stated once (conf/gpu/), a CUDA cluster
picks one and adds only its topology and launcher, and together they state every field that validation, the
planner, the predictor and the FP8 rules read. A composed config always carries the schema's default, so a
missing field (a memory bandwidth of 0, an fp32 high-precision dtype on a GPU) shows only in the YAML."""

from __future__ import annotations

import pytest
import yaml

from runner.config import validate
from runner.schema import ClusterConfig, DType
from tests.conftest import ROOT

CLUSTERS, GPUS = ROOT / "conf" / "cluster", ROOT / "conf" / "gpu"

DATASHEET = {
    "device": "validation, the device policy",
    "backend": "validation, the process group",
    "peak_tflops": "the planner's ideal compute, the predictor, MFU",
    "compute_capability": "the FP8 rules",
    "high_precision_dtype": "the FP8 recipes' precision.param_dtype",
    "device_memory_gb": "validation's memory check, the planner",
    "memory_bandwidth_gbs": "the predictor's non_matmul term",
    "intra_node_bandwidth_gbs": "the planner's and predictor's TP/EP/DP traffic",
    "achievable_mfu": "the planner's step time",
    "matmul_efficiency": "the predictor's compute term",
    "rank_overhead_gb": "the planner's memory",
}
"""Fields of a GPU's datasheet (conf/gpu/<gpu>.yaml), with who reads them."""
TOPOLOGY = {
    "name": "every message",
    "num_nodes": "validation's world size (null: required on the command line)",
    "devices_per_node": "validation's world size, TP placement",
    "inter_node_bandwidth_gbs": "the planner's and predictor's scale-out traffic",
    "mtbf_hours": "the planner's checkpoint interval (0: unknown, stated)",
    "checkpoint_write_gbs": "the planner's checkpoint interval (0: unknown, stated)",
    "local_write_gbs": "the planner's local-tier checkpoint interval (0: unknown, stated)",
}
"""Fields a CUDA cluster file itself states."""
LAUNCH = {"launcher", "max_restarts", "worker_start", "rdzv_host", "rdzv_port", "slurm", "peak_cache_dir", "profile"}
"""Fields whose schema default is right for a CUDA cluster unless its launcher says otherwise (no model reads them)."""
POSITIVE = ("intra_node_bandwidth_gbs", "inter_node_bandwidth_gbs", "device_memory_gb", "memory_bandwidth_gbs")


def _own(path) -> tuple[dict, list]:
    """A config file's own keys (under `cluster:` for a `# @package _global_` file) and its defaults list."""
    raw = yaml.safe_load(path.read_text())
    body = raw.get("cluster", {}) if path.read_text().startswith("# @package _global_") else raw
    return {k: v for k, v in body.items() if k != "defaults"}, raw.get("defaults", [])


def _datasheet(defaults: list) -> str | None:
    """The conf/gpu option a cluster's defaults list picks (`/gpu@_here_: <gpu>`, or `/gpu@cluster:` in a global file)."""
    picks = [v for d in defaults if isinstance(d, dict) for k, v in d.items() if k.startswith("/gpu@")]
    assert len(picks) <= 1, picks
    return picks[0] if picks else None


def _cuda_clusters() -> list[str]:
    cuda = []
    for path in sorted(CLUSTERS.glob("*.yaml")):
        own, defaults = _own(path)
        if _datasheet(defaults) or own.get("device") == "cuda":
            cuda.append(path.stem)
    return cuda


def test_every_cluster_field_is_placed():
    """A new ClusterConfig field must be put in one list here: stated by the datasheet, by the cluster, or a launch default."""
    fields = set(ClusterConfig.__dataclass_fields__)
    assert fields == set(DATASHEET) | set(TOPOLOGY) | LAUNCH
    assert not set(DATASHEET) & set(TOPOLOGY) and not (set(DATASHEET) | set(TOPOLOGY)) & LAUNCH


def test_one_datasheet_per_gpu_model():
    assert sorted(p.stem for p in GPUS.glob("*.yaml")) == ["a100_80gb", "b200", "h100_96gb", "h100_sxm_80gb", "h800"]
    for path in GPUS.glob("*.yaml"):
        own, defaults = _own(path)
        assert set(own) == set(DATASHEET) and defaults == [], path.name


@pytest.mark.parametrize("cluster", _cuda_clusters())
def test_cuda_cluster_states_every_field_it_is_read_for(cluster):
    """The cluster file picks a datasheet and states its topology; the two together state every field the models
    read, physical ones above zero, and FP8 keeps bf16 (not fp32) parameters on a GPU."""
    own, defaults = _own(CLUSTERS / f"{cluster}.yaml")
    gpu = _datasheet(defaults)
    assert gpu is not None, f"{cluster}: pick a datasheet, e.g. `- /gpu@_here_: h100_sxm_80gb`"
    assert not set(own) & set(DATASHEET), f"{cluster} restates its datasheet's {sorted(set(own) & set(DATASHEET))}"
    sheet, _ = _own(GPUS / f"{gpu}.yaml")
    stated = {**sheet, **own}
    missing = sorted((set(DATASHEET) | set(TOPOLOGY)) - set(stated))
    assert not missing, f"{cluster} (datasheet {gpu}) leaves {missing} to the schema default"
    assert [f for f in POSITIVE if not stated[f] > 0] == [], cluster
    assert stated["peak_tflops"]["bfloat16"] > 0 and stated["compute_capability"] and stated["achievable_mfu"] > 0
    assert (stated["device"], stated["backend"], stated["high_precision_dtype"]) == ("cuda", "nccl", "bfloat16")


def test_slurm_h100_trains_fp8_on_bf16_parameters(compose):
    """The new user's command: before, slurm_h100 had no compute capability (FP8 refused) and an fp32 high-precision dtype."""
    cfg = compose(
        [
            "recipe=llama3_70b_h100x1024",
            "precision=fp8_blockwise",
            "cluster=slurm_h100",
            "cluster.num_nodes=128",
            "cluster.slurm.partition=gpu",
            "mode=validate",
        ]
    )
    lay = validate.check(cfg)
    assert (lay.world_size, cfg.cluster.compute_capability, cfg.precision.param_dtype) == (1024, "9.0", DType.bfloat16)
    assert cfg.cluster.memory_bandwidth_gbs == 3350.0
