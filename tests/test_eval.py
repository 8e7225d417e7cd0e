"""Evaluation on held-out data: the config rules, the held-out splits, and the eval loss against a hand computation.

The eval loss in every layout and pipeline schedule (against one rank) and its place in the rows and summary.json
ride in the parity launches of tests/test_parallel.py; here one in-process rank (gloo over a file store) checks
the loss itself, and (sharing that rank's build) counts the step loop's host synchronizations and collectives per step.
"""

from __future__ import annotations

import json
import math
import threading
import weakref

import pytest
import torch

from runner import schema
from runner.config import validate
from runner.data import corpus as text_corpus
from runner.run import evaluate, loader
from runner.schema.problems import ConfigError
from tests import text_assets
from tests.one_rank import SMALL, gloo_rank

SEQ, BATCH, MICRO, STEPS = 32, 4, 2, 2


def _problems(compose, overrides: list[str]) -> dict[str, tuple[object, str]]:
    with pytest.raises(ConfigError) as e:
        validate.check(compose(overrides))
    return {p.field: (p.value, p.why) for p in e.value.problems}


def test_bad_eval_config_lists_every_field(compose, tmp_path):
    assert _problems(compose, ["objective=eval_loss"])["objective"] == ("eval_loss", "the run evaluates nothing (eval.interval=0)")
    got = _problems(compose, ["eval.interval=-1", "eval.steps=0", "data.eval_fraction=1.5"])
    assert got == {
        "eval.interval": (-1, "must be >= 0"),
        "eval.steps": (0, "an evaluation pass reads at least one batch"),
        "data.eval_fraction": (1.5, "is the fraction of documents held out, in [0, 1)"),
    }
    text = ["data=text", "data.files=[a.jsonl]", "data.tokenizer=tok.json"]
    assert _problems(compose, [*text, "eval.interval=5"])["data.eval_files"] == (
        [],
        "eval.interval=5 evaluates on held-out data, and data=text has no held-out split",
    )
    both = _problems(compose, [*text, "eval.interval=5", "data.eval_files=[b.jsonl]", "data.eval_fraction=0.1"])
    assert list(both) == ["data.eval_fraction"]
    missing = str(tmp_path / "val.jsonl")
    with pytest.raises(ConfigError) as e:  # the preflight's, which mode=validate runs too
        validate.preflight(compose([*text, "mode=validate", "eval.interval=5", f"data.eval_files=[{missing}]"]), tmp_path)
    got = {p.field: (p.value, p.why) for p in e.value.problems}
    assert got["data.eval_files"] == ([missing], "not found (paths are relative to where `python -m runner` starts)")
    validate.check(compose([*text, "eval.interval=5", "data.eval_fraction=0.1"]))  # a held-out split: nothing to say
    validate.check(compose(["eval.interval=5"]))  # synthetic data has its own held-out split


def test_passes_run_every_interval_and_after_the_last_step():
    assert [s for s in range(1, 11) if evaluate.due(3, s, 10)] == [3, 6, 9, 10]
    assert not any(evaluate.due(0, s, 10) for s in range(1, 11))


def _synthetic(split: str, dp_rank: int = 0, dp: int = 1) -> loader.SyntheticData:
    return loader.SyntheticData(seed=3, seq_len=SEQ, vocab=256, global_batch=BATCH, microbatch=MICRO, dp_rank=dp_rank, dp=dp, split=split)


def test_synthetic_held_out_split_is_disjoint_from_training_and_fixed():
    """Eval sample j is synthetic sample -(j + 1); batch k is eval samples [k B, (k + 1) B), sliced over DP as training's."""
    held = _synthetic("eval")
    assert torch.equal(held.sample(5), loader.sample(3, -6, SEQ, 256))
    train = _synthetic("train")
    seen = {tuple(train.sample(i).tolist()) for i in range(200)}
    assert not seen & {tuple(held.sample(j).tolist()) for j in range(2 * BATCH)}
    train.load_state_dict({"next_sample": 4096}, steps_done=7)  # the training position does not move the held-out batches
    assert [_synthetic("eval", r, 2).indices(1) for r in range(2)] == [[4, 5], [6, 7]]
    rows = torch.cat([torch.cat([i, lab[:, -1:]], dim=1) for i, lab, _ in held.microbatches(1)])
    assert torch.equal(rows, torch.stack([loader.sample(3, -(j + 1), SEQ, 256) for j in range(BATCH, 2 * BATCH)]))


def test_text_held_out_split_is_by_document(tmp_path):
    """data.eval_fraction holds out whole documents by a hash of their text; training reads the rest, both in file order."""
    corpus, tok_path = text_assets.make(tmp_path, n_docs=60, vocab_size=300)
    from tokenizers import Tokenizer

    docs = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    tok = Tokenizer.from_file(str(tok_path))
    eos = tok.token_to_id(text_assets.EOS)

    def by_hand(keep) -> list[int]:
        return [t for d in docs if keep(d) for t in [*tok.encode(d).ids, eos]]

    held = [d for d in docs if text_corpus.held_out(d, 0.25)]
    assert 5 <= len(held) <= 25  # about a quarter of 60
    for split, keep in (("eval", lambda d: d in held), ("train", lambda d: d not in held)):
        got = loader.load_tokens([str(corpus)], "json", "text", str(tok_path), text_assets.EOS, tmp_path / "cache", split, 0.25)
        assert got.tolist() == by_hand(keep), split
    small = loader.TextData(torch.tensor(by_hand(lambda d: d in held[:2])), seed=0, shuffle=False, **_shape())
    with pytest.raises(ValueError, match=r"fewer than eval.steps x training.global_batch_size = 400"):
        evaluate.check_split(small, 100)


