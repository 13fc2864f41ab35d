"""Decode's routed experts: `pallas_kernels.moe_decode.routed_glu` and `grouped_glu` tile variants against
XLA's gathered experts (`k3.moe.layer.gathered_experts`), side by side, as fractions of HBM bandwidth.

    python -m pallas_kernels.bench_moe_decode --shape=8x4x64x512x1024 --variants=64:128:4:3,32:64:4:3 --json=out.json

Shape NxKxExDxF: N tokens, top-K routes each (distinct experts per token, drawn at random), E experts
of width D and hidden F (K3's served d_model 1024 model: 64 experts, top 4, latent 512, hidden 1024).
Variants: block_in:block_out:warps:stages[:d|:g[N][s]|:f[N][s]] (`routed_glu`'s tile rows, tile columns,
Triton warps and pipeline stages; d: its row sums deferred to the end of the loop, ``defer_sum``; g:
`grouped_glu`, the routes grouped by expert, with these tiles; gN: with N columns per down-projection
program; f[N]: `grouped_glu_fused`, the same in one kernel, N down-projection columns per step; a
trailing s: the grid over slots of the distinct routed experts instead of all E, ``slots=True``). bf16
weights and inputs, SiTU-GLU. Each row is the seconds per call with --iters calls dispatched back to back
(`pallas_kernels.common.pipelined_seconds`), the bytes a call must move at least (each distinct routed
expert's three matrices once, plus x and y), that over the time as a fraction of the device's HBM
bandwidth, and the gather path's time over this one. Before timing each output is checked against the
gather path (max |difference| over its max |value|). With --kernel_time each row also has the GPU's
kernel time per call from a profiler trace: a call this short can be bound by the host's dispatch,
which the pipelined time then measures instead of the kernels.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from k3.ffn import glu_parts_output
from k3.hardware import device_hbm_bandwidth
from k3.moe.layer import gathered_experts
from pallas_kernels.common import kernel_seconds, pipelined_seconds
from pallas_kernels.moe_decode import grouped_glu, grouped_glu_fused, routed_glu

BETAS = (4.0, 25.0)


def make_inputs(N, K, E, D, F, seed=0):
    """bf16 x [N, D], weights [E, D, F] x2 and [E, F, D], routes [N, K] (distinct experts per token)."""
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (N, D), jnp.float32).astype(jnp.bfloat16)
    w = [(jax.random.normal(k, s, jnp.float32) * 0.05).astype(jnp.bfloat16)
         for k, s in zip(ks[1:4], ((E, D, F), (E, D, F), (E, F, D)))]
    idx = jnp.argsort(jax.random.uniform(ks[4], (N, E)), axis=1)[:, :K].astype(jnp.int32)
    return x, w, idx


def bench(shape, variants, iters, kernel_time: bool = False):
    """Rows of {impl, variant, ms, bytes, hbm_frac, gather_over_this, max_rel_diff} for one shape; with
    ``kernel_time`` also kernel_ms, kernel_hbm_frac and kernels ({name: ms per call}, `kernel_seconds`)."""
    N, K, E, D, F = shape
    x, (wg, wu, wd), idx = make_inputs(N, K, E, D, F)
    act = functools.partial(glu_parts_output, kind="situ", beta_gate=BETAS[0], beta_up=BETAS[1])
    experts = len(np.unique(np.asarray(idx)))
    nbytes = experts * 3 * D * F * 2 + 2 * N * K * D * 2
    hbm = device_hbm_bandwidth()
    gather = jax.jit(lambda x, i, a, b, c: gathered_experts(x, i, a, b, c, "situ", BETAS))
    impls = [("gather", "", gather)]
    for v in variants:
        parts = v.split(":")
        flag = parts[4] if len(parts) == 5 else ""
        try:
            slots = flag[:1] in "gf" and flag.endswith("s")
            digits = flag[1:-1] if slots else flag[1:]
            if len(parts) not in (4, 5) or not (flag in ("", "d")
                                                 or (flag[:1] in "gf" and (digits == "" or digits.isdigit()))):
                raise ValueError
            b_in, b_out, warps, stages = (int(p) for p in parts[:4])
        except ValueError:
            raise SystemExit("--variants entries are block_in:block_out:warps:stages[:d|:g[N][s]|:f[N][s]]; "
                             f"got {v!r}") from None
        tiles = dict(block_in=b_in, block_out=b_out, num_warps=warps, num_stages=stages)
        down = dict(block_out_down=int(digits), slots=slots) if digits else dict(slots=slots)

        def run(x, i, a, b, c, tiles=tiles, defer=flag == "d"):
            y = routed_glu(jnp.repeat(x, K, axis=0), i.reshape(-1), a, b, c, act=act, defer_sum=defer, **tiles)
            return y.reshape(N, K, -1)

        def run_grouped(x, i, a, b, c, tiles=tiles, down=down):
            return grouped_glu(x, i, a, b, c, act=act, **tiles, **down)

        def run_fused(x, i, a, b, c, tiles=tiles, down=down):
            return grouped_glu_fused(x, i, a, b, c, act=act, **tiles, **down)

        impls.append({"g": ("grouped", v, jax.jit(run_grouped)),
                      "f": ("fused", v, jax.jit(run_fused))}.get(flag[:1], ("pallas", v, jax.jit(run))))
    args = (x, idx, wg, wu, wd)
    ref = np.asarray(gather(*args), np.float32)
    rows = []
    for name, variant, fn in impls:
        err = float(np.max(np.abs(np.asarray(fn(*args), np.float32) - ref)) / np.max(np.abs(ref)))
        t = pipelined_seconds(fn, args, iters)
        rows.append(dict(impl=name, variant=variant, shape=list(shape), distinct_experts=experts, ms=t * 1e3,
                         bytes=nbytes, hbm_frac=nbytes / t / hbm if hbm else None, max_rel_diff=err))
        if kernel_time:
            tk, kernels = kernel_seconds(fn, args)
            rows[-1].update(kernel_ms=tk * 1e3, kernel_hbm_frac=nbytes / tk / hbm if hbm and tk else None,
                            kernels=kernels)
    for r in rows:
        r["gather_over_this"] = rows[0]["ms"] / r["ms"]
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8x4x64x512x1024", help="NxKxExDxF")
    ap.add_argument("--variants", default="64:128:4:3,128:128:8:3,64:64:4:3,128:128:8:3:g,128:128:8:3:g64,"
                    "128:128:8:3:g32,64:128:8:3:g,128:64:4:3:g,128:64:4:3:g32,64:256:8:3:g,128:128:4:2:g,"
                    "32:128:4:4:g",
                    help="block_in:block_out:warps:stages[:d|:g[N][s]|:f[N][s]], comma-separated")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--kernel_time", action="store_true",
                    help="also each call's device kernel time from a profiler trace (without host dispatch)")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    try:
        shape = tuple(int(s) for s in a.shape.split("x"))
    except ValueError:
        shape = ()
    if len(shape) != 5 or shape[1] > shape[2]:
        raise SystemExit(f"--shape must be NxKxExDxF with K <= E; got {a.shape!r}")
    rows = bench(shape, [v for v in a.variants.split(",") if v], a.iters, a.kernel_time)
    pct = lambda x: f"{x:5.0%}" if x is not None else "    -"  # noqa: E731
    print(f"{'impl':8s} {'variant':>14s} {'ms':>8s} {'HBM':>5s} {'gather/this':>11s} {'rel diff':>9s}"
          + (f" {'kernel ms':>9s} {'HBM':>5s}" if a.kernel_time else ""))
    for r in rows:
        tail = f" {r['kernel_ms']:9.4f} {pct(r['kernel_hbm_frac'])}" if a.kernel_time else ""
        print(f"{r['impl']:8s} {r['variant']:>14s} {r['ms']:8.4f} {pct(r['hbm_frac'])} {r['gather_over_this']:11.2f} "
              f"{r['max_rel_diff']:9.2e}{tail}")
    print(f"{rows[0]['distinct_experts']} distinct experts of {shape[2]}; {rows[0]['bytes'] / 1e6:.1f} MB per call")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python -m pallas_kernels.bench_moe_decode " + " ".join(argv),
                       "device": jax.devices()[0].device_kind,
                       "timing": "pipelined" + (", kernel time from a profile" if a.kernel_time else ""),
                       "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
