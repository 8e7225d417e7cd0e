"""FP8 Linear layers: which ones (TorchTitan's model config, walked with keep_high_precision) and the
recipe's module for each path (TorchTitan's converters and torchao on GPU, runner.run.titan.cpu on CPU); and the
routed experts precision.experts converts (TorchTitan's grouped-experts converters on GPU, the emulation on CPU)."""

from __future__ import annotations

from dataclasses import dataclass

from runner.estimate import precision
from runner.run.device import DevicePolicy
from runner.schema import ExpertsPrecision, Fp8Recipe, ModelConfig, RunConfig


def check_layer_table(model_config, m: ModelConfig) -> None:
    """TorchTitan's Linear layers must be the ones runner.estimate.precision.linear_layers lists, which is
    what validation shape-checked and `mode=validate` counted."""
    from torchtitan.models.common.linear import Linear

    got = [(fqn, c.in_features, c.out_features, type(c) is Linear.Config) for fqn, c, _, _ in model_config.traverse(Linear.Config)]
    want = [(la.fqn, la.in_dim, la.out_dim, la.fp8_twin) for la in precision.linear_layers(m)]
    if got != want:
        diff = next((g, w) for g, w in zip([*got, None], [*want, None], strict=False) if g != w)
        raise RuntimeError(
            f"{m.name}'s TorchTitan config has {len(got)} Linear layers, runner.estimate.precision.linear_layers lists {len(want)}; "
            f"first difference (fqn, in, out, plain Linear): TorchTitan {diff[0]}, table {diff[1]}: the table is out of date"
        )


def fp8_layers(model_config, cfg: RunConfig) -> list[str]:
    """The plain Linear layers (module FQNs, in model order) that no keep_high_precision pattern matches. Subclasses
    with their own forward (gpt-oss's ScaledBiasRowwiseLinear) have no FP8 twin and stay (precision.SCALED_BIAS)."""
    from torchtitan.models.common.linear import Linear

    patterns = cfg.precision.keep_high_precision
    plain = [fqn for fqn, c, _, _ in model_config.traverse(Linear.Config) if type(c) is Linear.Config]
    return [fqn for fqn in plain if precision.kept_by(fqn, patterns) is None]


def convert_precision(model_config, cfg: RunConfig) -> list[str]:
    """Swap the chosen Linear layers for the recipe's FP8 Linear (in the model config, before any module
    exists); return the converted module FQNs."""
    from torchtitan.models.common.linear import Linear

    r = cfg.precision.fp8
    if r == Fp8Recipe.none:
        return []
    check_layer_table(model_config, cfg.model)
    chosen = fp8_layers(model_config, cfg)
    plain = {fqn for fqn, c, _, _ in model_config.traverse(Linear.Config) if type(c) is Linear.Config}
    on_cpu = DevicePolicy.of(cfg.cluster, cfg.distributed).cpu
    if r in (Fp8Recipe.tensorwise, Fp8Recipe.rowwise):
        _float8(model_config, r, set(chosen), on_cpu)
    elif r == Fp8Recipe.mxfp8:  # validation rejects it on CPU
        from torchtitan.components.quantization import MXFP8LinearConverter

        MXFP8LinearConverter.Config(fqns=chosen).build().convert(model_config)
    else:
        if on_cpu:
            import runner.run.titan.cpu as cpu

            new = cpu.emulated_blockwise_linear_config()
        else:
            new = blockwise_linear_config()
        _swap_linears(model_config, new, set(chosen))
    got = [fqn for fqn, c, _, _ in model_config.traverse(Linear.Config) if fqn in plain and type(c) is not Linear.Config]
    if got != chosen:
        raise RuntimeError(f"FP8 conversion converted {got}, keep_high_precision leaves {chosen}")
    return got


