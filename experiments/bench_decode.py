"""Decode speed and memory: a small K3 against an all-MLA model of the same shape, at long contexts.

    python -m experiments.bench_decode [--contexts=4096,32768,131072] [--batch=8] [--steps=64]
        [--d_model=1024 --n_layers=16] [--dtype=bfloat16] [--weights_dtype=same] [--profile_top=0] [--json=PATH]

Both models are `experiments.configs.ladder`'s K3 arm at the given width and depth; the second one
swaps every KDA layer for (Gated, NoPE) MLA. The cache is filled with random values at the context
length (a decode step's cost does not depend on what the cache holds, and a real 128K prefill is not
what is measured), then ``--steps`` greedy decode steps run under one jit with the cache donated.
Reported: tokens/s (batch x steps / time, median of 3 repeats), the cache's and the weights' bytes, and
the compiled step's scratch memory (XLA's memory analysis: what the step needs beyond its arguments).
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import math
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.configs.ladder import arm_config
from k3 import decode
from k3.model import Model
from k3.params import count_params


def model_config(kind: str, d_model: int, n_layers: int, dtype: str):
    cfg = arm_config("k3", d_model, n_layers).model
    cfg.dtype = dtype
    cfg.kda.impl = "recurrent"
    if kind == "all_mla":
        cfg.mixer = "mla"
    return cfg


def device_kernel_times(fn, top: int) -> list[tuple[str, float]]:
    """Runs ``fn`` once under the profiler; the ``top`` device kernels by total time, as (name,
    fraction of all device-kernel time). Empty where the backend records no device streams (CPU)."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(fn())
        paths = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        if not paths:
            return []
        with gzip.open(paths[0], "rt") as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    device_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                   and "/device:" in str(e.get("args", {}).get("name", ""))}
    total = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device_pids:
            total[e["name"]] += float(e.get("dur", 0))
    whole = sum(total.values()) or 1.0
    return [(name, t / whole) for name, t in total.most_common(top)]


def capacity(context: int) -> int:
    """Room for the context and one more token, in multiples of 64 like `k3.generate`'s caches."""
    return -(-(context + 1) // 64) * 64


def random_cache(model, batch: int, context: int, key) -> dict:
    """A cache filled with random values, length = context, capacity rounded up as `generate` does."""
    cache = decode.init_cache(model, batch, capacity(context))
    leaves, treedef = jax.tree.flatten(cache)
    keys = jax.random.split(key, len(leaves))
    filled = [jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype) * 0.1 if x.dtype != jnp.int32 else x
              for k, x in zip(keys, leaves)]
    cache = jax.tree.unflatten(treedef, filled)
    cache["length"] = jnp.full((batch,), context, jnp.int32)
    return cache


def bench(kind: str, d_model: int, n_layers: int, context: int, batch: int, steps: int, dtype: str,
          weights_dtype: str = "", profile_top: int = 0) -> dict:
    cfg = model_config(kind, d_model, n_layers, dtype)
    model = Model(cfg, rngs=nnx.Rngs(0))
    cache_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(
        jax.eval_shape(lambda: decode.init_cache(model, batch, capacity(context)))))

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if weights_dtype:  # served weights are stored once in the compute dtype, not cast every step
        params = jax.tree.map(
            lambda x: x.astype(weights_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)

    # The weights are an argument, not closed-over constants, so the executable and its memory
    # analysis see them as the buffers they are at serving time.
    @functools.partial(jax.jit, donate_argnums=1)
    def decode_steps(params, cache, tok):
        model = nnx.merge(graphdef, params, rest)

        def step(carry, _):
            cache, tok = carry
            # Rewind to the measured context each step so the cache never fills up.
            cache = {**cache, "length": jnp.minimum(cache["length"], context)}
            logits, cache = decode.extend(model, tok[:, None], cache)
            return (cache, jnp.argmax(logits[:, 0], -1).astype(jnp.int32)), None

        (cache, tok), _ = jax.lax.scan(step, (cache, tok), None, length=steps)
        return cache, tok

    cache = random_cache(model, batch, context, jax.random.key(0))
    tok = jnp.zeros((batch,), jnp.int32)
    t0 = time.perf_counter()
    compiled = decode_steps.lower(params, cache, tok).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    cache, tok = compiled(params, cache, tok)
    jax.block_until_ready(tok)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        cache, tok = compiled(params, cache, tok)
        jax.block_until_ready(tok)
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    top = device_kernel_times(lambda: compiled(params, cache, tok)[1], profile_top) if profile_top else []
    counts = count_params(cfg)
    return {"model": kind, "d_model": d_model, "n_layers": n_layers, "context": context, "batch": batch,
            "steps": steps, "weights_dtype": weights_dtype or "float32", "tokens_per_s": batch * steps / dt,
            "ms_per_step": dt / steps * 1e3,
            "cache_bytes": cache_bytes, "weight_bytes": weight_bytes,
            "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
            "active_params": counts["active_params"], "compile_s": compile_s,
            "device": jax.devices()[0].device_kind, "top_kernels": top}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="4096,32768,131072")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--d_model", type=int, default=1024)
    p.add_argument("--n_layers", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--weights_dtype", default="same",
                   help="dtype the weights are stored in ('same': the compute dtype; 'float32': as trained)")
    p.add_argument("--profile_top", type=int, default=0,
                   help="also profile one call and list this many device kernels by share of time")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    rows = []
    for context in (int(x) for x in a.contexts.split(",")):
        for kind in ("k3", "all_mla"):
            wd = a.dtype if a.weights_dtype == "same" else a.weights_dtype
            rows.append(bench(kind, a.d_model, a.n_layers, context, a.batch, a.steps, a.dtype, wd, a.profile_top))
            print(json.dumps(rows[-1]), flush=True)
            for name, share in rows[-1]["top_kernels"]:
                print(f"    {share:6.1%}  {name[:110]}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{'context':>9}{'model':>9}{'tok/s':>12}{'ms/step':>10}{'cache MiB':>11}{'scratch MiB':>12}{'K3/all-MLA tok/s':>18}")
    for r in rows:
        base = next(x for x in rows if x["context"] == r["context"] and x["model"] == "all_mla")
        temp = f"{r['temp_bytes'] / 2 ** 20:.0f}" if r["temp_bytes"] is not None else "n/a"
        print(f"{r['context']:>9}{r['model']:>9}{r['tokens_per_s']:>12,.0f}{r['ms_per_step']:>10.2f}"
              f"{r['cache_bytes'] / 2 ** 20:>11.1f}{temp:>12}{r['tokens_per_s'] / base['tokens_per_s']:>18.2f}")
    return rows


if __name__ == "__main__":
    main()
