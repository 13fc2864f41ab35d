"""What an MoE layer costs in memory and communication (summed by `k3.plan`): the bytes it keeps for
its backward, the expert all-to-all's rows and bytes, its tensor-parallel collectives and its router
bias. Its FLOPs are those of its active parameters (`k3.params` counts top_k of the routed experts).

The formulas sit in a module of their own, beside the layer and expert parallelism rather than in
them, because their readers only do arithmetic on config values: the planner uses them without
building a layer, and a change to the dispatch or the experts finds its cost estimate in the same
package.

Byte formulas read the planner's layout (`k3.plan.Layout`: local tokens, the FFN-width divisors,
the expert-parallel group size P and rows per destination C, the dispatch) and the compute-dtype
bytes ``a``; fp32 values count f = 4 bytes.
"""

from __future__ import annotations

import math

from k3.ffn import glu_bytes
from k3.moe.layer import expert_capacity


def moe_dispatch(moe_cfg) -> str:
    """The all-to-all an expert-parallel MoE layer runs on an accelerator: 'ragged' (only the routed
    rows travel) or 'padded' (fixed [P, C] buffers travel)."""
    # 'auto' picks the ragged all-to-all on GPUs and TPUs (`k3.moe.MoE`), which every device kind
    # of the planner's table is; the emulated ragged exchange moves padded chunks.
    return {"auto": "ragged", "ragged": "ragged"}.get(moe_cfg.ep_dispatch, "padded")


def moe_dispatch_rows(moe_cfg, tokens: int, P: int, capacity_factor: float) -> int:
    """All-to-all rows per destination device, C, for ``tokens`` local tokens over P expert shards:
    0 without expert parallelism (P = 1), N k dropless (capacity_factor <= 0), else
    max(1, ceil(c N k / P)) (`k3.moe.expert_parallel`)."""
    R = tokens * moe_cfg.top_k
    return 0 if P == 1 else (R if capacity_factor <= 0 else max(1, math.ceil(capacity_factor * R / P)))


