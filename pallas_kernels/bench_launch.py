"""The device's time per small dependent kernel inside a scanned step: the floor under a decode step that
runs a few hundred kernels which each move kilobytes.

    python -m pallas_kernels.bench_launch [--shape=8x1024] [--steps=64] [--kernels=32] [--step_kernels=307]
        [--kernel_time] [--json=FILE]

A jitted `lax.scan` of --steps steps, each running --kernels dependent kernels on x [rows, D] (bf16),
one kernel after the other, each adding one to every element (plus the scan's counter, one more small
kernel a step, which the per-kernel figures leave in); forms:
  * 'xla': an elementwise fusion per kernel, kept apart from its neighbours by
    `lax.optimization_barrier` (XLA would fuse a chain of adds into one kernel);
  * 'pallas': a Pallas Triton kernel per kernel, one program over the whole array.
Each row gives the wall time per kernel (the whole scan's pipelined seconds over steps x kernels),
with --kernel_time the GPU's kernel time per kernel from a profiler trace (without the gaps between
kernels), the bytes a kernel moves (x read and written) as a fraction of HBM bandwidth, and the floor
those put under a step of --step_kernels such kernels (307: the K3 decode step at batch 8, compiled
for an H100, `experiments.aot_report --decode`). XLA's options (e.g. ``--xla_gpu_enable_pdl``) are
read from XLA_FLAGS, so a run with and without one compares launch settings.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from k3.hardware import device_hbm_bandwidth
from pallas_kernels.common import default_interpret, kernel_seconds, pipelined_seconds, triton_params

FORMS = ("xla", "pallas")


def _add_one_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1


def _pallas_add_one(x_RD, interpret: bool):
    """x + 1 [R, D] as one Pallas call of one program."""
    spec = pl.BlockSpec(x_RD.shape, lambda i: (0, 0))
    return pl.pallas_call(_add_one_kernel, grid=(1,), in_specs=[spec], out_specs=spec,
                          out_shape=jax.ShapeDtypeStruct(x_RD.shape, x_RD.dtype), interpret=interpret,
                          compiler_params=triton_params(interpret, 4, 1), name="launch_add_one")(x_RD)


def chain(form: str, steps: int, kernels: int, interpret: bool | None = None):
    """jitted x [R, D] -> x + steps * kernels, as `steps` scan steps of `kernels` dependent kernels of
    ``form`` (see the module docstring); ValueError on an unknown form."""
    if form not in FORMS:
        raise ValueError(f"bench_launch: unknown form {form!r}; one of {FORMS}")
    interpret = default_interpret() if interpret is None else interpret

    def one(x):
        if form == "xla":
            return lax.optimization_barrier(x + 1)
        return _pallas_add_one(x, interpret)

    def body(x, _):
        for _ in range(kernels):
            x = one(x)
        return x, None

    return jax.jit(lambda x: lax.scan(body, x, None, length=steps)[0])


def bench(rows: int, D: int, steps: int, kernels: int, step_kernels: int, iters: int, kernel_time: bool):
    """One row per form: wall and (with kernel_time) kernel microseconds per kernel, bytes, HBM
    fraction, and the step floor for ``step_kernels`` such kernels; the chain's result is checked."""
    x = jnp.zeros((rows, D), jnp.bfloat16)
    hbm = device_hbm_bandwidth()
    nbytes = 2 * x.size * x.dtype.itemsize
    n = steps * kernels
    out = []
    for form in FORMS:
        fn = chain(form, steps, kernels)
        got = float(jnp.max(jnp.abs(fn(x).astype(jnp.float32) - n)))
        if got != 0.0:
            raise RuntimeError(f"bench_launch: the {form} chain is off by {got} from {n}")
        t = pipelined_seconds(fn, (x,), iters)
        row = dict(form=form, rows=rows, D=D, steps=steps, kernels=kernels, us_per_kernel=t / n * 1e6,
                   bytes_per_kernel=nbytes, hbm_frac=nbytes / (t / n) / hbm if hbm else None,
                   step_floor_ms=t / n * step_kernels * 1e3)
        if kernel_time:
            tk, names = kernel_seconds(fn, (x,), calls=3)
            row.update(kernel_us_per_kernel=tk / n * 1e6, kernel_step_floor_ms=tk / n * step_kernels * 1e3,
                       kernels_traced=names)
        out.append(row)
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8x1024", help="rows x D of the bf16 array each kernel reads and writes")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--kernels", type=int, default=32, help="dependent kernels per scan step")
    ap.add_argument("--step_kernels", type=int, default=307, help="kernels of the step whose floor is printed")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--kernel_time", action="store_true", help="also the profiler's kernel time per kernel")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    try:
        rows, D = (int(s) for s in a.shape.split("x"))
    except ValueError:
        raise SystemExit(f"--shape must be ROWSxD; got {a.shape!r}") from None
    if min(rows, D, a.steps, a.kernels, a.step_kernels, a.iters) < 1:
        raise SystemExit("--shape, --steps, --kernels, --step_kernels and --iters must be positive")
    out = bench(rows, D, a.steps, a.kernels, a.step_kernels, a.iters, a.kernel_time)
    pct = lambda v: f"{v:6.2%}" if v is not None else "     -"  # noqa: E731
    print(f"{'form':12s} {'us/kernel':>9s} {'HBM':>6s} {f'{a.step_kernels} kernels, ms':>17s}"
          + (f" {'kernel us':>9s} {'ms':>6s}" if a.kernel_time else ""))
    for r in out:
        tail = f" {r['kernel_us_per_kernel']:9.2f} {r['kernel_step_floor_ms']:6.3f}" if a.kernel_time else ""
        print(f"{r['form']:12s} {r['us_per_kernel']:9.2f} {pct(r['hbm_frac'])} {r['step_floor_ms']:17.3f}{tail}")
    print(f"device: {jax.devices()[0].device_kind}; {out[0]['bytes_per_kernel']:,} bytes a kernel")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python -m pallas_kernels.bench_launch " + " ".join(argv),
                       "device": jax.devices()[0].device_kind, "rows": out}, f, indent=1)
    return out


if __name__ == "__main__":
    main()
