"""KDA conv branches: the Pallas kernels against the jnp `k3.kda.layer.conv_branch_xla`, side by side.

    python -m pallas_kernels.bench_short_conv --shape=8x4096x32x32 --variants=8:64:32:4:t,8:64:32:4:tp --json=out.json

Variants: block:channels:steps:warps, then optionally :FLAGS with g to address rows by gathered indices
instead of slices, t to carry the taps' gradient as whole tiles and p for the backward in two passes
(`conv_silu_pallas`'s row_slices, dw_tiles and split_backward). Shape BxTxHxK: B x T tokens in packed
documents of 512, H heads of K channels, bf16, 4 taps. Each row times one branch with the per-head L2 norm (q, k) and one
without (v), forward and forward + backward (gradients of y and the taps) under `jax.jit`: --iters
calls dispatched back to back and waited for once (`pallas_kernels.common.pipelined_seconds`). A
call takes a fraction of a millisecond; timed one by one, each with its own wait, the same variant
moved by 20-40% between two runs on the H200 (BENCHMARKS.md). It prints the bytes a pass must move
at least, the fraction of HBM bandwidth that gives and the ratio to the jnp backend. Bytes: forward
reads y and writes the output; backward reads y and dout and writes dy. Before timing, each
kernel's output and gradients are checked against the jnp backend on the same inputs (max
|difference| over the jnp output's max |value|, the largest printed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3.hardware import device_hbm_bandwidth
from k3.kda.layer import conv_branch_xla
from pallas_kernels.common import kernel_bench_main, pipelined_seconds
from pallas_kernels.short_conv import conv_silu_pallas

DOC = 512


def make_inputs(B, T, C, seed=0):
    """bf16 y and dout [B, T, C], fp32 taps [4, C], segment ids [B, T] (documents of DOC tokens)."""
    k = jax.random.split(jax.random.key(seed), 3)
    y = jax.random.normal(k[0], (B, T, C), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(k[1], (4, C), jnp.float32) * 0.5
    dout = jax.random.normal(k[2], (B, T, C), jnp.float32).astype(jnp.bfloat16)
    seg = jnp.broadcast_to(jnp.arange(T) // DOC + 1, (B, T)).astype(jnp.int32)
    return y, w, seg, dout


def bench(shape, variants, iters):
    """Rows of {impl, norm, block, warps, fwd_ms, fwdbwd_ms, ...} for one shape."""
    B, T, H, K = shape
    C = H * K
    y, w, seg, dout = make_inputs(B, T, C)
    fwd_bytes, bwd_bytes = 2 * B * T * C * 2, 3 * B * T * C * 2
    hbm = device_hbm_bandwidth()
    rows = []
    for head_dim in (K, 0):
        def fns(branch):
            fwd = jax.jit(lambda y, w: branch(y, w, seg, head_dim))

            @jax.jit
            def fwdbwd(y, w, d):
                out, vjp = jax.vjp(lambda y, w: branch(y, w, seg, head_dim), y, w)
                return out, vjp(d)

            return fwd, fwdbwd

        impls = [("jnp", (0, 0, 0, 0, ""), conv_branch_xla)]
        for v in variants:
            *nums, rows_as = v.split(":") if v.count(":") == 4 else (v + ":s").split(":")
            blk, ch, st, warps = (int(x) for x in nums)
            impls.append(("pallas", (blk, ch, st, warps, rows_as),
                          lambda *a, blk=blk, ch=ch, st=st, warps=warps, sl="g" not in rows_as, dwt="t" in rows_as,
                          split="p" in rows_as:
                          conv_silu_pallas(*a, block=blk, channels=ch, steps=st, num_warps=warps, row_slices=sl,
                                           dw_tiles=dwt, split_backward=split)))
        ref = fns(conv_branch_xla)[1](y, w, dout)
        first = len(rows)
        for name, (blk, ch, st, warps, rows_as), branch in impls:
            fwd, fwdbwd = fns(branch)
            got = fwdbwd(y, w, dout)
            err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                            / jnp.max(jnp.abs(b.astype(jnp.float32))))
                      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
            t_f = pipelined_seconds(fwd, (y, w), iters)
            t_fb = pipelined_seconds(fwdbwd, (y, w, dout), iters)
            rows.append(dict(impl=name, norm=bool(head_dim), block=blk, channels=ch, steps=st, warps=warps,
                             rows=rows_as, shape=list(shape),
                             fwd_ms=t_f * 1e3, fwdbwd_ms=t_fb * 1e3, max_rel_diff_vs_jnp=err,
                             fwd_hbm_frac=fwd_bytes / t_f / hbm if hbm else None,
                             fwdbwd_hbm_frac=(fwd_bytes + bwd_bytes) / t_fb / hbm if hbm else None))
        for r in rows[first:]:
            r["jnp_over_this_fwd"] = rows[first]["fwd_ms"] / r["fwd_ms"]
            r["jnp_over_this_fwdbwd"] = rows[first]["fwdbwd_ms"] / r["fwdbwd_ms"]
    return rows


def main(argv=None):
    return kernel_bench_main(
        argv, doc=__doc__, module="pallas_kernels.bench_short_conv", shape_help="BxTxHxK",
        default_shape="8x4096x32x32", default_variants="8:64:32:4:t,8:64:32:4:tp",
        variants_help="block:channels:steps:warps[:FLAGS] of the kernels (FLAGS: g rows gathered, t tap "
                      "gradients carried as tiles, p backward in two passes), comma-separated",
        bench=bench, label_header="norm block:channels:steps:warps:rows", extra_json={"timing": "pipelined"},
        label=lambda r: f"{'yes' if r['norm'] else 'no'} {r['block']}:{r['channels']}:{r['steps']}:{r['warps']}:{r['rows']}")


if __name__ == "__main__":
    main()
