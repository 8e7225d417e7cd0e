"""Which families export to Hugging Face, as which `transformers` architecture (torch-free: validation reads it).

Every family the runner trains has a TorchTitan `state_dict_adapter` (TorchTitan 0.3.0); an export also needs a
`transformers` class that computes the same function with the family's numbers. Kimi K2 has none without remote
code; gpt-oss and Qwen3.5 do not train on CPU, where exports are checked against `transformers`' logits, so
they are not offered until they are.
"""

from __future__ import annotations

from runner.config.schema import ModelConfig

ARCHITECTURES = {
    "llama3": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
"""Export key (the family, `qwen3_moe` for Qwen3 with experts) -> the `transformers` class its config.json names."""

NOT_EXPORTED = {
    "kimi_k2_7": "transformers has no Kimi K2 class without remote code",
    "gpt_oss": "gpt-oss does not train on CPU, where an export is checked against transformers' logits",
    "qwen3_5": "Qwen3.5 does not train on CPU, where an export is checked against transformers' logits",
}
"""Families with a TorchTitan adapter but no checked export, and why."""


SIGMOID_ROUTER = {"deepseek_v3": ("671B",)}
"""Families whose transformers class routes only with sigmoid scores -> the TorchTitan flavors that do (the others use a
softmax; a test checks this against TorchTitan's registry, and the export checks the built model's router itself)."""


def key(m: ModelConfig) -> str:
    """The ARCHITECTURES key of a model: its family, or qwen3_moe for Qwen3 with routed experts."""
    return "qwen3_moe" if m.name == "qwen3" and m.num_experts > 0 else m.name


def refusal(m: ModelConfig) -> str | None:
    """Why `m` cannot be exported to Hugging Face (None: it can)."""
    if key(m) in ARCHITECTURES:
        flavors = SIGMOID_ROUTER.get(m.name)
        if flavors and m.flavor not in flavors:
            return (
                f"model.name {m.name} (flavor {m.flavor}) cannot be exported: transformers' {ARCHITECTURES[key(m)]} scores experts "
                f"with a sigmoid, TorchTitan's {m.flavor} with a softmax; flavors that export: {', '.join(flavors)}"
            )
        return None
    why = NOT_EXPORTED.get(m.name, "the runner has no transformers architecture for it")
    return f"model.name {m.name} has no Hugging Face export: {why}; families that export: {', '.join(sorted(ARCHITECTURES))}"
