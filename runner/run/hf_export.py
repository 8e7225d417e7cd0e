"""`python -m runner.export <run folder | checkpoint folder> --format hf --out <folder>`: a checkpoint of any layout
as a Hugging Face folder that `transformers` loads (config.json, sharded safetensors with their index,
generation_config.json, the run's tokenizer).

One process streams the DCP checkpoint shard by shard: DCP reads the tensors of one output shard (whatever layout
wrote them: DCP reassembles each from the ranks' pieces), the family's TorchTitan adapter maps them to HF names
(`to_hf`), safetensors writes the shard, and they are dropped, so at most one shard's weights (`--max-shard-gb`)
are in memory. Everything is written into `<out>.partial` and renamed to `<out>` at the end: a refusal or a
crash leaves nothing under `<out>`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runner.config import freeze
from runner.formats import checkpoint, hf_folder, runfiles
from runner.formats.user_files import UnreadableFile
from runner.run import export_inputs
from runner.run.titan import hf_adapter as hf
from runner.schema import ModelConfig
from runner.schema.problems import ConfigError

WRITTEN = re.compile(
    r"^(config\.json|generation_config\.json|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|"
    r"tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|chat_template\.jinja)$"
)
"""The names an export writes: an out folder holding only these is an earlier export, replaced; anything else is refused."""


class ExportRefused(Exception):
    """The input or the out folder cannot be exported to; the message names the path, the value and the fix."""


@dataclass
class Source:
    checkpoint: Path
    """A published `step-<n>` checkpoint folder (COMPLETE.json)."""
    model: ModelConfig
    tokenizer: str = ""
    """The run's tokenizers JSON file ('' = the run had none: no tokenizer files are written)."""
    eos_token: str = ""
    reads: list[tuple[str, Path]] = field(default_factory=list)
    """(what, path) of every file or folder the run reads: an export never writes over one of them."""
    note: str = ""
    """One line saying why the export has no tokenizer and how to add one ('' = it has one, or the run had none)."""
    warn: bool = False
    """The note is a warning: the run had a tokenizer the export cannot take."""


def _run_config(run_dir: Path):
    frozen = run_dir / runfiles.FROZEN
    try:
        return freeze.load(frozen) if frozen.is_file() else None
    except (UnreadableFile, ConfigError) as e:
        raise ExportRefused(str(e)) from e


def source(path: Path, tokenizer_file: str = "", eos_token: str | None = None) -> Source:
    """The checkpoint to export from a run folder (its newest checkpoint) or a checkpoint folder, checksums verified;
    `tokenizer_file`/`eos_token` (--tokenizer, --eos-token) stand in for the run's."""
    if (path / runfiles.CHECKPOINT_MARKER).is_file():
        ckpt, cfg = path, _run_config(path.parent.parent)  # <run folder>/<checkpoint.folder>/step-<n>, when it is that
    elif (path / runfiles.FROZEN).is_file():
        cfg = _run_config(path)
        ckpt = _newest(checkpoint.folder(cfg.checkpoint, path))
        if ckpt is None:
            raise ExportRefused(f"{path} holds no checkpoint. Fix: train with checkpoint.enable=true, or name a checkpoint folder")
    else:
        raise ExportRefused(
            f"{path} is neither a run folder ({runfiles.FROZEN}) nor a checkpoint folder ({runfiles.CHECKPOINT_MARKER}). "
            "Fix: name a run folder or one of its checkpoints/step-<n> folders"
        )
    why = checkpoint.verify(ckpt, deep=True)
    if why:
        raise ExportRefused(f"checkpoint {ckpt} fails its check: {why}. Fix: export another checkpoint (an older step-<n> folder)")
    try:
        model = ModelConfig(**checkpoint.marker(ckpt)["model"])
    except (KeyError, TypeError) as e:  # verify read the marker: it lacks the model, or names fields ModelConfig has not
        raise ExportRefused(
            f"{ckpt / runfiles.CHECKPOINT_MARKER} does not record the model it was saved from ({e}). Fix: {checkpoint.MARKER_FIX}"
        ) from e
    return run_source(ckpt, model, cfg, tokenizer_file, eos_token)


def run_source(ckpt: Path, model: ModelConfig, cfg, tokenizer_file: str = "", eos_token: str | None = None) -> Source:
    """The Source of checkpoint `ckpt` of the run `cfg` (None: a checkpoint outside a run folder): its tokenizer
    and the paths it reads. The run's own export (checkpoint.export_hf) comes here too."""
    try:
        tok = export_inputs.choose(ckpt, cfg.data if cfg is not None else None, tokenizer_file, eos_token)
    except export_inputs.TokenizerRefused as e:
        raise ExportRefused(str(e)) from e
    reads = [("the checkpoint", ckpt), *export_inputs.reads(cfg)]
    if tok.path:
        reads.append(("the tokenizer", Path(tok.path)))
    return Source(ckpt, model, tok.path, tok.eos_token, reads, tok.note, tok.warn)


