"""Decode speed and memory: a small K3 against an all-MLA model of the same shape, at long contexts.

    python -m experiments.bench_decode [--contexts=4096,32768,131072] [--models=k3,all_mla] [--batch=8] [--steps=64]
        [--d_model=1024 --n_layers=16] [--dtype=bfloat16] [--weights_dtype=same] [--layers=served|unrolled|scanned]
        [--mla_decode=auto|xla|pallas|pallas_merged] [--moe_decode=auto|train|gather|pallas|grouped|grouped_fused]
        [--kda_decode=auto|xla|pallas]
        [--loop=scan|host]
        [--profile_top=0] [--hbm_bytes_per_s=0]
        [--speculative=0] [--xla_option=KEY=VALUE ...] [--set=model.KEY=VALUE ...] [--json=PATH]

Both models are `experiments.configs.ladder`'s K3 arm at the given width and depth; the second one
swaps every KDA layer for (Gated, NoPE) MLA. The cache is filled with random values at the context
length (a decode step's cost does not depend on what the cache holds, and a real 128K prefill is not
what is measured), then ``--steps`` greedy decode steps run under one jit with the cache donated.
Reported: tokens/s (batch x steps / time, median of 3 repeats), the cache's and the weights' bytes, the
compiled step's scratch memory (XLA's memory analysis: what the step needs beyond its arguments), and
the step's bandwidth floor: the bytes a step must move (`floor_bytes`) over the device's HBM bandwidth
(`k3.hardware.HBM_BYTES_PER_S`, or ``--hbm_bytes_per_s``), with each row's time as a multiple of it.

``--speculative=K`` (> 0) also times `k3.decode.speculative_generate` (prompt-lookup drafts of K
tokens) against `k3.generate`, greedy, on the K3 model: ``--batch`` prompts of 512 tokens that repeat a
random 64-token phrase, ``--steps`` new tokens, second call of each timed (the first compiles).

``--loop=scan`` (default) runs the steps as one scan inside one jitted call, as `k3.generate`
does; ``host`` calls a jitted single step from Python once per token, as a server's loop would.
A GPU runtime may record a whole jitted call as one CUDA graph (XLA's command buffers), which a
loop body inside the call may not get: comparing the two separates launch gaps from work.

``--layers=served`` (default) holds the weights as a server would (`k3.model.served`, done once
before timing, as at load time): split per layer, each mixer's input projections fused into one
matrix; ``unrolled`` splits the layers only (`k3.model.unrolled`: XLA then merges the input
projections' small matmuls by concatenating their weights at every step); ``scanned`` keeps the
training layout, whose decode step slices every body layer's weights out of their stack.

``--set=model.KEY=VALUE`` (repeatable) changes any model setting of both models, after the flags
above, e.g. ``--set=model.attn_res_impl=xla``; each row records them.
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
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.bench_train_step import apply_sets
from experiments.configs.ladder import arm_config
from k3 import decode
from k3.backends import COMPILE_CACHE_HELP, use_compile_cache
from k3.hardware import device_hbm_bandwidth
from k3.model import Model, served, unrolled
from k3.params import count_params
from pallas_kernels.common import device_pids


DECODE_MODELS = ("k3", "all_mla")  # the benchmarked models (`model_config`)


def model_config(kind: str, d_model: int, n_layers: int, dtype: str, mla_decode: str = "auto",
                 moe_decode: str = "auto", kda_decode: str = "auto", sets=()):
    """The benchmarked model's config: the ladder's K3 arm at this width and depth ('all_mla': every
    mixer MLA), with the decode backends given and then ``sets`` ('model.KEY=VALUE') applied."""
    if kind not in DECODE_MODELS:
        raise SystemExit(f"unknown decode model {kind!r}: one of {', '.join(DECODE_MODELS)}")
    full = arm_config("k3", d_model, n_layers)
    cfg = full.model
    cfg.dtype = dtype
    cfg.mla.decode_impl = mla_decode
    cfg.moe.decode_impl = moe_decode
    cfg.kda.decode_impl = kda_decode
    cfg.kda.impl = "recurrent"
    if kind == "all_mla":
        cfg.mixer = "mla"
    bad = [item for item in sets if not item.startswith("model.")]
    if bad:
        raise SystemExit(f"--set takes model settings (model.KEY=VALUE); got {bad}")
    return apply_sets(full, sets).model if sets else cfg


def device_kernel_times(fn, top: int) -> dict:
    """Runs ``fn`` once under the profiler and sums its device kernels.

    Returns {'top': the ``top`` kernels by total time as (name, fraction of all kernel time),
    'kernel_ms': summed kernel time, 'span_ms': first kernel start to last kernel end, 'launches':
    the number of kernels}. ``kernel_ms / span_ms`` well under 1 means the device sits idle between
    kernels (launch gaps), not that it waits on memory. Empty where the backend records no device
    streams (CPU)."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(fn())
        paths = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        if not paths:
            return {}
        with gzip.open(paths[0], "rt") as f:
            events = json.load(f)
    return kernel_stats(events["traceEvents"] if isinstance(events, dict) else events, top)


