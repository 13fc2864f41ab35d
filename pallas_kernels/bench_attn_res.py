"""Block AttnRes depth mix: the Pallas kernels against the jnp `k3.attn_res.depth_mix`, side by side.

    python -m pallas_kernels.bench_attn_res --shape=3x8x4096x1024 --variants=16:8,16:4,8:4,32:8 --json=out.json

Shape MxBxTxD: M bank candidates plus the running partial sum, B x T tokens, width D; bf16 operands.
Each row times the mix forward and forward + backward (gradients of the candidates, the partial sum
and w) under `jax.jit`, median of --iters calls after warm-ups (wall clock with block_until_ready),
and prints the bytes a pass must move at least, the fraction of HBM bandwidth that gives, and the
ratio to the jnp backend. Bytes: forward reads the M + 1 candidates and writes the mix; backward
reads them and dout and writes their gradients. Before timing, the kernels' mix and gradients are
checked against the jnp backend on the same inputs (per output, max |difference| over the jnp
output's max |value|; the largest is printed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from k3 import attn_res
from k3.hardware import device_hbm_bandwidth
from pallas_kernels.attn_res import depth_mix_pallas


def _time(fn, args, iters: int) -> float:
    """Median seconds of ``iters`` calls after three warm-ups."""
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_inputs(M, B, T, D, seed=0):
    """bf16 candidates [M, B, T, D] (the first and last two valid), partial [B, T, D], w [D], dout."""
    k = jax.random.split(jax.random.key(seed), 4)
    cands = jax.random.normal(k[0], (M, B, T, D), jnp.float32).astype(jnp.bfloat16)
    extra = jax.random.normal(k[1], (B, T, D), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(k[2], (D,), jnp.float32)
    dout = jax.random.normal(k[3], (B, T, D), jnp.float32).astype(jnp.bfloat16)
    valid = jnp.arange(M) != min(1, M - 1) if M > 2 else jnp.ones((M,), bool)
    return cands, valid, extra, jnp.asarray(True), w, dout


def bench(shape, variants, iters):
    """Rows of {impl, block, warps, fwd_ms, fwdbwd_ms, ...} for one shape."""
    M, B, T, D = shape
    cands, valid, extra, ev, w, dout = make_inputs(M, B, T, D)
    N, item = B * T, 2
    fwd_bytes = (M + 2) * N * D * item
    bwd_bytes = (2 * (M + 1) + 1) * N * D * item
    hbm = device_hbm_bandwidth()

    def fns(mix):
        fwd = jax.jit(lambda c, e, w: mix(c, valid, e, ev, w, 1e-5))

        @jax.jit
        def fwdbwd(c, e, w, d):
            out, vjp = jax.vjp(lambda c, e, w: mix(c, valid, e, ev, w, 1e-5), c, e, w)
            return out, vjp(d)

        return fwd, fwdbwd

    impls = [("jnp", 0, 0, attn_res.depth_mix)]
    for v in variants:
        blk, warps = (int(x) for x in v.split(":"))
        impls.append(("pallas", blk, warps, lambda *a, blk=blk, warps=warps: depth_mix_pallas(
            *a, block=blk, num_warps=warps)))
    ref = fns(attn_res.depth_mix)[1](cands, extra, w, dout)
    rows = []
    for name, blk, warps, mix in impls:
        fwd, fwdbwd = fns(mix)
        got = fwdbwd(cands, extra, w, dout)
        # Per output (mix, d cands, d partial, dw): max |difference| over the reference's max |value|.
        err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                        / jnp.max(jnp.abs(b.astype(jnp.float32))))
                  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
        t_f = _time(fwd, (cands, extra, w), iters)
        t_fb = _time(fwdbwd, (cands, extra, w, dout), iters)
        rows.append(dict(impl=name, block=blk, warps=warps, shape=list(shape), fwd_ms=t_f * 1e3,
                         fwdbwd_ms=t_fb * 1e3, max_rel_diff_vs_jnp=err,
                         fwd_hbm_frac=fwd_bytes / t_f / hbm if hbm else None,
                         fwdbwd_hbm_frac=(fwd_bytes + bwd_bytes) / t_fb / hbm if hbm else None))
    base = rows[0]
    for r in rows:
        r["jnp_over_this_fwd"] = base["fwd_ms"] / r["fwd_ms"]
        r["jnp_over_this_fwdbwd"] = base["fwdbwd_ms"] / r["fwdbwd_ms"]
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="3x8x4096x1024", help="MxBxTxD")
    ap.add_argument("--variants", default="16:8,16:4,8:4,32:8", help="block:warps of the kernels, comma-separated")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    shape = tuple(int(x) for x in a.shape.split("x"))
    if len(shape) != 4:
        raise SystemExit(f"--shape must be MxBxTxD; got {a.shape!r}")
    rows = bench(shape, [v for v in a.variants.split(",") if v], a.iters)
    print(f"{'impl':8s} {'block':>5s} {'warps':>5s} {'fwd ms':>8s} {'HBM':>5s} {'fwd+bwd ms':>10s} {'HBM':>5s} "
          f"{'jnp/this fwd':>12s} {'fwd+bwd':>8s} {'rel diff':>9s}")
    for r in rows:
        frac = lambda x: f"{x:5.0%}" if x is not None else "    -"  # noqa: E731
        print(f"{r['impl']:8s} {r['block']:5d} {r['warps']:5d} {r['fwd_ms']:8.3f} {frac(r['fwd_hbm_frac'])} "
              f"{r['fwdbwd_ms']:10.3f} {frac(r['fwdbwd_hbm_frac'])} {r['jnp_over_this_fwd']:12.2f} "
              f"{r['jnp_over_this_fwdbwd']:8.2f} {r['max_rel_diff_vs_jnp']:9.2e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python -m pallas_kernels.bench_attn_res " + " ".join(argv),
                       "device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
