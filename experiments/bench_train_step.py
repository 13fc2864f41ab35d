"""Times the jitted train step of K2-style and K3-style models side by side; prints tokens/s and MFU.

    python -m experiments.bench_train_step [--models=k2:1024:12,k3:1024:12] [--seq_len=4096] [--batch=8]
        [--remat] [--set model.moe.expert_impl=ragged ...] [--fit_batches=16,32] [--profile_dir=DIR]
        [--json=FILE]

Each model is ``experiments/configs/ladder.py``'s config of that style and width, with the layer
count given (STYLE:D_MODEL:LAYERS), bf16 compute, Muon, and the platform's default kernels
(``--set KEY=VALUE`` overrides any config key for every model, e.g. the reference paths:
``--set model.moe.expert_impl=ragged --set model.mla.attention_impl=xla --set model.kda.impl=chunk``).
MFU = tokens/s x training FLOPs per token (the ``full`` convention of `k3.params`; ``6N`` in
brackets) / the device's dense bf16 peak. ``full`` counts causal attention over the whole row; "MFU doc"
counts it over the 512-token documents only, the work a kernel that skips other documents' blocks does.
Synthetic tokens in packed documents of 512; the median
of the timed steps is reported, with the device's peak memory and the routes dropped by a capacity.
``--profile_dir`` traces two more steps and prints where the time goes
(`experiments.profile_step`). ``--fit_batches`` compiles (without running) the step at larger
batches and reports XLA's memory
estimate for each, to find the largest tokens/step that fits.
"""

import argparse
import json
import os
import statistics
import time
import sys

# JAX preallocates 75% of the device memory by default (104 GiB of an H200's 139); a training job
# that owns the GPU can take more of it.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments.configs.ladder import ladder_config  # noqa: E402
from k3.config import layer_kinds, renamed_hint, renamed_setting  # noqa: E402
from k3.mla.layer import ATTENTION  # noqa: E402
from k3.moe.layer import EXPERT_BACKENDS  # noqa: E402
from k3.kda.ops import KDA_CORES  # noqa: E402
from k3.params import count_params, flops_per_token  # noqa: E402
from k3.hardware import device_peak_flops  # noqa: E402
from k3.backends import COMPILE_CACHE_HELP, use_compile_cache  # noqa: E402
from k3.steps import make_run  # noqa: E402


def parse_value(text: str):
    """'1.5' -> 1.5, '3' -> 3, 'true' -> True, else the string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def build_config(style, d_model, n_layers, seq_len, batch, remat, sets=()):
    """The benchmark's config: ladder rung STYLE:D_MODEL with LAYERS, bf16, ``sets`` applied."""
    cfg = ladder_config(style, d_model)
    cfg.model.n_layers = n_layers
    cfg.model.dtype = "bfloat16"
    cfg.model.remat = remat
    cfg.data.seq_len, cfg.data.batch_size = seq_len, batch
    cfg.steps = 1000
    return apply_sets(cfg, sets)


def apply_sets(cfg, sets=()):
    """``cfg`` with each 'KEY=VALUE' of ``sets`` applied, validated (SystemExit naming an unknown key)."""
    for item in sets:
        key, _, val = item.partition("=")
        key, val = renamed_setting(key, parse_value(val))
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        if leaf not in node:
            raise SystemExit(f"--set {item}: unknown config key {key}{renamed_hint(key)}")
        node[leaf] = val
    from k3.config import validate

    return validate(cfg)


DOC = 512  # document length of the synthetic batches


def synthetic_batch(cfg, seed=0):
    """Random tokens [B, T] in packed documents of 512 (segment ids 1, 2, ...), all positions scored."""
    B, T = cfg.data.batch_size, cfg.data.seq_len
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.model.vocab_size, (B, T + 1), dtype=np.int32)
    seg = (np.arange(T)[None, :] // DOC + 1).repeat(B, 0).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
            "loss_mask": np.ones((B, T), np.float32)}


