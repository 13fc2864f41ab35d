"""Parameter and FLOP accounting from abstract shapes (nothing is allocated).

    python -m launch.params --config=experiments/configs/k3_full.py

prints one JSON object (`report`). Conventions (the K3 spec table's): ``active_params`` counts everything a
token touches except the input-embedding table: all non-routed weights, the LM head, and top_k of
the n_experts routed experts per MoE layer. FLOPs per token for training (forward + backward =
3 x forward, a multiply-add = 2):
  ``6N``   6 x non-embedding active parameters (N excludes the embedding table and the LM head);
  ``full`` 6 x (N + LM head) plus 3 x the forward cost of causal softmax attention
           (H T (d_qk + d_v) per MLA layer at context T, causal-halved; `k3.mla.cost.mla_flops`), the
           chunked KDA core per head (6KV + 2C(K+V) + 2CV + 2.5CK + 2C^2/3 at chunk C; kda_kernels.md
           A.7; `k3.kda.cost.kda_flops`) and the AttnRes depth mixes (6 M D for M candidates;
           `k3.attn_res.attn_res_flops`).
Each mechanism owns its formula; `flops_per_token` adds them up over the layer kinds.
"""

from __future__ import annotations

import contextlib
import copy
import math

from flax import nnx

from k3.attn_res import attn_res_flops
from k3.config import layer_kinds, validate
from k3.kda.cost import kda_flops
from k3.mla.cost import mla_flops
from k3.model import Model
from k3.moe.layer import MoE

ROUTED = ("w_gate", "w_up", "w_down")


def abstract_model(model_cfg) -> nnx.Module:
    """The model with ShapeDtypeStruct leaves, built through ``nnx.eval_shape``. Kernel choices do not
    change parameter shapes, so they are built as 'auto': a config that names a GPU-only kernel can
    be counted and planned on any machine."""
    model_cfg = copy.deepcopy(model_cfg)
    with model_cfg.unlocked() if hasattr(model_cfg, "unlocked") else contextlib.nullcontext():
        model_cfg.mla.attention_impl = model_cfg.kda.impl = model_cfg.moe.expert_impl = "auto"
    return nnx.eval_shape(lambda: Model(model_cfg, rngs=nnx.Rngs(0)))


def count_params(model_cfg) -> dict:
    """Parameter counts by category for a model config (see the module docstring)."""
    model = abstract_model(model_cfg)
    total = embed = head = routed = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        size = math.prod(var.shape)
        total += size
        if path == ("embed",):
            embed += size
        elif path == ("lm_head",):
            head += size
    for _, node in nnx.iter_graph(model):
        if isinstance(node, MoE):
            routed += sum(math.prod(getattr(node, name).shape) for name in ROUTED)
    e = model_cfg.moe
    routed_active = routed * e.top_k / e.n_experts
    active = total - embed - routed + routed_active
    return {
        "total_params": int(total),
        "active_params": int(round(active)),
        "non_embedding_active_params": int(round(active - head)),
        "embedding_params": int(embed),
        "lm_head_params": int(head),
        "routed_expert_params": int(routed),
        "routed_active_params": int(round(routed_active)),
    }


def flops_per_token(model_cfg, seq_len: int, counts: dict | None = None) -> dict:
    """Training FLOPs per token under the ``6N`` and ``full`` conventions, plus the forward terms."""
    counts = counts or count_params(model_cfg)
    n = counts["non_embedding_active_params"]
    kinds = layer_kinds(model_cfg)
    n_mla = sum(m == "mla" for m, _ in kinds)
    n_kda = len(kinds) - n_mla
    attn_fwd = mla_flops(model_cfg.mla, seq_len, n_mla)
    kda_fwd = kda_flops(model_cfg.kda, n_kda)
    res_fwd = attn_res_flops(model_cfg)
    full = 6 * (n + counts["lm_head_params"]) + 3 * (attn_fwd + kda_fwd + res_fwd)
    return {
        "6N": float(6 * n),
        "full": float(full),
        "forward_attention": float(attn_fwd),
        "forward_kda_core": float(kda_fwd),
        "forward_attn_res": float(res_fwd),
    }


def report(cfg, seq_len: int | None = None) -> dict:
    """Counts and FLOPs for a full config (model + data sections)."""
    validate(cfg)
    seq_len = seq_len or cfg.data.seq_len
    counts = count_params(cfg.model)
    return {"name": cfg.name, **counts, "seq_len": seq_len,
            "flops_per_token": flops_per_token(cfg.model, seq_len, counts)}
