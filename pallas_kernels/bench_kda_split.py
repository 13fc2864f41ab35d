"""Where the Pallas KDA kernel's time goes: each of its kernels timed on its own.

    python -m pallas_kernels.bench_kda_split [--shape=8x4096x16x128] [--variants=64:float32,32:float32]
        [--iters=10] [--launch=intra_fwd=8/1,...] [--backward=auto|fused|split|two|chain]
        [--strip_precision=tf32|tf32x3|bf16x3|bf16x2|tf32_rounded] [--kernels=state_fwd,...] [--no_time]
        [--out=FILE.json]

A variant is chunk_size:matmul_dtype[:bk[:bki[:bp[:bv[:bf]]]]]: key blocks of the strip backward and of
the inter-chunk backward, column block of the pairs backward, value block of the state chains, key block
of the forward's pair sums (0 or absent: the kernel module's). --launch=kernel=warps/stages,...
overrides the Triton launch parameters of `pallas_kernels.kda._LAUNCH`; --backward picks the backward plan
(`pallas_kernels.kda._BACKWARDS`; auto: the module's choice for the key dim),
--strip_precision the precision of the backward's strip products (default: the module's).
Inputs follow `pallas_kernels.bench_kda` (bf16 q, k, v; g in [-5, 0)); each kernel's inputs are
computed once and the kernel alone is jitted and timed as `bench_kda` times whole functions: --iters
calls queued back to back and waited for once, after 3 warm-ups; the median over 5 rounds of the
per-call mean (results before 2026-12-06 are single waited calls, which add 0.3-0.5 ms of dispatch to
each kernel). Each kernel's bytes moved (its operands and results, each once: the least HBM traffic it
can have) and the fraction of the device's HBM bandwidth (`k3.hardware`) that moving them in the
measured time takes say how far it runs from its memory floor; --no_time gives the bytes alone, from
shapes, on any machine. Prints a table and writes JSON.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k3.hardware import device_hbm_bandwidth  # noqa: E402
from pallas_kernels import kda as P  # noqa: E402
from pallas_kernels.bench_kda import pipelined_ms  # noqa: E402


def _time(fn, args, iters):
    """Compile seconds and the median ms of `fn(*args)` under jit."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    return compile_s, float(np.median(pipelined_ms(compiled, args, 3, iters)))


def moved_bytes(fn, args):
    """Bytes of fn's operands and results, each counted once [int]: the least HBM traffic of a kernel
    that reads every input and writes every output once (operands that several programs read again, as
    the key-blocked kernels read the [C, C] pair matrices, count once)."""
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
    leaves = [*shapes, *jax.tree.leaves(jax.eval_shape(fn, *shapes))]
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves)


def split(shape, chunk, matmul_dtype, iters, bk=0, bki=0, bp=0, bv=0, bf=0, launch=(), kernels=None,
          backward="auto", strip_precision=None, timing=True):
    """Median ms, compile s and bytes moved (`moved_bytes`) of each forward and backward kernel for one
    shape and variant; with timing=False the bytes only, from shapes (nothing is computed: any shape on
    any machine).

    bk, bki: key blocks of the strip and inter-chunk backward kernels, bp: column block of the pairs
    backward kernels, bv: value block of the state chains, bf: key block of the forward's pair sums
    (0: the module's defaults);
    launch: ((kernel, warps, stages), ...) overriding the module's defaults; kernels: the names to
    time (default all); backward: a `_BACKWARDS` entry, or 'auto' for the module's choice;
    strip_precision: a `pallas_kernels.kda._STRIP_PRECISIONS` entry (None: the module's)."""
    rows = {}
    wanted = set(kernels or P._LAUNCH)

    def timed(name, fn, args):
        if name in wanted:
            c, m = _time(fn, args, iters) if timing else (None, None)
            rows[name] = dict(compile_s=c, median_ms=m, bytes=moved_bytes(fn, args))

    flow = functools.partial(_flow, shape, chunk, matmul_dtype, timed, bk=bk, bki=bki, bp=bp, bv=bv, bf=bf,
                             launch=launch, backward=backward, strip_precision=strip_precision)
    if timing:
        flow()
    else:
        jax.eval_shape(flow)
    return rows


