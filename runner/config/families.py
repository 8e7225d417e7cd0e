"""What the runner knows of each TorchTitan model family without importing it: its registered flavors, how
its blocks are built (for conf/model/ comments and the model table of docs/models.md), and where it cannot run.

Torch-free. The architecture numbers of each flavor live in conf/model/<family>_<flavor>.yaml, written by
scripts/gen_models.py from TorchTitan's registries; tests/test_families.py checks the flavors below, the files
and the parameter and FLOP counts of runner/estimate/flops.py against TorchTitan, every flavor.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from runner.config import family_support
from runner.schema import ModelConfig, wording


@dataclass(frozen=True)
class Family:
    title: str
    """The family's name in prose."""
    flavors: tuple[str, ...]
    """TorchTitan's registered flavors, in its registry's order."""
    shape: str
    """How its blocks are built, in a few words (docs/models.md's list of families above the model table)."""
    kernel_package: str = ""
    """A GPU kernel package the family's model module imports on load (qwen3_5: flash-linear-attention's `fla`,
    Triton), which CPU machines lack; scripts/gen_models.py and tests/test_families.py read the registry with
    placeholders for it (building a config or a meta-device model calls no kernel)."""
    cpu_flavors: tuple[str, ...] = ()
    """Flavors a test trains on CPU ranks (the model table's CPU column says yes for them, plan only for the rest)."""
    cpu_rejection: str = ""
    """Why the family cannot train on CPU ranks, with the fix; "" = it can. Validation refuses such a model
    on a CPU cluster with this reason and keeps it valid for GPU clusters."""


FAMILIES: dict[str, Family] = {
    "llama3": Family(
        "Llama 3", ("debugmodel", "1B", "3B", "8B", "70B", "405B"), "dense, grouped-query attention", cpu_flavors=("debugmodel",)
    ),
    "qwen3": Family(
        "Qwen3",
        ("debugmodel", "debugmodel_non_fused_qkv", "0.6B", "1.7B", "4B", "8B", "14B", "32B", "debugmodel_moe", "30B-A3B", "235B-A22B"),
        "grouped-query attention with q/k norms; dense or MoE in every block",
        cpu_flavors=("debugmodel", "debugmodel_moe"),  # tests/test_family_train.py
    ),
    "deepseek_v3": Family(
        "DeepSeek-V3",
        ("debugmodel", "16B", "236B", "671B"),
        "multi-head latent attention; MoE with shared experts after dense first blocks",
        cpu_flavors=("debugmodel",),
    ),
    "gpt_oss": Family(
        "gpt-oss",
        ("debugmodel", "20b", "120b"),
        "grouped-query attention with sinks and biases, sliding window in every other block; MoE with biases",
        cpu_rejection=family_support.SUPPORT["gpt_oss"].cpu,
    ),
    "kimi_k2_7": Family(
        "Kimi",
        ("debugmodel", "moonlight-16B-A3B", "Kimi-VL-A3B", "Kimi-K2.5"),
        "DeepSeek-V3's blocks (multi-head latent attention, MoE with shared experts); the text tower of VL flavors",
        cpu_flavors=("debugmodel",),  # tests/test_family_train.py
    ),
    "qwen3_5": Family(
        "Qwen3.5",
        ("debugmodel", "debugmodel_moe", "0.8B", "2B", "4B", "9B", "27B", "35B-A3B", "122B-A10B", "397B-A17B"),
        "Gated DeltaNet linear attention in 3 of 4 blocks, gated softmax attention in the 4th; dense or MoE with a gated shared expert",
        kernel_package="fla",
        cpu_rejection=family_support.SUPPORT["qwen3_5"].cpu,
    ),
}


def family(m: ModelConfig) -> Family | None:
    return FAMILIES.get(m.name)


def tp_degrees(m: ModelConfig) -> list[int]:
    """TP degrees the attention can be split over: they must divide the query heads, (GQA) the KV heads and
    (Qwen3.5) the linear-attention key and value heads."""
    g = m.num_heads if m.kv_lora_rank > 0 else gcd(m.num_heads, m.num_kv_heads)
    g = gcd(g, m.num_linear_key_heads, m.num_linear_value_heads)  # Gated DeltaNet's heads split the same way (gcd(g, 0, 0) = g)
    return [d for d in range(1, g + 1) if g % d == 0]


def ep_degrees(m: ModelConfig) -> list[int]:
    """EP degrees the routed experts split evenly over."""
    return [d for d in range(1, m.num_experts + 1) if m.num_experts % d == 0]


def describe(m: ModelConfig) -> str:
    """The flavor's shape in one phrase: attention, then FFN."""
    from runner.estimate import flops

    if flops.is_mla(m):
        q = f"q rank {m.q_lora_rank}" if m.q_lora_rank else "direct q"
        attention = f"MLA {m.num_heads} heads, kv rank {m.kv_lora_rank}, {q}"
    else:
        attention = f"GQA {m.num_heads}/{m.num_kv_heads} heads of {flops.head_dim(m)}"
        extras = [
            "q/k norms" * m.qk_norm,
            "sinks" * m.attention_sinks,
            f"window {m.sliding_window} in {m.full_attention_interval - 1} of {m.full_attention_interval} blocks" * bool(m.sliding_window),
        ]
        attention += "".join(f", {e}" for e in extras if e)
    if flops.is_hybrid(m):
        n = m.full_attention_interval
        attention = f"Gated DeltaNet {m.num_linear_key_heads}/{m.num_linear_value_heads} heads in {n - 1} of {n} blocks, {attention}"
        attention += ", output gate" if m.attention_output_gate else ""
    if not flops.is_moe(m):
        return f"{attention}; dense SwiGLU {m.ffn_hidden_dim}"
    moe = f"{m.num_experts} experts of {m.moe_hidden_dim}, top-{m.num_experts_per_token}"
    moe += f" + {m.num_shared_experts} shared" if m.num_shared_experts else ""
    moe += f", {wording.count(m.num_dense_layers, 'dense block')} first" if m.num_dense_layers else ""
    return f"{attention}; {moe}"


def size(n: int) -> str:
    """A parameter count as people write it: 6.16M, 8.03B, 1.03T."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def legend() -> list[str]:
    """docs/models.md's list of families: module, title, shape, the GPU kernel package it needs."""
    out = []
    for name, f in FAMILIES.items():
        line = f"- **{f.title}** (`{name}`): {f.shape}"
        kernel = f"; its model module imports `{f.kernel_package}` (GPU kernels)" if f.kernel_package else ""
        out.append(f"{line}{kernel}.")
    return out


def table_rows(options: dict[str, ModelConfig], alias_of: dict[str, str]) -> list[str]:
    """docs/models.md's model table: one row per option (its alias beside it), counted by runner.estimate.flops."""
    from runner.estimate import flops

    rows = [
        "| option | family | flavor | params | active | TP degrees | EP degrees | trains on CPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in options.items():
        f = FAMILIES[m.name]
        option = f"`{name}`" + (f" (`{alias_of[name]}`)" if name in alias_of else "")
        cpu = "yes" if m.flavor in f.cpu_flavors else "no: needs a GPU" if f.cpu_rejection else "plan only"
        ep = ", ".join(map(str, ep_degrees(m))) if flops.is_moe(m) else "-"
        tp = ", ".join(map(str, tp_degrees(m)))
        active = size(flops.num_active_params(m)) if flops.is_moe(m) else "="
        rows.append(f"| {option} | {f.title} | {m.flavor} | {size(flops.num_params(m))} | {active} | {tp} | {ep} | {cpu} |")
    return rows
