"""mode=search: the space it states, the rules and memory model it rejects with (validation's own), pruning that
never loses the best candidate (checked against brute force over a small space), and the sweep it writes, run as it
is with mode=plan."""

from __future__ import annotations

import json

import pytest

from runner.config import flops, memory, plan, search, search_render, steptime, validate
from runner.config.problems import ConfigError
from runner.config.schema import Mode
from tests.conftest import run_cli

# Llama 3 8B on one 8-GPU node at seq 8,192: small enough to brute-force, large enough that memory rejects layouts
SMALL = [
    "model=llama3_8b",
    "cluster=h100_node",
    "precision=bf16",
    "training.seq_len=8192",
    "training.global_batch_size=16",
    "search.max_microbatch_size=2",
    "search.max_virtual_stages=2",
    "search.max_cp=2",
    "mode=search",
]


@pytest.fixture(scope="module")
def small(compose):
    cfg = compose(SMALL)
    return cfg, search.run(cfg)


def _space(cfg):
    """Every candidate of the stated space, enumerated the obvious way."""
    for tp, cp, pp, dpr, dps, ep in search.layouts(cfg, search.world_size(cfg)):
        for sched, v in search.schedules(pp, cfg.search.max_virtual_stages):
            for mbs in range(1, cfg.search.max_microbatch_size + 1):
                for ac in search.AC:
                    for r in search._reshards(dps):
                        yield search.Candidate(tp, cp, pp, dpr, dps, ep, sched, v, mbs, ac, r)


def test_every_candidate_is_accounted_for(small):
    cfg, res = small
    assert res.candidates == len(list(_space(cfg))) > 1000
    assert sum(res.rejected.values()) + len(res.ranked) == res.candidates
    assert min(res.rejected[k] for k in (search.MEMORY, search.DOMINATED, "slower", "training.global_batch_size")) > 0
    for r in res.ranked:  # every kept candidate passes every rule of validation
        validate.check(_as_plan(r.candidate.config(cfg)))


def _brute_force(cfg) -> dict:
    """Every candidate through validate.check (every rule) and memory.memory (the plan's verdict): key -> fits."""
    fits = {}
    for cand in _space(cfg):
        c = _as_plan(cand.config(cfg))
        try:
            lay = validate.check(c)
        except ConfigError:
            continue
        micro = c.training.global_batch_size // (lay.dp * c.training.microbatch_size)
        fits[cand] = memory.memory(c, lay, micro, None)["fits_memory"]
    return fits


def _undominated(fits: dict) -> list:
    """Of each layout, schedule and microbatch, the fitting candidates of the lowest AC tier (none < selective < full),
    each AC with the first fitting of never, always: what the search may keep."""
    out = []
    for cand, ok in fits.items():
        if not ok or cand.ac not in next(
            t for t in search.AC_TIERS if any(fits.get(cand._replace(ac=a, reshard=r)) for a in t for r in search._reshards(cand.dp_shard))
        ):
            continue
        if cand.reshard == search.ReshardPolicy.always and fits.get(cand._replace(reshard=search.ReshardPolicy.never)):
            continue
        out.append(cand)
    return out


def test_pruning_keeps_the_brute_force_best(small):
    """Brute force over the whole space, then the dominance rule (less recomputation, or no re-gathering, that fits
    wins): the search's best ten are its best ten, with the same step time, recomputation and memory."""
    cfg, res = small
    fits = _brute_force(cfg)
    keep = _undominated(fits)
    assert sum(fits.values()) > len(keep) > 20  # the dominance rule removes some, not all
    keys = []
    for cand in keep:
        c, lay = _as_plan(cand.config(cfg)), cand.layout()
        recompute = flops.recompute_fraction(c.model, cand.ac, c.training.ac_layer_frequency)
        micro = c.training.global_batch_size // (lay.dp * cand.microbatch_size)
        keys.append((steptime.predict(c, lay).step_s, recompute, memory.memory(c, lay, micro, None)["total_gb_per_gpu"]))
    assert [r.key() for r in res.ranked] == sorted(keys)[: len(res.ranked)]  # the same functions: equal to the bit
    top = res.ranked[0]
    budget = plan.compute(_as_plan(top.candidate.config(cfg)), top.candidate.layout())
    assert budget["estimated_step_time_s"] == pytest.approx(top.step_s) and budget["total_gb_per_gpu"] == pytest.approx(top.memory_gb)