def kernel_family(name: str) -> str:
    """A kernel's name without its instance number: XLA names each fusion of a step apart
    ('gemm_fusion_dot_95', 'loop_add_fusion.3'), so only their family sums the step's share."""
    return re.sub(r"([._]\d+)+$", "", name) or name


def kernel_stats(events: list[dict], top: int) -> dict:
    """`device_kernel_times`'s summary of a Perfetto trace's events (complete events of the
    processes named '/device:...'); {} when there are none. 'families': the ``top`` kernel families
    (`kernel_family`) as (family, fraction of all kernel time, launches)."""
    pids = device_pids(events)
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in pids]
    if not kernels:
        return {}
    total = collections.Counter()
    for e in kernels:
        total[e["name"]] += float(e.get("dur", 0))
    whole = sum(total.values()) or 1.0
    start = min(float(e["ts"]) for e in kernels)
    end = max(float(e["ts"]) + float(e.get("dur", 0)) for e in kernels)
    family, launches = collections.Counter(), collections.Counter()
    for name, t in total.items():
        family[kernel_family(name)] += t
    for e in kernels:
        launches[kernel_family(e["name"])] += 1
    return {"top": [(name, t / whole) for name, t in total.most_common(top)], "kernel_ms": whole / 1e3,
            "span_ms": (end - start) / 1e3, "launches": len(kernels),
            "families": [(name, t / whole, launches[name]) for name, t in family.most_common(top)]}


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