def _flow(shape, chunk, matmul_dtype, timed, *, bk, bki, bp, bv, bf, launch, backward, strip_precision):
    """Every kernel of the forward and backward in order, each passed to timed(name, fn, args)."""
    B, T, H, K = shape
    keys = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(keys[0], (B, T, H, K)).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, T, H, K)).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, T, H, K)).astype(jnp.bfloat16)
    g = -5.0 * jax.nn.sigmoid(jax.random.normal(keys[3], (B, T, H, K)))
    beta = jax.random.uniform(keys[4], (B, T, H))
    do = jax.random.normal(keys[5], (B, T, H, K)).astype(jnp.bfloat16)
    cfg, (q_raw, k_raw, v, g, beta, h0t, doc, mf, ml) = P._prepare(
        q, k, v, g, beta, scale=None, initial_state=None, segment_ids=None, interpret=None,
        chunk_size=chunk, lower_bound=-5.0, check_gate=False, matmul_dtype=matmul_dtype, qk_l2norm=True)
    cfg = P.with_overrides(cfg, bk=bk, bki=bki, bp=bp, bv=bv, bf=bf, launch=launch, backward=backward,
                           strip_precision=strip_precision)
    do = jnp.pad(do, [(0, 0), (0, cfg.NT * cfg.C - T), (0, 0), (0, cfg.V - K)])  # as `chunk_kda` pads o's cotangent

    q, q_r = P._l2norm_fwd(cfg, q_raw)
    k, _ = P._l2norm_fwd(cfg, k_raw)
    timed("l2norm_fwd", lambda x: P._l2norm_fwd(cfg, x), (q_raw,))
    timed("l2norm_bwd", lambda *a: P._l2norm_bwd(cfg, *a), (q, q_r, q_raw.astype(jnp.float32)))
    G = P._gate_fwd(cfg, g)
    timed("gate_fwd", lambda x: P._gate_fwd(cfg, x), (g,))

    w, u, aqk, Tm, qg, kg = P._intra_fwd(cfg, q, k, v, G, beta, doc, mf, ml)
    timed("intra_fwd", lambda *a: P._intra_fwd(cfg, *a), (q, k, v, G, beta, doc, mf, ml))
    _, vn, h, ht = P._state_fwd(cfg, kg, G, w, u, mf, h0t, qg, aqk, q.dtype)
    timed("state_fwd", lambda *a: P._state_fwd(cfg, *a, q.dtype), (kg, G, w, u, mf, h0t, qg, aqk))
    dht = jnp.zeros_like(ht)
    if cfg.backward == "chain":  # the reverse chain forms the state terms; no dh, no inter kernel
        chain_args = (qg, kg, G, w, aqk, do, mf, dht)
        terms = (h, vn, k, ml)
        timed("state_terms_bwd", lambda *a: P._state_bwd(cfg, *a, terms=terms), chain_args)
        dvn, _, dq0, dk0, dw, dGe = P._state_bwd(cfg, *chain_args, terms=terms)
    else:
        dh, dvn, _ = P._state_bwd(cfg, qg, kg, G, w, aqk, do, mf, dht)
        timed("state_bwd", lambda *a: P._state_bwd(cfg, *a), (qg, kg, G, w, aqk, do, mf, dht))
        if cfg.backward == "fused":
            timed("chunk_bwd", lambda *a: P._chunk_bwd(cfg, *a),
                  (q, k, v, G, g, beta, doc, mf, ml, Tm, h, dh, do, vn, dvn))
            return
        if cfg.backward == "two":
            pairs_args = (k, v, G, beta, doc, mf, Tm, do, vn, dvn)
            timed("pairs_h_bwd", lambda *a: P._pairs_bwd(cfg, *a, h=h), pairs_args)
            _, _, dA, dL = P._pairs_bwd(cfg, *pairs_args, h=h)
            timed("keys_bwd", lambda *a: P._keys_bwd(cfg, *a),
                  (q, k, G, g, beta, mf, ml, Tm, h, dh, do, vn, dvn, dA, dL))
            return
        inter_args = (q, k, G, mf, ml, h, dh, do, vn, dvn)
        timed("inter_bwd", lambda *a: P._inter_bwd(cfg, *a), inter_args)
        dq0, dk0, dGe, dw = P._inter_bwd(cfg, *inter_args)
    pairs_args = (k, v, G, beta, doc, mf, Tm, do, vn, dvn, dw)
    timed("pairs_bwd", lambda *a: P._pairs_bwd(cfg, *a[:-1], dw=a[-1]), pairs_args)
    _, _, dA, dL = P._pairs_bwd(cfg, *pairs_args[:-1], dw=dw)
    timed("intra_bwd", lambda *a: P._intra_bwd(cfg, *a), (q, k, G, g, beta, mf, Tm, dw, dA, dL, dq0, dk0, dGe))