def _shape() -> dict[str, int]:
    return dict(seq_len=SEQ, global_batch=BATCH, microbatch=MICRO, dp_rank=0, dp=1)


class Recorded:
    """A held-out stream that records the global samples each call reads."""

    def __init__(self, stream):
        self.stream, self.read = stream, []

    def microbatches(self, k: int):
        self.read.append(self.stream.indices(k))
        return self.stream.microbatches(k)


@pytest.fixture(scope="module")
def one_rank(compose, tmp_path_factory):
    """The small debug model (SMALL: what these tests pin does not depend on its size) built by the runner on one
    in-process gloo rank, its weights moved off their initialization."""
    from runner.run import titan
    from runner.run.device import DevicePolicy
    from runner.schema import layout

    shape = [f"training.seq_len={SEQ}", f"training.global_batch_size={BATCH}", f"training.microbatch_size={MICRO}"]
    cfg = compose(["parallelism=single", *SMALL, *shape])
    cfg.eval.steps = STEPS
    lay = layout.resolve(cfg.parallelism, cfg.cluster)
    with gloo_rank(cfg, tmp_path_factory.mktemp("store")):
        built = titan.build(cfg, lay, titan.build_mesh(cfg, lay), tmp_path_factory.mktemp("run"), torch.device("cpu"))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in built.parts[0].parameters():
                (p.to_local() if hasattr(p, "to_local") else p).add_(0.05 * torch.randn(p.shape, generator=g))  # one rank: the whole tensor
        yield cfg, lay, built, DevicePolicy.of(cfg.cluster, cfg.distributed)


def test_eval_loss_equals_a_hand_computation_and_passes_are_comparable(one_rank):
    from types import SimpleNamespace

    from runner.run import titan
    from runner.run.step_loop import StepLoop

    cfg, lay, built, policy = one_rank
    held = Recorded(loader.SyntheticData(seed=cfg.training.seed, vocab=cfg.model.vocab_size, split="eval", **_shape()))
    tokens = torch.tensor(float(BATCH * SEQ))
    loop = SimpleNamespace(cfg=cfg, lay=lay, built=built, eval_data=held, policy=policy, loss_fn=titan.loss_fn(cfg), global_tokens=tokens)
    model = built.parts[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first, second = StepLoop.evaluate(loop), StepLoop.evaluate(loop)
    # by hand: the mean token cross-entropy of the model over held-out samples 0..7 (synthetic samples -1..-8)
    rows = torch.stack([loader.sample(cfg.training.seed, -(j + 1), SEQ, cfg.model.vocab_size) for j in range(STEPS * BATCH)])
    with torch.no_grad():
        logits = titan.local_value(model(rows[:, :-1])).double()
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).item()
    assert first["eval_loss"] == pytest.approx(expected, abs=2e-6)
    assert first["eval_ppl"] == pytest.approx(torch.tensor(expected).exp().item(), rel=1e-5)
    assert second["eval_loss"] == first["eval_loss"]  # the same samples, the same weights: the same loss
    assert held.read == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    assert model.training and all(p.grad is None for p in model.parameters())  # back in train mode, no gradients
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_eval_on_documents_reads_each_document_alone(one_rank):
    """Packed documents (data.document_mask): the held-out loss is computed as training computes it, with each sample's
    positions and document mask, so it equals the mean token cross-entropy of every document piece run alone at
    positions 0..L-1, and not the loss of the same tokens attended across documents."""
    from types import SimpleNamespace

    import numpy as np

    from runner.run import titan
    from runner.run.step_loop import StepLoop

    cfg, lay, built, policy = one_rank
    g = torch.Generator().manual_seed(3)
    lengths = [5, 40, 2, 17, 70, 9, 33, 61, 12, 80]  # with BOS and EOS: shorter than a sample, and longer than two
    docs = [torch.randint(0, cfg.model.vocab_size, (n,), generator=g) for n in lengths]
    held = loader.TextData(torch.cat(docs), ends=np.cumsum(lengths), seed=0, shuffle=False, **_shape())
    tokens = torch.tensor(float(BATCH * SEQ))
    loop = SimpleNamespace(cfg=cfg, lay=lay, built=built, eval_data=held, policy=policy, loss_fn=titan.loss_fn(cfg), global_tokens=tokens)
    got = StepLoop.evaluate(loop)["eval_loss"]
    model, losses = built.parts[0], []
    inputs, labels, positions = (torch.from_numpy(np.stack(x)) for x in zip(*map(held.window, range(STEPS * BATCH)), strict=True))
    with torch.no_grad():
        for row, (x, y, pos) in enumerate(zip(inputs, labels, positions, strict=True)):
            starts = [*torch.nonzero(pos == 0).flatten().tolist(), SEQ]
            for a, b in zip(starts, starts[1:], strict=False):  # each document piece alone, at positions 0..L-1
                logits = titan.local_value(model(x[None, a:b])).double()[0]
                losses.append(torch.nn.functional.cross_entropy(logits, y[a:b], reduction="none"))
            assert row > 0 or len(starts) > 2  # a sample holds more than one document
        across = titan.local_value(model(inputs)).double()  # the same tokens, attended across documents
    assert got == pytest.approx(torch.cat(losses).mean().item(), abs=2e-6)
    assert abs(got - torch.nn.functional.cross_entropy(across.flatten(0, 1), labels.flatten()).item()) > 1e-3


