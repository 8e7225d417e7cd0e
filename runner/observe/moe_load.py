"""Expert load of a mixture-of-experts model, measured and judged (docs/monitoring.md, "Hot experts").

At logged steps the step loop reads the routed experts' token counts (TorchTitan's `tokens_per_expert_E`, summed over
the steps since the last logged one: a window) with the step's one host read, and sums them over ranks in the step's
one host collective (runner.run.expert_load). This module is plain Python, like the straggler judges: what a window's
counts say (`summarize`: metrics.jsonl's compact `moe`), their flat W&B keys, and `HotExpertJudge`, which names an expert
or an EP rank that is hot, or an expert that receives no token, for `windows` windows in a row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runner.schema import MoeLoadConfig


def rank_shares(tokens: list[float], ep: int) -> list[float]:
    """Each EP rank's share of a layer's tokens: TorchTitan shards the experts in contiguous blocks of E / ep."""
    total, per = sum(tokens), len(tokens) // ep
    return [sum(tokens[r * per : (r + 1) * per]) / total if total else 0.0 for r in range(ep)]


def max_mean(tokens: list[float]) -> float:
    """The busiest expert's tokens over the mean expert's (1.0 is perfect balance)."""
    mean = sum(tokens) / len(tokens)
    return max(tokens) / mean if mean else 0.0


def summarize(layers: list[int], counts: list[list[float]], ep: int, steps: int) -> dict[str, Any]:
    """metrics.jsonl's `moe`: per MoE layer (model block index) the tokens per expert over the window's `steps` steps,
    max/mean, with EP the busiest EP rank's share of the layer's tokens, and the experts that received none."""
    out: dict[str, Any] = {"steps": steps, "layers": layers, "tokens": [[int(n) for n in row] for row in counts]}
    out["max_mean"] = [round(max_mean(row), 4) for row in counts]
    if ep > 1:
        out["ep_share"] = [round(max(rank_shares(row, ep)), 4) for row in counts]
    out["dead"] = [[layer, e] for layer, row in zip(layers, counts, strict=True) for e, n in enumerate(row) if n == 0]
    return out


def wandb_keys(moe: dict[str, Any]) -> dict[str, float]:
    """Flat W&B keys: moe/max_mean (the worst layer's), moe/layer<L>_max_mean, moe/layer<L>_ep_share, moe/dead_experts."""
    out = {"moe/max_mean": max(moe["max_mean"]), "moe/dead_experts": len(moe["dead"])}
    out |= {f"moe/layer{layer}_max_mean": v for layer, v in zip(moe["layers"], moe["max_mean"], strict=True)}
    if "ep_share" in moe:
        out |= {f"moe/layer{layer}_ep_share": v for layer, v in zip(moe["layers"], moe["ep_share"], strict=True)}
    return out


def describe(f: dict[str, Any]) -> str:
    """The console's line for a finding."""
    where = f"moe load: layer {f['layer']}"
    since = f"since step {f['since_step']} ({f['windows']} windows)"
    if f["kind"] == "hot_ep_rank":
        return f"{where} EP rank {f['ep_rank']} hot: {100 * f['share']:.1f} % of the layer's tokens (fair {100 * f['fair']:.1f} %), {since}"
    expert = f"{where} expert {f['expert']} (EP rank {f['ep_rank']})"
    if f["kind"] == "dead_expert":
        return f"{expert} dead: no token {since}"
    return f"{expert} hot: {100 * f['share']:.1f} % of the layer's tokens, {f['load']:.2f} x the mean expert's, {since}"


class HotExpertJudge:
    """Per window, per MoE layer: experts above `hot_factor` x the mean expert's tokens, experts with no token, and (with
    EP) the busiest EP rank above `rank_factor` x its fair share 1 / ep. One that stays so for `windows` windows in a row
    is named once (until it recovers); a layer whose window saw under `min_tokens` tokens per expert is not judged."""

    def __init__(self, cfg: MoeLoadConfig, ep: int):
        self.cfg, self.ep = cfg, ep
        self.streak: dict[tuple[str, int, int], int] = {}
        self.since: dict[tuple[str, int, int], int] = {}
        self.named: set[tuple[str, int, int]] = set()

    def update(self, first_step: int, step: int, layers: list[int], counts: list[list[float]]) -> list[dict[str, Any]]:
        """counts[i][e]: tokens routed to expert e of MoE layer layers[i] in steps first_step..step. Returns what is named now."""
        now: dict[tuple[str, int, int], dict[str, Any]] = {}
        judged = set()
        for layer, row in zip(layers, counts, strict=True):
            if sum(row) / len(row) >= self.cfg.min_tokens:
                judged.add(layer)
                now |= self._layer(layer, row)
        for key in [k for k in self.streak if k[1] in judged and k not in now]:  # recovered
            del self.streak[key], self.since[key]
            self.named.discard(key)
        found = []
        for key, f in now.items():
            self.streak[key] = self.streak.get(key, 0) + 1
            self.since.setdefault(key, first_step)
            if self.streak[key] >= self.cfg.windows and key not in self.named:
                self.named.add(key)
                found.append(f | {"step": step, "since_step": self.since[key], "windows": self.streak[key]})
        return found

    def _layer(self, layer: int, row: list[float]) -> dict[tuple[str, int, int], dict[str, Any]]:
        """This window's hot and dead experts and hot EP rank of one layer."""
        total, per = sum(row), len(row) // self.ep
        mean = total / len(row)
        out = {}
        for e, n in enumerate(row):
            f = {"layer": layer, "expert": e, "ep_rank": e // per, "share": n / total, "load": n / mean}
            if n > self.cfg.hot_factor * mean:
                out[("hot_expert", layer, e)] = {"kind": "hot_expert", **f}
            elif n == 0:
                out[("dead_expert", layer, e)] = {"kind": "dead_expert", **f}
        if self.ep > 1:
            shares = rank_shares(row, self.ep)
            r = max(range(self.ep), key=shares.__getitem__)
            if shares[r] > self.cfg.rank_factor / self.ep:
                f = {"kind": "hot_ep_rank", "layer": layer, "expert": None, "ep_rank": r, "share": shares[r], "fair": 1 / self.ep}
                out[("hot_ep_rank", layer, r)] = f | {"load": shares[r] * self.ep}
        return out


def record(path: Path, found: list[dict[str, Any]]) -> None:
    """Append the findings to moe_load.jsonl (rank 0) and print their lines."""
    with path.open("a") as f:
        for finding in found:
            f.write(json.dumps(finding) + "\n")
            print(describe(finding), flush=True)
