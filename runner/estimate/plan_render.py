"""The step budget as a table (`mode=plan`) and as one line per sweep point."""

from __future__ import annotations

from typing import Any

from runner.schema import wording
from runner.schema.wording import count


def _layers(split: list[int]) -> str:
    """'0 | 1 x 6 | 0' style: stage sizes with runs collapsed."""
    runs: list[list[int]] = []
    for n in split:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return " | ".join(f"{n} x {k}" if k > 1 else str(n) for n, k in runs)


def _f(x: float | None, fmt: str, unit: str = "") -> str:
    return "n/a" if x is None else format(x, fmt) + unit


def _pp(plan: dict[str, Any]) -> bool:
    return len(plan["total_gb_per_stage"]) > 1


EXAMPLE = "  worked example"
"""The label of the rows in the budget convention of the worked example."""


def _memory_rows(plan: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The memory rows: the default figures (what TorchTitan allocates, checked by mode=dryrun) and, indented below
    them, the worked example's convention, which one row explains."""
    mem = plan["device_memory_gb"]
    fit = {True: "fits", False: "DOES NOT FIT", None: "device memory unknown"}[plan["fits_memory"]]
    return [
        (
            "memory",
            "",
            f"as TorchTitan allocates it; '{EXAMPLE.strip()}' rows: the worked example's budget convention (training-dtype "
            "gradients, Korthikanti activations)",
        ),
        (
            "weights + gradients",
            _f(plan["weights_grads_gb_per_gpu"], ".3g", " GB"),
            "bf16 gathered + fp32 unsharded gradients of the stage (no sync until the last microbatch)"
            if plan["weights_gathered_during_step"] and _pp(plan)
            else "fp32 gradient shard + the head gathered",
        ),
        (EXAMPLE, _f(plan["weights_grads_gb_per_gpu_worked_example"], ".3g", " GB"), "weights and gradients in the training dtype"),
        ("optimizer state", _f(plan["optimizer_gb_per_gpu"], ".3g", " GB"), "fp32 master + Adam moments / (dp_shard x cp)"),
        (EXAMPLE, _f(plan["optimizer_gb_per_gpu_worked_example"], ".3g", " GB"), "12 B per parameter / dp_shard"),
        (
            "activations per microbatch",
            _f(plan["activations_gb_per_microbatch"], ".3g", " GB"),
            "what TorchTitan's blocks save for backward, with the loss's on the last stage",
        ),
        (
            EXAMPLE,
            _f(plan["activations_gb_per_microbatch_worked_example"], ".3g", " GB"),
            f"Korthikanti 2022; {plan['activations_gb_per_microbatch_recompute_worked_example']:.3g} GB with full recomputation",
        ),
        ("activations in flight", _f(plan["activations_gb_per_gpu"], ".3g", " GB"), count(plan["microbatches_in_flight"], "microbatch")),
        *_moe_rows(plan),
        (
            "temporaries + buffers",
            _f(plan["temporaries_gb_per_gpu"] + plan["buffers_gb_per_gpu"] + plan["block_mask_gb_per_gpu"], ".3g", " GB"),
            f"recomputed block{_fp8_casts(plan)} or loss backward {plan['temporaries_gb_per_gpu']:.3g} GB; "
            f"RoPE tables {plan['buffers_gb_per_gpu']:.3g} GB" + _block_masks(plan),
        ),
        (
            "total memory",
            _f(plan["total_gb_per_gpu"], ".3g", " GB"),
            f"{fit}"
            + (f" in {mem:.3g} GB" if mem else "")
            + (f"; stage {plan['memory_stage']}" if _pp(plan) else "")
            + "; checked by mode=dryrun",
        ),
        (EXAMPLE, _f(plan["total_gb_per_gpu_worked_example"], ".3g", " GB"), "weights + optimizer + Korthikanti activations"),
    ]


def _moe_rows(plan: dict[str, Any]) -> list[tuple[str, str, str]]:
    """MoE models: one MoE block's memory per microbatch by named term (runner.estimate.moe_memory)."""
    terms = plan["moe_memory_gb"]
    if not terms:
        return []
    saved = {k: v for k, v in terms.items() if k not in ("dispatch_combine", "combine_backward")}
    parts = ", ".join(f"{k} {1e3 * v:.4g}" for k, v in saved.items())
    return [
        ("  MoE block, saved", _f(sum(saved.values()), ".3g", " GB"), f"per microbatch, MB: {parts}"),
        (
            "  MoE block, transient",
            _f(max(terms["dispatch_combine"], terms["combine_backward"]), ".3g", " GB"),
            f"with the temporaries: combine_backward {1e3 * terms['combine_backward']:.4g} MB (its fp32 gradients), "
            f"dispatch_combine {1e3 * terms['dispatch_combine']:.4g} MB (the all-to-all's buffers)",
        ),
    ]


def _block_masks(plan: dict[str, Any]) -> str:
    """FlexAttention's block masks (CUDA): their memory, and how many the step builds (runner.estimate.block_mask)."""
    if not plan["block_mask_gb_per_gpu"]:
        return ""
    built = plan["block_mask_builds_per_step"]
    when = f"{built} built per step, {plan['block_mask_evaluations_per_step']:.3g} mask evaluations" if built else "built once"
    return f"; block masks {plan['block_mask_gb_per_gpu']:.3g} GB ({when})"


def _fp8_casts(plan: dict[str, Any]) -> str:
    """FP8 recipes: a converted Linear's backward also holds its float8 operands and a cast (runner.estimate.memory)."""
    return ", an FP8 Linear's backward casts" if _fp8(plan) else ""


def _binding(plan: dict[str, Any]) -> str:
    """'compute 61 %, non_matmul 22 %, ...' of the predicted step: its largest terms first."""
    terms, total = plan["predicted_terms_s"], plan["estimated_step_time_s"]
    if not terms or not total:
        return "terms n/a"
    top = sorted(terms.items(), key=lambda kv: -kv[1])[:3]
    return ", ".join(f"{k} {100 * v / total:.0f} %" for k, v in top if v > 0)


def _active(plan: dict[str, Any]) -> str:
    """MoE models: the parameters one token uses, which model FLOPs and MFU count."""
    active = plan["active_params"]
    return f"{active / 1e9:.2f} B active per token (FLOPs, MFU)" if active != plan["params"] else ""


def _fp8(plan: dict[str, Any]) -> bool:
    """The GEMMs run in another dtype than MFU's peak (FP8 recipes): both MFU figures are printed."""
    return plan.get("gemm_peak_dtype", plan["peak_dtype"]) != plan["peak_dtype"]


def _fp8_rows(plan: dict[str, Any]) -> list[tuple[str, str, str]]:
    """FP8 recipes: the predictor's own FP8 terms (runner/estimate/predict/fp8_cost.py), and the routed experts' precision."""
    terms = plan["predicted_terms_s"]
    experts = [("routed experts", plan["experts_precision"], plan["routed_experts"])] if plan.get("routed_experts") else []
    if not (_fp8(plan) or plan.get("experts_precision", "high") != "high") or not terms:
        return experts
    cast, amax = terms.get("fp8_cast", 0.0), terms.get("fp8_amax", 0.0)
    out = [
        (
            "FP8 casts and scales",
            _f(cast + amax, ".3f", " s"),
            f"fp8_cast {cast:.3f} s (cast kernels, memory-bound), fp8_amax {amax:.3f} s (tensorwise amax all-reduces); "
            "converted GEMMs in compute at the FP8 rate, kept layers (lm_head) at bf16's",
        ),
        *experts,
    ]
    if plan.get("fp8_speed_up") is not None:
        over = plan["fp8_speed_up_over"]
        out.append(
            (
                "FP8 speed-up",
                f"x{plan['fp8_speed_up']:.2f}",
                f"the same layout's predicted {over} step ({plan['estimated_step_time_s'] * plan['fp8_speed_up']:.3f} s) over this one: "
                "above 1 where the GEMMs are large, below where casts and high-precision layers eat their gain",
            )
        )
    return out


def rows(plan: dict[str, Any], configured_interval: int | None = None, configured_local: int | None = None) -> list[tuple[str, str, str]]:
    """(row, value, note) lines of the printed table."""
    pct = lambda x: _f(None if x is None else 100 * x, ".1f", " %")  # noqa: E731
    conv = plan["flops_convention"]
    unit = wording.device_unit(plan["device"])
    out = [
        ("model", f"{plan['model']}, {plan['params'] / 1e9:.2f} B params", _active(plan)),
        ("layout", f"{plan['layout']} [{plan['degrees']}]", count(plan["world_size"], unit)),
        ("links", ", ".join(f"{a}: {lk}" for a, lk in plan["links"].items()) or "-", "ranks placed TP fastest"),
        ("tokens per step", f"{plan['tokens_per_step']:,}", "global batch x seq_len"),
        ("microbatches per pipeline m", str(plan["microbatches"]), ""),
        ("pipeline bubble", pct(plan["bubble_fraction"]), plan["bubble_formula"]),
        ("layers per stage", _layers(plan["layers_per_stage"]), f"{count(plan['virtual_stages_per_rank'], 'stage')} per pipeline rank"),
        (f"parameters per {unit}", f"{plan['params_per_gpu'] / 1e9:.3f} B", "params / (tp x pp)"),
        *_memory_rows(plan),
        ("model FLOPs per step", f"{plan['model_flops_per_step']:.3e}", f"{conv} convention"),
        (
            "ideal compute",
            _f(plan["ideal_compute_s"], ".3f", " s"),
            f"at {plan['peak_tflops']:g} TFLOP/s {plan['peak_dtype']} dense peak"
            if plan["peak_tflops"]
            else "no peak in the cluster config (a CPU peak is measured at launch)",
        ),
        (
            "step time",
            _f(plan["step_time_s"], ".3f", " s"),
            f"at {100 * plan['mfu_assumed']:.0f} % MFU ({conv}) of the {plan['peak_dtype']} peak"
            + (f", whatever the GEMMs' dtype ({plan['gemm_peak_dtype']})" if _fp8(plan) else ""),
        ),
        (
            "bottom-up step estimate",
            _f(plan["estimated_step_time_s"], ".3f", " s"),
            f"MFU {pct(plan['estimated_mfu'])} of {plan['peak_dtype']}"
            + (f", mfu_of_gemm_peak {pct(plan['estimated_mfu_of_gemm_peak'])} of {plan['gemm_peak_dtype']}" if _fp8(plan) else "")
            + f"; shares of this estimate: {_binding(plan)}; {plan['predicted_source']}",
        ),
        *_fp8_rows(plan),
        (
            "TP traffic",
            _f(plan["tp_comm_s"], ".3f", " s"),
            f"{plan['tp_comm_gb']:.1f} GB, {pct(plan['tp_comm_share'])} of the step time at {100 * plan['mfu_assumed']:.0f} % MFU",
        ),
        ("PP traffic", _f(plan["pp_comm_s"], ".4f", " s"), f"{plan['pp_comm_gb']:.2f} GB point-to-point"),
        (
            "DP traffic",
            _f(plan["dp_comm_s"], ".3f", " s"),
            f"{plan['dp_comm_gb']:.1f} GB; "
            + {True: "hides behind backward", False: "LONGER THAN BACKWARD", None: "overlap unknown"}[plan["dp_hidden_behind_backward"]],
        ),
    ]
    if plan["cp_comm_gb"]:
        out.append(("CP traffic", _f(plan["cp_comm_s"], ".3f", " s"), f"{plan['cp_comm_gb']:.1f} GB ring attention K/V"))
    if plan["ep_comm_gb"]:
        syncs = f"; {plan['moe_host_syncs']} host syncs a step" if plan["moe_host_syncs"] else "; no host sync"
        what = f"{plan['ep_comm_gb']:.2f} GB token exchange ({plan['moe_comm_backend']}), {plan['ep_link']}{syncs}"
        out.append(("EP traffic", _f(plan["ep_comm_s"], ".3f", " s"), what))
    note = f"write {_f(plan['checkpoint_write_s'], '.1f', ' s')}, MTBF {_f(plan['mtbf_hours'], 'g', ' h')} (Young/Daly)"
    if configured_interval:
        note += f"; configured: {configured_interval}"
    out.append(("checkpoint interval", _f(plan["checkpoint_interval_steps"], "d", " steps"), note))
    if configured_local or plan["local_checkpoint_write_s"] is not None:
        write = _f(plan["local_checkpoint_write_s"], ".1f", " s")
        note = f"node-local tier: write {write} ({plan['local_checkpoint_gb_per_node']:.3g} GB per node)"
        note += f"; configured: {configured_local}" if configured_local else "; off (checkpoint.local.folder)"
        out.append(("local checkpoint interval", _f(plan["local_checkpoint_interval_steps"], "d", " steps"), note))
    return out


def one_line(plan: dict[str, Any]) -> str:
    """A sweep point's plan. The layout's label names the pipeline schedule and its stages per rank, so points that differ
    only in them (the search's top candidates) print apart."""
    fit = {True: "fits", False: "DOES NOT FIT", None: "fit unknown"}[plan["fits_memory"]]
    step = _f(plan["estimated_step_time_s"], ".3f", " s")
    return (
        f"plan {plan['layout']} [{plan['degrees']}]: estimated step {step} ({plan['predicted_source']}) "
        f"(MFU {_f(plan['estimated_mfu'] and 100 * plan['estimated_mfu'], '.1f', ' %')}), m={plan['microbatches']}, "
        f"bubble {100 * plan['bubble_fraction']:.1f} %, TP {_f(plan['tp_comm_s'], '.3f', ' s')}, "
        f"memory {plan['total_gb_per_gpu']:.3g} GB ({fit})"
        + (f", FP8 x{plan['fp8_speed_up']:.2f} vs {plan['fp8_speed_up_over']}" if plan.get("fp8_speed_up") is not None else "")
    )


def render(plan: dict[str, Any], configured_interval: int | None = None, configured_local: int | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    unit = wording.device_unit(plan["device"])
    table = Table(title=f"step budget: {plan['model']} on {count(plan['world_size'], unit)}", title_justify="left")
    for col in ("", f"per {unit}", "note"):
        table.add_column(col)
    for r in rows(plan, configured_interval, configured_local):
        table.add_row(*r, style="bold red" if "NOT" in r[2] or "LONGER" in r[2] else None)
    Console(highlight=False, width=160).print(table)
