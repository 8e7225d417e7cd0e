"""Machine profiles for the tests, in the form `python -m runner.calibrate` writes. A helper module: test modules
import it, never each other."""

from __future__ import annotations

from runner.estimate.predict import machine_profile as steptime_profile


def round_profile(layer_overhead_s: float = 2e-3) -> dict:
    """A profile as python -m runner.calibrate writes it, with round figures."""
    entry = {"threads": 1, "matmul_tflops": 0.1, "gemm_half_dim": 32.0, "attention_tflops": 0.02, "memory_gbs": 10.0, "gemms": []}
    link = {"latency_s": 1e-3, "gbs": 1.0}
    return {
        "machine": {"cpu": "test cpu", "cores": 2, "device": "cpu", "backend": "gloo", "torch": "2.13", "dtype": "float32"},
        "by_ranks": {"1": {**entry, "threads": 2}, "2": dict(entry), "4": dict(entry)},
        "collectives": {n: {f"{op}@2": link for op in ("all_gather", "reduce_scatter", "all_reduce", "send_recv")} for n in ("2", "4")},
        "constants": {
            "layer_overhead_s": steptime_profile.constant("layer_overhead_s", layer_overhead_s),
            "collective_fixed_s": steptime_profile.constant("collective_fixed_s", 1e-3),
            "comm_overlap": steptime_profile.constant("comm_overlap", 0.0),
        },
    }
