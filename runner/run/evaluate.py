"""Evaluation on held-out data: the loss of the current weights on the first eval.steps batches of the held-out split.

An evaluation pass runs after the optimizer step of every eval.interval-th step and of the last step. Each pass reads
the same samples: batch k (k < eval.steps) is global samples [k * B, (k + 1) * B) of the held-out split, B the
training global batch, each DP replica its slice of them as in training (runner.run.loader, split="eval"), so passes
are comparable and independent of the training position. The forward runs without gradients, with the model parts in
eval mode (MoE routers then leave their load-balancing token counts alone), through the pipeline schedule's
forward-only step under PP. The loss is averaged per token over the pass like the training loss: every batch's share
is divided by its global token count, the shares are summed over ranks (global_loss) and over the
batches, and divided by eval.steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from runner.run import titan
from runner.run.device import DevicePolicy
from runner.schema.layout import Layout

ROW_KEYS = ("eval_loss", "eval_ppl", "eval_s")


def global_loss(local: torch.Tensor, lay: Layout, policy: DevicePolicy) -> float:
    """Sum of the per-rank shares = mean token loss (an evaluation pass's; a training step's goes through
    runner.run.step_sync). Ranks of a TP group hold the same share, so only TP rank 0 contributes; non-last
    pipeline stages hold zero."""
    share = local if lay.coords(dist.get_rank())["tp"] == 0 else torch.zeros_like(local)
    return float(policy.all_reduce(share))


def due(interval: int, step: int, num_steps: int) -> bool:
    """Whether step `step` (1-based) ends with an evaluation pass: every `interval` steps and after the last one."""
    return interval > 0 and (step % interval == 0 or step == num_steps)


def check_split(data, steps: int) -> None:
    """A held-out split read in full by one pass must hold eval.steps batches: wrapping around would count samples twice."""
    held = getattr(data, "num_samples", None)  # the synthetic split is unbounded
    need = steps * data.global_batch
    more = "hold out more text (data.eval_files, data.eval_fraction)"
    if isinstance(held, list):  # prepared token folders: each source's eval split must hold the samples the pass reads of it
        short = [(h, r) for h, r in zip(held, data.mixture.counts(need), strict=True) if h < r]
        held, need = short[0] if short else (None, need)
        more = "prepare the folder again with a larger --eval-fraction"  # validation names the folder (data_rules)
    if held is not None and held < need:
        raise ValueError(
            f"the held-out split holds {held} samples, fewer than eval.steps x training.global_batch_size "
            f"= {need}; lower eval.steps, or {more}"
        )


def _forward(built, loss_fn, microbatches, global_tokens: torch.Tensor) -> torch.Tensor:
    """This rank's loss share of one batch, microbatch by microbatch, as step_loop.forward_backward without its backward."""
    losses = []
    for mb in microbatches:
        inputs, labels, extra = titan.model_inputs(built, mb.inputs, mb.labels, positions=mb.positions)
        losses.append(titan.next_token_loss(loss_fn, built.parts[0](inputs, **extra), labels, global_tokens))
    return titan.local_value(sum(losses)).cpu()


def local_loss(built, loss_fn, batches: Iterable, global_tokens: torch.Tensor) -> torch.Tensor:
    """This rank's share of the pass's loss, summed over its batches (each a list of on-device microbatches)."""
    for part in built.parts:
        part.eval()
    try:
        with torch.no_grad():
            total = torch.zeros((), dtype=torch.float32)
            for microbatches in batches:
                if built.schedule is not None:
                    total += titan.pipeline_eval(built, microbatches, global_tokens)
                else:
                    total += _forward(built, loss_fn, microbatches, global_tokens)
    finally:
        for part in built.parts:
            part.train()
    return total


def row(loss: float, seconds: float) -> dict[str, float]:
    """The pass's entries of its step's metrics row."""
    return {"eval_loss": loss, "eval_ppl": math.exp(loss) if loss < 700 else math.inf, "eval_s": seconds}


def summary(rows: list[dict]) -> dict[str, float | int | None]:
    """summary.json's view of evaluation: the last pass's loss and perplexity and the step it ran at (None when off)."""
    last = next((r for r in reversed(rows) if "eval_loss" in r), None)
    if last is None:
        return {"eval_loss_final": None, "eval_ppl_final": None, "eval_step_final": None}
    return {"eval_loss_final": last["eval_loss"], "eval_ppl_final": last["eval_ppl"], "eval_step_final": last["step"]}
