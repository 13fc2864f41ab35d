"""The train step's GEMM shapes alone: how close cuBLAS gets to the matmul peak on each.

    python -m experiments.bench_gemms [--json=FILE]

Times bf16 products of the K3 and K2 1024:12 ladder configs at 32,768 tokens (8 x 4096): the
capacity-padded expert GEMMs [E, C, W] x [E, W, F] (C = 1.25 x 32768 x top_k / E rows) and the dense
projections [32768, D] x [D, F], forward and backward (both operand gradients), each jitted alone,
mean of 20 calls after a compiling one. Prints TFLOP/s and the fraction of the device's bf16 peak
(`k3.hardware`), so a profile's matmul time can be read against what these shapes allow on their own.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp

from k3.hardware import device_peak_flops

N = 32768
# (name, einsum, lhs shape, rhs shape)
SHAPES = (
    ("k3 expert gate/up 64x2560x512x1024", "ecd,edf->ecf", (64, 2560, 512), (64, 512, 1024)),
    ("k3 expert down 64x2560x1024x512", "ecd,edf->ecf", (64, 2560, 1024), (64, 1024, 512)),
    ("k2 expert 32x2560x1024x1024", "ecd,edf->ecf", (32, 2560, 1024), (32, 1024, 1024)),
    ("dense 32768x1024x1024", "nd,df->nf", (N, 1024), (1024, 1024)),
    ("dense 32768x1024x512", "nd,df->nf", (N, 1024), (1024, 512)),
    ("dense 32768x512x1024", "nd,df->nf", (N, 512), (512, 1024)),
    ("dense 32768x1024x768", "nd,df->nf", (N, 1024), (1024, 768)),
    ("dense 32768x1024x4096 (head)", "nd,df->nf", (N, 1024), (1024, 4096)),
    ("dense 32768x1024x3072", "nd,df->nf", (N, 1024), (1024, 3072)),
)


def mean_seconds(fn, *args, n: int = 20) -> float:
    """Mean wall time of ``n`` calls of jitted ``fn`` after one compiling call.

    The calls are queued back to back and waited for once (not one by one, as
    `pallas_kernels.bench_kda.wall_times_ms` does): a 0.07 ms GEMM would otherwise be timed with a
    host round trip per call."""
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n


def bench(name: str, eq: str, a_shape, b_shape, peak: float | None) -> dict:
    """Forward and backward (both operand gradients) of einsum ``eq`` on bf16 operands."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, a_shape, jnp.bfloat16)
    b = jax.random.normal(kb, b_shape, jnp.bfloat16)
    mm = lambda a, b: jnp.einsum(eq, a, b)  # noqa: E731
    g = jax.random.normal(ka, jax.eval_shape(mm, a, b).shape, jnp.bfloat16)
    flops = 2 * math.prod(a_shape) * b_shape[-1]
    fwd = mean_seconds(mm, a, b)
    bwd = mean_seconds(lambda a, b, g: jax.vjp(mm, a, b)[1](g), a, b, g)
    row = {"name": name, "fwd_ms": fwd * 1e3, "fwd_tflops": flops / fwd / 1e12,
           "bwd_ms": bwd * 1e3, "bwd_tflops": 2 * flops / bwd / 1e12}
    if peak:
        row["fwd_peak_frac"], row["bwd_peak_frac"] = flops / fwd / peak, 2 * flops / bwd / peak
    return row


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    peak = device_peak_flops()
    rows = []
    for shape in SHAPES:
        r = bench(*shape, peak)
        rows.append(r)
        frac = lambda k: f" ({r[k]:5.1%})" if k in r else ""  # noqa: E731
        print(f"{r['name']:36s} fwd {r['fwd_ms']:7.3f} ms {r['fwd_tflops']:6.1f} TF/s{frac('fwd_peak_frac')}  "
              f"bwd {r['bwd_ms']:7.3f} ms {r['bwd_tflops']:6.1f} TF/s{frac('bwd_peak_frac')}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