def test_eval_line_and_summary_reach_the_sinks(tmp_path):
    from runner.run import metrics

    row = {"step": 4, "loss": 7.9, "grad_norm": 0.5, "tokens_per_s": 100.0, "mfu": 0.1, "step_time_s": 1.0, "memory_gb": 1.0}
    row |= evaluate.row(2.0, 0.25)
    line = metrics._fmt(row)
    assert line.endswith("eval_loss 2.0000  eval_ppl 7.39  eval 0.25s")
    assert evaluate.summary([{"step": 2, **evaluate.row(3.0, 0.1)}, row, {"step": 5}]) == {
        "eval_loss_final": 2.0,
        "eval_ppl_final": pytest.approx(7.389056),
        "eval_step_final": 4,
    }
    assert evaluate.summary([{"step": 1}]) == {"eval_loss_final": None, "eval_ppl_final": None, "eval_step_final": None}
    sink = metrics.JsonlSink(tmp_path)
    sink.log(row)
    sink.close(evaluate.summary([row]))
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["eval_loss"] == 2.0
    assert json.loads((tmp_path / "summary.json").read_text())["eval_loss_final"] == 2.0


def test_compare_shows_the_final_eval_loss(tmp_path):
    from runner.outputs import comparison, run_rows

    base = {"degrees": "dp=2", "memory_gb_max": 1.0, "plan_check": {}, "step_time_s_median": 1.0, "mfu_median": 0.1}
    for name, extra in (("with", {"eval_loss_final": 6.54321}), ("without", {})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(base | extra))
    rows = run_rows.collect([tmp_path])
    table = comparison.table(rows)
    assert table.columns[-1].header == "eval loss"
    assert {r["run"]: cell for r, cell in zip(rows, table.columns[-1]._cells, strict=True)} == {"with": "6.5432", "without": "-"}


# ---------------------------------------------------------------- the step loop's host synchronizations
# (here, beside the evaluation, to share the module's one-rank build)

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast_object_list", "barrier", "all_gather_into_tensor", "broadcast")
CONVERSIONS = ("item", "cpu", "__float__", "tolist")


class _Counts:
    """Per step (the step loop's `_step` calls): host synchronizations (a conversion of a tensor to the host, or the
    policy's sync) and host collectives, on the thread that runs the step loop. Tensors that live on the host on CUDA
    too are not counted: a host collective's own buffers, and the optimizer's step counters where they live on the host
    (torch's fused AdamW keeps `state["step"]` on the parameters' device and never reads it on the host; its foreach
    AdamW keeps it on the host and reads it with .item())."""

    def __init__(self):
        self.step, self.by_step, self.host = 0, {}, {}
        self.main = threading.get_ident()
        self.opt = None

    def add(self, kind: str, what: str) -> None:
        if threading.get_ident() == self.main and self.step:
            self.by_step.setdefault(self.step, {"sync": [], "collective": []})[kind].append(what)

    def buffer(self, t) -> None:
        for x in t if isinstance(t, list) else [t]:
            if isinstance(x, torch.Tensor):
                self.host[id(x)] = weakref.ref(x)

    def is_host(self, t) -> bool:
        ref = self.host.get(id(t))
        if ref is not None and ref() is t:
            return True
        held = [s for o in self.opt for s in o.state.values()] if self.opt is not None else []  # TorchTitan's container's optimizers
        return t.dim() == 0 and any(t is state.get("step") for state in held)


def _instrument(monkeypatch, counts: _Counts, train, DevicePolicy) -> None:
    import torch.distributed as dist

    for name in CONVERSIONS:
        original = getattr(torch.Tensor, name)

        def converted(t, *args, _name=name, _original=original, **kwargs):
            if not counts.is_host(t):
                counts.add("sync", _name)
            return _original(t, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, converted)
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def collective(*args, _name=name, _original=original, **kwargs):
            counts.add("collective", _name)
            for a in (*args, *kwargs.values()):
                counts.buffer(a)
            return _original(*args, **kwargs)

        monkeypatch.setattr(dist, name, collective)
    sync = DevicePolicy.sync
    monkeypatch.setattr(DevicePolicy, "sync", lambda self: counts.add("sync", "policy.sync") or sync(self))
    step = train.StepLoop.step

    def counted_step(loop, k):
        counts.step, counts.opt = k, loop.opt
        try:
            return step(loop, k)
        finally:
            counts.step = 0

    monkeypatch.setattr(train.StepLoop, "step", counted_step)


def _train_one_rank(one_rank, tmp_path, monkeypatch, counts: _Counts) -> list[dict]:
    """train.run over 3 steps of the module's one-rank debug model, logging every 10th step (and the last)."""
    import copy

    from runner.run import accounting, train
    from runner.run.device import DevicePolicy

    cfg, lay, built, policy = one_rank
    cfg = copy.deepcopy(cfg)
    cfg.training.steps, cfg.logging.log_every = 3, 10
    cfg.training.global_batch_size = cfg.training.microbatch_size = 2  # one microbatch of 2 samples: the cheapest step
    acc = accounting.Accounting(1.0, 1e12, "test", built.flops_per_token, built.flops_per_token, "float32", False, built.num_params, None)
    data = loader.SyntheticData(seed=0, vocab=cfg.model.vocab_size, **(_shape() | {"global_batch": 2, "microbatch": 2}))
    _instrument(monkeypatch, counts, train, DevicePolicy)
    try:
        return train.run(cfg, lay, built, data, acc, [], tmp_path, policy)
    finally:
        monkeypatch.undo()


