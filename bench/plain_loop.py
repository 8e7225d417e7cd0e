"""Minimal training loop over TorchTitan's building blocks, the baseline for the runner.

torchrun --nproc-per-node 4 bench/plain_loop.py <out.json> <steps> <seq_len> <global_batch> <microbatch>
dp_shard=2 x tp=2, debug llama3, fp32, AdamW; writes the median tokens/s (steps after the first).
"""

import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from runner.run.titan import cpu as titan_cpu

out, steps, seq, gbs, mbs = sys.argv[1], *map(int, sys.argv[2:6])
torch.set_num_threads(max(1, os.cpu_count() // int(os.environ["LOCAL_WORLD_SIZE"])))
titan_cpu.patch_device_globals()
dist.init_process_group("gloo")

from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed.utils import clip_grad_norm_, set_spmd_backend  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402

DP, TP = 2, 2
pd = ParallelDims(dp_replicate=1, dp_shard=DP, cp=1, tp=TP, pp=1, ep=1, world_size=4, spmd_backend="partial_dtensor")
pd.build_mesh()
set_spmd_backend("partial_dtensor")
spec = model_registry("debugmodel")
cfg = spec.model
titan_cpu.use_sdpa(cfg)
training = TrainingConfig(local_batch_size=mbs, seq_len=seq, steps=steps, mixed_precision_param="float32")
par = ParallelismConfig(data_parallel_shard_degree=DP, tensor_parallel_degree=TP, spmd_backend="partial_dtensor")
cfg.update_from_config(config=SimpleNamespace(training=training, parallelism=par))
with torch.device("meta"):
    model = cfg.build()
model = spec.parallelize_fn(
    model, parallel_dims=pd, training=training, parallelism=par, compile_config=CompileConfig(), ac_config=None, dump_folder="/tmp"
)
titan_cpu.force_sum_reduction(model)
model.to_empty(device="cpu")
with torch.no_grad():
    model.init_weights(buffer_device=None)
opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)  # as the runner
loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=2048))
ntok = torch.tensor(float(gbs * seq))
dp_rank = pd.get_mesh("batch").get_local_rank()
g = torch.Generator().manual_seed(dp_rank)
times = []
for _ in range(steps):
    t0 = time.perf_counter()
    for _ in range(gbs // DP // mbs):
        batch = torch.randint(0, 2048, (mbs, seq + 1), generator=g)
        loss, _ = loss_fn(model(batch[:, :-1]), batch[:, 1:], ntok)
        loss.backward()
    clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    dist.all_reduce(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())
    times.append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump({"tokens_per_s_median": statistics.median(gbs * seq / t for t in times[1:])}, f)
dist.destroy_process_group()
