"""Helpers every Pallas kernel module here shares: where the kernels run and how operands are padded."""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

# `jax.ad_checkpoint.checkpoint_name` labels of what each kernel's custom_vjp saves for its backward,
# so a remat policy can keep them (`k3.model.REMAT_POLICIES`) instead of running the kernel's
# forward a second time inside the backward pass.
KDA_RESIDUALS = "kda_residuals"
KDA_INPUTS = "kda_inputs"
ATTENTION_RESIDUALS = "attention_residuals"


def compute_dtype(*xs) -> jnp.dtype:
    """The dtype for numerics that need more than the inputs carry (norms' variance, gates, softmax):
    float64 when any input is float64 (only with x64 enabled, in the tests), else float32."""
    return jnp.float64 if jnp.result_type(*xs) == jnp.float64 else jnp.float32


def default_interpret() -> bool:
    """Whether kernels called with ``interpret=None`` run in Pallas interpret mode: off a GPU, or as
    the ``K3_PALLAS_INTERPRET`` environment variable says ('0'/'false'/'' = compiled)."""
    env = os.environ.get("K3_PALLAS_INTERPRET")
    if env is not None:
        return env not in ("0", "false", "False", "")
    return jax.default_backend() != "gpu"


def pow2_from_16(n: int) -> bool:
    """Whether n is a power of two >= 16: a side Triton tiles take as it is."""
    return n >= 16 and n & (n - 1) == 0


def pow2_at_least_16(n: int) -> int:
    """The smallest power of two >= max(n, 16): Triton tiles need power-of-two sides of 16 or more."""
    return max(16, 1 << (int(n) - 1).bit_length())


def document_index(segment_ids_BT, cu_seqlens, B, T):
    """[B, T] int32 index of each token's document within its row: 0, 0, ..., 1, 1, ..., 2, ...

    Counting id changes (rather than comparing ids) makes documents contiguous runs, so masks built
    from "same document" can never join two separate runs that happen to reuse an id.
    """
    if cu_seqlens is not None:
        token_BT = jnp.arange(T)[None, :]
        return (jnp.searchsorted(jnp.asarray(cu_seqlens), token_BT, side="right") - 1).astype(jnp.int32)
    if segment_ids_BT is None:
        return jnp.zeros((B, T), jnp.int32)
    seg_BT = jnp.asarray(segment_ids_BT)
    starts_BT1 = (seg_BT[:, 1:] != seg_BT[:, :-1]).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.cumsum(starts_BT1, axis=1)], axis=1)


def tile_dot(a, b, contract, exact: bool):
    """A kernel's 2-D dot_general over the ``contract`` dims ((lhs,), (rhs,)) with fp32 accumulation;
    ``exact`` (fp32 operands) asks for full precision, which Triton would otherwise run as TF32."""
    prec = lax.Precision.HIGHEST if exact else lax.Precision.DEFAULT
    return lax.dot_general(a, b, (contract, ((), ())), precision=prec, preferred_element_type=jnp.float32)


