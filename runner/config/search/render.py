"""mode=search's printed report, search.json and the sweep of the top candidates (torch-free).

The sweep is a Hydra config folder in the run folder, runnable as it is:

    <run folder>/search/sweep/search_top.yaml      hydra.mode MULTIRUN over +search_top=top1,...,topk, with the
                                                   overrides the search ran with (model, cluster, batch, ...)
    <run folder>/search/search_top/top<i>.yaml     candidate i's parallelism and training fields

    python -m runner --config-dir <run folder>/search sweep=search_top [mode=plan]
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import yaml

from runner.config.search import DOMINATED, MEMORY, TIED, UNPRICED, Ranked, Result, verdict
from runner.formats import runfiles
from runner.schema import RunConfig

SHOWN = 10
SWEEP_NAME = "search_top"
NOT_CARRIED = ("mode", "objective", "search", "hydra")  # overrides the sweep does not repeat (and their sub-keys)
REASONS = {
    MEMORY: "memory: more than a device holds (the plan's memory model, which mode=dryrun checks)",
    DOMINATED: "dominated: the same candidate with less recomputation, or keeping gathered weights, fits",
    "slower": f"slower: even its fastest setting is predicted no faster than the best {SHOWN}",
    TIED: "tied: predicted exactly as a listed candidate that differs only in the schedule, shown on its row as (also: ...)",
    UNPRICED: "unpriced: the cluster has no peak or link bandwidth to predict with (set cluster.peak_tflops and the "
    "bandwidths, or cluster.profile from python -m runner.calibrate)",
}


def _reason(key: str, res: Result) -> str:
    if key in REASONS:
        return REASONS[key]
    return f"rule {key}" + (f" (e.g. {res.examples[key]})" if key in res.examples else "")


SHORT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def _fp8(cfg: RunConfig) -> str | None:
    """Under an FP8 recipe, the dtype its speed-up column compares with (param_dtype: bf16 on GPUs); else None."""
    p = cfg.precision
    return None if p.fp8.value == "none" else SHORT.get(p.param_dtype.value, p.param_dtype.value)


def _fp8_note(cfg: RunConfig, fp8: str) -> str:
    return f" ({cfg.precision.name}; 'vs {fp8}': the same candidate's predicted {fp8} step time over its FP8 one, MFU of the {fp8} peak):"


def speed_up(x: float | None) -> str:
    """An FP8 speed-up as printed: 'x1.23' (the same candidate's bf16 step time over its FP8 one), '-' unpriced."""
    return "-" if x is None else f"x{x:.2f}"


def _row(i: int, r: Ranked, fp8: bool = False) -> str:
    c = r.candidate
    mfu = f"{100 * r.mfu:5.1f} %" if r.mfu is not None else "    -  "
    gain = f" {speed_up(r.fp8_speed_up):>8}" if fp8 else ""
    return (
        f"{i:>3}  {r.label:<48} {c.microbatch_size:>3}  {c.ac.value:<15} {c.reshard.value:<7} {r.step_s:>9.3f} {mfu}{gain}  "
        f"{r.binding:<10} {r.terms.get(r.binding, 0):>8.3f} {r.memory_gb:>8.1f}" + (f"  (also: {', '.join(r.also)})" if r.also else "")
    )


def _secs(x: float) -> str:
    """Seconds with 3 significant digits, so a gap of 0.2 ms does not print as 0.000 s."""
    return f"{x:.3g} s"


def _beats(a: Ranked, b: Ranked, i: int) -> str:
    """#1 against #i: the time gap and the term that differs most."""
    gap = b.step_s - a.step_s
    diff = {k: b.terms.get(k, 0.0) - a.terms.get(k, 0.0) for k in set(a.terms) | set(b.terms)}
    term = max(diff, key=diff.get)
    return (
        f"#1 beats #{i} ({b.label}) by {_secs(gap)} ({100 * gap / b.step_s:.2g} %): its {term} term is {_secs(diff[term])} "
        f"shorter ({_secs(a.terms.get(term, 0))} vs {_secs(b.terms.get(term, 0))})"
    )


def _ties(a: Ranked, b: Ranked) -> bool:
    return b.step_s - a.step_s <= 1e-9 * max(a.step_s, 1e-12)


def why_first(res: Result) -> str:
    """One line: the term that separates #1 from #2; when they tie, what differs and, after it, why #1 beats the
    first candidate that is slower."""
    if len(res.ranked) < 2:
        return "only one candidate survived" if res.ranked else "no candidate survived"
    a, b = res.ranked[0], res.ranked[1]
    if not _ties(a, b):
        return _beats(a, b, 2)
    oa, ob = a.candidate.overrides(), b.candidate.overrides()
    differ = ", ".join(f"{k.split('.')[1]} {oa[k]} vs {ob[k]}" for k in oa if oa[k] != ob[k])
    mem = f"{a.memory_gb:.1f} vs {b.memory_gb:.1f} GB" if abs(b.memory_gb - a.memory_gb) > 0.05 else "the same memory"
    why = "recomputes less" if a.recompute < b.recompute else "needs less memory" if a.memory_gb < b.memory_gb else "came first"
    line = f"#1 ties #2 at {a.step_s:.3f} s predicted ({differ}; {mem}): the predictor prices them alike, and #1 {why}"
    slower = next((i for i, r in enumerate(res.ranked) if not _ties(a, r)), None)
    return line + (f"; {_beats(a, res.ranked[slower], slower + 1)}" if slower is not None else "")


def lines(cfg: RunConfig, res: Result, sweep_cmd: str | None = None) -> list[str]:
    m, fp8 = cfg.model, _fp8(cfg)
    rejected = sum(res.rejected.values())
    out = [
        f"search: {m.name} {m.flavor} on {res.world_size:,} devices: {res.candidates:,} candidates, "
        f"{rejected:,} rejected, {res.predictions:,} predicted in {res.seconds:.2f} s (step times: {res.source})",
        *([res.warning] if res.warning else []),
        "search space:",
        *(f"  {b}" for b in res.bounds),
        "rejected, by reason:",
        *(f"  {n:>10,}  {_reason(k, res)}" for k, n in res.rejected.most_common()),
        f"top {min(SHOWN, len(res.ranked))} by predicted step time" + (_fp8_note(cfg, fp8) if fp8 else ":"),
        f"{'#':>3}  {'layout':<48} {'mbs':>3}  {'AC':<15} {'reshard':<7} {'step (s)':>9} {'MFU':>7}"
        + (f" {'vs ' + fp8:>8}" if fp8 else "")
        + f"  {'binding':<10} {'(s)':>8} {'mem (GB)':>8}",
        *(_row(i + 1, r, bool(fp8)) for i, r in enumerate(res.ranked[:SHOWN])),
        why_first(res),
    ]
    t = verdict.tier(cfg, res, SHOWN)
    if t:
        out.append(verdict.tier_line(cfg, t))
    if sweep_cmd:
        out.append(f"sweep of the top {min(cfg.search.top_k, len(res.ranked))} (add mode=plan to price them one by one): {sweep_cmd}")
    return out


def to_json(res: Result) -> dict:
    return {
        "world_size": res.world_size,
        "bounds": res.bounds,
        "candidates": res.candidates,
        "rejected": dict(res.rejected),
        "predictions": res.predictions,
        "seconds": res.seconds,
        "source": res.source,
        "warning": res.warning,
        "ranked": [
            {
                "label": r.label,
                "overrides": r.candidate.overrides(),
                "step_s": r.step_s,
                "mfu": r.mfu,
                "fp8_speed_up": r.fp8_speed_up,
                "binding": r.binding,
                "terms": r.terms,
                "memory_gb": r.memory_gb,
                "also": list(r.also),
            }
            for r in res.ranked
        ],
        "why_first": why_first(res),
    }


def _carried(overrides: list[str]) -> dict[str, str]:
    """The command line's overrides that define the problem (model, cluster, batch), as sweeper params."""
    out = {}
    for o in overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+~").split(".")[0].split("/")[0] not in NOT_CARRIED:
            out[key] = value
    return out


def write_sweep(cfg: RunConfig, res: Result, run_dir: Path, overrides: list[str]) -> str:
    """The top search.top_k as a Hydra sweep under run_dir/search; returns the command that runs it."""
    root = run_dir / runfiles.SEARCH_SWEEP
    (root / "sweep").mkdir(parents=True, exist_ok=True)
    (root / SWEEP_NAME).mkdir(exist_ok=True)
    top = res.ranked[: cfg.search.top_k]
    for i, r in enumerate(top, 1):
        fields: dict[str, dict] = {}
        for key, value in r.candidate.overrides().items():
            group, name = key.split(".")
            fields.setdefault(group, {})[name] = value
        fields["parallelism"]["name"] = f"{SWEEP_NAME}{i}"
        head = f"# @package _global_\n# mode=search #{i}: {r.label}, predicted {r.step_s:.4g} s, {r.memory_gb:.3g} GB per device\n"
        (root / SWEEP_NAME / f"top{i}.yaml").write_text(head + yaml.safe_dump(fields, sort_keys=False))
    params = {f"+{SWEEP_NAME}": ",".join(f"top{i}" for i in range(1, len(top) + 1)), **_carried(overrides)}
    sweep = {"hydra": {"mode": "MULTIRUN", "sweeper": {"params": params}}}
    cmd = f"python -m runner --config-dir {root.resolve()} sweep={SWEEP_NAME}"
    head = f"# @package _global_\n# The top {len(top)} layouts of mode=search, best first. Run: {cmd}\n"
    (root / "sweep" / f"{SWEEP_NAME}.yaml").write_text(head + yaml.safe_dump(sweep, sort_keys=False))
    return cmd


def write(cfg: RunConfig, res: Result, run_dir: Path, overrides: list[str]) -> tuple[Path, str | None]:
    """search.json, and the sweep when a candidate survived (None: nothing to sweep)."""
    cmd = write_sweep(cfg, res, run_dir, overrides) if res.ranked else None
    path = run_dir / runfiles.SEARCH
    t = verdict.tier(cfg, res, SHOWN)
    found = to_json(res) | {"sweep": cmd, "tier": dataclasses.asdict(t) if t else None}
    path.write_text(json.dumps(found, indent=2) + "\n")
    return path, cmd