def _is_oom(err: Exception) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def compiled_memory_gib(run, state, batch) -> float | None:
    """XLA's estimate of the compiled step's device memory (arguments + outputs + temporaries), GiB."""
    try:
        mem = run.train_step.lower(state, batch).compile().memory_analysis()
    except Exception as err:  # noqa: BLE001 - reported, not raised: the estimate is optional
        return "oom" if _is_oom(err) else None
    if mem is None:
        return None
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    return total / 2 ** 30


def _progress(msg: str) -> None:
    """A progress line on stderr, flushed: a run stopped by a time limit still shows where it was."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def timed_steps(step, state, batch, steps: int):
    """Runs ``step(state, batch) -> (state, out)`` ``steps`` times; (state, last out, seconds per call)."""
    times, out = [], None
    for _ in range(steps):
        t0 = time.perf_counter()
        state, out = step(state, batch)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return state, out, times


def bench(style, d_model, n_layers, seq_len, batch, steps, remat, sets=(), fit_batches=(), profile_dir=""):
    """One model's row: step time, tokens/s, MFU, memory, drops (or 'oom')."""
    cfg = build_config(style, d_model, n_layers, seq_len, batch, remat, sets)
    counts = count_params(cfg.model)
    flops = flops_per_token(cfg.model, seq_len, counts)
    flops_doc = flops_per_token(cfg.model, min(DOC, seq_len), counts)["full"]
    row = {"style": style, "d_model": d_model, "n_layers": n_layers, "remat": remat, "sets": list(sets),
           "kda_impl": KDA_CORES.resolve(cfg.model.kda.impl),
           "expert_impl": EXPERT_BACKENDS.resolve(cfg.model.moe.expert_impl),
           "attention_impl": ATTENTION.resolve(cfg.model.mla.attention_impl),
           "total_params": counts["total_params"], "active_params": counts["active_params"],
           "tokens_per_step": batch * seq_len, "device": jax.devices()[0].device_kind}
    name = f"{style}:{d_model}:{n_layers} x {batch * seq_len}"
    t_start = time.perf_counter()
    run, state = make_run(cfg)
    batch_ = jax.device_put(synthetic_batch(cfg))
    jax.block_until_ready((state, batch_))
    row["build_s"] = time.perf_counter() - t_start  # mostly compiling the initialiser
    _progress(f"{name}: state built in {row['build_s']:.1f} s")
    try:
        t0 = time.perf_counter()
        step = run.train_step.lower(state, batch_).compile()  # one compilation for timing and profile
        _progress(f"{name}: compiled in {time.perf_counter() - t0:.1f} s")
        state, m = step(state, batch_)
        jax.block_until_ready(m)
        row["compile_s"] = time.perf_counter() - t0
        _progress(f"{name}: first step done {row['compile_s']:.1f} s after compiling started")
        state, m = step(state, batch_)
        jax.block_until_ready(m)
        state, m, times = timed_steps(step, state, batch_, steps)
    except Exception as err:  # noqa: BLE001 - an out-of-memory step is a result of the benchmark
        if not _is_oom(err):
            raise
        row["oom"] = str(err).splitlines()[0][:300]
        return row
    step_s = statistics.median(times)
    tps = batch * seq_len / step_s
    peak = device_peak_flops()
    n_moe = sum(1 for _, f in layer_kinds(cfg.model) if f == "moe")
    routes = batch * seq_len * cfg.model.moe.top_k * n_moe
    stats = jax.devices()[0].memory_stats() or {}
    row.update({"step_ms": step_s * 1e3, "step_ms_spread": (max(times) - min(times)) * 1e3, "tokens_per_s": tps,
                "mfu_full": tps * flops["full"] / peak if peak else None,
                "mfu_6N": tps * flops["6N"] / peak if peak else None,
                "mfu_doc": tps * flops_doc / peak if peak else None,
                "flops_per_token_full": flops["full"], "flops_per_token_6N": flops["6N"],
                "peak_gib": stats.get("peak_bytes_in_use", 0) / 2 ** 30 or None,
                "dropped_route_frac": float(m["dropped_routes"]) / routes if routes else 0.0,
                "loss": float(m["loss"])})
    if profile_dir:
        from experiments.profile_step import print_breakdown, profile_compiled

        res, state = profile_compiled(step, state, batch_, 2, os.path.join(profile_dir, f"{style}_{d_model}"))
        res.update({"model": f"{style}:{d_model}:{n_layers}", "sets": list(sets), "tokens_per_step": batch * seq_len,
                    "device": row["device"]})
        row["profile"] = res
        print_breakdown(res)
    del state, step
    for fb in fit_batches:
        cfg_f = build_config(style, d_model, n_layers, seq_len, fb, remat, sets)
        run_f, state_f = make_run(cfg_f)
        row.setdefault("fit_gib", {})[str(fb * seq_len)] = compiled_memory_gib(
            run_f, state_f, jax.device_put(synthetic_batch(cfg_f)))
        del run_f, state_f
    return row


