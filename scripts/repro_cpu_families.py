"""Minimal reproductions of why two TorchTitan families cannot train on CPU ranks
(runner/config/family_support.py rejects them there with these reasons).

    python scripts/repro_cpu_families.py gpt_oss    # sinks + sliding window: FlexAttention has no CPU backward,
                                                    # and the SDPA attention CPU ranks use drops the sinks
    python scripts/repro_cpu_families.py qwen3_5    # Gated DeltaNet = flash-linear-attention's Triton kernels,
                                                    # and Triton launches kernels on GPUs only

Each case prints what failed and exits 0 when the failure reproduces, 1 when it does not (then the
rejection is out of date: lift it in family_support.py).
"""

from __future__ import annotations

import sys

import torch


def gpt_oss() -> list[str]:
    """gpt-oss's attention = FlexAttention with a sliding-window block mask and an out_transform that rescales
    by the per-head sinks (TorchTitan's gpt_oss/model.py). On CPU the backward is refused; TorchTitan's SDPA
    attention, the only one with a CPU backward, accepts the out_transform argument and never calls it."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.models.common.attention import ScaledDotProductAttention, get_sliding_window_mask_mod

    q = torch.randn(1, 4, 128, 16, requires_grad=True)
    mask = create_block_mask(get_sliding_window_mask_mod(32), 1, 1, 128, 128, device="cpu")
    found = []
    try:
        flex_attention(q, q, q, block_mask=mask).sum().backward()
    except NotImplementedError as e:
        found.append(f"FlexAttention backward on CPU: NotImplementedError: {e}")
    sdpa = ScaledDotProductAttention(ScaledDotProductAttention.Config())
    x = q.detach().transpose(1, 2)  # TorchTitan's layout: batch, seq, heads, head dim
    called = []
    out = sdpa(x, x, x, out_transform=lambda o, lse: called.append(1) or torch.zeros_like(o))
    if not called and out.abs().sum() > 0:
        found.append("SDPA attention on CPU: out_transform (the sinks' rescale) never called, output unchanged")
    return found


def qwen3_5() -> list[str]:
    """qwen3_5's model module imports fla.ops.gated_delta_rule (Triton kernels). Any Triton kernel launch
    needs a GPU driver; this machine's Triton has none."""
    import triton
    import triton.language as tl

    found = []
    try:
        import torchtitan.models.qwen3_5  # noqa: F401
    except ImportError as e:
        found.append(f"import torchtitan.models.qwen3_5: {type(e).__name__}: {e}")

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + i, tl.load(src + i, mask=i < n), mask=i < n)

    x = torch.arange(8.0)
    try:
        copy[(1,)](x, torch.empty_like(x), 8, BLOCK=8)
    except Exception as e:  # Triton raises RuntimeError or its own driver errors, by version
        found.append(f"a Triton kernel on CPU tensors: {type(e).__name__}: {str(e).splitlines()[0]}")
    return found


CASES = {"gpt_oss": gpt_oss, "qwen3_5": qwen3_5}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in CASES:
        print(f"usage: python scripts/repro_cpu_families.py {{{','.join(CASES)}}}", file=sys.stderr)
        return 2
    found = CASES[argv[0]]()
    for line in found:
        print(f"reproduced: {line}")
    if not found:
        print(f"not reproduced: {argv[0]} may train on CPU now; lift its rejection in runner/config/family_support.py")
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