def moe_residual_bytes(m, lay, a: int, qk_clip: bool) -> tuple[dict, float]:
    """Bytes one MoE layer keeps for its backward pass, per device, and its largest transient:
    ({'moe': bytes}, transient bytes).

    m: the model config; lay: the planner's layout; a: compute-dtype bytes. N local tokens, D =
    d_model, W = latent width (D without a latent), F_e, F_s the routed and shared hidden widths per
    device, E experts, k = top_k, GLU = `k3.ffn.glu_bytes`:
      the input N D a (with a latent or shared expert, whose weight gradients read it); router
      scores N E f; expert side R (2 W a + F_e GLU), R = P C rows received (P = expert shards, C =
      `moe_dispatch_rows`; without expert parallelism `expert_rows`): each row's input and output
      and its hidden activations; the latent up-projection's norm, its input and output
      N W 2a + N f; shared expert N F_s GLU; routing indices and combine weights 8 R + 16 N k + 2 N f.
    This is what the compiled step holds (XLA's buffer assignment for the H200 keeps the experts'
    bf16 output rows, from which the combine gathers). Autodiff's trace instead keeps fp32 copies of
    the router's input and of the gathered outputs [N, k, W] (`moe_traced_extra_bytes`); with that
    difference the formula is within 2% of the traced layer
    (`tests/test_plan.py::test_moe_residuals_are_what_the_traced_layer_keeps`).
    transient: the all-to-all's send and receive buffers, (R + R) W a padded or (N k + R) W a
    ragged (the sorted routes are sent as they are); 0 without expert parallelism. ``qk_clip`` is
    MLA's setting (the planner's per-layer formulas share one signature).
    """
    del qk_clip
    f = 4
    N, D = lay.tokens, m.d_model
    glu = glu_bytes(a)
    e = m.moe
    W = e.latent_dim if e.latent_dim > 0 else D
    Fe = e.expert_dim // lay.expert_mlp_div
    R = expert_rows(m, lay)
    moe = N * e.n_experts * f + R * (2 * W * a + Fe * glu)
    if e.latent_dim > 0 or e.shared_dim > 0:
        moe += N * D * a
    moe += 8 * R + 16 * N * e.top_k + 2 * N * f
    if e.latent_dim > 0:
        moe += N * W * 2 * a + N * f
    if e.shared_dim > 0:
        moe += N * (e.shared_dim // lay.shared_div) * glu
    transient = 0
    if lay.P > 1:
        sent = R if lay.dispatch == "padded" else N * e.top_k
        transient = (sent + R) * W * a
    return {"moe": moe}, transient


def moe_traced_extra_bytes(m, lay, a: int) -> float:
    """Bytes the residuals JAX traces for one MoE layer hold beyond `moe_residual_bytes`, per device:
    the fp32 copies of the router's input N D f and of the gathered routed outputs N k W f, less the
    experts' bf16 output rows R W a that the compiled step keeps in their place."""
    e = m.moe
    W = e.latent_dim if e.latent_dim > 0 else m.d_model
    return float(lay.tokens * (m.d_model + e.top_k * W) * 4 - expert_rows(m, lay) * W * a)


def expert_product_bytes(m, lay, a: int) -> float:
    """Bytes of one MoE layer's named expert products (`k3.ffn.EXPERT_PRODUCTS`), per device, which a
    remat policy in `k3.model.SAVES_EXPERT_PRODUCTS` keeps across the whole forward: the gate and up
    products R F_e a each, R the expert rows (P C received with expert parallelism; E C with the
    'capacity' backend, C = `k3.moe.layer.expert_capacity`; else the N k routes), and the combined
    outputs N k W a."""
    e = m.moe
    W = e.latent_dim if e.latent_dim > 0 else m.d_model
    return float(expert_rows(m, lay) * 2 * (e.expert_dim // lay.expert_mlp_div) * a + lay.tokens * e.top_k * W * a)


def expert_rows(m, lay) -> int:
    """Rows one device's routed experts run per micro-batch: P C received with expert parallelism,
    E C with the 'capacity' backend (C = `k3.moe.layer.expert_capacity`), else the N k routes."""
    e = m.moe
    if lay.P > 1:
        return lay.P * lay.C
    if lay.experts == "capacity":
        return e.n_experts * expert_capacity(lay.tokens * e.top_k, e.n_experts, e.expert_capacity)
    return lay.tokens * e.top_k


def moe_all_to_all_bytes(m, lay, a: int, passes: int) -> float:
    """Bytes one MoE layer's expert all-to-alls send per device per micro-batch over ``passes``
    passes (2: forward and backward; 3 under remat, the forward again): each pass sends rows of
    width W (a bytes) there and back, and each forward pass (passes - 1) the rows' int32 expert ids;
    rows = the padded buffer P C, or with the ragged all-to-all the N k routes (at most P C). The
    remote share is (P - 1) / P under uniform routing."""
    N = lay.tokens
    e = m.moe
    W = e.latent_dim if e.latent_dim > 0 else m.d_model
    n_rows = lay.P * lay.C if lay.dispatch == "padded" else min(N * e.top_k, lay.P * lay.C)
    return (2 * passes * n_rows * W * a + (passes - 1) * n_rows * 4) * (lay.P - 1) / lay.P


def moe_tensor_bytes(m, lay, a: int, tp: int) -> list[float]:
    """Bytes each tensor-parallel collective of one MoE layer sends per device and pass, over a
    tensor group of ``tp`` (all-reduce factor 2 (tp - 1) / tp), in the order the planner adds them:
    the shared expert's output N D a; the latent up-projection's output N D a with the all-gather
    of the latent input N W a (tp - 1) / tp; the routed experts' partial sums N k W a when their
    hidden width is split."""
    N, D = lay.tokens, m.d_model
    e = m.moe
    k, shared, latent = e.top_k, e.shared_dim, e.latent_dim
    W = latent if latent > 0 else D
    ar = 2 * (tp - 1) / tp
    out = []
    if shared > 0:
        out.append(N * D * a * ar)
    if latent > 0:
        out.append(N * D * a * ar + N * W * a * (tp - 1) / tp)
    if lay.expert_mlp_div > 1:
        out.append(N * k * W * a * ar)
    return out


def router_bias_bytes(moe_cfg) -> int:
    """Bytes of one MoE layer's router bias [E] fp32, a variable outside the parameters (the planner
    counts it unsharded)."""
    return moe_cfg.n_experts * 4