def print_table(rows):
    base = next((r["tokens_per_s"] for r in rows if "tokens_per_s" in r), None)
    print(f"\n{'model':<16}{'kernels (kda/expert/attn)':<28}{'total':>8}{'active':>8}{'tok/step':>9}"
          f"{'step ms':>9}{'tok/s':>9}{'MFU full':>9}{'(6N)':>7}{'doc':>7}{'peak GiB':>9}{'drop':>7}{'vs first':>9}")
    for r in rows:
        name = f"{r['style']} d{r['d_model']} L{r['n_layers']}"
        kern = f"{r['kda_impl'] if r['style'] == 'k3' else '-'}/{r['expert_impl']}/{r['attention_impl']}"
        head = (f"{name:<16}{kern:<28}{r['total_params'] / 1e6:>7.0f}M{r['active_params'] / 1e6:>7.0f}M"
                f"{r['tokens_per_step']:>9}")
        if "oom" in r:
            print(head + "   out of memory")
            continue
        mfu = f"{r['mfu_full']:.3f}" if r["mfu_full"] is not None else "n/a"
        mfu6 = f"{r['mfu_6N']:.3f}" if r["mfu_6N"] is not None else "n/a"
        mfud = f"{r['mfu_doc']:.3f}" if r.get("mfu_doc") is not None else "n/a"
        pk = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "n/a"
        print(head + f"{r['step_ms']:>9.1f}{r['tokens_per_s']:>9.0f}{mfu:>9}{mfu6:>7}{mfud:>7}{pk:>9}"
              f"{r['dropped_route_frac']:>7.3f}{r['tokens_per_s'] / base:>9.2f}")
        for tok, gib in (r.get("fit_gib") or {}).items():
            print(f"{'':<16}compile-only at {tok} tokens/step: "
                  + (f"{gib:.1f} GiB" if isinstance(gib, float) else str(gib)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="k2:1024:12,k3:1024:12")
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--remat", action="store_true", help="rematerialise each scanned layer group")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every model (repeatable)")
    p.add_argument("--fit_batches", default="", help="comma-separated batch sizes to compile-check for memory")
    p.add_argument("--profile_dir", default="", help="also trace 2 steps there and print the time breakdown")
    p.add_argument("--json", default="")
    p.add_argument("--compile_cache", default="", help=COMPILE_CACHE_HELP)
    a = p.parse_args()
    use_compile_cache(a.compile_cache)
    fit = [int(b) for b in a.fit_batches.split(",") if b]
    rows = []
    for spec in a.models.split(","):
        style, d, layers = spec.split(":")
        rows.append(bench(style, int(d), int(layers), a.seq_len, a.batch, a.steps, a.remat, a.set, fit,
                          a.profile_dir))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "profile"}), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
    print_table(rows)


if __name__ == "__main__":
    main()
