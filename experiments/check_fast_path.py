"""Same losses through the fast kernels and the reference path: N train steps of small K3 and K2.

    python -m experiments.check_fast_path [--steps=30] [--models=k3:128:4,k2:128:4] [--json=FILE]

For each model (ladder config STYLE:D_MODEL:LAYERS, bf16 compute) the same seed and the same
batches (bytes of Python standard-library sources in packed documents) are trained twice: with
the platform defaults ('auto': on a GPU the Pallas KDA, conv-branch and depth-mix kernels, capacity
experts, the flash attention kernel) and with the reference entries (jnp chunked KDA, conv branches
and depth mixes, dropless ragged_dot experts, XLA attention).
The capacity run uses expert_capacity = E / k, under which no route can be dropped (an expert gets
at most one route per token), so both runs compute the same function and differ by rounding only;
a third run at the default capacity reports its drops and their effect. Prints the per-step
losses and the largest difference.
"""

import argparse
import json
import sysconfig
from pathlib import Path

import jax
import numpy as np

from experiments.bench_train_step import build_config
from k3.steps import make_run

REFERENCE = ("model.kda.impl=chunk", "model.moe.expert_impl=ragged", "model.mla.attention_impl=xla",
             "model.attn_res_impl=xla", "model.kda.conv_impl=xla")


def stdlib_batches(n_batches: int, batch: int, seq_len: int, vocab: int):
    """Deterministic byte-token batches from the standard library's .py files (one document each)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    need = n_batches * batch * (seq_len + 1)
    toks, segs, seg = [], [], 1
    for f in files:
        data = np.frombuffer(f.read_bytes(), np.uint8).astype(np.int32) % vocab
        toks.append(data)
        segs.append(np.full(data.shape, seg, np.int32))
        seg += 1
        if sum(t.size for t in toks) >= need:
            break
    tok = np.concatenate(toks)[:need].reshape(n_batches, batch, seq_len + 1)
    sg = np.concatenate(segs)[:need].reshape(n_batches, batch, seq_len + 1)
    return [{"inputs": t[:, :-1], "targets": t[:, 1:], "segment_ids": s[:, :-1],
             "loss_mask": (s[:, 1:] == s[:, :-1]).astype(np.float32)} for t, s in zip(tok, sg)]


def train_losses(style, d, layers, seq_len, batch, steps, sets):
    cfg = build_config(style, d, layers, seq_len, batch, False, sets)
    cfg.steps = steps
    run, state = make_run(cfg)
    losses, dropped = [], 0.0
    for b in stdlib_batches(steps, batch, seq_len, cfg.model.vocab_size):
        state, m = run.train_step(state, jax.device_put(b))
        losses.append(float(m["loss"]))
        dropped += float(m["dropped_routes"])
    print(f"  {style}:{d}:{layers} {' '.join(sets) or 'defaults'}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
          f"{dropped:.0f} routes dropped", flush=True)
    return losses, dropped


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="k3:128:4,k2:128:4")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--json", default="")
    a = p.parse_args()
    out = {"device": jax.devices()[0].device_kind, "steps": a.steps, "models": {}}
    for spec in a.models.split(","):
        style, d, layers = spec.split(":")
        cfg = build_config(style, int(d), int(layers), a.seq_len, a.batch, False)
        no_drop = cfg.model.moe.n_experts / cfg.model.moe.top_k
        fast, fast_drop = train_losses(style, int(d), int(layers), a.seq_len, a.batch, a.steps,
                                       (f"model.moe.expert_capacity={no_drop}",))
        ref, _ = train_losses(style, int(d), int(layers), a.seq_len, a.batch, a.steps, REFERENCE)
        cap, cap_drop = train_losses(style, int(d), int(layers), a.seq_len, a.batch, a.steps, ())
        diff = np.abs(np.array(fast) - np.array(ref))
        res = {"fast": fast, "reference": ref, "default_capacity": cap, "max_abs_diff": float(diff.max()),
               "max_rel_diff": float((diff / np.abs(ref)).max()), "fast_dropped": fast_drop,
               "default_capacity_dropped": cap_drop,
               "default_capacity_max_abs_diff": float(np.abs(np.array(cap) - np.array(ref)).max())}
        out["models"][spec] = res
        print(f"\n{spec}: step  fast  reference  |diff|   (default capacity: loss, dropped {cap_drop:.0f} routes)")
        for i in range(0, a.steps, max(1, a.steps // 10)):
            print(f"  {i:>4} {fast[i]:.4f} {ref[i]:.4f} {diff[i]:.2e}   {cap[i]:.4f}")
        print(f"  max |diff| {res['max_abs_diff']:.3e} (relative {res['max_rel_diff']:.2e}); "
              f"fast-path drops {fast_drop:.0f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
