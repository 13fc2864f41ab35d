"""Decode speed and memory: a small K3 against an all-MLA model of the same shape, at long contexts.

    python -m experiments.bench_decode [--contexts=4096,32768,131072] [--batch=8] [--steps=64]
        [--d_model=1024 --n_layers=16] [--dtype=bfloat16] [--json=PATH]

Both models are `experiments.configs.ladder`'s K3 arm at the given width and depth; the second one
swaps every KDA layer for (Gated, NoPE) MLA. The cache is filled with random values at the context
length (a decode step's cost does not depend on what the cache holds, and a real 128K prefill is not
what is measured), then ``--steps`` greedy decode steps run under one jit with the cache donated.
Reported: tokens/s (batch x steps / time, median of 3 repeats), the cache's bytes, and the device's
peak memory where the backend reports it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
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


def random_cache(model, batch: int, context: int, key) -> dict:
    """A cache of capacity context + 1 per row, filled with random values, length = context."""
    cache = decode.init_cache(model, batch, context + 1)
    leaves, treedef = jax.tree.flatten(cache)
    keys = jax.random.split(key, len(leaves))
    filled = [jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype) * 0.1 if x.dtype != jnp.int32 else x
              for k, x in zip(keys, leaves)]
    cache = jax.tree.unflatten(treedef, filled)
    cache["length"] = jnp.full((batch,), context, jnp.int32)
    return cache


def bench(kind: str, d_model: int, n_layers: int, context: int, batch: int, steps: int, dtype: str) -> dict:
    cfg = model_config(kind, d_model, n_layers, dtype)
    model = Model(cfg, rngs=nnx.Rngs(0))
    cache_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(
        jax.eval_shape(lambda: decode.init_cache(model, batch, context + 1))))

    @jax.jit
    def decode_steps(cache, tok):
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
    cache, tok = decode_steps(cache, tok)
    jax.block_until_ready(tok)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        cache, tok = decode_steps(cache, tok)
        jax.block_until_ready(tok)
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    stats = jax.devices()[0].memory_stats() or {}
    counts = count_params(cfg)
    return {"model": kind, "d_model": d_model, "n_layers": n_layers, "context": context, "batch": batch,
            "steps": steps, "tokens_per_s": batch * steps / dt, "ms_per_step": dt / steps * 1e3,
            "cache_bytes": cache_bytes, "peak_bytes": stats.get("peak_bytes_in_use"),
            "active_params": counts["active_params"], "compile_s": compile_s,
            "device": jax.devices()[0].device_kind}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="4096,32768,131072")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--d_model", type=int, default=1024)
    p.add_argument("--n_layers", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    rows = []
    for context in (int(x) for x in a.contexts.split(",")):
        for kind in ("k3", "all_mla"):
            rows.append(bench(kind, a.d_model, a.n_layers, context, a.batch, a.steps, a.dtype))
            print(json.dumps(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{'context':>9}{'model':>9}{'tok/s':>12}{'ms/step':>10}{'cache MiB':>11}{'peak MiB':>10}{'K3/all-MLA tok/s':>18}")
    for r in rows:
        base = next(x for x in rows if x["context"] == r["context"] and x["model"] == "all_mla")
        peak = f"{r['peak_bytes'] / 2 ** 20:.0f}" if r["peak_bytes"] else "n/a"
        print(f"{r['context']:>9}{r['model']:>9}{r['tokens_per_s']:>12,.0f}{r['ms_per_step']:>10.2f}"
              f"{r['cache_bytes'] / 2 ** 20:>11.1f}{peak:>10}{r['tokens_per_s'] / base['tokens_per_s']:>18.2f}")
    return rows


if __name__ == "__main__":
    main()