def triton_params(interpret: bool, num_warps: int, num_stages: int):
    """A pallas_call's Triton launch parameters; None in interpret mode (nothing is compiled)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def median_seconds(fn, args, iters: int) -> float:
    """Median wall-clock seconds of ``iters`` calls of ``fn(*args)`` (each waited for) after three warm-ups."""
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def pipelined_seconds(fn, args, iters: int, repeats: int = 5) -> float:
    """Seconds per call of ``fn(*args)`` dispatched ``iters`` times back to back and waited for once
    (median of ``repeats`` such rounds, after three warm-ups): the device stays busy, so a call far
    shorter than its launch and synchronisation is not timed as their sum."""
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(iters)]
        jax.block_until_ready(outs)
        rounds.append((time.perf_counter() - t0) / iters)
    return statistics.median(rounds)


def kernel_bench_main(argv, *, doc: str, module: str, shape_help: str, default_shape: str, variants_help: str,
                      default_variants: str, bench, label_header: str, label, extra_json: dict | None = None,
                      options: Sequence[tuple[str, str]] = ()):
    """The command line the kernel-vs-jnp benchmarks share: parses --shape (4 dims, ``shape_help``),
    --variants, --iters and --json; runs ``bench(shape, variants, iters)``, which returns rows with
    impl, fwd_ms, fwdbwd_ms, their HBM fractions, jnp_over_this_* ratios and max_rel_diff_vs_jnp;
    prints them (``label(row)`` names the variant) and writes the JSON with the exact command.
    options: (name, help) of boolean flags passed on to ``bench`` as keywords; a row's
    ``fwd_kernel_ms`` (`kernel_seconds`), where present, is printed too."""
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--shape", default=default_shape, help=shape_help)
    ap.add_argument("--variants", default=default_variants, help=variants_help)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default="")
    for name, help_text in options:
        ap.add_argument(f"--{name}", action="store_true", help=help_text)
    a = ap.parse_args(argv)
    shape = tuple(int(x) for x in a.shape.split("x"))
    if len(shape) != 4:
        raise SystemExit(f"--shape must be {shape_help}; got {a.shape!r}")
    rows = bench(shape, [v for v in a.variants.split(",") if v], a.iters,
                 **{name: getattr(a, name) for name, _ in options})
    width = max(len(label_header), *(len(label(r)) for r in rows))
    print(f"{'impl':8s} {label_header:>{width}s} {'fwd ms':>8s} {'HBM':>5s} {'fwd+bwd ms':>10s} {'HBM':>5s} "
          f"{'jnp/this fwd':>12s} {'fwd+bwd':>8s} {'rel diff':>9s}")
    for r in rows:
        frac = lambda x: f"{x:5.0%}" if x is not None else "    -"  # noqa: E731
        tail = (f"  fwd kernels {r['fwd_kernel_ms'] * 1e3:.1f} us {frac(r['fwd_kernel_hbm_frac'])}"
                if "fwd_kernel_ms" in r else "")
        print(f"{r['impl']:8s} {label(r):>{width}s} {r['fwd_ms']:8.3f} {frac(r['fwd_hbm_frac'])} "
              f"{r['fwdbwd_ms']:10.3f} {frac(r['fwdbwd_hbm_frac'])} {r['jnp_over_this_fwd']:12.2f} "
              f"{r['jnp_over_this_fwdbwd']:8.2f} {r['max_rel_diff_vs_jnp']:9.2e}{tail}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": f"python -m {module} " + " ".join(argv), "device": jax.devices()[0].device_kind,
                       **(extra_json or {}), "rows": rows}, f, indent=1)
    return rows


def device_pids(events: list[dict]) -> set:
    """Process ids of a Perfetto trace's accelerator (their process_name names a device, not the host)."""
    pids = set()
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            label = str(e.get("args", {}).get("name", ""))
            if "/device:" in label and "host" not in label.lower():
                pids.add(e["pid"])
    return pids


def trace_kernel_ms(events: list[dict]) -> dict:
    """{kernel name: summed ms} of a Perfetto trace's complete events on the accelerator's processes
    (`device_pids`); on a trace with none (a CPU run) the host's XLA op events, which carry an 'hlo_op'
    argument, instead."""
    pids = device_pids(events)
    on_device = bool(pids)
    out: dict = {}
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        if (e.get("pid") in pids) if on_device else "hlo_op" in (e.get("args") or {}):
            out[e["name"]] = out.get(e["name"], 0.0) + float(e["dur"]) / 1e3
    return out


def kernel_seconds(fn, args, calls: int = 10) -> tuple[float, dict]:
    """(device kernel seconds per call of ``fn(*args)``, {kernel: ms per call}, largest first) from a
    profiler trace of ``calls`` calls (`trace_kernel_ms`): the time the GPU spends in the call's
    kernels, without the host's dispatch, which for a call of a few tens of microseconds can exceed it
    and set `pipelined_seconds`."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            outs = [fn(*args) for _ in range(calls)]
            jax.block_until_ready(outs)
        traces = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        if not traces:
            raise RuntimeError(f"the profiler wrote no perfetto_trace.json.gz under {d}")
        with gzip.open(traces[0], "rt") as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    per_call = {k: v / calls for k, v in sorted(trace_kernel_ms(events).items(), key=lambda kv: -kv[1])}
    return sum(per_call.values()) / 1e3, per_call
