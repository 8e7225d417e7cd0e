"""model.init_from: a local Hugging Face folder the run starts from. Torch-free.

`check` (CONFIG) needs no files: the family must have a TorchTitan state_dict_adapter. `files` (FILES, the preflight
of mode=validate and mode=train) reads the folder's config.json and index, and the shards' safetensors headers, and
on a replay compares the folder with what the frozen file recorded (model.init_record, written by
runner.config.freeze.pin).
"""

from __future__ import annotations

from pathlib import Path

from runner.formats import hf_folder
from runner.formats.user_files import UnreadableFile
from runner.schema import ModelConfig, RunConfig
from runner.schema.problems import Problem

FIELD = "model.init_from"
SAVE = "a folder written by transformers' save_pretrained (or `hf download <repo> --local-dir <folder>`)"


def check(cfg: RunConfig, out: list[Problem]) -> None:
    m = cfg.model
    if not m.init_from:
        if m.init_record:
            out.append(Problem("model.init_record", "(set)", "records a Hugging Face folder, but model.init_from is empty", "drop it"))
        return
    if m.name not in hf_folder.ADAPTERS:
        why = hf_folder.NO_ADAPTER.get(m.name, f"TorchTitan has no state_dict_adapter for {m.name}")
        out.append(
            Problem(
                "model.name",
                m.name,
                f"{why}, so {FIELD} cannot be read into it",
                f"start {', '.join(hf_folder.ADAPTERS)} from Hugging Face weights, or drop {FIELD}",
            )
        )
        return


def files(cfg: RunConfig, out: list[Problem]) -> None:
    """The folder on this machine now: config.json, the shards' headers and, on a replay, the frozen record."""
    m = cfg.model
    if m.init_from and m.name in hf_folder.ADAPTERS and folder(m, out):
        _unchanged(m, out)


def folder(m: ModelConfig, out: list[Problem]) -> bool:
    """config.json against model.*, the index, the dtype and each shard's header; True when the folder could be read
    far enough to compare."""
    path = Path(m.init_from)
    config = _config(path, out)
    if config is None or not _has_weights(path, out):
        return False
    if not _family(m, path, config, out):
        return False
    for name, want, got, key in hf_folder.differences(config, m):
        out.append(
            Problem(
                f"model.{name}",
                want,
                f"{path}/{hf_folder.CONFIG} has {key} = {got}: the run's model is not the checkpoint's",
                f"set model.{name}={got} (or pick the model option of that checkpoint, or another {FIELD})",
            )
        )
    _router(m, path, config, out)
    _dtype(path, config, out)
    return _shards(path, out)


def _router(m: ModelConfig, path: Path, config: dict, out: list[Problem]) -> None:
    diff = hf_folder.router_differences(config, m)
    flavors = ", ".join(hf_folder.ROUTERS.get(m.name, {}))
    if diff is None:
        why = f"TorchTitan's {m.name} {m.flavor} routes with softmax scores; {path} is a checkpoint of the sigmoid, grouped router"
        out.append(Problem("model.flavor", m.flavor, why, f"set model.flavor to {flavors} (the router; model.* keep the numbers)"))
    for key, ours, theirs in diff or []:
        why = f"{path}/{hf_folder.CONFIG} has {key} = {theirs}, the flavor's router {ours}"
        out.append(Problem("model.flavor", m.flavor, why, f"a checkpoint with {m.name} {m.flavor}'s router, or drop {FIELD}"))


def _config(path: Path, out: list[Problem]) -> dict | None:
    if not path.is_dir():
        out.append(Problem(FIELD, str(path), "no such local folder (nothing is downloaded)", f"give {SAVE}"))
        return None
    try:
        return hf_folder.read_config(path)
    except UnreadableFile as e:
        out.append(_unreadable(path, e))
        return None


def _unreadable(path: Path, e: UnreadableFile) -> Problem:
    return Problem(FIELD, str(path), f"{e.path} {e.why}", e.fix)


def _has_weights(path: Path, out: list[Problem]) -> bool:
    index = path / hf_folder.INDEX
    if index.is_file():
        try:
            if hf_folder.read_index(path)["weight_map"]:
                return True
        except UnreadableFile as e:
            out.append(_unreadable(path, e))
            return False
        why = f"its {hf_folder.INDEX} maps no tensors"
    elif (path / hf_folder.SINGLE).is_file():
        return True
    else:
        why = f"holds no weights: neither {hf_folder.INDEX} nor {hf_folder.SINGLE}"
    out.append(Problem(FIELD, str(path), why, f"give {SAVE} (safetensors: save_pretrained(..., safe_serialization=True))"))
    return False


def _family(m: ModelConfig, path: Path, config: dict, out: list[Problem]) -> bool:
    kind = hf_folder.model_type(config)
    if kind in hf_folder.ADAPTERS[m.name]:
        return True
    fits = [f for f, kinds in hf_folder.ADAPTERS.items() if kind in kinds]
    fix = f"model=<a {fits[0]} option> (conf/model/)" if fits else f"a checkpoint of {m.name} ({', '.join(hf_folder.ADAPTERS[m.name])})"
    out.append(Problem("model.name", m.name, f"{path}/{hf_folder.CONFIG} is a {kind or 'unnamed'} checkpoint (model_type)", f"use {fix}"))
    return False


def _dtype(path: Path, config: dict, out: list[Problem]) -> None:
    quant, dtype = hf_folder.quantization(config), hf_folder.dtype(config)
    if quant:
        why = f"{path}/{hf_folder.CONFIG} declares {quant} quantized weights, which the run's fp32 master weights cannot take as they are"
    elif dtype and dtype not in hf_folder.HOLDS:
        holds = ", ".join(hf_folder.HOLDS)
        why = f"{path}/{hf_folder.CONFIG} has dtype {dtype}: the run holds {holds} weights exactly (its master weights are fp32)"
    else:
        return
    out.append(Problem(FIELD, str(path), why, "convert it first: model.to(torch.bfloat16).save_pretrained(<folder>)"))


def _shards(path: Path, out: list[Problem]) -> bool:
    missing = [name for name in hf_folder.shards(path) if not (path / name).is_file()]
    if missing:
        out.append(Problem(FIELD, str(path), f"the index names shards that are not there: {', '.join(missing)}", f"give {SAVE}"))
        return False
    held, readable = set(hf_folder.HOLDS.values()), True
    for name in hf_folder.shards(path):
        try:
            other = sorted(hf_folder.header_dtypes(path / name) - held)
        except UnreadableFile as e:
            out.append(_unreadable(path, e))
            readable = False
            continue
        if other:
            why = f"{name} holds {', '.join(other)} tensors: the run holds {', '.join(sorted(held))} weights exactly"
            out.append(Problem(FIELD, str(path), why, "convert it first: model.to(torch.bfloat16).save_pretrained(<folder>)"))
    return readable


def _unchanged(m: ModelConfig, out: list[Problem]) -> None:
    if not m.init_record:
        return
    diff = hf_folder.changed(m.init_record, hf_folder.record(Path(m.init_from)))
    if diff:
        out.append(
            Problem(
                FIELD,
                m.init_from,
                f"changed since this run was frozen ({'; '.join(diff)}): the replay would start from other weights",
                "restore the folder the run started from, or start a new run from this one (without model.init_record)",
            )
        )
