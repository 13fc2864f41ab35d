"""Accelerator peak rates: the tables that MFU (`k3.train`, the benchmarks), bandwidth floors
(`experiments.bench_decode`) and the planner (`k3.plan`) read."""

from __future__ import annotations

import jax

# Dense bf16 peak FLOP/s per device (datasheets), keyed by a substring of jax's ``device_kind``.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12, "TPU v5p": 459e12,
                   "TPU v5 lite": 197e12, "TPU v6 lite": 918e12, "TPU v4": 275e12}


def device_peak_flops(override: float = 0.0) -> float | None:
    """Peak bf16 FLOP/s of all local devices together, or None when the kind is unknown (e.g. a CPU);
    ``override`` > 0 is returned as is."""
    if override > 0:
        return override
    kind = jax.devices()[0].device_kind
    for name, peak in PEAK_BF16_FLOPS.items():
        if name.lower() in kind.lower():
            return peak * jax.device_count()
    return None


# HBM bandwidth in bytes/s per device (datasheets), keyed like PEAK_BF16_FLOPS.
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.04e12, "B200": 8.0e12, "TPU v5p": 2.765e12,
                   "TPU v5 lite": 0.819e12, "TPU v6 lite": 1.64e12, "TPU v4": 1.2e12}


def device_hbm_bandwidth(override: float = 0.0) -> float | None:
    """HBM bytes/s of one local device, or None when the kind is unknown; ``override`` > 0 is returned."""
    if override > 0:
        return override
    kind = jax.devices()[0].device_kind
    for name, rate in HBM_BYTES_PER_S.items():
        if name.lower() in kind.lower():
            return rate
    return None