def _as_plan(cfg):
    cfg.mode = Mode.plan
    return cfg


def test_a_rule_rejects_every_candidate_under_its_layout(compose):
    """debug model with 4 KV heads on 8 GPUs: every tp=8 candidate falls to the TP rule, in validation's words."""
    cfg = compose(["cluster=h100_node", "model.num_kv_heads=4", "search.max_cp=1", "search.max_microbatch_size=1", "mode=search"])
    res = search.run(cfg)
    tp8 = [c for c in _space(cfg) if c.tp == 8]
    assert res.rejected["parallelism.tp"] == len(tp8) > 0
    with pytest.raises(ConfigError) as e:
        validate.check(_as_plan(tp8[0].config(cfg)))
    assert res.examples["parallelism.tp"] == str(e.value.problems[0])
    assert "must divide model.num_heads = 16 and model.num_kv_heads = 4" in res.examples["parallelism.tp"]


def test_bounds_and_why_line_are_printed(small):
    cfg, res = small
    text = "\n".join(search_render.lines(cfg, res))
    assert f"{res.candidates:,} candidates" in text and "search.max_cp = 2" in text and "v = 2..search.max_virtual_stages = 2" in text
    assert "selective_op, selective_layer (every 2), full" in text
    assert f"rule training.global_batch_size (e.g. {res.examples['training.global_batch_size']})" in text
    why = search_render.why_first(res)
    assert text.count("\n  1  ") == 1 and why in text
    second = res.ranked[1]  # not tied here: the line names #2, the term that separates them and both values
    gap, term = second.step_s - res.ranked[0].step_s, why.split("its ")[1].split(" term")[0]
    assert (
        why.startswith(f"#1 beats #2 ({second.label}) by {gap:.3f} s")
        and f"({res.ranked[0].terms[term]:.3f} vs {second.terms[term]:.3f} s)" in why
    )


def test_search_cli_writes_a_sweep_that_runs_as_it_is(tmp_path):
    run = tmp_path / "search"
    proc = run_cli(
        "model=llama3_8b",
        "cluster=h100_node",
        "precision=bf16",
        "training.seq_len=8192",
        "training.global_batch_size=16",
        "search.top_k=3",
        "mode=search",
        run_dir=run,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads((run / "search.json").read_text())
    assert "top 10 by predicted step time" in proc.stdout and found["why_first"] in proc.stdout
    assert sum(found["rejected"].values()) + len(found["ranked"]) <= found["candidates"]
    sweep = tmp_path / "sweep"
    proc = run_cli("--config-dir", str(run / "search"), "sweep=search_top", "mode=plan", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for i, want in enumerate(found["ranked"][:3]):
        got = json.loads((sweep / str(i) / "plan.json").read_text())
        assert got["estimated_step_time_s"] == pytest.approx(want["step_s"]) and got["total_gb_per_gpu"] == pytest.approx(want["memory_gb"])
        assert got["layout"] == want["label"]
    assert not (sweep / "3").exists()


def test_search_needs_a_fixed_device_count(tmp_path):
    proc = run_cli("mode=search", run_dir=tmp_path / "r")
    assert proc.returncode == 2
    assert "cluster.devices_per_node = -1" in proc.stderr and "set cluster.num_nodes and cluster.devices_per_node" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "r" / "search.json").exists()


def test_a_cluster_without_a_peak_prices_nothing_and_writes_no_sweep(compose, tmp_path):
    """local_cpu measures its peak at start-up: without a profile the predictor has nothing to price with."""
    cfg = compose(["cluster.devices_per_node=4", "mode=search"])
    res = search.run(cfg)
    assert res.ranked == [] and res.rejected[search.UNPRICED] > 0
    assert sum(res.rejected.values()) == res.candidates
    path, cmd = search_render.write(cfg, res, tmp_path, [])
    assert cmd is None and path.is_file() and not (tmp_path / "search").exists()
    assert "unpriced: the cluster has no peak or link bandwidth" in "\n".join(search_render.lines(cfg, res))
