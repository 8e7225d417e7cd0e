"""MoE token exchange under expert parallelism as numbers: what each of TorchTitan 0.3.0's `moe_comm_backend`s needs
(validation reads it), the bytes its dispatch and combine move and the host reads it makes (the plan reads them).

From TorchTitan 0.3.0's models/common/token_dispatcher.py and distributed/{minimal_async_ep,deepep}/: `standard`
(AllToAllTokenDispatcher) sends each token once per routed expert with torch's all-to-all and reads the splits on
the host (`.tolist()`) in every MoE block's forward; `minimal_async_ep` copies the same rows to peers through CUDA
symmetric memory with Triton kernels, its counts staying on the device; `deepep` and `hybridep` (DeepEP's kernels)
send a token once to each rank that holds any of its experts and combine it there before it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

from runner.schema import MoeCommBackend


@dataclass(frozen=True)
class Backend:
    library: str
    """What it runs on besides torch: the import a CUDA node needs ("" = torch alone)."""
    cuda_only: bool
    """Its kernels are CUDA's (symmetric memory, NVSHMEM, TMA): no CPU or gloo path."""
    min_capability: str
    """Lowest CUDA compute capability its kernels are built for ("" = any)."""
    full_ac: bool
    """TorchTitan refuses it unless every block is recomputed (training.activation_checkpoint=full)."""
    one_node: bool
    """Its peers are mapped through CUDA IPC: every EP group inside one node."""
    dedup: bool
    """A token goes once to each rank holding any of its experts (not once per expert)."""
    host_reads: bool
    """Its training dispatch reads the routing counts on the host: one synchronization per MoE block per forward."""


BACKENDS: dict[MoeCommBackend, Backend] = {
    MoeCommBackend.standard: Backend("", False, "", False, False, False, True),
    MoeCommBackend.minimal_async_ep: Backend("triton", True, "", True, True, False, False),
    MoeCommBackend.deepep: Backend("deep_ep", True, "9.0", False, False, True, True),
    MoeCommBackend.hybridep: Backend("deep_ep", True, "9.0", False, False, True, False),
}
"""What each backend needs and does; the docs' table (docs/models.md, Communication backends) says the same."""


def copies_per_token(num_experts: int, top_k: int, ep: int, dedup: bool) -> float:
    """Rows a token sends to other EP ranks in one dispatch, under uniform routing: top_k x (ep-1)/ep without
    deduplication; with it, the expected number of other ranks holding at least one of its top_k experts,
    (ep-1) x (1 - C(E - E/ep, k) / C(E, k))."""
    if ep <= 1:
        return 0.0
    if not dedup:
        return top_k * (ep - 1) / ep
    per_rank = num_experts // ep
    return (ep - 1) * (1 - comb(num_experts - per_rank, top_k) / comb(num_experts, top_k))


def host_syncs_per_step(backend: MoeCommBackend, moe_blocks: int, forwards: int) -> int:
    """Host synchronizations the token exchange adds to a step: one per MoE block per forward (each microbatch's, and
    its recomputation under activation checkpointing) where the backend reads counts on the host."""
    return moe_blocks * forwards if BACKENDS[backend].host_reads else 0
