"""Block AttnRes depth mix: the Pallas kernels against the jnp `k3.attn_res.depth_mix`, side by side.

    python -m pallas_kernels.bench_attn_res --shape=4x8x4096x1024 --variants=2:1:1,2:1:8,2:1:8:2 --json=out.json

Shape MxBxTxD: M bank candidates plus the running partial sum, B x T tokens, width D; bf16 operands.
A variant block:warps[:steps[:n]] may give the kernels a static count n: the bank's first n slots
are valid and the rest are not (as in a model whose bank is filling), so its passes skip them.
Each row times the mix forward and forward + backward (gradients of the candidates, the partial sum
and w) under `jax.jit`, median of --iters calls after warm-ups (wall clock with block_until_ready),
and prints the bytes a pass must move at least, the fraction of HBM bandwidth that gives, and the
ratio to the jnp backend; --kernel_time adds the forward's device kernel time from a profiler trace
(`pallas_kernels.common.kernel_seconds`), the measure for decode-sized calls (e.g. --shape=4x8x1x1024),
whose wall time is the host's dispatch; --norm mixes with the RMSNorm that reads the mix. Bytes:
forward reads the M + 1 candidates (n + 1 with a static count) and writes the mix; backward reads
them and dout and writes their gradients. Before timing, the kernels' mix and gradients are checked
against the jnp backend on the same inputs (per output, max |difference| over the jnp output's max
|value|; the largest is printed).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3 import attn_res
from k3.hardware import device_hbm_bandwidth
from pallas_kernels.attn_res import depth_mix_pallas
from pallas_kernels.common import kernel_bench_main, kernel_seconds, median_seconds


def make_inputs(M, B, T, D, seed=0):
    """bf16 candidates [M, B, T, D] (all valid), partial [B, T, D], w [D], dout."""
    k = jax.random.split(jax.random.key(seed), 4)
    cands = jax.random.normal(k[0], (M, B, T, D), jnp.float32).astype(jnp.bfloat16)
    extra = jax.random.normal(k[1], (B, T, D), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(k[2], (D,), jnp.float32)
    dout = jax.random.normal(k[3], (B, T, D), jnp.float32).astype(jnp.bfloat16)
    valid = jnp.ones((M,), bool)
    return cands, valid, extra, jnp.asarray(True), w, dout


def bench(shape, variants, iters, kernel_time: bool = False, norm: bool = False):
    """Rows of {impl, block, warps, fwd_ms, fwdbwd_ms, ...} for one shape; ``kernel_time`` adds the
    forward's device kernel time (fwd_kernel_ms, its HBM fraction, the kernels), ``norm`` runs the mix
    with the RMSNorm that reads it (the kernels' fused form; the jnp mix then `k3.nn.rms_norm`)."""
    M, B, T, D = shape
    cands, valid, extra, ev, w, dout = make_inputs(M, B, T, D)
    N, item = B * T, 2
    hbm = device_hbm_bandwidth()
    gamma = dict(gamma_D=jnp.ones((D,), jnp.float32), norm_eps=1e-6) if norm else {}
    reference = functools.partial(attn_res.depth_mix_then_norm, **gamma) if norm else attn_res.depth_mix

    def fns(mix, n=None):
        ok = valid if n is None else valid & (jnp.arange(M) < n)
        fwd = jax.jit(lambda c, e, w: mix(c, ok, e, ev, w, 1e-5))

        @jax.jit
        def fwdbwd(c, e, w, d):
            out, vjp = jax.vjp(lambda c, e, w: mix(c, ok, e, ev, w, 1e-5), c, e, w)
            return out, vjp(d)

        return fwd, fwdbwd

    impls = [("jnp", 0, 0, 1, None, reference)]
    for v in variants:
        given = [int(x) for x in v.split(":")]
        blk, warps, steps, n = given + [None, None, 1, M][len(given):]
        impls.append(("pallas", blk, warps, steps, n, lambda *a, blk=blk, warps=warps, steps=steps, n=n:
                      depth_mix_pallas(*a, block=blk, num_warps=warps, steps=steps, n_valid=n, **gamma)))
    rows = []
    for name, blk, warps, steps, n, mix in impls:
        fwd, fwdbwd = fns(mix, n)
        # The slots past a variant's static count are invalid for it, and for its reference.
        got, ref = fwdbwd(cands, extra, w, dout), fns(reference, n)[1](cands, extra, w, dout)
        # Per output (mix, d cands, d partial, dw): max |difference| over the reference's max |value|.
        err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                        / jnp.max(jnp.abs(b.astype(jnp.float32))))
                  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
        t_f = median_seconds(fwd, (cands, extra, w), iters)
        t_fb = median_seconds(fwdbwd, (cands, extra, w, dout), iters)
        read = M + 1 if n is None else n + 1  # candidates a pass touches
        fwd_bytes, bwd_bytes = (read + 1) * N * D * item, (2 * read + 1) * N * D * item
        rows.append(dict(impl=name, block=blk, warps=warps, steps=steps, n_valid=n, shape=list(shape),
                         fwd_ms=t_f * 1e3,
                         fwdbwd_ms=t_fb * 1e3, max_rel_diff_vs_jnp=err,
                         fwd_hbm_frac=fwd_bytes / t_f / hbm if hbm else None,
                         fwdbwd_hbm_frac=(fwd_bytes + bwd_bytes) / t_fb / hbm if hbm else None))
        if kernel_time:
            tk, kernels = kernel_seconds(fwd, (cands, extra, w))
            rows[-1].update(fwd_kernel_ms=tk * 1e3, fwd_kernel_hbm_frac=fwd_bytes / tk / hbm if hbm and tk else None,
                            fwd_kernels=kernels)
    base = rows[0]
    for r in rows:
        r["jnp_over_this_fwd"] = base["fwd_ms"] / r["fwd_ms"]
        r["jnp_over_this_fwdbwd"] = base["fwdbwd_ms"] / r["fwdbwd_ms"]
    return rows


def main(argv=None):
    return kernel_bench_main(
        argv, doc=__doc__, module="pallas_kernels.bench_attn_res", shape_help="MxBxTxD",
        default_shape="4x8x4096x1024", default_variants="2:1:1,2:1:8,2:1:8:2",
        variants_help="block:warps[:steps[:n]] of the kernels (n: the static count of bank slots that may be "
                      "valid, the rest invalid for that row), comma-separated", bench=bench,
        label_header="block:warps:steps:n",
        label=lambda r: f"{r['block']}:{r['warps']}:{r['steps']}:{r['n_valid']}",
        options=[("kernel_time", "also the forward's device kernel time from a profiler trace (without the "
                                 "host's dispatch, which bounds the wall time of a decode-sized call)"),
                 ("norm", "the mix with its RMSNorm, as the model's 'pallas_norm' backend runs it")])


if __name__ == "__main__":
    main()
