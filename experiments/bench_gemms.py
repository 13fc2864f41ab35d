"""The train step's GEMM shapes alone: how close cuBLAS gets to the matmul peak on each.

    python -m experiments.bench_gemms [--json=FILE] [--accumulate=M]

Times bf16 products of the K3 and K2 1024:12 ladder configs at 32,768 tokens (8 x 4096): the
capacity-padded expert GEMMs [E, C, W] x [E, W, F] (C = 1.25 x 32768 x top_k / E rows) and the dense
projections [32768, D] x [D, F], forward and backward (both operand gradients), each jitted alone,
mean of 20 calls after a compiling one. Prints TFLOP/s and the fraction of the device's bf16 peak
(`k3.hardware`), so a profile's matmul time can be read against what these shapes allow on their own.

``--accumulate=M`` times instead the expert shapes' weight gradient summed into an fp32 buffer over
M micro-batches, as gradient accumulation does, both ways in one process: the bf16 gradient converted
and added in a pass of its own, and `k3.nn.weight_einsum` inside `k3.nn.fp32_weight_grads` (fp32 out
of the GEMM, the add folded into it); ms per micro-batch, fraction of the peak, new/old speed-up.
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


def bench_accumulate(name: str, eq: str, a_shape, b_shape, peak: float | None, micro: int) -> dict:
    """ms per micro-batch of einsum ``eq``'s weight gradient (rhs b) summed over ``micro`` bf16
    micro-batches into an fp32 sum: 'old' (bf16 gradient, then convert and add) and 'new'
    (`weight_einsum` inside `fp32_weight_grads`)."""
    from k3.nn import fp32_weight_grads, weight_einsum

    ka, kb, kg = jax.random.split(jax.random.key(1), 3)
    a = jax.random.normal(ka, (micro,) + tuple(a_shape), jnp.bfloat16)
    b = jax.random.normal(kb, b_shape, jnp.bfloat16)
    out_shape = jax.eval_shape(lambda a, b: jnp.einsum(eq, a, b), a[0], b).shape
    g = jax.random.normal(kg, (micro,) + out_shape, jnp.bfloat16)

    def summed(fp32: bool):
        def one(acc, ag):
            def grad_b(ai, gi):
                return jax.vjp(lambda w: weight_einsum(eq, ai, w), b)[1](gi)[0]
            if fp32:
                with fp32_weight_grads():
                    d = grad_b(*ag)
            else:
                d = grad_b(*ag)
            return acc + d.astype(jnp.float32), None
        return lambda a, g: jax.lax.scan(one, jnp.zeros(b.shape, jnp.float32), (a, g))[0]

    flops = 2 * math.prod(a_shape) * b_shape[-1]
    row = {"name": name, "micro_batches": micro}
    for key, fp32 in (("old", False), ("new", True)):
        t = mean_seconds(summed(fp32), a, g) / micro
        row[f"{key}_ms"] = t * 1e3
        if peak:
            row[f"{key}_peak_frac"] = flops / t / peak
    row["speedup"] = row["old_ms"] / row["new_ms"]
    return row


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="")
    p.add_argument("--accumulate", type=int, default=0, metavar="M",
                   help="time the expert weight gradients summed over M micro-batches, old and new way")
    args = p.parse_args(argv)
    peak = device_peak_flops()
    rows = []
    if args.accumulate:
        for shape in (s for s in SHAPES if s[1].startswith("ecd")):
            r = bench_accumulate(*shape, peak, args.accumulate)
            rows.append(r)
            frac = lambda k: f" ({r[k]:5.1%})" if k in r else ""  # noqa: E731
            print(f"{r['name']:36s} per micro-batch: bf16 + add {r['old_ms']:7.3f} ms{frac('old_peak_frac')}  "
                  f"fp32 folded {r['new_ms']:7.3f} ms{frac('new_peak_frac')}  new/old speed {r['speedup']:.2f}x",
                  flush=True)
    for shape in () if args.accumulate else SHAPES:
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