def test_a_non_logging_step_synchronizes_once_and_runs_one_host_collective(one_rank, tmp_path, monkeypatch):
    """logging.log_every=10 over 3 steps: steps 1 and 2 are plain steps (step 3, the last, logs; step 2 runs step 1's
    deferred update, the optimizer's first). Each reads its loss and grad norm to the host once (the policy's read) and
    runs one host collective (the exchange of loss, data digest and stop flag), and says so in its row's host_syncs;
    before, a plain step made 4 host synchronizations and 3 host collectives."""
    counts = _Counts()
    rows = _train_one_rank(one_rank, tmp_path, monkeypatch, counts)
    print({k: c for k, c in counts.by_step.items()})
    plain = {k: counts.by_step[k] for k in (1, 2)}
    assert all(c == {"sync": ["tolist"], "collective": ["all_reduce"]} for c in plain.values()), plain
    assert [r["host_syncs"] for r in rows] == [1, 1, 1]  # the last step's update runs at once: on CPU no sync of its own
    assert len({r["data_hash"] for r in rows}) == 3 and all(len(r["data_hash"]) == 16 for r in rows)


# ---------------------------------------------------------------- what the step loop trains (the module's one-rank build)


def _train(one_rank, tmp_path, overrides: dict, hooks=None, data=None) -> list[dict]:
    """train.run of the module's one-rank debug model with `overrides` (dotted field -> value) and metrics.jsonl written,
    on `data` (default: synthetic, 2 samples a step); returns its rows as metrics.jsonl holds them. The weights are put
    back afterwards."""
    import copy
    import functools
    import json

    from runner.run import accounting, metrics, train

    cfg, lay, built, policy = one_rank
    cfg = copy.deepcopy(cfg)
    cfg.logging.log_every = 1
    cfg.training.global_batch_size = cfg.training.microbatch_size = 2
    for key, value in overrides.items():
        *path, name = key.split(".")
        setattr(functools.reduce(getattr, path, cfg), name, value)
    acc = accounting.Accounting(1.0, 1e12, "test", built.flops_per_token, built.flops_per_token, "float32", False, built.num_params, None)
    data = data or loader.SyntheticData(seed=0, vocab=cfg.model.vocab_size, **(_shape() | {"global_batch": 2, "microbatch": 2}))
    before = {k: v.detach().clone() for k, v in built.parts[0].state_dict().items()}
    try:
        train.run(cfg, lay, built, data, acc, [metrics.JsonlSink(tmp_path)], tmp_path, policy, hooks=hooks)
    finally:
        built.parts[0].load_state_dict(before)  # the next test starts from the same weights
    return [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
@pytest.mark.parametrize("ratio,floor", [(None, 0.0), (0.5, 0.1)], ids=["decay_after_warmup", "wsd_min_0.1"])
def test_the_logged_learning_rate_is_torchtitans_schedule(one_rank, tmp_path, decay_type, ratio, floor):
    """Every step's logged rate is the one TorchTitan's LRSchedulersContainer gives for the same numbers (warm-up 2,
    10 steps, the decay type, decay_ratio and min_lr_factor): the rate step k's update uses."""
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    from runner.schema import LRDecay

    steps, warmup, peak = 10, 2, 1e-3
    rows = _train(
        one_rank,
        tmp_path,
        {
            "training.steps": steps,
            "optimizer.lr": peak,
            "lr_scheduler.warmup_steps": warmup,
            "lr_scheduler.decay_type": LRDecay(decay_type),
            "lr_scheduler.decay_ratio": ratio,
            "lr_scheduler.min_lr_factor": floor,
        },
    )
    model = torch.nn.Linear(2, 2)
    opt = default_adamw(lr=peak).build(model_parts=[model])
    sched = LRSchedulersContainer.Config(warmup_steps=warmup, decay_type=decay_type, decay_ratio=ratio, min_lr_factor=floor).build(
        optimizers=opt, training_steps=steps
    )
    expected = []
    for _ in range(steps):
        expected.append(opt.optimizers[0].param_groups[0]["lr"])
        sched.step()
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["lr"] for r in rows] == expected
    assert expected[0] == peak / warmup and max(expected) == peak and expected[-1] < peak  # it warms up, then decays
    if floor:
        assert min(expected[warmup:]) >= floor * peak


@pytest.mark.parametrize(
    "overrides",
    [["training.steps=1"], ["training.steps=10", "lr_scheduler.warmup_steps=3", "lr_scheduler.decay_ratio=0.8"]],
    ids=["smoke_step", "decay_clipped"],
)
def test_a_clipped_schedule_is_torchtitans_without_its_warning(compose, caplog, overrides):
    """A warm-up or decay longer than the run trains TorchTitan's clipped schedule (the same rates step by step), and
    TorchTitan's own "Adjusting ..." warning stays off: the runner's validation already said it in one line."""
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    from runner.run.titan import optim

    cfg = compose(overrides)
    s, steps = cfg.lr_scheduler, cfg.training.steps
    with caplog.at_level("WARNING"):
        opt, sched = optim.build_optimizer(cfg, [torch.nn.Linear(2, 2)])
    assert [r.getMessage() for r in caplog.records if "Adjusting" in r.getMessage()] == []
    ref_opt = default_adamw(lr=cfg.optimizer.lr).build(model_parts=[torch.nn.Linear(2, 2)])
    with caplog.at_level("WARNING"):
        ref = LRSchedulersContainer.Config(
            warmup_steps=s.warmup_steps, decay_type=s.decay_type.value, decay_ratio=s.decay_ratio, min_lr_factor=s.min_lr_factor
        ).build(optimizers=ref_opt, training_steps=steps)
    assert any("Adjusting" in r.getMessage() for r in caplog.records)  # TorchTitan clips the same numbers, with its warning
    got, want = [], []
    for _ in range(steps):
        got.append(optim.current_lr(opt))
        want.append(ref_opt.optimizers[0].param_groups[0]["lr"])
        sched.step()
        ref.step()
    assert got == want


