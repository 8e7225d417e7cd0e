"""A local Hugging Face folder as the config layer sees it: config.json, the weights index, the shards' headers.

Torch-free: validation compares config.json with model.* and reads the index (never the weights); the launch's
preflight also reads each shard's safetensors header (its first bytes: tensor names, dtypes, shapes), and freezing
records a fingerprint of the folder that a replay checks. The weights themselves are read on the ranks, through the
family's TorchTitan state_dict_adapter (runner.run.titan.hf_adapter).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.formats.user_files import UnreadableFile, parse_json, read_json, wrong
from runner.schema import ModelConfig

INIT_FIELDS = ("init_from", "init_format", "init_record")
"""ModelConfig fields that say where the weights started, not what the model is."""

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FIX = "save the folder again with transformers' save_pretrained (or `hf download <repo> --local-dir <folder>`)"
"""The fix of a file of the folder that cannot be read."""
MAX_HEADER = 100_000_000
"""The largest safetensors header, in bytes (the safetensors library's own limit)."""

ADAPTERS: dict[str, tuple[str, ...]] = {
    "llama3": ("llama",),
    "qwen3": ("qwen3", "qwen3_moe"),
    "deepseek_v3": ("deepseek_v3",),
    "qwen3_5": ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"),
    "kimi_k2_7": ("kimi_k25", "kimi_k2"),
}
"""Family -> the config.json model_types its TorchTitan 0.3.0 state_dict_adapter reads (a test checks every family here
has one, torchtitan/models/<family>/state_dict_adapter.py, whose key mapping keeps every tensor)."""

NO_ADAPTER = {
    "gpt_oss": "TorchTitan 0.3.0's gpt_oss state_dict_adapter maps the experts as mlp1_weight/mlp2_bias..., which its model "
    "names mlp1_weight_EGD/mlp2_bias_ED...: every routed expert would stay at its random initialization",
}
"""Families whose adapter exists but cannot be used, and why (tests/test_hf_load.py checks the reason still holds)."""

ROUTERS: dict[str, dict[str, dict[str, Any]]] = {
    "deepseek_v3": {"671B": {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True}},
}
"""Family -> flavor -> its router in config.json's terms, for families whose transformers class has one router only:
DeepseekV3 routes with sigmoid scores over expert groups, which of TorchTitan's flavors only 671B does (the others use
softmax). The flavor gives the router (model.* does not name it); a test checks these against TorchTitan's registry."""

HOLDS = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
"""Checkpoint dtypes the run's fp32 master weights hold exactly (config.json's name -> the safetensors header's)."""


@dataclass(frozen=True)
class Field:
    name: str
    """The ModelConfig field."""
    keys: tuple[str, ...]
    """config.json keys that hold it, the first present wins (transformers has renamed some)."""
    families: tuple[str, ...] = ()
    """Families it is compared for; () = all."""


FIELDS = (
    Field("dim", ("hidden_size",)),
    Field("num_layers", ("num_hidden_layers",)),
    Field("num_heads", ("num_attention_heads",)),
    Field("num_kv_heads", ("num_key_value_heads",), ("llama3", "qwen3", "gpt_oss", "qwen3_5")),
    Field("vocab_size", ("vocab_size",)),
    Field("ffn_hidden_dim", ("intermediate_size",)),
    Field("weight_tying", ("tie_word_embeddings",)),
    Field("num_experts", ("num_experts", "num_local_experts", "n_routed_experts")),
    Field("num_experts_per_token", ("num_experts_per_tok",)),
    Field("num_shared_experts", ("n_shared_experts",), ("deepseek_v3", "kimi_k2_7")),
    Field("moe_hidden_dim", ("moe_intermediate_size",)),
    Field("num_dense_layers", ("first_k_dense_replace",), ("deepseek_v3", "kimi_k2_7")),
    Field("head_dim", ("head_dim",), ("qwen3", "gpt_oss", "qwen3_5")),
    Field("kv_lora_rank", ("kv_lora_rank",), ("deepseek_v3", "kimi_k2_7")),
    Field("q_lora_rank", ("q_lora_rank",), ("deepseek_v3", "kimi_k2_7")),
    Field("qk_nope_head_dim", ("qk_nope_head_dim",), ("deepseek_v3", "kimi_k2_7")),
    Field("qk_rope_head_dim", ("qk_rope_head_dim",), ("deepseek_v3", "kimi_k2_7")),
    Field("v_head_dim", ("v_head_dim",), ("deepseek_v3", "kimi_k2_7")),
    Field("rope_theta", ("rope_theta",)),
    Field("num_mtp_layers", ("num_nextn_predict_layers",), ("deepseek_v3",)),
)
"""The architecture numbers compared between config.json and model.* (rope_theta also inside rope_parameters)."""


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of config.json (a multimodal checkpoint nests it under text_config)."""
    return config.get("text_config") or config


def model_type(config: dict[str, Any]) -> str:
    return str(config.get("model_type") or text_config(config).get("model_type") or "")


def key(config: dict[str, Any], f: Field) -> str:
    """The config.json key that holds field f (the first of f.keys present; the first one when none is)."""
    c = text_config(config)
    return next((k for k in f.keys if k in c), f.keys[0])


def hf_value(config: dict[str, Any], f: Field, m: ModelConfig) -> Any:
    """config.json's value of field f in the runner's terms, or None where config.json does not say."""
    c = text_config(config)
    if f.name == "rope_theta":
        v = c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta"))
        return None if v is None else float(v)
    v = c.get(key(config, f))
    if f.name == "ffn_hidden_dim" and m.num_experts > 0 and m.num_dense_layers == 0:
        return None  # an all-MoE model (Qwen3 MoE) has no dense block; its intermediate_size is unused
    if f.name == "q_lora_rank" and v is None and "q_lora_rank" in c:
        return 0  # null: a direct query projection
    if f.name == "num_kv_heads" and v is None:
        return c.get("num_attention_heads")
    if f.name == "num_mtp_layers" and v is not None and m.num_mtp_layers <= v:
        return m.num_mtp_layers  # the folder's first MTP depths are read, the others left out (model.layers.{num_layers + k})
    if f.name == "head_dim" and v is not None and m.head_dim == 0:
        return v if v != m.dim // max(m.num_heads, 1) else 0  # the runner's 0 means dim // heads
    return v


def differences(config: dict[str, Any], m: ModelConfig) -> list[tuple[str, Any, Any, str]]:
    """(field, run's value, config.json's value, config.json key) for each compared number that differs."""
    out = []
    for f in FIELDS:
        if f.families and m.name not in f.families:
            continue
        got = hf_value(config, f, m)
        if got is None:
            continue
        want = getattr(m, f.name)
        if (bool(got) if isinstance(want, bool) else got) != want:
            out.append((f.name, want, got, key(config, f)))
    return out


def router_differences(config: dict[str, Any], m: ModelConfig) -> list[tuple[str, Any, Any]] | None:
    """(config.json key, the flavor's value, config.json's) for each router setting that differs; None when the flavor's
    router is not the one config.json's family has at all; [] when it is, or when the family has any router."""
    flavors = ROUTERS.get(m.name)
    if flavors is None:
        return []
    if m.flavor not in flavors:
        return None
    c = text_config(config)
    return [(k, v, c[k]) for k, v in flavors[m.flavor].items() if k in c and c[k] != v]


def dtype(config: dict[str, Any]) -> str:
    """The checkpoint's dtype as config.json names it ('' when it does not)."""
    c = text_config(config)
    return str(config.get("dtype") or config.get("torch_dtype") or c.get("dtype") or c.get("torch_dtype") or "")


def quantization(config: dict[str, Any]) -> str:
    """The quantization method config.json declares ('' = none)."""
    q = config.get("quantization_config") or text_config(config).get("quantization_config") or {}
    return str(q.get("quant_method") or q.get("quant_type") or "quantized") if q else ""


def read_config(folder: Path) -> dict[str, Any]:
    """config.json: an object whose keys this module reads hold their JSON kinds, else UnreadableFile."""
    path = folder / CONFIG
    config = read_json(path, FIX)
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise UnreadableFile(path, wrong("text_config", text, "an object"), FIX)
    for c, at in ((config, ""), (text or {}, "text_config.")):
        for k, v in c.items():
            ok, not_ok, want = _KINDS.get(k, (object, (), ""))
            if v is not None and (not isinstance(v, ok) or isinstance(v, not_ok)):
                raise UnreadableFile(path, wrong(at + k, v, want), FIX)
    return config


_NUMBER = ((int, float), bool, "a number")
_KINDS: dict[str, tuple[Any, Any, str]] = {
    **{k: _NUMBER for f in FIELDS for k in f.keys},
    "tie_word_embeddings": (bool, (), "true or false"),
    **dict.fromkeys(("model_type", "dtype", "torch_dtype"), (str, (), "a string")),
    **dict.fromkeys(("rope_parameters", "quantization_config"), (dict, (), "an object")),
}
"""config.json key -> (the kinds its value may be, kinds it may not, in words); null is always allowed (not said)."""


def read_index(folder: Path) -> dict[str, Any]:
    """model.safetensors.index.json: an object whose weight_map (absent: {}) maps tensor names to file names."""
    path = folder / INDEX
    index = read_json(path, FIX)
    names = {} if index.get("weight_map") is None else index["weight_map"]
    if not isinstance(names, dict):
        raise UnreadableFile(path, wrong("weight_map", names, "an object"), FIX)
    bad = next(((k, v) for k, v in names.items() if not isinstance(v, str)), None)
    if bad:
        raise UnreadableFile(path, wrong(f"weight_map[{json.dumps(bad[0])}]", bad[1], "a file name"), FIX)
    index["weight_map"] = names
    return index


def shards(folder: Path) -> list[str]:
    """The safetensors files of the folder: the index's shards, else the single model.safetensors."""
    if (folder / INDEX).is_file():
        return sorted(set(read_index(folder)["weight_map"].values()))
    return [SINGLE]


def header(path: Path) -> bytes:
    """The safetensors header of a shard: 8 bytes of little-endian length, then that many bytes of JSON; UnreadableFile
    when the length does not fit in the file (random bytes, a file cut short, another format)."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if n is not None and n <= min(size - 8, MAX_HEADER):
                return head + f.read(n)
    except OSError as e:
        raise UnreadableFile(path, f"cannot be read ({e.strerror or e})", FIX) from e
    if n is None:
        why = f"has {size} bytes, fewer than the 8 that give a safetensors header's length"
    elif n > MAX_HEADER:
        why = f"starts with a header length of {n} bytes, more than safetensors allows ({MAX_HEADER}): not a safetensors file"
    else:
        why = f"starts with a header length of {n} bytes, but holds {size}: cut short, or not a safetensors file"
    raise UnreadableFile(path, why, FIX)


def tensors(path: Path) -> dict[str, dict[str, Any]]:
    """A shard's header: tensor name -> dtype, shape and data_offsets, each checked, and the data they span must be the
    rest of the file (a shard cut short in its data is refused here, not on the ranks)."""
    head = header(path)
    meta = parse_json(head[8:], path, FIX)
    meta.pop("__metadata__", None)
    end = 0
    for name, t in meta.items():
        at = f"the tensor {name}"
        if not isinstance(t, dict):
            raise UnreadableFile(path, wrong(at, t, "an object"), FIX)
        for k, ok, want in (
            ("dtype", isinstance(t.get("dtype"), str), "a string"),
            ("shape", isinstance(t.get("shape"), list) and all(_count(d) for d in t["shape"]), "a list of sizes"),
            ("data_offsets", isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2, "[begin, end]"),
        ):
            if not ok:
                raise UnreadableFile(path, wrong(f"{at}'s {k}", t.get(k), want), FIX)
        begin, stop = t["data_offsets"]
        if not (_count(begin) and _count(stop) and begin <= stop):
            raise UnreadableFile(path, wrong(f"{at}'s data_offsets", t["data_offsets"], "[begin, end] with begin <= end"), FIX)
        end = max(end, stop)
    data = path.stat().st_size - len(head)
    if end != data:
        what = "cut short" if end > data else "not a safetensors file"
        raise UnreadableFile(path, f"has tensors that end at byte {end} of its data, which holds {data} bytes: {what}", FIX)
    return meta


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def header_dtypes(path: Path) -> set[str]:
    """The tensor dtypes a shard's header names (F32, BF16, F8_E4M3, ...)."""
    return {t["dtype"] for t in tensors(path).values()}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record(folder: Path) -> dict[str, Any]:
    """What the frozen file keeps of the folder: sha256 of config.json and of the index ('' without one), and each
    shard's size and header sha256 (not the weights, which can be hundreds of GB)."""
    index = folder / INDEX
    return {
        "config_sha256": _sha256(folder / CONFIG),
        "index_sha256": _sha256(index) if index.is_file() else "",
        "shards": {
            name: {"size": (folder / name).stat().st_size, "header_sha256": hashlib.sha256(header(folder / name)).hexdigest()}
            for name in shards(folder)
        },
    }


def changed(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between a frozen record and the folder now, in words."""
    out = [f"{key} {saved.get(key)} -> {now[key]}" for key in ("config_sha256", "index_sha256") if saved.get(key) != now[key]]
    before, after = saved.get("shards") or {}, now["shards"]
    out += [f"{name} missing now" for name in sorted(set(before) - set(after))]
    out += [f"{name} not in the record" for name in sorted(set(after) - set(before))]
    for name in sorted(set(before) & set(after)):
        was, now_ = before[name], after[name]
        diff = [f"{k} {was.get(k)} -> {now_[k]}" for k in ("size", "header_sha256") if was.get(k) != now_[k]]
        out += [f"{name}: {', '.join(diff)}"] if diff else []
    return out


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


def export_key(m: ModelConfig) -> str:
    """The ARCHITECTURES key of a model: its family, or qwen3_moe for Qwen3 with routed experts."""
    return "qwen3_moe" if m.name == "qwen3" and m.num_experts > 0 else m.name


def refusal(m: ModelConfig) -> str | None:
    """Why `m` cannot be exported to Hugging Face (None: it can)."""
    if export_key(m) in ARCHITECTURES:
        flavors = SIGMOID_ROUTER.get(m.name)
        if flavors and m.flavor not in flavors:
            return (
                f"model.name {m.name} (flavor {m.flavor}) cannot be exported: transformers' {ARCHITECTURES[export_key(m)]} scores experts "
                f"with a sigmoid, TorchTitan's {m.flavor} with a softmax; flavors that export: {', '.join(flavors)}"
            )
        return None
    why = NOT_EXPORTED.get(m.name, "the runner has no transformers architecture for it")
    return f"model.name {m.name} has no Hugging Face export: {why}; families that export: {', '.join(sorted(ARCHITECTURES))}"
