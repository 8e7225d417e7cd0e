"""Initial weights on the GPU path (build._materialize when the device policy is not CPU), run on CPU tensors: every
block starts from weights of its own, the same in every pipeline layout and equal to the CPU path's one-rank
initialization. The stages each pp rank holds are cut as TorchTitan's pipeline_llm cuts them (`_split_module` of the
stages `_get_pp_rank_to_stage_indices_mapping` gives the rank); no process group is needed, as nothing is sharded."""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch

from runner.run import titan
from runner.run.device import DevicePolicy
from runner.run.titan import cpu
from runner.run.titan import initial_weights as init
from runner.schema import layout

build = importlib.import_module("runner.run.titan.build")  # the package exports build(), the function

LAYOUTS = {
    "2 stages": ["parallelism=pp2_interleaved", "parallelism.pp_schedule=1F1B", "parallelism.pp_virtual_stages=1"],
    "2x2 interleaved": ["parallelism=pp2_interleaved"],  # rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
}


def _gpu_parts(compose, overrides: list[str], monkeypatch) -> list[list[torch.nn.Module]]:
    """The model parts of each pp rank, materialized on CPU tensors by the path a CUDA policy takes."""
    # TorchTitan's own split, as pipeline_llm's _pipeline_module_split calls it for one pp rank
    from torchtitan.distributed.pipeline_parallel import _get_pp_rank_to_stage_indices_mapping, _split_module

    cfg = compose([*overrides, "cluster.device=cuda", "training.seed=7"])
    assert not DevicePolicy.of(cfg.cluster, cfg.distributed).cpu
    lay = layout.resolve(cfg.parallelism, cfg.cluster)
    spec, *_ = titan.model_config(cfg, lay)
    with torch.device("meta"):
        whole = spec.model.build()
    stages = titan.stage_modules(cfg, lay)
    with monkeypatch.context() as m:
        m.setattr(cpu, "init_like_one_rank", lambda *a: pytest.fail("the CPU path initialized a part of a CUDA run"))
        ranks = []
        for r in range(lay.pp):
            held = _get_pp_rank_to_stage_indices_mapping(r, lay.pp, cfg.parallelism.pp_schedule, len(stages))
            ranks.append([_split_module(whole, stages[i]) for i in held])
            for part in ranks[-1]:
                build._materialize(part, spec.model, cfg, torch.device("cpu"))
    return ranks


def _one_rank(compose) -> dict[str, torch.Tensor]:
    """The CPU path's initialization of the same model: the unsharded model from training.seed."""
    cfg = compose(["parallelism=single", "training.seed=7"])
    spec, *_ = titan.model_config(cfg, layout.resolve(cfg.parallelism, cfg.cluster))
    with torch.device("cpu"):
        model = spec.model.build()
    cpu.init_like_one_rank(model, spec.model, cfg.training.seed)
    return dict(model.named_parameters())


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    """One stream drawn twice: equal, or proportional (TorchTitan scales some blocks' std by their depth)."""
    return a.shape == b.shape and torch.allclose(a / a.norm(), b / b.norm(), rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def one_rank(compose):
    return _one_rank(compose)


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_block_starts_from_its_own_weights_the_same_in_every_layout(compose, monkeypatch, one_rank, name):
    """One seed per model part gave the stages of one structure the same blocks (under 2x2 interleaving: layers 1, 3
    and 5 alike, on both ranks and within rank 1); each unit now draws from (training.seed, its FQN)."""
    ranks = _gpu_parts(compose, LAYOUTS[name], monkeypatch)
    params = {fqn: p for parts in ranks for part in parts for fqn, p in part.named_parameters()}
    assert sorted(params) == sorted(one_rank)  # every parameter is held once, under its one-rank name
    blocks = {}
    for fqn, p in params.items():
        if fqn.startswith("layers.") and p.std() > 0:  # drawn, not filled (norms are ones)
            layer, local = fqn.split(".", 2)[1:]
            blocks.setdefault(local, {})[layer] = p
    alike = [
        (f"layers.{i}.{local}", f"layers.{j}.{local}")
        for local, by_layer in blocks.items()
        for (i, a), (j, b) in itertools.combinations(sorted(by_layer.items()), 2)
        if _alike(a, b)
    ]
    assert alike == []
    differ = [fqn for fqn, p in params.items() if not torch.equal(p, one_rank[fqn])]
    assert differ == []  # the same weights in both layouts and on one rank, embedding, norm and head included


def test_no_unit_shares_a_stream():
    """The embedding, the head and the blocks each get a seed of their own, none of them training.seed itself."""
    fqns = ["tok_embeddings", "norm", "lm_head", *(f"layers.{i}" for i in range(126))]
    seeds = {init.unit_seed(0, f) for f in fqns} | {init.unit_seed(1, f) for f in fqns}
    assert len(seeds) == 2 * len(fqns) and not seeds & {0, 1}
    assert all(0 <= s < 2**63 for s in seeds)