def test_no_weight_decay_on_norms_and_embeddings_under_the_switch(one_rank):
    """optimizer.no_decay_1d_and_embeddings: the norm weights and the token embeddings land in a group with weight decay
    0, a Linear weight in the default group with optimizer.weight_decay; a pattern that matches no parameter is named."""
    import copy

    from runner.run import titan
    from runner.run.titan import optim

    cfg, _, built, _ = one_rank
    cfg = copy.deepcopy(cfg)
    cfg.optimizer.no_decay_1d_and_embeddings = True
    opt, _ = titan.build_optimizer(cfg, built.parts)
    decay = {id(p): g["weight_decay"] for o in opt for g in o.param_groups for p in g["params"]}
    named = dict(built.parts[0].named_parameters())
    assert decay[id(named["norm.weight"])] == 0.0 and decay[id(named["tok_embeddings.weight"])] == 0.0
    assert decay[id(named["layers.0.attention_norm.weight"])] == 0.0
    assert decay[id(named["layers.0.feed_forward.w1.weight"])] == 0.1 and decay[id(named["lm_head.weight"])] == 0.1
    assert len(decay) == len(named)  # every parameter in exactly one group
    names = optim.parameter_names(cfg)
    assert sorted(names) == sorted(named)
    cfg.optimizer.param_groups = [schema.ParamGroup(pattern="ffn_norm"), schema.ParamGroup(pattern="router\\.gate")]
    err = optim.unmatched(cfg, names)
    assert err is not None and [p.field for p in err.problems] == ["optimizer.param_groups[1].pattern"]
    assert "optimizer.param_groups[1].pattern = router\\.gate: matches no parameter of the model" in str(err)


def test_param_groups_follow_titans_first_match_rule(compose, monkeypatch, capsys):
    """TorchTitan gives a parameter to the first group whose pattern matches it: with [norm, ffn_norm] every ffn_norm
    weight goes to group 0 and TorchTitan raises building the optimizer. `mode=validate` names group 1 (exit 2) and
    its fix (the groups reordered) builds; the switch's group, left empty by a user group, is skipped, not raised."""
    import re

    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    from runner.run.titan import optim
    from runner.run.titan.model import model_spec
    from tests.in_process import cli as _here

    override = "optimizer.param_groups=[{pattern:norm,weight_decay:0.0},{pattern:ffn_norm,weight_decay:0.0}]"
    cfg = compose([override])
    with torch.device("meta"):
        model = model_spec(cfg.model).model.build()

    def configs(c):
        return [ParamGroupConfig(pattern=p, optimizer_name="AdamW", optimizer_kwargs={"weight_decay": d}) for p, d in optim.groups(c)]

    with pytest.raises(ValueError, match="pattern 'ffn_norm' matched no parameters"):
        OptimizersContainer._build_param_groups(model, configs(cfg), {})  # what a launch met after validation passed
    code, err = _here(monkeypatch, capsys, override, "mode=validate")
    assert code == 2 and err == (
        "Invalid config (1 problem):\n  - optimizer.param_groups[1].pattern = ffn_norm: takes no parameter: every parameter "
        "it matches goes to optimizer.param_groups[0] (pattern norm) first (TorchTitan gives a parameter to the first group "
        "whose pattern matches it). Fix: put it first, optimizer.param_groups=[{pattern:'ffn_norm',weight_decay:0.0},"
        "{pattern:'norm',weight_decay:0.0}], or narrow the earlier pattern.\n"
    )
    fixed = compose([re.search(r"optimizer\.param_groups=\[.*\]", err)[0]])
    assert optim.unmatched(fixed, [n for n, _ in model.named_parameters()]) is None
    OptimizersContainer._build_param_groups(model, configs(fixed), {})
    fixed.optimizer.no_decay_1d_and_embeddings = True
    fixed.optimizer.param_groups.append(schema.ParamGroup(pattern="embeddings"))  # the switch's group is left nothing
    groups, _ = optim._container_class()._build_param_groups(model, configs(fixed), {})
    n, total = cfg.model.num_layers, len(list(model.parameters()))
    assert [(len(g["params"]), g["weight_decay"]) for g in groups["AdamW"]] == [(n, 0.0), (n + 1, 0.0), (1, 0.0), (total - 2 * n - 2, 0.1)]