def parse_launch(text):
    """'intra_fwd=8/2,state_fwd=4/3' -> (('intra_fwd', 8, 2), ('state_fwd', 4, 3))."""
    out = []
    for item in filter(None, text.split(",")):
        name, _, ws = item.partition("=")
        if name not in P._LAUNCH:
            raise SystemExit(f"--launch: unknown kernel {name!r}; expected one of {sorted(P._LAUNCH)}")
        warps, _, stages = ws.partition("/")
        out.append((name, int(warps), int(stages or 1)))
    return tuple(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="8x4096x16x128")
    p.add_argument("--variants", default="64:float32,32:float32")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--launch", type=parse_launch, default=())
    p.add_argument("--backward", default="auto", choices=("auto",) + tuple(P._BACKWARDS))
    p.add_argument("--strip_precision", default=None, choices=P._STRIP_PRECISIONS)
    p.add_argument("--kernels", default="", help="comma-separated kernels to time (default: all)")
    p.add_argument("--no_time", action="store_true", help="bytes moved only, from shapes (any machine)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_kda_split.json"))
    args = p.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split("x"))
    hbm = None if args.no_time else device_hbm_bandwidth()
    report = dict(shape=shape, device=jax.devices()[0].device_kind, jax=jax.__version__, backward=args.backward,
                  strip_precision=args.strip_precision, hbm_bytes_per_s=hbm, timed=not args.no_time, variants={})
    print("| variant | kernel | ms | share | MB moved | % of HBM bandwidth | compile s |")
    print("|---|---|---|---|---|---|---|")
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    for variant in args.variants.split(","):
        chunk, dtype, *blocks = variant.split(":")
        try:
            rows = split(shape, int(chunk), dtype, args.iters, *(int(b) for b in blocks), launch=args.launch,
                         backward=args.backward, strip_precision=args.strip_precision,
                         kernels=[k for k in args.kernels.split(",") if k] or None, timing=not args.no_time)
        except Exception as exc:  # keep the other variants
            report["variants"][variant] = dict(error=repr(exc)[:500])
            print(f"| {variant} | error | {repr(exc)[:120]} | | | | |", flush=True)
            continue
        report["variants"][variant] = rows
        total_ms = None if args.no_time else sum(r["median_ms"] for r in rows.values())
        total_b = sum(r["bytes"] for r in rows.values())
        for name, r in [*rows.items(), ("total", dict(median_ms=total_ms, bytes=total_b, compile_s=None))]:
            ms = r["median_ms"]
            share = None if ms is None else ms / total_ms
            frac = None if ms is None or hbm is None else 100 * r["bytes"] / (ms * 1e-3) / hbm
            print(f"| {variant} | {name} | {fmt(ms, '.3f')} | {fmt(share, '.2f')} | {r['bytes'] / 1e6:.1f} | "
                  f"{fmt(frac, '.0f')} | {fmt(r['compile_s'], '.1f')} |", flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