def _newest(folder: Path) -> Path | None:
    """The newest `step-<n>` folder, intact or not (a damaged newest one is refused, not silently passed over)."""
    found = checkpoint.scan(folder)
    paths = [p for _, p in found.complete] + [p for p, _ in found.skipped]
    return max(paths, key=checkpoint.step_of, default=None)


def earlier_export(out: Path) -> bool:
    """An export wrote `out`: its config.json and weight index are there and nothing an export does not write."""
    names = [p.name for p in out.iterdir()]
    return "config.json" in names and INDEX in names and all(WRITTEN.match(n) for n in names)


def _overlap(out: Path, reads: list[tuple[str, Path]]) -> str | None:
    """What the run reads that lies at or under `out` (replacing `out` would delete or overwrite it)."""
    for what, path in reads:
        path = Path(os.path.abspath(path))
        if path == out or out in path.parents:
            return f"{what} {path}"
    return None


def check_out(out: Path, reads: list[tuple[str, Path]] = ()) -> None:
    """Refuse an out folder that is a file, holds something the run reads, or holds anything but an earlier export."""
    if out.exists() and not out.is_dir():
        raise ExportRefused(f"--out {out} is a file. Fix: name a new or empty folder")
    if hit := _overlap(out, reads):
        raise ExportRefused(f"--out {out} holds {hit}, which the run reads. Fix: name a new or empty folder outside it")
    names = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if names and not earlier_export(out):
        other = [n for n in names if not WRITTEN.match(n)] or names
        raise ExportRefused(
            f"--out {out} holds {', '.join(other[:5])}{', ...' if len(other) > 5 else ''} and is not an earlier export "
            f"(config.json and {INDEX}). Fix: name a new or empty folder (an earlier export there is replaced)"
        )
    partial = _partial(out)
    if partial.exists() and not (partial.is_dir() and all(WRITTEN.match(p.name) for p in partial.iterdir())):
        raise ExportRefused(f"{partial} is in the way of the export (it writes there first). Fix: move it, or name another --out")