def test_a_lasting_level_shift_is_skipped_at_most_max_consecutive_times(one_rank, tmp_path, capsys):
    """From step 8 on the guard sees 4 x the gradient norm (a level shift, not a spike): steps 8-10 are skipped
    (monitor.guard.max_consecutive 3), step 11 is accepted and the medians restart from it, and the run trains every
    later step; before, every step after the shift was skipped and the run trained nothing more."""
    shift = {"monitor.inject.norm_shift_step": 8, "monitor.inject.norm_shift_scale": 4.0}
    rows = _train(one_rank, tmp_path, {"training.steps": 16, "optimizer.lr": 1e-7, **shift})  # the weights barely move: no real spike
    assert [r["step"] for r in rows] == list(range(1, 17))
    assert [r["step"] for r in rows if r.get("action") == "skip"] == [8, 9, 10]
    assert [r["step"] for r in rows if r.get("action") == "accept"] == [11]
    assert rows[-1]["skipped_steps"] == 3  # 13 of 16 steps trained
    out = capsys.readouterr().out
    assert "loss guard: step 11: grad norm " in out and "after 3 skipped steps in a row: accepted as a new level" in out


CHECKPOINTS = {"checkpoint.enable": True, "checkpoint.interval": 4, "checkpoint.keep": 0, "checkpoint.async_save": False}


def test_a_lasting_level_shift_rewinds_once_and_every_spike_is_attributed_to_the_data(one_rank, tmp_path, capsys):
    """Every batch's loss x5 from step 8 on (monitor.inject.corrupt_steps: the same on every pass) with action=rewind and
    checkpoints every 4 steps: 8-10 spike, the run rewinds to step 4 and replays 5-7, 11-13 spike again right after the
    rewind and 13 is accepted as the new level: one rewind, and 14-20 train. Each flagged step is replayed before the
    optimizer acts and reproduces bitwise: a data verdict each, in spikes.jsonl and the summary. Before, the run rewound
    again at 13 and skipped every later step."""
    from runner.formats import runfiles

    shift = {"monitor.inject.corrupt_steps": list(range(8, 21)), "monitor.inject.corrupt_scale": 5.0}
    rewind = {"monitor.guard.action": schema.GuardAction.rewind, **CHECKPOINTS}
    rows = _train(one_rank, tmp_path, {"training.steps": 20, "optimizer.lr": 1e-7, **shift, **rewind})
    assert [r["step"] for r in rows] == [*range(1, 11), 5, 6, 7, *range(11, 21)]
    acted = {r["step"]: r["action"] for r in rows if "action" in r}
    assert acted == {8: "skip", 9: "skip", 10: "rewind", 11: "skip", 12: "skip", 13: "accept"}
    assert rows[9]["rewound_to"] == 4 and rows[-1]["skipped_steps"] == 5
    spikes = [json.loads(ln) for ln in (tmp_path / runfiles.SPIKES).read_text().splitlines()]
    assert [(e["step"], e["verdict"], e["action"], e["ranks"]) for e in spikes] == [
        (8, "data", "skip", [0]),
        (9, "data", "skip", [0]),
        (10, "data", "rewind", [0]),
        (11, "data", "skip", [0]),
        (12, "data", "skip", [0]),
        (13, "data", "accept", [0]),
    ]
    assert spikes[0]["metric"] == "loss" and spikes[0]["value"] == rows[7]["loss"] and spikes[0]["value"] > 3 * spikes[0]["median"]
    # the batch that spiked: step 8 reads global samples 14 and 15 (2 a step), step 11 (after the rewind) 20 and 21
    assert spikes[0]["samples"] == [{"index": i, "token_start": i * (SEQ + 1), "num_tokens": SEQ + 1} for i in (14, 15)]
    assert [e["index"] for e in spikes[3]["samples"]] == [20, 21]
    # where it started: every block's gradient norm x5 (the loss x5), the verdict line names the one that rose most
    assert spikes[0]["block"]["why"] == "rise" and 4 < spikes[0]["block"]["rise"] < 6
    assert rows[7]["layers"]["grad_norm"][spikes[0]["block"]["block"]] == spikes[0]["block"]["grad_norm"]
    monitor = json.loads((tmp_path / runfiles.SUMMARY).read_text())["monitor"]
    assert (monitor["rewinds"], monitor["spike_verdicts"]) == (1, {"data": 6, "hardware": 0})
    out = " ".join(capsys.readouterr().out.split())
    assert "again right after the rewind at step 10: a lasting level shift, not a spike: accepted, no second rewind" in out
    assert "spike attribution: step 8 loss " in out and ": data (the replay reproduces it bitwise on all 1 ranks" in out
    assert f"; block {spikes[0]['block']['block']}'s gradient norm rose most: " in out


def test_a_fault_the_replay_does_not_reproduce_is_hardware_and_rewinds(one_rank, tmp_path, capsys):
    """Rank 0's loss at step 6 x1e4 on the first pass only (monitor.inject.fault_rank): the replay differs, a hardware
    verdict naming the rank; the step is not applied, not counted as skipped, and monitor.integrity.on_mismatch=rewind
    goes back to step 4's checkpoint, after which steps 5-8 train (the fault fires once)."""
    from runner.formats import runfiles

    fault = {"monitor.inject.fault_rank": 0, "monitor.inject.fault_at_step": 6, "monitor.inject.corrupt_scale": 1e4}
    rewind = {"monitor.integrity.on_mismatch": schema.MismatchAction.rewind, **CHECKPOINTS}
    rows = _train(one_rank, tmp_path, {"training.steps": 8, **fault, **rewind})
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]
    r6 = rows[5]
    assert (r6["verdict"], r6["verdict_ranks"], r6["rewound_to"], r6["skipped_steps"]) == ("hardware", [0], 4, 0)
    assert rows[7]["loss"] < 20 and "verdict" not in rows[7] and rows[-1]["skipped_steps"] == 0
    (e,) = [json.loads(ln) for ln in (tmp_path / runfiles.SPIKES).read_text().splitlines()]
    assert (e["step"], e["verdict"], e["ranks"], e["action"]) == (6, "hardware", [0], "rewind") and e["hosts"]
    assert "samples" not in e  # the batch is not to blame
    monitor = json.loads((tmp_path / runfiles.SUMMARY).read_text())["monitor"]
    assert monitor["spike_verdicts"] == {"data": 0, "hardware": 1} and monitor["bad_steps"] == []
    out = " ".join(capsys.readouterr().out.split())
    assert f"spike attribution: step 6 loss {e['value']:.4g} > 3 x running median" in out
    assert f": hardware (the replay differs on rank 0, host {e['hosts'][0]}): step not applied" in out