def floor_bytes(cfg, cache: dict, batch: int, context: int, weight_itemsize: int) -> dict:
    """Bytes one greedy decode step must move at least, by part.

    weights: every non-expert weight once, except the embedding (``batch`` rows); the routed experts
      in the expected share a step touches, 1 - (1 - k / E)^batch per MoE layer under uniform routing.
    kda_state: each KDA layer's state and conv rings, read and written back.
    mla_cache: each MLA layer's latent and rope-key rows up to ``context``, read once.
    """
    counts = count_params(cfg)
    moe = cfg.moe
    touched = 1 - (1 - moe.top_k / moe.n_experts) ** batch
    dense = counts["total_params"] - counts["routed_expert_params"] - counts["embedding_params"]
    weights = (dense + touched * counts["routed_expert_params"] + batch * cfg.d_model) * weight_itemsize
    kda = mla = 0
    for c in jax.tree.leaves(cache["layers"], is_leaf=lambda x: isinstance(x, dict) and ("state" in x or "c_kv" in x)):
        if "state" in c:
            kda += 2 * sum(x.nbytes for x in jax.tree.leaves(c))
        else:
            mla += sum(x.nbytes * context // x.shape[-2] for x in (c["c_kv"], c["k_rope"]))
    return {"weights": float(weights), "kda_state": float(kda), "mla_cache": float(mla)}


def bench(kind: str, d_model: int, n_layers: int, context: int, batch: int, steps: int, dtype: str,
          weights_dtype: str = "", profile_top: int = 0, layers: str = "served", hbm: float = 0.0,
          mla_decode: str = "auto", loop: str = "scan", moe_decode: str = "auto",
          xla_options: dict | None = None, kda_decode: str = "auto", sets=()) -> dict:
    cfg = model_config(kind, d_model, n_layers, dtype, mla_decode, moe_decode, kda_decode, sets)
    model = Model(cfg, rngs=nnx.Rngs(0))
    model = {"served": served, "unrolled": unrolled, "scanned": lambda m: m}[layers](model)
    rows = decode.decode_rows(batch)  # as `k3.generate` decodes: one sequence beside a copy on a GPU
    cache_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(
        jax.eval_shape(lambda: decode.init_cache(model, rows, capacity(context)))))

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if weights_dtype:  # served weights are stored once in the compute dtype, not cast every step
        params = jax.tree.map(
            lambda x: x.astype(weights_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)

    # The weights are an argument, not closed-over constants, so the executable and its memory
    # analysis see them as the buffers they are at serving time.
    def step(params, carry, _=None):
        cache, tok = carry
        # Rewind to the measured context each step so the cache never fills up.
        cache = {**cache, "length": jnp.minimum(cache["length"], context)}
        logits, cache = decode.extend(nnx.merge(graphdef, params, rest), tok[:, None], cache)
        return (cache, jnp.argmax(logits[:, 0], -1).astype(jnp.int32)), None

    @functools.partial(jax.jit, donate_argnums=1)
    def decode_steps(params, cache, tok):
        (cache, tok), _ = jax.lax.scan(functools.partial(step, params), (cache, tok), None, length=steps)
        return cache, tok

    @functools.partial(jax.jit, donate_argnums=1)
    def decode_one(params, cache, tok):
        return step(params, (cache, tok))[0]

    cache = random_cache(model, rows, context, jax.random.key(0))
    tok = jnp.zeros((rows,), jnp.int32)
    t0 = time.perf_counter()
    if loop == "scan":
        compiled = decode_steps.lower(params, cache, tok).compile(compiler_options=xla_options)
    else:
        one = decode_one.lower(params, cache, tok).compile(compiler_options=xla_options)

        def compiled(params, cache, tok):  # a server's loop: one dispatch per token
            for _ in range(steps):
                cache, tok = one(params, cache, tok)
            return cache, tok
    compile_s = time.perf_counter() - t0
    mem = (compiled if loop == "scan" else one).memory_analysis()
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
    prof = device_kernel_times(lambda: compiled(params, cache, tok)[1], profile_top) if profile_top else {}
    counts = count_params(cfg)
    w_item = jnp.dtype(weights_dtype or "float32").itemsize
    floor = floor_bytes(cfg, cache, batch, context, w_item)
    # The floor is what ``batch`` sequences need: a copied row's cache reads are the step's overhead.
    floor.update({k: floor[k] * batch / rows for k in ("kda_state", "mla_cache")})
    rate = device_hbm_bandwidth(hbm)
    floor_ms = sum(floor.values()) / rate * 1e3 if rate else None
    return {"model": kind, "d_model": d_model, "n_layers": n_layers, "context": context, "batch": batch, "rows": rows,
            "steps": steps, "weights_dtype": weights_dtype or "float32", "layers": layers,
            "mla_decode": mla_decode, "moe_decode": moe_decode, "kda_decode": kda_decode, "loop": loop,
            "xla_options": xla_options or {}, "sets": list(sets),
            "tokens_per_s": batch * steps / dt, "ms_per_step": dt / steps * 1e3,
            "floor_bytes": floor, "floor_ms": floor_ms,
            "x_floor": (dt / steps * 1e3) / floor_ms if floor_ms else None,
            "cache_bytes": cache_bytes, "weight_bytes": weight_bytes,
            "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
            "active_params": counts["active_params"], "compile_s": compile_s,
            "device": jax.devices()[0].device_kind, "top_kernels": prof.get("top", []),
            "kernel_families": [(name, share, n / steps) for name, share, n in prof.get("families", [])],
            # Per decode step, from the profiled call (None unprofiled or on a CPU).
            "kernel_ms_per_step": prof["kernel_ms"] / steps if prof else None,
            "kernel_busy_frac": prof["kernel_ms"] / prof["span_ms"] if prof and prof["span_ms"] else None,
            "launches_per_step": prof["launches"] / steps if prof else None}


def bench_speculative(d_model: int, n_layers: int, batch: int, new_tokens: int, k: int, dtype: str,
                      mla_decode: str = "auto", moe_decode: str = "auto", kda_decode: str = "auto",
                      sets=()) -> dict:
    """Greedy tokens/s of `k3.generate` and of `k3.decode.speculative_generate` (prompt-lookup drafts
    of ``k`` tokens) on repetitive prompts; the two must emit the same tokens."""
    cfg = model_config("k3", d_model, n_layers, dtype, mla_decode, moe_decode, kda_decode, sets)
    graphdef, params, rest = nnx.split(Model(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    rng = jax.random.split(jax.random.key(1), batch)
    prompts = [(jax.random.randint(r, (64,), 0, cfg.vocab_size).tolist() * 8) for r in rng]
    row = {"k": k, "batch": batch, "new_tokens": new_tokens}
    outs = {}
    for name, fn in (("plain", lambda: (decode.generate(graphdef, params, rest, prompts, new_tokens), None)),
                     ("speculative", lambda: decode.speculative_generate(graphdef, params, rest, prompts,
                                                                         new_tokens, k=k))):
        fn()
        t0 = time.perf_counter()
        outs[name], stats = fn()
        row[f"{name}_tokens_per_s"] = batch * new_tokens / (time.perf_counter() - t0)
        if stats:
            row.update(stats)
    row["same_tokens"] = outs["plain"] == outs["speculative"]
    row["speedup"] = row["speculative_tokens_per_s"] / row["plain_tokens_per_s"]
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="4096,32768,131072")
    p.add_argument("--models", default="k3,all_mla",
                   help="which of 'k3' and 'all_mla' to time (the ratio column needs both)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--d_model", type=int, default=1024)
    p.add_argument("--n_layers", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--weights_dtype", default="same",
                   help="dtype the weights are stored in ('same': the compute dtype; 'float32': as trained)")
    p.add_argument("--layers", default="served", choices=("served", "unrolled", "scanned"),
                   help="served (split per layer, input projections fused), unrolled (split only) or scanned")
    p.add_argument("--speculative", type=int, default=0,
                   help="K > 0: also time prompt-lookup speculative decoding with K-token drafts")
    p.add_argument("--mla_decode", default="auto", help="model.mla.decode_impl: 'auto', 'xla' or 'pallas'")
    p.add_argument("--moe_decode", default="auto",
                   help="model.moe.decode_impl: 'auto', 'train', 'gather', 'pallas' or 'grouped'")
    p.add_argument("--kda_decode", default="auto", help="model.kda.decode_impl: 'auto', 'xla' or 'pallas'")
    p.add_argument("--loop", default="scan", choices=("scan", "host"),
                   help="the steps as one scan in one jitted call, or a Python loop over a jitted step")
    p.add_argument("--hbm_bytes_per_s", type=float, default=0.0,
                   help="HBM bandwidth for the floor (default: the device's, from k3.hardware)")
    p.add_argument("--profile_top", type=int, default=0,
                   help="also profile one call and list this many device kernels by share of time")
    p.add_argument("--xla_option", action="append", default=[], metavar="KEY=VALUE",
                   help="an XLA compiler option for the timed program only (repeatable), e.g. "
                        "xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL,CONDITIONAL,WHILE")
    p.add_argument("--set", action="append", default=[], metavar="model.KEY=VALUE",
                   help="a model setting for both models (repeatable), e.g. model.attn_res_impl=xla")
    p.add_argument("--json", default="")
    p.add_argument("--compile_cache", default="", help=COMPILE_CACHE_HELP)
    a = p.parse_args(argv)
    use_compile_cache(a.compile_cache)
    kinds = [m for m in a.models.split(",") if m]
    bad = sorted(set(kinds) - set(DECODE_MODELS))
    if bad or not kinds:
        p.error(f"--models: expected a comma list of {' and '.join(map(repr, DECODE_MODELS))}; got {a.models!r}")
    xla_options = {}
    for item in a.xla_option:
        key, sep, val = item.partition("=")
        if not sep or not key:
            p.error(f"--xla_option: expected KEY=VALUE; got {item!r}")
        # XLA's boolean options take Python bools, not the strings 'true' / 'false'.
        xla_options[key] = {"true": True, "false": False}.get(val.lower(), val)
    rows = []
    for context in (int(x) for x in a.contexts.split(",")):
        for kind in kinds:
            wd = a.dtype if a.weights_dtype == "same" else a.weights_dtype
            rows.append(bench(kind, a.d_model, a.n_layers, context, a.batch, a.steps, a.dtype, wd, a.profile_top,
                              a.layers, a.hbm_bytes_per_s, a.mla_decode, a.loop, a.moe_decode, xla_options,
                              a.kda_decode, a.set))
            print(json.dumps(rows[-1]), flush=True)
            for name, share in rows[-1]["top_kernels"]:
                print(f"    {share:6.1%}  {name[:110]}", flush=True)
            for name, share, per_step in rows[-1]["kernel_families"]:
                print(f"    {share:6.1%}  {per_step:5.1f}/step  {name[:100]}", flush=True)
            if rows[-1]["kernel_ms_per_step"] is not None:
                r = rows[-1]
                print(f"    kernels {r['kernel_ms_per_step']:.3f} ms/step of {r['ms_per_step']:.3f}, busy "
                      f"{r['kernel_busy_frac']:.0%} of their span, {r['launches_per_step']:.0f} launches/step",
                      flush=True)
    if a.speculative > 0:
        spec = bench_speculative(a.d_model, a.n_layers, a.batch, a.steps, a.speculative,
                                 a.dtype, a.mla_decode, a.moe_decode, a.kda_decode, a.set)
        print(json.dumps({"speculative": spec}), flush=True)
        rows.append({"model": "k3_speculative", **spec})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{'context':>9}{'model':>9}{'tok/s':>12}{'ms/step':>10}{'floor ms':>10}{'x floor':>9}"
          f"{'cache MiB':>11}{'scratch MiB':>12}{'K3/all-MLA tok/s':>18}")
    for r in rows:
        if r["model"] == "k3_speculative":
            print(f"speculative (k={r['k']}): {r['speculative_tokens_per_s']:,.0f} tok/s vs "
                  f"{r['plain_tokens_per_s']:,.0f} plain ({r['speedup']:.2f}x; {r['mean_accepted']:.2f} tokens per "
                  f"row and pass; same tokens: {r['same_tokens']})")
            continue
        base = next((x for x in rows if x.get("context") == r["context"] and x["model"] == "all_mla"), None)
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "n/a"
        temp = f"{r['temp_bytes'] / 2 ** 20:.0f}" if r["temp_bytes"] is not None else "n/a"
        floor = f"{r['floor_ms']:.3f}" if r["floor_ms"] else "n/a"
        times = f"{r['x_floor']:.1f}" if r["x_floor"] else "n/a"
        print(f"{r['context']:>9}{r['model']:>9}{r['tokens_per_s']:>12,.0f}{r['ms_per_step']:>10.2f}{floor:>10}"
              f"{times:>9}{r['cache_bytes'] / 2 ** 20:>11.1f}{temp:>12}{ratio:>18}")
    return rows


if __name__ == "__main__":
    main()
