"""Decode-cache bytes of the full K3 and K2 shapes and of an all-MLA model of K3's depth.

    python -m experiments.cache_size [--contexts=8192,131072,1048576] [--batch=1]

From abstract shapes (`k3.decode.init_cache` under `jax.eval_shape`, nothing allocated): per
context length, the bytes that grow with the context (MLA latents: kv_lora + rope values per token
per MLA layer) and the fixed part (KDA states [H, K, V] in fp32 and the conv rings), in the model's
compute dtype for the latents. The K3 growth should be about a quarter of the all-MLA model's:
24 of its 93 layers are MLA.
"""

from __future__ import annotations

import argparse
import math

import jax
from flax import nnx

from k3 import decode
from k3.config import layer_kinds
from k3.params import abstract_model

GIB = 1024 ** 3


def cache_bytes(model_cfg, context: int, batch: int = 1) -> dict:
    """{'fixed', 'per_token', 'total'} bytes of the decode cache of ``batch`` rows at ``context`` tokens."""
    model = abstract_model(model_cfg)
    graphdef, state = nnx.split(model)

    def build(max_len):
        return decode.init_cache(nnx.merge(graphdef, state), batch, max_len)

    def split_bytes(cache):
        fixed = grow = 0
        for path, x in jax.tree_util.tree_flatten_with_path(cache)[0]:
            name = path[-1].key if hasattr(path[-1], "key") else ""
            b = math.prod(x.shape) * x.dtype.itemsize
            if name in ("c_kv", "k_rope"):
                grow += b
            else:
                fixed += b
        return fixed, grow

    fixed, grow = split_bytes(jax.eval_shape(lambda: build(context)))
    return {"fixed": fixed, "per_token": grow / (context * batch), "total": fixed + grow}


def _configs():
    from experiments.configs import k2_full, k3_full

    k3 = k3_full.get_config().model
    all_mla = k3_full.get_config().model
    all_mla.mixer = "mla"
    return [("K3 (69 KDA + 24 MLA)", k3), ("all-MLA, K3 depth (93 MLA)", all_mla),
            ("K2 (61 MLA)", k2_full.get_config().model)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="8192,131072,1048576")
    p.add_argument("--batch", type=int, default=1)
    a = p.parse_args(argv)
    contexts = [int(x) for x in a.contexts.split(",")]
    rows = []
    for name, cfg in _configs():
        kinds = layer_kinds(cfg)
        n_mla = sum(m == "mla" for m, _ in kinds)
        per = [cache_bytes(cfg, t, a.batch) for t in contexts]
        rows.append((name, n_mla, len(kinds), per))
    head = "".join(f"{f'{t // 1024}K total GiB':>17}" for t in contexts)
    print(f"{'model':<28}{'MLA/layers':>11}{'bytes/token':>13}{'fixed MiB':>11}{head}")
    for name, n_mla, n, per in rows:
        print(f"{name:<28}{f'{n_mla}/{n}':>11}{per[0]['per_token']:>13,.0f}{per[0]['fixed'] / 2 ** 20:>11.1f}"
              + "".join(f"{x['total'] / GIB:>17.3f}" for x in per))
    k3, mla = rows[0][3][0], rows[1][3][0]
    print(f"\nK3 cache growth per token / all-MLA's: {k3['per_token'] / mla['per_token']:.4f} "
          f"(MLA layers {rows[0][1]}/{rows[1][1]} = {rows[0][1] / rows[1][1]:.4f})")
    for i, t in enumerate(contexts):
        print(f"K3 total / all-MLA total at {t // 1024}K: {rows[0][3][i]['total'] / rows[1][3][i]['total']:.4f}")


if __name__ == "__main__":
    main()