def test_per_block_statistics_at_logged_steps_match_a_hand_computation(one_rank, tmp_path):
    """logging.log_every=2 over 4 steps: rows 2 and 4 carry `layers`, one value per block, equal (to the 4 digits the row
    keeps) to each block's gradient norm, largest absolute weight (computed by hand where the clip starts) and largest
    absolute output (a forward hook of the test's own), with no non-finite value."""
    from runner.run.step_loop import Hooks

    cfg, _, built, _ = one_rank
    blocks = list(built.parts[0].layers.values())
    seen: dict[int, dict] = {}

    def by_hand(step, parts):
        grads = [torch.sqrt(sum(p.grad.double().square().sum() for p in b.parameters())).item() for b in blocks]
        weights = [max(p.detach().abs().max().item() for p in b.parameters()) for b in blocks]
        seen[step] = {"grad_norm": grads, "weight_max": weights, "act_max": list(acts)}
        acts[:] = [0.0] * len(blocks)  # the next step's forward starts afresh

    acts = [0.0] * len(blocks)

    def act(i):
        return lambda m, a, out: acts.__setitem__(i, max(acts[i], out.detach().abs().max().item()))

    handles = [b.register_forward_hook(act(i)) for i, b in enumerate(blocks)]
    try:
        rows = _train(one_rank, tmp_path, {"training.steps": 4, "logging.log_every": 2}, hooks=Hooks(before_clip=by_hand))
    finally:
        for h in handles:
            h.remove()
    assert [r["step"] for r in rows] == [2, 4]
    for r in rows:
        got = r["layers"]
        assert got["nonfinite"] == [0] * cfg.model.num_layers and "verdict" not in r
        for field in ("grad_norm", "weight_max", "act_max"):
            assert got[field] == pytest.approx(seen[r["step"]][field], rel=1e-3), field
        assert sum(g * g for g in got["grad_norm"]) < r["grad_norm"] ** 2  # the embeddings and the output hold the rest


def test_the_block_a_spike_started_in_and_the_flat_keys():
    """Against running medians of 1, 2 and 4: a step with norms 2, 10, 8 names block 1 (5x its median, block 2 only 2x);
    a non-finite output names the first block holding one; before any median, the largest norm. A shard held by the 2
    replicas of an HSDP group counts half on each; a norm on a TP-replicated weight under dp2_tp2 too; W&B keys are flat."""
    from runner.observe import layer_stats

    stats = layer_stats.LayerStats([], 3, 4, torch.device("cpu"))
    fresh = {"grad_norm": [2.0, 10.0, 8.0], "act_max": [1.0, 2.0, 3.0], "weight_max": [0.1, 0.2, 0.3], "nonfinite": [0, 0, 0]}
    assert stats.blame(fresh) == {"block": 1, "why": "largest", "grad_norm": 10.0}
    for _ in range(3):
        stats.accept(fresh | {"grad_norm": [1.0, 2.0, 4.0]})
    assert stats.blame(fresh) == {"block": 1, "why": "rise", "grad_norm": 10.0, "rise": 5.0}
    assert layer_stats.describe(stats.blame(fresh)) == "block 1's gradient norm rose most: 10, 5 x its running median"
    bad = fresh | {"act_max": [1.0, math.inf, math.inf], "nonfinite": [0, 7, 9]}
    assert layer_stats.describe(stats.blame(bad)) == "block 1's output is the first non-finite (7 non-finite tensors)"
    # (ranks of the stage, ranks the tensor's mesh spans, sizes of the mesh dims it is replicated over)
    assert [layer_stats.copies(*c) for c in ((4, 4, 2), (4, 4, 1), (4, 1, 1), (2, 2, 1))] == [2, 1, 4, 1]
    keys = layer_stats.wandb_keys(fresh)
    assert len(keys) == 12 and keys["layers/block1_grad_norm"] == 10.0 and keys["layers/block2_nonfinite"] == 0


