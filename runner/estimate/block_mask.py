"""FlexAttention's block masks of a step (torch-free): how many TorchTitan builds, their memory and the work of
building them, for the plan and the dry runs.

On a CUDA cluster every family attends with FlexAttention (the runner asks TorchTitan's registry for `attn_backend=
"flex"`: runner/run/titan/model.py), which takes a BlockMask built by the model's `get_attention_masks(positions)`
(TorchTitan's `models/common/decoder.py`: `create_block_mask` over the causal AND packed-document mask mods, batch B,
heads None (broadcast: 1), seq_len queries and keys, BLOCK_SIZE 128, full blocks kept apart). Its tensors, per mask:
kv_num_blocks, full_kv_num_blocks, q_num_blocks, full_q_num_blocks of (B, 1, n) int32 and their four index tensors of
(B, 1, n, n) int32, n = ceil(seq_len / 128): 16 B n (n + 1) per sample. gpt-oss builds a second one for its
sliding-window layers.

Which the runner builds (runner.run.titan.step):
- a pipeline: one mask per step for this DP rank's whole batch (`batch_masks`), which the schedule splits per
  microbatch and holds through the step;
- no pipeline, packed documents (data.document_mask on real data): one per microbatch (`document_inputs`), held from
  its forward through its backward (the attention saves it);
- no pipeline, one document per sample (synthetic data): one built with the model (`_extra_inputs`), kept for the run.

Under context parallelism the mask is built over the whole sequence before TorchTitan's load balancer shards it, and
that is what is counted. On a CPU cluster the attention is SDPA, which takes no BlockMask (none is counted).
Building one evaluates the mask mods at every (query, key) of B x seq_len x seq_len: the work counted here; its
seconds are measured by the dry run (`runner.run.dryrun`), not modelled.
"""

from __future__ import annotations

import math

from runner.schema import DataSource, DeviceType, RunConfig
from runner.schema.layout import Layout

BLOCK_SIZE = 128
"""TorchTitan's FlexAttention.Config.block_size (torch's _DEFAULT_SPARSE_BLOCK_SIZE), in tokens."""
INDEX_BYTES = 4
"""The block counts and indices are int32."""
TENSORS = 4
"""Block-count tensors of a BlockMask (kv, full kv, q, full q), each with its index tensor."""


def flex(cfg: RunConfig) -> bool:
    """The step's attention takes block masks: FlexAttention, the CUDA path."""
    return cfg.cluster.device == DeviceType.cuda


def documents(cfg: RunConfig) -> bool:
    """Samples are packed documents with their positions (data.document_mask on real data)."""
    return cfg.data.name != DataSource.synthetic and cfg.data.document_mask


def masks_per_build(cfg: RunConfig) -> int:
    """gpt-oss's get_attention_masks builds a sliding-window mask beside the full one."""
    return 2 if cfg.model.name == "gpt_oss" else 1


def mask_bytes(batch: int, seq_len: int) -> int:
    """Bytes of one BlockMask of `batch` samples of seq_len queries and keys, as create_block_mask allocates them."""
    n = math.ceil(seq_len / BLOCK_SIZE)
    return INDEX_BYTES * TENSORS * batch * n * (n + 1)


def mask_batch(cfg: RunConfig, lay: Layout, micro: int) -> int:
    """Samples of one mask: this DP rank's batch of `micro` microbatches with a pipeline, else one microbatch."""
    return micro * cfg.training.microbatch_size if lay.pp > 1 else cfg.training.microbatch_size


def builds_per_step(cfg: RunConfig, lay: Layout, micro: int) -> int:
    """Masks built per training step (0: the one built with the model serves every step)."""
    if not flex(cfg):
        return 0
    if lay.pp > 1:
        return masks_per_build(cfg)
    return micro * masks_per_build(cfg) if documents(cfg) else 0


def held_bytes(cfg: RunConfig, lay: Layout, micro: int) -> float:
    """Bytes of block masks a rank holds at the step's peak (one build's worth: see the module docstring)."""
    if not flex(cfg):
        return 0.0
    return float(masks_per_build(cfg) * mask_bytes(mask_batch(cfg, lay, micro), cfg.training.seq_len))


def plan(cfg: RunConfig, lay: Layout, micro: int) -> dict[str, float | int]:
    """The plan's keys: the masks held, the builds per step and the mask-mod evaluations they make."""
    builds, s = builds_per_step(cfg, lay, micro), cfg.training.seq_len
    return {
        "block_mask_gb_per_gpu": held_bytes(cfg, lay, micro) / 1e9,
        "block_mask_builds_per_step": builds,
        "block_mask_evaluations_per_step": builds * mask_batch(cfg, lay, micro) * s * s,
    }