def _partial(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def refusal(m: ModelConfig) -> str | None:
    """Why `m` cannot be exported: its family has no checked export, or transformers would compute another function."""
    why = hf_folder.refusal(m)
    if why:
        return why
    model_config, _ = hf.model_and_adapter(m)
    differ = hf.mismatches(m, model_config)
    return f"model.name {m.name} (flavor {m.flavor}) cannot be exported: {'; '.join(differ)}" if differ else None


def export(src: Source, out: Path, max_shard_bytes: int = 5 * 10**9) -> Path:
    """Write `src` as a Hugging Face folder `out` (refusing first, writing nothing, when it cannot); return `out`."""
    why = refusal(src.model)
    if why:
        raise ExportRefused(f"{why}. Fix: export a model of another family")
    check_out(out, src.reads)
    partial = _partial(out)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    try:
        _write(src, partial, max_shard_bytes)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    return out


def _write(src: Source, folder: Path, max_shard_bytes: int) -> None:
    token_ids = tokenizer(src.tokenizer, src.eos_token, folder) if src.tokenizer else {}
    weights(src.checkpoint, src.model, folder, max_shard_bytes)
    configs(src.model, token_ids, folder)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runner.export", description="Export a run's checkpoint to another format.")
    p.add_argument("path", type=Path, help="a run folder (its newest checkpoint) or a checkpoint folder (<run>/checkpoints/step-<n>)")
    p.add_argument("--format", choices=["hf"], required=True, help="hf: a Hugging Face folder that transformers loads")
    p.add_argument("--out", type=Path, required=True, help="the folder to write (new, empty, or an earlier export)")
    p.add_argument("--tokenizer", default="", help="the tokenizers JSON file to export (default: the run's; data=tokens: its manifest's)")
    p.add_argument("--eos-token", default=None, help="its end-of-text token (default: the run's)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file, GB (also the weights held in memory)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        src = source(args.path.resolve(), args.tokenizer, args.eos_token)
        out = export(src, args.out.resolve(), int(args.max_shard_gb * 1e9))
    except ExportRefused as e:
        print(f"export refused: {e}", file=sys.stderr)
        return 2
    print(f"export: {src.checkpoint} -> {out} ({', '.join(sorted(os.listdir(out)))})")
    if src.note:
        print(f"{'WARNING: ' if src.warn else ''}export: {src.note}", file=sys.stderr if src.warn else sys.stdout)
    return 0


def cli() -> None:
    """`python -m runner.export` (runner/export.py)."""
    sys.exit(main())


INDEX = "model.safetensors.index.json"
_LAYER = re.compile(r"layers\.(\d+)\.")


def _order(name: str) -> tuple[int, str]:
    """Embedding first, then block by block, then the final norm and head (HF's own shard order)."""
    found = _LAYER.search(name)
    if found:
        return 1 + int(found.group(1)), name
    return (0 if "embed" in name else 1 << 30), name


def _groups(meta, adapter, max_shard_bytes: int) -> list[list[str]]:
    """The model's DCP keys, in order, cut into groups whose HF tensors hold at most max_shard_bytes (a larger
    tensor alone). The adapter maps meta tensors to learn each key's HF bytes; a key it drops (the tied head, an
    expert bias the HF class lacks) rides along with its group, read only to be checked."""
    keys = sorted((k for k in meta.state_dict_metadata if k.startswith("model.")), key=_order)
    groups, size = [[]], 0
    for k in keys:
        md = meta.state_dict_metadata[k]
        got = adapter.to_hf({k[len("model.") :]: torch.empty(tuple(md.size), dtype=md.properties.dtype, device="meta")})
        nbytes = sum(v.numel() * v.element_size() for v in got.values())
        if nbytes and size and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += nbytes
    return groups


def _read(path: Path, meta, keys: list[str]) -> dict[str, torch.Tensor]:
    """The full tensors of `keys` (DCP assembles each from every rank's piece), in one process without a group."""
    import torch.distributed.checkpoint as dcp

    mds = {k[len("model.") :]: meta.state_dict_metadata[k] for k in keys}
    want = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in mds.items()}
    dcp.load({"model": want}, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return want


def weights(path: Path, m: ModelConfig, folder: Path, max_shard_bytes: int) -> dict[str, str]:
    """Every weight of the checkpoint at `path` as HF safetensors shards in `folder`, one shard in memory at a time;
    writes the index and returns its weight map."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    model_config, adapter = hf.model_and_adapter(m)
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    groups = _groups(meta, adapter, max_shard_bytes)
    weight_map, total = {}, 0
    for i, keys in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for key, value in _read(path, meta, keys).items():
            got = adapter.to_hf({key: value})
            if not got and value.count_nonzero() > 0 and not (m.weight_tying and key == "lm_head.weight"):
                print(f"WARNING: export: {key} has no place in transformers' model and is left out (nonzero values)", file=sys.stderr)
            shard.update({k: v.contiguous() for k, v in got.items()})
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        total += sum(v.numel() * v.element_size() for v in shard.values())
        weight_map.update(dict.fromkeys(shard, name))
        del shard
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    mode = (folder / INDEX).stat().st_mode & 0o777  # what the umask gives a new file; safetensors creates its own 0600
    for shard in folder.glob("model-*.safetensors"):
        os.chmod(shard, mode)
    return weight_map


def tokenizer(path: str, eos_token: str, folder: Path) -> dict[str, int | None]:
    """The run's tokenizer as transformers' fast tokenizer files; returns the bos/eos ids the configs name. BOS and EOS
    are the tokenizer's own definition, as the run framed its documents with them (runner.formats.documents.specials:
    the tokenizer_config.json beside the tokenizer.json, TorchTitan's reading); a bare tokenizer.json has no BOS and
    `eos_token` (the run's data.eos_token, or --eos-token) as its EOS."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from runner.formats import documents

    s = documents.specials(Tokenizer.from_file(path), path, eos_token)
    named = {k: v for k, v, i in (("bos_token", s.bos_token, s.bos_id), ("eos_token", s.eos_token, s.eos_id)) if i is not None}
    tok = PreTrainedTokenizerFast(tokenizer_file=path, **named)
    tok.save_pretrained(str(folder))
    return {"bos_token_id": s.bos_id, "eos_token_id": s.eos_id, "pad_token_id": None}


def configs(m: ModelConfig, token_ids: dict[str, int | None], folder: Path) -> None:
    """config.json (the family's transformers architecture with the run's numbers) and generation_config.json."""
    from transformers import GenerationConfig

    model_config, _ = hf.model_and_adapter(m)
    ids = token_ids or {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    hf.config(m, model_config, ids).save_pretrained(str(folder))
    GenerationConfig(**ids).save_pretrained(str(folder))