def test_a_poisoned_text_batch_is_the_datas_its_samples_are_named_and_shown(one_rank, tmp_path, capsys):
    """data=text (framed documents, shuffled), step 6's batch x1e4 on every pass: a data verdict that records global samples
    10 and 11 with the file, record and offset each starts at; the step is skipped; `python -m runner.data show` prints
    them decoded with the run's tokenizer, and refuses a missing run folder or an unrecorded step with exit 2."""
    import copy
    import functools

    from tokenizers import Tokenizer

    from runner.config import freeze
    from runner.data import cli
    from runner.formats import documents, runfiles

    path, tok = text_assets.make(tmp_path / "assets", n_docs=60, vocab_size=300)
    c = text_corpus.build([str(path)], "json", "text", str(tok), text_assets.EOS, tmp_path / "cache")
    data = loader.TextData(
        torch.from_numpy(c.tokens), seed=0, shuffle=True, ends=c.ends, source=c, **(_shape() | {"global_batch": 2, "microbatch": 2})
    )
    text = {"data.name": schema.DataSource.text, "data.files": [str(path)], "data.tokenizer": str(tok), "data.eos_token": text_assets.EOS}
    run = tmp_path / "run"
    run.mkdir()
    rows = _train(one_rank, run, {"training.steps": 7, "monitor.inject.corrupt_steps": [6], **text}, data=data)
    assert (rows[5]["action"], rows[5]["verdict"], rows[5]["skipped_steps"]) == ("skip", "data", 1)
    (e,) = [json.loads(ln) for ln in (run / runfiles.SPIKES).read_text().splitlines()]
    assert [s["index"] for s in e["samples"]] == [10, 11] and e["samples"][0] == {"index": 10, **data.origin(10)}
    docs = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    tokenizer = Tokenizer.from_file(str(tok))
    frame = documents.specials(tokenizer, str(tok), text_assets.EOS).frame
    for s in e["samples"]:  # the record's framed document, from the offset on, is where the sample's inputs start
        k = c.where.index((0, s["record"]))
        framed = c.tokens[(c.ends[k - 1] if k else 0) : c.ends[k]].tolist()
        assert s["file"] == str(path) and s["num_pairs"] == SEQ and framed == frame(tokenizer.encode(docs[s["record"]]).ids)
        m = min(len(framed) - 1 - s["offset"], SEQ)
        assert m > 0 and data.window(s["index"])[0].tolist()[:m] == framed[s["offset"] : s["offset"] + m]
    frozen_cfg = copy.deepcopy(one_rank[0])
    for key, value in text.items():
        *where, name = key.split(".")
        setattr(functools.reduce(getattr, where, frozen_cfg), name, value)
    freeze.write(frozen_cfg, one_rank[1], run)
    capsys.readouterr()
    assert cli.main(["show", str(run), "--step", "6"]) == 0
    out = capsys.readouterr().out.splitlines()
    inputs, labels, _ = data.window(10)
    assert out[0] == "step 6: 2 samples (text data)"
    assert out[1] == f"sample 10: {path} record {e['samples'][0]['record']} at offset {e['samples'][0]['offset']}"
    assert out[2] == "  " + repr(tokenizer.decode([*inputs.tolist(), int(labels[-1])], skip_special_tokens=False))
    assert cli.main(["show", str(tmp_path / "nope"), "--step", "6"]) == 2
    assert "run folder" in capsys.readouterr().err
    assert cli.main(["show", str(run), "--step", "3"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--step" in err and "no samples recorded for this step" in err and "pick a recorded step: 6" in err


def test_a_rewind_records_the_batches_it_leaves_out_and_a_replay_leaves_out_the_same(one_rank, tmp_path):
    """Steps 6 and 7 x1e4 with action=rewind, max_consecutive 2 and checkpoints every 4 steps: the run rewinds to step 4,
    replays 5 and leaves out 6 and 7, recording their samples in left_out.jsonl; the same config run again (as a replay of
    frozen.yaml runs it) leaves out the same samples and gives the same losses and gradient norms, bit for bit."""
    from runner.formats import runfiles

    poison = {"monitor.inject.corrupt_steps": [6, 7], "monitor.guard.max_consecutive": 2}
    rewind = {"training.steps": 8, "monitor.guard.action": schema.GuardAction.rewind, **CHECKPOINTS, **poison}
    runs = []
    for name in ("first", "replay"):
        (tmp_path / name).mkdir()
        rows = _train(one_rank, tmp_path / name, rewind)
        left = [json.loads(ln) for ln in (tmp_path / name / runfiles.LEFT_OUT).read_text().splitlines()]
        runs.append(([(r["step"], r["loss"], r["grad_norm"]) for r in rows], left))
    (rows, left), replay = runs
    assert [s for s, _, _ in rows] == [1, 2, 3, 4, 5, 6, 7, 5, 8]
    assert [(e["step"], [s["index"] for s in e["samples"]]) for e in left] == [(6, [10, 11]), (7, [12, 13])]
    assert replay == (rows, left)


def test_collections_run_at_the_same_steps_with_automatic_collection_off(one_rank, tmp_path):
    """training.gc_every=3 over 7 steps: inside the loop Python's automatic collection is off and the only collections are
    TorchTitan's GarbageCollection's, at steps 3 and 6 (every rank collects at the same step); after it, it is on again."""
    import gc

    from runner.run.step_loop import Hooks

    now, seen, enabled = [0], [], []

    def counted(phase, info):
        if phase == "start" and now[0]:
            seen.append(now[0])

    def before_clip(step, parts):
        now[0] = step
        enabled.append(gc.isenabled())

    gc.callbacks.append(counted)
    try:
        rows = _train(one_rank, tmp_path, {"training.steps": 7, "training.gc_every": 3}, hooks=Hooks(before_clip=before_clip))
    finally:
        gc.callbacks.remove(counted)
    assert enabled == [False] * 7 and gc.isenabled()
    assert seen == [3, 6]
    assert [r["step"] for r in rows if "gc_s" in r] == [3, 6]
