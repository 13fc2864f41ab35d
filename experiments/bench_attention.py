"""MLA attention backends side by side: error against the XLA form and forward+backward time.

    python -m experiments.bench_attention [--shape=8x4096x32x48x32] [--doc=512] [--impls=xla,cudnn,...]
        [--flash_blocks=64x64x4x2,128x64x8x2]

Shape B x T x H x D(q/k head) x E(v head), bf16, causal within packed documents of ``--doc``
tokens. Each backend of `k3.mla.ATTENTION` runs forward and forward+backward (the gradient of
sum(o * w) for a fixed random w); outputs and gradients are compared with the 'xla' entry
(relative Frobenius error), then timed (median of 20 after warm-up). TFLOP/s count the causal
FLOPs (4 B H T^2 / 2 (D + E) / 2 forward, 2.5x that backward); "doc TF/s" counts only the pairs
inside documents (T^2 -> T * doc), the work a kernel that skips other documents' blocks must do.
``--flash_blocks`` adds rows for `pallas_kernels.flash_attention` at other launch parameters
(block_q x block_k x warps x stages), to choose its defaults.
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from k3.backends import BackendError
from k3.mla.layer import ATTENTION
from pallas_kernels.flash_attention import flash_attention
from k3.hardware import device_peak_flops


def _time(fn, *args, reps=20):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _rel(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8x4096x32x48x32")
    p.add_argument("--doc", type=int, default=512)
    p.add_argument("--impls", default=",".join(c for c in ATTENTION.choices() if c != "auto"))
    p.add_argument("--flash_blocks", default="", help="extra 'flash' rows: BQxBKxWARPSxSTAGES, comma-separated")
    p.add_argument("--json", default="")
    a = p.parse_args()
    B, T, H, D, E = (int(x) for x in a.shape.split("x"))
    keys = jax.random.split(jax.random.key(0), 4)
    q, k = (jax.random.normal(kk, (B, T, H, D), jnp.bfloat16) for kk in keys[:2])
    v = jax.random.normal(keys[2], (B, T, H, E), jnp.bfloat16)
    w = jax.random.normal(keys[3], (B, T, H, E), jnp.float32)
    seg = (jnp.arange(T)[None, :] // a.doc + 1).repeat(B, 0).astype(jnp.int32)
    scale = D ** -0.5
    flops_fwd = 4 * B * H * T * T / 2 * (D + E) / 2
    doc_frac = min(a.doc, T) / T  # in-document causal pairs / causal pairs (documents of equal length)
    peak = device_peak_flops()
    rows, ref = [], None
    variants = []
    for name in a.impls.split(","):
        try:
            variants.append((name, ATTENTION.get(name)))
        except BackendError as err:
            rows.append({"impl": name, "error": str(err)})
    for spec in filter(None, a.flash_blocks.split(",")):
        bq, bk, warps, stages = (int(x) for x in spec.split("x"))
        variants.append((f"flash:{spec}", lambda q, k, v, s_, sc, bq=bq, bk=bk, w=warps, st=stages: flash_attention(
            q, k, v, s_, scale=sc, block_q=bq, block_k=bk, num_warps=w, num_stages=st)))
    for name, fn in variants:
        fwd = jax.jit(lambda q, k, v, fn=fn: fn(q, k, v, seg, scale))
        grad = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v, seg, scale).astype(jnp.float32) * w),
                                argnums=(0, 1, 2)))
        try:
            out, grads = fwd(q, k, v), grad(q, k, v)
            row = {"impl": name}
            if ref is None:
                ref = (out, grads)
            row["err_o"] = _rel(out, ref[0])
            row["err_grad"] = max(_rel(g, r) for g, r in zip(grads, ref[1]))
            row["fwd_ms"] = _time(fwd, q, k, v)
            row["fwd_bwd_ms"] = _time(grad, q, k, v)
            row["tflops_fwd"] = flops_fwd / row["fwd_ms"] / 1e9
            row["tflops_fwd_bwd"] = 3.5 * flops_fwd / row["fwd_bwd_ms"] / 1e9
            row["doc_tflops_fwd_bwd"] = row["tflops_fwd_bwd"] * doc_frac
            if peak:
                row["peak_frac_fwd_bwd"] = row["tflops_fwd_bwd"] * 1e12 / peak
        except Exception as err:  # noqa: BLE001 - a backend that fails here is a row of the table
            row = {"impl": name, "error": f"{type(err).__name__}: {str(err)[:300]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shape": a.shape, "doc": a.doc, "device": jax.devices()[0].device_kind, "rows": rows}, f,
                      indent=1)
    base = next((r["fwd_bwd_ms"] for r in rows if "fwd_bwd_ms" in r), None)
    best = min((r["fwd_bwd_ms"] for r in rows if "fwd_bwd_ms" in r and not r["impl"].startswith("flash")),
               default=None)
    print(f"\n{'impl':<20}{'err o':>9}{'err grad':>10}{'fwd ms':>9}{'f+b ms':>9}{'TF/s f+b':>10}{'doc TF/s':>10}"
          f"{'doc peak':>9}{'vs xla':>8}{'vs best':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:<20} {r['error'][:100]}")
            continue
        frac = r["doc_tflops_fwd_bwd"] * 1e12 / peak if peak else float("nan")
        print(f"{r['impl']:<20}{r['err_o']:>9.1e}{r['err_grad']:>10.1e}{r['fwd_ms']:>9.2f}{r['fwd_bwd_ms']:>9.2f}"
              f"{r['tflops_fwd_bwd']:>10.1f}{r['doc_tflops_fwd_bwd']:>10.1f}{frac:>9.3f}{base / r['fwd_bwd_ms']:>8.2f}"
              f"{best / r['fwd_bwd_ms']:>8.2f}")
    print("vs best: against the fastest library backend (xla/cudnn/JAX's pallas) of this run")


if __name__ == "__main__":
    main()
