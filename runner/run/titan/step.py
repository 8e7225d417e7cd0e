"""The step loop's TorchTitan operations: loss, gradient clipping, a pipeline step (training or forward-only)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from runner.schema import RunConfig

if TYPE_CHECKING:
    from torchtitan.components.loss import BaseLoss


def loss_fn(cfg: RunConfig) -> BaseLoss:
    """TorchTitan's cross-entropy: sum over tokens divided by the global token count, because
    TorchTitan's FSDP sums (does not average) gradients over data-parallel ranks. With model.num_mtp_layers, TorchTitan's
    MTPLoss as deepseek_v3_debugmodel_mtp() configures it: that cross-entropy of the main head plus mtp_loss_scale x
    the mean over the MTP depths of theirs, the depth-k labels shifted k tokens further within each document."""
    from torchtitan.components.loss import CrossEntropyLoss

    if cfg.model.num_mtp_layers:
        from torchtitan.models.deepseek_v3 import MTPLoss

        return MTPLoss(MTPLoss.Config(mtp_scale=cfg.model.mtp_loss_scale, global_vocab_size=cfg.model.vocab_size))
    return CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=cfg.model.vocab_size))


def loss_inputs(extra: dict, labels: torch.Tensor) -> dict:
    """The loss's keyword inputs as TorchTitan's trainer passes them (the batch's positions; MTPLoss shifts its labels
    within documents by them, the cross-entropy ignores them). Without packed documents, 0..seq-1 in every sample:
    what TorchTitan's text loader gives a sample of one document."""
    positions = extra.get("positions")
    if positions is None:
        positions = torch.arange(labels.shape[1], device=labels.device).expand(labels.shape)
    return {"positions": positions}


def next_token_loss(loss, pred, labels: torch.Tensor, global_tokens: torch.Tensor) -> torch.Tensor:
    """The held-out loss share: `loss`'s cross-entropy of the next token; under MTP that of the main head alone (MTPLoss's
    main term), so eval_loss and eval_ppl mean what they mean without MTP (TorchTitan's Validator calls the training
    loss without positions, which MTPLoss refuses)."""
    from torchtitan.components.loss import cross_entropy_loss

    if isinstance(pred, list):
        return cross_entropy_loss(pred[0], labels, global_vocab_size=loss.global_vocab_size) / global_tokens
    return loss(pred, labels, global_tokens)[0]


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's value as a plain tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def clip_grad_norm_tensor(parts: list[torch.nn.Module], max_norm: float, pd) -> torch.Tensor:
    """Clip to the global gradient norm and return it (pre-clip) on the device, as TorchTitan's Trainer does: DTensor
    gradients reduce their norm over the axes they are sharded on (dp_shard, cp, tp; ep in the EP-aware variant, which
    sums the expert and dense parts), and the pipeline mesh sums the stages' parts. The step reads it back once, with the
    loss (DevicePolicy.read); the dry run's fake tensors hold no value to read."""
    from torchtitan.distributed.utils import clip_grad_norm_

    grads = [p for m in parts for p in m.parameters() if p.grad is not None]
    return clip_grad_norm_(grads, max_norm, foreach=True, pp_mesh=pd.get_optional_mesh("pp"), ep_enabled=pd.ep_enabled)


