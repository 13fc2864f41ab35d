"""Times the jitted train step of K2-style and K3-style models side by side; prints tokens/s and MFU.

    python -m experiments.bench_train_step [--models=k2:448:12,k3:384:12] [--seq_len=2048] [--batch=16] [--remat]

Each model is ``experiments/configs/ladder.py``'s config of that style and width, with the layer
count given (STYLE:D_MODEL:LAYERS), bf16 compute, Muon. MFU = tokens/s x training FLOPs per token
(the ``full`` convention of `k3.params`; ``6N`` in brackets) / the device's dense bf16 peak.
Synthetic tokens in packed documents of 512; the median of the timed steps is reported.
"""

import argparse
import json
import statistics
import time

import jax
import numpy as np

from experiments.configs.ladder import ladder_config
from k3.params import count_params, flops_per_token
from k3.train import device_peak_flops, make_run


def bench(style, d_model, n_layers, seq_len, batch, steps, kda_impl, remat):
    cfg = ladder_config(style, d_model)
    cfg.model.n_layers = n_layers
    cfg.model.dtype = "bfloat16"
    cfg.model.kda.chunk_size = 64
    cfg.model.kda.impl = kda_impl
    cfg.model.remat = remat
    cfg.data.seq_len, cfg.data.batch_size = seq_len, batch
    cfg.steps = 1000
    counts = count_params(cfg.model)
    flops = flops_per_token(cfg.model, seq_len, counts)
    run, state = make_run(cfg)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, (batch, seq_len + 1), dtype=np.int32)
    seg = (np.arange(seq_len)[None, :] // 512 + 1).repeat(batch, 0).astype(np.int32)
    batch_ = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
              "loss_mask": np.ones((batch, seq_len), np.float32)}
    batch_ = jax.device_put(batch_)
    t0 = time.perf_counter()
    state, m = run.train_step(state, batch_)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    state, m = run.train_step(state, batch_)
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = run.train_step(state, batch_)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tps = batch * seq_len / step_s
    peak = device_peak_flops()
    return {"style": style, "d_model": d_model, "n_layers": n_layers, "kda_impl": kda_impl, "remat": remat,
            "total_params": counts["total_params"], "active_params": counts["active_params"],
            "tokens_per_step": batch * seq_len, "step_ms": step_s * 1e3, "tokens_per_s": tps,
            "mfu_full": tps * flops["full"] / peak if peak else None,
            "mfu_6N": tps * flops["6N"] / peak if peak else None,
            "compile_s": compile_s, "loss": float(m["loss"]), "device": jax.devices()[0].device_kind}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="k2:448:12,k3:384:12")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--kda_impl", default="chunk", help="KDA core for K3 models (STYLE:D:L:IMPL overrides)")
    p.add_argument("--remat", action="store_true", help="rematerialise each scanned layer group")
    p.add_argument("--json", default="")
    a = p.parse_args()
    rows = []
    for spec in a.models.split(","):
        style, d, layers, *impl = spec.split(":")
        rows.append(bench(style, int(d), int(layers), a.seq_len, a.batch, a.steps,
                          impl[0] if impl else a.kda_impl, a.remat))
        print(json.dumps(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    base = rows[0]["tokens_per_s"]
    print(f"\n{'model':<24}{'total':>9}{'active':>9}{'step ms':>10}{'tok/s':>11}{'MFU full':>10}{'(6N)':>8}{'vs first':>10}")
    for r in rows:
        mfu = f"{r['mfu_full']:.3f}" if r["mfu_full"] is not None else "n/a"
        mfu6 = f"{r['mfu_6N']:.3f}" if r["mfu_6N"] is not None else "n/a"
        name = f"{r['style']} d{r['d_model']} L{r['n_layers']}" + (f" {r['kda_impl']}" if r["style"] == "k3" else "")
        print(f"{name:<24}{r['total_params'] / 1e6:>8.1f}M{r['active_params'] / 1e6:>8.1f}M{r['step_ms']:>10.1f}"
              f"{r['tokens_per_s']:>11.0f}{mfu:>10}{mfu6:>8}{r['tokens_per_s'] / base:>10.2f}")


if __name__ == "__main__":
    main()
