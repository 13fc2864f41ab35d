"""Times the optimizer update alone (clip, Muon/AdamW, weight decay, apply) on a model's parameters.

    python -m experiments.bench_optimizer [--models=k2:1024:12,k3:1024:12] [--impls=folded,grouped,optax]
        [--set optim.mu_dtype=bfloat16 ...] [--steps=10] [--profile_dir=DIR] [--json=FILE]

Each model is the train-step benchmark's config (`experiments.bench_train_step.build_config`);
``--impls`` are values of ``optim.newton_schulz`` compared side by side on the same parameters and
gradients. The optimizer's cost does not depend on the tokens per step, so at small batches it is a
large share of the step; this separates it. Printed per row:

- ``ms``: median wall time of one jitted update (parameters and state donated);
- ``dots``: matmuls in the update's program (``dot_general`` equations of its jaxpr): each is at
  least one GEMM launch, which at small sizes costs more than its FLOPs;
- ``NS TFLOP``: Newton-Schulz FLOPs per update, 5 steps x (4 m^2 n + 2 m^3) per m x n matrix
  (m <= n), counted from the shapes; ``NS floor ms`` = that over the device's dense bf16 peak;
- ``bytes floor ms``: parameters, gradients and optimizer state read once and parameters and state
  written once, over the HBM bandwidth;
- ``floor frac``: (NS floor + bytes floor) / ms, the share of the hardware bound reached;
- ``vs first``: the first impl's time over this row's (> 1: faster);
- ``temp GiB``: XLA's temporaries for the update (compiled memory analysis), the memory the
  optimizer needs on top of parameters, gradients and state.

With ``--profile_dir`` each row's kernels are traced and split into matmuls and the rest
(`experiments.profile_step`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from experiments.bench_train_step import build_config, timed_steps  # noqa: E402
from k3 import optim, plan  # noqa: E402
from k3.hardware import device_hbm_bandwidth, device_peak_flops  # noqa: E402
from k3.steps import init_model  # noqa: E402


def newton_schulz_flops(params: nnx.State, per_head: bool = False) -> float:
    """FLOPs of one update's Newton-Schulz over every Muon matrix of ``params`` on one device
    (`k3.plan.muon_work`: 5 x (4 m^2 n + 2 m^3) per m x n matrix, m <= n)."""
    infos = plan.param_infos(params, per_head)
    return plan.muon_work(infos, [1] * len(infos), 2)["flops"]


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def bench(model: str, impl: str, sets, steps: int, profile_dir: str = "") -> dict:
    """One row: the update's median ms and its floors for ``model`` (STYLE:D:LAYERS) under ``impl``."""
    style, d, layers = model.split(":")
    cfg = build_config(style, int(d), int(layers), 4096, 8, False, [*sets, f"optim.newton_schulz={impl}"])
    _, params, _ = init_model(cfg)
    tx, _ = optim.build_optimizer(cfg, params)
    opt = jax.jit(tx.init)(params)
    keys = jax.random.split(jax.random.key(1), len(jax.tree.leaves(params)))
    grads = jax.tree.unflatten(jax.tree.structure(params), [
        1e-3 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, jax.tree.leaves(params))])

    def update(state, grads):
        params, opt = state
        with jax.named_scope("optimizer"):
            updates, opt = tx.update(grads, opt, params)
            params = optax.apply_updates(params, updates)
        return (params, opt), optax.tree.norm(updates)

    state = (params, opt)
    dots = sum(e.primitive.name == "dot_general" for e in jax.make_jaxpr(update)(state, grads).eqns)
    step = jax.jit(update, donate_argnums=0).lower(state, grads).compile()
    mem = step.memory_analysis()
    state, n = step(state, grads)
    jax.block_until_ready(n)
    state, _, times = timed_steps(step, state, grads, steps)
    ms = statistics.median(times) * 1e3
    ns_flops = newton_schulz_flops(params, cfg.optim.per_head_muon)
    moved = 2 * _bytes(state) + _bytes(grads)
    peak, hbm = device_peak_flops(), device_hbm_bandwidth()
    row = {"model": model, "impl": impl, "sets": list(sets), "device": jax.devices()[0].device_kind,
           "params": sum(x.size for x in jax.tree.leaves(params)), "ms": ms, "dots": dots,
           "ms_spread": (max(times) - min(times)) * 1e3, "ns_tflop": ns_flops / 1e12, "bytes_gb": moved / 1e9,
           "ns_floor_ms": ns_flops / peak * 1e3 if peak else None,
           "bytes_floor_ms": moved / hbm * 1e3 if hbm else None,
           # XLA's temporaries for the update beyond its inputs: what the optimizer adds to the state
           # at its own peak (after the backward has freed the activations).
           "temp_gib": mem.temp_size_in_bytes / 2 ** 30 if mem is not None else None}
    if peak and hbm:
        row["floor_frac"] = (row["ns_floor_ms"] + row["bytes_floor_ms"]) / ms
    if profile_dir:
        from experiments.profile_step import profile_compiled

        res, state = profile_compiled(step, state, grads, 2, os.path.join(profile_dir, f"{style}_{d}_{impl}"))
        row["profile"] = {k: res[k] for k in ("total_ms", "ms", "top", "top_fusions")}
    return row


def print_table(rows) -> None:
    print(f"\n{'model':<12}{'impl':<8}{'params M':>9}{'ms':>9}{'dots':>6}{'NS TFLOP':>10}{'NS floor ms':>12}"
          f"{'bytes GB':>9}{'bytes floor ms':>15}{'floor frac':>11}{'vs first':>9}{'temp GiB':>9}")
    first = {}
    for r in rows:
        first.setdefault(r["model"], r["ms"])
        fmt = lambda v, f: format(v, f) if v is not None else format("n/a", ">" + f.split(".")[0])
        print(f"{r['model']:<12}{r['impl']:<8}{r['params'] / 1e6:>9.0f}{r['ms']:>9.2f}{r.get('dots', 0):>6}"
              f"{r['ns_tflop']:>10.2f}"
              f"{fmt(r['ns_floor_ms'], '12.2f')}{r['bytes_gb']:>9.1f}{fmt(r['bytes_floor_ms'], '15.2f')}"
              f"{fmt(r.get('floor_frac'), '11.1%')}{first[r['model']] / r['ms']:>9.2f}{fmt(r.get('temp_gib'), '9.2f')}")
        if "profile" in r:
            p = r["profile"]
            cats = ", ".join(f"{k} {v:.1f}" for k, v in p["ms"].items() if v > 0.05)
            print(f"    kernels {p['total_ms']:.1f} ms: {cats}")
            for name, ms, cat in p["top"][:6]:
                print(f"      {ms:>8.2f}  {cat:<18} {name[:80]}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="k2:1024:12,k3:1024:12")
    p.add_argument("--impls", default="folded,optax")
    p.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile_dir", default="")
    p.add_argument("--json", default="")
    a = p.parse_args()
    rows = []
    for model in a.models.split(","):
        for impl in a.impls.split(","):
            rows.append(bench(model, impl, a.sets, a.steps, a.profile_dir))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "profile"}), flush=True)
    print_table(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