def convert_experts(model_config, cfg: RunConfig, materialize: bool = True) -> list[str]:
    """Swap the routed experts for precision.experts' FP8 ones (in the model config, before any module exists, next to
    the Linear converters, as TorchTitan's deepseek_v3_671b_float8() lists both); return their FQNs. GPU: TorchTitan's
    Float8GroupedExpertsConverter or MXFP8GroupedExpertsConverter, which also swap each MoE's token dispatcher for
    TorchAOTokenDispatcher (token groups padded to the kernels' multiple). CPU: the float8 rowwise emulation, except on
    the dry run's fake tensors (materialize=False), whose token counts have no values for its per-expert split."""
    from torchtitan.models.common.moe import GroupedExperts

    e = cfg.precision.experts
    if e == ExpertsPrecision.high:
        return []
    want = precision.converted_experts(cfg)
    if DevicePolicy.of(cfg.cluster, cfg.distributed).cpu:
        if not materialize:
            return []
        import runner.run.titan.cpu as cpu

        got = cpu.emulated_fp8_experts(model_config)  # validation rejects mxfp8 on CPU
    else:
        before = {fqn: type(c) for fqn, c, _, _ in model_config.traverse(GroupedExperts.Config)}
        _experts_converter(cfg).build().convert(model_config)
        got = [fqn for fqn, c, _, _ in model_config.traverse(GroupedExperts.Config) if type(c) is not before.get(fqn)]
    if got != want:
        raise RuntimeError(f"precision.experts={e.value} converted {got}, runner.estimate.precision.converted_experts lists {want}")
    return got


def _experts_converter(cfg: RunConfig):
    """TorchTitan's converter config for precision.experts, its token padding from runner.estimate.precision."""
    from torchtitan.components.quantization import Float8GroupedExpertsConverter, MXFP8GroupedExpertsConverter

    compiled = cfg.training.compile
    if cfg.precision.experts == ExpertsPrecision.fp8_rowwise:
        return Float8GroupedExpertsConverter.Config(model_compile_enabled=compiled)  # pads to its PAD_MULTIPLE, 16
    pad = precision.EXPERT_RECIPES[ExpertsPrecision.mxfp8].token_pad
    return MXFP8GroupedExpertsConverter.Config(model_compile_enabled=compiled, pad_multiple=pad)


def _float8(model_config, recipe: Fp8Recipe, chosen: set[str], on_cpu: bool) -> None:
    """TorchTitan's Float8LinearConverter with the runner's choice of layers: its own filter matches
    names as substrings and silently skips dims not divisible by 16 (validation rejects those instead)."""
    from torchtitan.components.quantization import Float8LinearConverter

    conf = Float8LinearConverter.Config(recipe_name=recipe.value)
    if on_cpu:
        import runner.run.titan.cpu as cpu

        converter = cpu.float8_converter(conf)
    else:
        converter = conf.build()
    converter.filter_fn = lambda _config, fqn: fqn in chosen
    converter.convert(model_config)


def _swap_linears(model_config, new_config_cls, fqns: set[str]) -> None:
    from torchtitan.models.common.linear import Linear

    for fqn, old, parent, attr in list(model_config.traverse(Linear.Config)):
        if fqn in fqns:
            new = new_config_cls(in_features=old.in_features, out_features=old.out_features, bias=old.bias, param_init=old.param_init)
            if isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)


_BLOCKWISE_LINEAR = None


def blockwise_linear_config():
    """torchao's blockwise FP8 Linear (SM 9.0+, Triton quantization kernels) as a TorchTitan
    module, wrapped the way TorchTitan wraps torchao's Float8Linear; it adds the bias torchao's forward drops."""
    global _BLOCKWISE_LINEAR
    if _BLOCKWISE_LINEAR is None:
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear  # private_api: torchao_blockwise_fp8_linear
        from torchtitan.models.common.linear import Linear
        from torchtitan.protocols.module import Module

        class BlockwiseFp8Linear(Float8BlockwiseLinear, Module):
            @dataclass(kw_only=True, slots=True)
            class Config(Linear.Config):
                pass

            def __init__(self, config: Config):
                Float8BlockwiseLinear.__init__(self, config.in_features, config.out_features, bias=config.bias)

            def forward(self, x):
                out = Float8BlockwiseLinear.forward(self, x)  # torchao's GEMM leaves the bias out (torchao 0.18)
                return out if self.bias is None else out + self.bias.to(out.dtype)

        _BLOCKWISE_LINEAR = BlockwiseFp8Linear
    return _BLOCKWISE_LINEAR.Config