def model_inputs(
    built, inputs: torch.Tensor, labels: torch.Tensor, extra: dict | None = None, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Tokens, labels and keyword inputs of one microbatch (`extra`, default the model's built ones; with `positions`,
    packed documents: those positions and their document mask, `document_inputs`); with CP, this rank's sequence
    chunks (TorchTitan's prepare_context_parallel_input: load-balanced chunks of tokens, positions and masks)."""
    if positions is not None:
        extra = document_inputs(built, positions)
    extra = built.extra_inputs if extra is None else extra
    if built.cp_load_balancer is None:
        return inputs, labels, extra
    from torchtitan.distributed.context_parallel import prepare_context_parallel_input

    if "positions" not in extra:
        extra = {"positions": torch.arange(inputs.shape[1], device=inputs.device).expand(inputs.shape)} | extra
    cp_mesh = built.parallel_dims.get_mesh("cp")
    return prepare_context_parallel_input(inputs, labels, dict(extra), cp_mesh, inputs.device, built.cp_load_balancer)


def document_inputs(built, positions: torch.Tensor) -> dict:
    """Keyword inputs of packed documents, as TorchTitan's trainer builds them per batch from the loader's positions
    (restarting at 0 at each document): the positions (RoPE) and the model's get_attention_masks, FlexAttention's causal
    AND packed-document BlockMask (models/common/decoder.py). The CPU's SDPA takes the same mask mods as a boolean mask
    (runner.run.titan.cpu.document_mask)."""
    if built.attention_masks:
        return {"positions": positions, "attention_masks": built.parts[0].get_attention_masks(positions=positions)}
    from runner.run.titan.cpu import document_mask

    return {"positions": positions, "attention_masks": document_mask(positions)}


def batch_masks(built, inputs: torch.Tensor, positions: torch.Tensor | None = None) -> dict:
    """Keyword inputs of a pipeline step's whole local batch, as TorchTitan's trainer builds them: positions, then the
    model's get_attention_masks (FlexAttention's BlockMask; one document per sample without `positions`). The schedule
    splits both along the batch, one part per microbatch (torch.distributed.pipelining.microbatch splits a BlockMask
    and a tensor), and hands them to every stage. Without positions or masks (SDPA, the CPU attention) the model's
    built inputs."""
    if positions is not None:
        return document_inputs(built, positions)
    if not built.attention_masks:
        return built.extra_inputs
    positions = torch.arange(inputs.shape[1], device=inputs.device).expand(inputs.shape)
    return {"positions": positions, "attention_masks": built.parts[0].get_attention_masks(positions=positions)}


def pipeline_step(built, microbatches, global_tokens: torch.Tensor) -> torch.Tensor:
    """One pipeline schedule over this DP rank's batch; the loss share lives on the last stage. With CP every
    stage gets this rank's sequence chunks and their RoPE positions (TorchTitan's trainer prepares each
    microbatch the same way before its schedule step); the schedule splits them into microbatches."""
    return _schedule(built, built.schedule.step, microbatches, global_tokens)


def pipeline_set_up(built, microbatches, global_tokens: torch.Tensor) -> None:
    """What the schedule's first step() sets up before it runs any microbatch, and nothing more (the dry run's warm-up,
    runner.run.dryrun.rehearse): torch's stage initialization, as every schedule's `_step_microbatches` starts, on the
    first microbatch (shape inference: one forward and backward per stage where the shapes are not declared) and the
    receive buffers of every microbatch, which the stages keep for the following steps."""
    # private_api: torch_schedule_step_microbatches, torch_schedule_check_inputs, torch_schedule_initialize,
    # private_api: torch_schedule_initialize_single
    schedule = built.schedule
    initialize = getattr(schedule, "_initialize_stages", None) or schedule._initialize_stage

    def first_only(arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True, loss_kwargs=None):
        arg_mbs, kwarg_mbs = schedule._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        initialize(arg_mbs[0], kwarg_mbs[0], None if target_mbs is None else target_mbs[0], loss_kwargs)

    schedule._step_microbatches = first_only  # this object's only: the class's comes back on del
    try:
        _schedule(built, schedule.step, microbatches, global_tokens)
    finally:
        del schedule._step_microbatches


def pipeline_eval(built, microbatches, global_tokens: torch.Tensor) -> torch.Tensor:
    """The schedule's forward-only step (`eval`, as TorchTitan's Validator runs it; call it under torch.no_grad)
    over this DP rank's batch: the loss share as pipeline_step's, on the last stage."""
    with _forward_actions_only(built.schedule):
        return _schedule(built, built.schedule.eval, microbatches, global_tokens).cpu()


@contextmanager
def _forward_actions_only(schedule):
    """torch 2.13's action-list schedules (the looped and V ones) still run their backward actions under `eval`;
    they do nothing there, except where two adjacent stages share a rank (ZBVZeroBubble, DualPipeV): handing the
    input gradient to the stage before fails with "can't steal_bwd_input if this stage doesn't have backward". So
    during `eval` the action list keeps only the forward actions (and the forward halves of DualPipeV's overlaps)."""
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if order is None:  # the single-stage schedules (1F1B, GPipe) skip backward themselves
        yield
        return
    # private_api: torch_computation_type
    from torch.distributed.pipelining.schedules import _ComputationType as Act

    backward = {Act.FULL_BACKWARD, Act.BACKWARD_INPUT, Act.BACKWARD_WEIGHT, Act.SEND_B, Act.RECV_B, Act.REDUCE_GRAD}

    def forward(actions):
        out = []
        for a in actions:
            parts = a.sub_actions if a.computation_type == Act.OVERLAP_F_B else [a]
            out += [p for p in parts if p.computation_type not in backward]
        return out

    schedule.pipeline_order_with_comms = {rank: forward(actions) for rank, actions in order.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = order


def _schedule(built, run, microbatches, global_tokens: torch.Tensor) -> torch.Tensor:
    inputs = torch.cat([mb.inputs for mb in microbatches])
    positions = None if microbatches[0].positions is None else torch.cat([mb.positions for mb in microbatches])
    labels = torch.cat([mb.labels for mb in microbatches])
    inputs, labels, extra = model_inputs(built, inputs, labels, batch_masks(built, inputs, positions))
    losses = [] if built.has_last else None
    run(
        *((inputs,) if built.has_first else ()),
        **extra,
        target=labels if built.has_last else None,
        losses=losses,
        loss_kwargs={"global_valid_tokens": global_tokens},
        return_outputs=False,
    )
    if built.has_last:
        return local_value(sum(loss.detach() for loss in losses))
    # read by the policy with the grad norm (DevicePolicy.read): made on the compute device, since a CPU zero would be
    # copied to the device there, a blocking copy that waits for the stage's kernels (a second host sync per step)
    return torch.zeros((), device=inputs.device)


def pipeline_stages(schedule) -> list:
    """This rank's stages of a torch.distributed.pipelining schedule ([] without one); torch has no public accessor."""
    if schedule is None:
        return []
    # private_api: torch_schedule_stages, torch_schedule_stage
    return list(getattr(schedule, "_stages", None) or [schedule._stage])
