"""The planner's single-device memory estimate beside the measured peaks of the train-step benchmark.

    python -m experiments.plan_vs_measured [--results=experiments/results/train_step]

Reads the benchmark's JSON rows (`experiments.bench_train_step`), rebuilds each row's config (model,
tokens per step, remat, ``--set`` overrides) and plans it on one H200 with `k3.plan.plan`; prints
the estimate and the measured peak (or the out-of-memory message) side by side. Shapes only: runs on
a CPU. The planner knows remat on or off, not the 'dots' policy, which it plans as full remat.

Beside it: the state the step holds (parameters, optimizer, gradients: the planner's figures), the
residuals JAX saves for the backward under the row's remat policy with the GPU's kernels
(`k3.plan.saved_residual_bytes`, traced), and what the measured peak holds beyond those two (XLA's
working set while a group is recomputed, and its temporaries). Both are counted for the code as it
is now: a row measured before a change (K2's before the GLU activation's VJP) carries the
difference in 'rest'.
"""

import argparse
import glob
import json
import os

from experiments.bench_train_step import build_config
from k3 import plan as P


def rows(results: str) -> list[dict]:
    """Every benchmark row of the JSON files in ``results`` (files of other scripts are skipped)."""
    out = []
    for path in sorted(glob.glob(os.path.join(results, "*.json"))):
        data = json.load(open(path))
        for r in (data.get("rows") if isinstance(data, dict) else data) or []:
            if isinstance(r, dict) and "style" in r and "tokens_per_step" in r:
                out.append(dict(r, file=os.path.basename(path)))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default="experiments/results/train_step")
    p.add_argument("--seq_len", type=int, default=4096)
    a = p.parse_args()
    one = {axis: 1 for axis in P.MESH_AXES}
    print(f"{'file':<44}{'model':<12}{'tok/step':>9}{'remat':>7}  {'policy':<16}{'plan GiB':>9}{'state':>7}"
          f"{'saved':>7}{'rest':>7}  measured")
    for r in rows(a.results):
        batch = r["tokens_per_step"] // a.seq_len
        cfg = build_config(r["style"], r["d_model"], r["n_layers"], a.seq_len, batch, r["remat"], r.get("sets", []))
        est = P.plan(P.load_model(cfg), one, "h200", batch=batch, seq=a.seq_len, remat=r["remat"])
        mem = est["memory"]
        state = (mem["params"] + mem["optimizer"] + mem["gradients"]) / 2**30
        # One micro-batch's residuals are alive at a time.
        saved = P.saved_residual_bytes(cfg, batch // cfg.optim.grad_accum, a.seq_len) / 2**30
        peak = r.get("peak_gib")
        measured = f"{peak:.1f} GiB" if peak else (r.get("oom", "")[:60] or "n/a")
        rest = f"{peak - state - saved:>7.1f}" if peak else f"{'-':>7}"
        policy = cfg.model.remat_policy if r["remat"] else "-"
        print(f"{r['file'][:43]:<44}{r['style']} {r['d_model']}:{r['n_layers']:<5}{r['tokens_per_step']:>9}"
              f"{'yes' if r['remat'] else 'no':>7}  {policy:<16}{mem['total'] / 2**30:>9.1f}{state:>7.1f}"
              f"{saved:>7.1f}{rest}  {measured}")


if __name__ == "__main__":
    main()
