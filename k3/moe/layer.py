"""Mixture of experts: sigmoid router with a selection-only bias; expert matmuls from a backend table.

s = sigmoid(W_r x) (fp32); idx = top_k(s + b); p_i = s_i / sum_idx s * routed_scaling
K2 (plain MoE):   y = sum_i p_i E_i(x) + Shared(x)                     experts at full width D
K3 (LatentMoE):   y = W_up RMSNorm(sum_i p_i E_i(W_down x)) + Shared(x)  experts at latent width

The bias ``b`` is a non-trainable `RouterBias` variable: it only picks experts and is updated
outside the optimizer from the routing statistics each call returns (see `update_router_biases`).
Quantile balancing routes with top-(k+1) so the (k+1)-th biased score gives each token's threshold.

The routed experts' matmuls are an entry of `EXPERT_BACKENDS`, keyed by ``model.moe.expert_impl``:
  'ragged'    dropless: routes sorted by expert through ``jax.lax.ragged_dot`` (CPU/TPU default;
              XLA's GPU lowering computes every row against every expert, E times the work);
  'capacity'  every expert gets C = ceil(expert_capacity N k / E) rows (rounded up to 8); routes past
              an expert's C (in token order) are dropped and counted; the experts then run as one
              batched dense matmul [E, C, W] x [E, W, F] (GPU default: cuBLAS at full rate);
  'dense'     every token through every expert and a one-hot pick: the simple test reference.

Decoding (`MoE.__call__(..., decode=True)`, from `k3.decode`) sees a few tokens a step; with fewer
routes than experts (N k < E) the routes' own experts are read instead, an entry of `DECODE_EXPERTS`
keyed by ``model.moe.decode_impl``:
  'train'     the training backend above (reads every expert's weights each step);
  'gather'    each route's expert weights gathered by XLA, then per-route matrix-vector products
              (the portable form; XLA writes the gathered weights and reads them again);
  'pallas'    `pallas_kernels.moe_decode.routed_glu`: each route reads its expert's weights once
              (widths that are not powers of two take 'gather'; interpreted off the GPU);
  'grouped'   `pallas_kernels.moe_decode.grouped_glu`: routes grouped by expert, each routed expert's
              weights read once for all its routes, as tensor-core tile products (same fallbacks);
  'grouped_fused'  the same in one kernel (`grouped_glu_fused`), no hidden activations in memory.
'auto' is 'grouped' on a GPU (its equality tests pass compiled on an H100), 'train' elsewhere.
A decoding call with N k >= E routes (e.g. verifying a speculative draft, or batch 64) runs the training
backend; with at most `DROPLESS_DECODE_TOKENS` tokens the 'capacity' backend then gets C >= N rows per
expert, so it drops nothing (top-k experts are distinct, so no expert gets more than N routes). The
backends in `ANY_ROUTES_DECODE` (the grouped ones, which read each expert once whatever its routes) take such
calls of at most that many tokens themselves, without the capacity backend's sort and scatter.
Those decoding calls pick their experts with an entry of `DECODE_ROUTERS` (``model.moe.decode_route_impl``:
'xla', or 'pallas', `pallas_kernels.moe_route`'s kernel; 'auto': 'pallas' on a GPU), the same selection
as `MoE.route`'s.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from k3.moe import balancing
from k3.backends import Table, platform
from k3.moe.expert_parallel import combine_routes, routed_experts_sharded
from k3.ffn import EXPERT_PRODUCTS, GLUMLP, glu_activation, glu_parts_output
from k3.nn import FUSED_INPUTS, RMSNorm, cast, normal, param, weight_einsum
from k3.sharding import Sharder


class RouterBias(nnx.Variable):
    """Per-expert selection bias [E] (fp32), updated outside the optimizer."""


EXPERT_BACKENDS = Table("model.moe.expert_impl", default="ragged", auto={"gpu": "capacity"})

# A decoding call of at most this many tokens N runs 'capacity' dropless (C = N rows per expert). Its
# [E, N, W] x [E, W, F] matmuls do N FLOPs per weight byte, below the bf16 FLOP/byte ridge of current
# accelerators (about 200-300: H100, H200, TPU v5), so they cost about the one read of every expert's
# weights that the capacity pass makes anyway. Longer calls (prompts) keep the training capacity.
DROPLESS_DECODE_TOKENS = 128


@EXPERT_BACKENDS.register("ragged")
def ragged_experts(x_ND, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD, activation, betas, capacity=0.0):
    """Dropless expert FFN: each token row through each of its k experts, sorted into groups.

    x: [N, D]; idx: [N, k] expert ids; weights [E, D, F] / [E, F, D]. Returns ([N, k, D] in
    x.dtype, dropped routes = 0); ``capacity`` is unused.
    """
    del capacity
    N, k = idx_Nk.shape
    E = w_gate_EDF.shape[0]
    flat_expert = idx_Nk.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    token_of = order // k
    x_sorted = x_ND[token_of]
    group_sizes = jnp.bincount(flat_expert, length=E).astype(jnp.int32)
    gate = checkpoint_name(jax.lax.ragged_dot(x_sorted, w_gate_EDF, group_sizes), EXPERT_PRODUCTS)
    up = checkpoint_name(jax.lax.ragged_dot(x_sorted, w_up_EDF, group_sizes), EXPERT_PRODUCTS)
    h = glu_activation(gate, up, activation, *betas)
    out_sorted = jax.lax.ragged_dot(h, w_down_EFD, group_sizes)
    # Gather back through the inverse permutation: cheaper to differentiate than a scatter.
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return checkpoint_name(out_sorted[inverse].reshape(N, k, -1), EXPERT_PRODUCTS), jnp.zeros((), jnp.int32)


def expert_capacity(n_routes: int, n_experts: int, factor: float) -> int:
    """Rows per expert of the 'capacity' backend: ceil(factor * n_routes / E), rounded up to 8."""
    return max(8, -(-math.ceil(factor * n_routes / n_experts) // 8) * 8)


def capacity_slots(idx_Nk: jax.Array, n_experts: int, capacity: int):
    """Where each route goes in the [E * C] expert buffer: (slot [N k] int32, E*C when dropped;
    route per slot [E * C] int32, N k when the slot is empty). Routes keep token order per expert."""
    flat = idx_Nk.reshape(-1)
    R = flat.shape[0]
    order = jnp.argsort(flat, stable=True)
    e_sorted = flat[order]
    counts = jnp.bincount(flat, length=n_experts)
    starts = (jnp.cumsum(counts) - counts).astype(jnp.int32)
    pos_sorted = jnp.arange(R, dtype=jnp.int32) - starts[e_sorted]
    slot_sorted = jnp.where(pos_sorted < capacity, e_sorted * capacity + pos_sorted, n_experts * capacity)
    slot = jnp.zeros((R,), jnp.int32).at[order].set(slot_sorted)
    route_of_slot = jnp.full((n_experts * capacity + 1,), R, jnp.int32).at[slot].set(
        jnp.arange(R, dtype=jnp.int32))[:-1]
    return slot, route_of_slot


@jax.custom_vjp
def gather_rows(x_MD: jax.Array, index_R: jax.Array, inverse_MJ: jax.Array) -> jax.Array:
    """Rows of x with a zero row appended: out[r] = x[index[r]], zeros where index[r] == M. [R, D].

    ``inverse`` [M, J] lists the output rows that read each input row (R where fewer than J do), so
    the gradient is a gather and a J-term sum, dx[m] = sum_j dout[inverse[m, j]], instead of the
    scatter-add that differentiating an indexing op produces (atomics on a GPU).
    """
    x_pad = jnp.concatenate([x_MD, jnp.zeros((1, x_MD.shape[1]), x_MD.dtype)], axis=0)
    return x_pad[index_R]


def _gather_rows_fwd(x_MD, index_R, inverse_MJ):
    return gather_rows(x_MD, index_R, inverse_MJ), (index_R, inverse_MJ)


def _gather_rows_bwd(res, dout_RD):
    index_R, inverse_MJ = res
    d_pad = jnp.concatenate([dout_RD, jnp.zeros((1, dout_RD.shape[1]), dout_RD.dtype)], axis=0)
    dx = jnp.sum(d_pad[inverse_MJ].astype(jnp.float32), axis=1).astype(dout_RD.dtype)
    return dx, None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


@EXPERT_BACKENDS.register("capacity")
def capacity_experts(x_ND, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD, activation, betas, capacity=1.25):
    """Expert FFN with a fixed number of rows per expert, as batched dense matmuls.

    x: [N, D]; idx: [N, k]; weights [E, D, F] / [E, F, D]; ``capacity``: rows per expert as a multiple
    of the mean load N k / E (`expert_capacity`). Returns ([N, k, D] in x.dtype, zero for dropped
    routes; the number of dropped routes, int32). Both data movements and their gradients are
    gathers (`gather_rows`): slots and routes are a matching, so each side inverts the other.
    """
    N, k = idx_Nk.shape
    E = w_gate_EDF.shape[0]
    C = expert_capacity(N * k, E, capacity)
    slot, route_of_slot = capacity_slots(idx_Nk, E, C)
    # Dispatch: slot s reads token route_of_slot[s] // k (N: empty); token n feeds slots slot[n, :].
    xs = gather_rows(x_ND, route_of_slot // k, slot.reshape(N, k)).reshape(E, C, -1)
    gate = checkpoint_name(weight_einsum("ecd,edf->ecf", xs, w_gate_EDF), EXPERT_PRODUCTS)
    up = checkpoint_name(weight_einsum("ecd,edf->ecf", xs, w_up_EDF), EXPERT_PRODUCTS)
    out = weight_einsum("ecf,efd->ecd", glu_activation(gate, up, activation, *betas), w_down_EFD)
    # Combine: route r reads slot[r] (E*C: dropped); slot s feeds route route_of_slot[s] (N k: none).
    y = gather_rows(out.reshape(E * C, -1), slot, route_of_slot[:, None])
    dropped = jnp.sum(slot == E * C).astype(jnp.int32)
    return checkpoint_name(y.reshape(N, k, -1), EXPERT_PRODUCTS), dropped


@EXPERT_BACKENDS.register("dense")
def dense_experts(x_ND, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD, activation, betas, capacity=0.0):
    """Test reference for `ragged_experts`: every token through every expert, then a one-hot pick."""
    del capacity
    gate = jnp.einsum("nd,edf->nef", x_ND, w_gate_EDF)
    up = jnp.einsum("nd,edf->nef", x_ND, w_up_EDF)
    out = jnp.einsum("nef,efd->ned", glu_activation(gate, up, activation, *betas), w_down_EFD)
    onehot = jax.nn.one_hot(idx_Nk, w_gate_EDF.shape[0], dtype=out.dtype)  # [N, k, E]
    return jnp.einsum("nke,ned->nkd", onehot, out), jnp.zeros((), jnp.int32)


# 'auto' is 'grouped' on a GPU: its tests (tests/test_moe_decode.py) pass compiled on an H100, and there
# (`experiments.bench_decode --moe_decode=grouped|pallas`, K3 d_model 1024, 16 layers, batch 8, 4K
# context) the step took 1.44 / 1.56 ms; it also takes the calls with N k >= E routes, which 'pallas'
# leaves to the training backend.
DECODE_EXPERTS = Table("model.moe.decode_impl", default="train", auto={"gpu": "grouped"})
DECODE_EXPERTS.register("train")(None)  # the training backend (`EXPERT_BACKENDS`) itself
FUSED_OUTPUTS = "w_out"  # `MoE.fuse_outputs`' stacked output matrix, an attribute only served models have

# Decode backends that also take calls with N k >= E routes (of at most `DROPLESS_DECODE_TOKENS` tokens,
# at widths their kernels take): one pass per expert however many routes it has, so nothing drops.
ANY_ROUTES_DECODE = {"grouped", "grouped_fused"}

# A decoding call's routing, keyed by ``model.moe.decode_route_impl``:
#   'xla'     `MoE.route`'s ops (the router GEMM, its partial sums with the sigmoid, a top-k sort, a slice
#             and a gather: five launches per layer on a GPU);
#   'pallas'  after the router GEMM, `pallas_kernels.moe_route`'s one kernel for the rest (shapes it
#             does not take use 'xla').
# An entry maps (the router's fp32 logits in the first E columns of [N, C >= E] (`MoE.project_inputs`),
# bias [E], k, scaling) to (idx [N, k] int32, weights [N, k] fp32), the selection of `MoE.route`
# without the balancing threshold. 'auto' is 'pallas' on a GPU: its tests (tests/test_moe_route.py)
# pass compiled on an H100, and there (`experiments.bench_decode --set=model.moe.decode_route_impl=...`,
# the model above with 'grouped' experts) the step took 1.35 / 1.42 ms with 'pallas' / 'xla'.
DECODE_ROUTERS = Table("model.moe.decode_route_impl", default="xla", auto={"gpu": "pallas"})


def router_logits(x_ND: jax.Array, w_router_DE: jax.Array) -> jax.Array:
    """The router's logits [N, E], in fp32 (products of the stored values are exact there)."""
    return x_ND.astype(jnp.float32) @ w_router_DE.astype(jnp.float32)


def combine_weights(scores_NE: jax.Array, idx_Nk: jax.Array, scaling: float) -> jax.Array:
    """The picked experts' scores [N, k] normalised to sum to ``scaling`` per token (fp32)."""
    picked = jnp.take_along_axis(scores_NE, idx_Nk, axis=-1)
    return picked / (jnp.sum(picked, axis=-1, keepdims=True) + 1e-20) * scaling


@DECODE_ROUTERS.register("xla")
def xla_route(logits_NC, bias_E, k, scaling):
    """`MoE.route`'s selection and combine weights."""
    scores = jax.nn.sigmoid(logits_NC[:, :bias_E.shape[0]])
    idx, _ = balancing.topk_route(scores, bias_E, k)
    return idx, combine_weights(scores, idx, scaling)


@DECODE_ROUTERS.register("pallas")
def pallas_route(logits_NC, bias_E, k, scaling):
    """`pallas_kernels.moe_route.route_topk` on the logits (it reads the first E columns of a wider
    array in place); shapes it does not take use `xla_route`."""
    from pallas_kernels.moe_route import route_topk, route_topk_supported

    if route_topk_supported(logits_NC.shape[0], bias_E.shape[0], k):
        return route_topk(logits_NC, bias_E, k, scaling)
    return xla_route(logits_NC, bias_E, k, scaling)


@DECODE_EXPERTS.register("gather")
def gathered_experts(x_ND, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD, activation, betas):
    """Each route through its own expert, weights gathered per route: ([N, k, D] in x.dtype).

    x: [N, D]; idx: [N, k]; weights [E, D, F] / [E, F, D]. Reads N k experts' weights (for decoding,
    where N k < E), at the cost of writing and reading the gathered copy."""
    N, k = idx_Nk.shape
    flat = idx_Nk.reshape(-1)
    x = jnp.repeat(x_ND, k, axis=0)
    gate = jnp.einsum("rd,rdf->rf", x, w_gate_EDF[flat])
    up = jnp.einsum("rd,rdf->rf", x, w_up_EDF[flat])
    h = glu_activation(gate, up, activation, *betas)
    return jnp.einsum("rf,rfd->rd", h, w_down_EFD[flat]).reshape(N, k, -1)


@DECODE_EXPERTS.register("pallas")
def pallas_routed_experts(x_ND, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD, activation, betas):
    """`gathered_experts` as `pallas_kernels.moe_decode.routed_glu` (each route reads its expert's
    weights in place); widths that are not powers of two >= 16 take `gathered_experts`."""
    from pallas_kernels.moe_decode import routed_glu, routed_glu_supported

    _, D, F = w_gate_EDF.shape
    if not routed_glu_supported(D, F):
        return gathered_experts(x_ND, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD, activation, betas)
    N, k = idx_Nk.shape
    act = functools.partial(glu_parts_output, kind=activation, beta_gate=betas[0], beta_up=betas[1])
    y = routed_glu(jnp.repeat(x_ND, k, axis=0), idx_Nk.reshape(-1), w_gate_EDF, w_up_EDF, w_down_EFD, act=act)
    return y.reshape(N, k, -1)


@DECODE_EXPERTS.register("grouped")
def grouped_routed_experts(x_ND, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD, activation, betas):
    """`gathered_experts` as `pallas_kernels.moe_decode.grouped_glu` (each routed expert's weights read
    once for all its routes); widths that are not powers of two >= 16 take `gathered_experts`."""
    from pallas_kernels.moe_decode import grouped_glu, routed_glu_supported

    _, D, F = w_gate_EDF.shape
    if not routed_glu_supported(D, F):
        return gathered_experts(x_ND, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD, activation, betas)
    act = functools.partial(glu_parts_output, kind=activation, beta_gate=betas[0], beta_up=betas[1])
    return grouped_glu(x_ND, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD, act=act)


@DECODE_EXPERTS.register("grouped_fused")
def grouped_fused_routed_experts(x_ND, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD, activation, betas):
    """'grouped' as one kernel, `pallas_kernels.moe_decode.grouped_glu_fused` (both projections in each
    program) up to its `FUSED_MAX_TOKENS` tokens, `grouped_glu` above; same fallback."""
    from pallas_kernels.moe_decode import FUSED_MAX_TOKENS, grouped_glu, grouped_glu_fused, routed_glu_supported

    _, D, F = w_gate_EDF.shape
    if not routed_glu_supported(D, F):
        return gathered_experts(x_ND, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD, activation, betas)
    act = functools.partial(glu_parts_output, kind=activation, beta_gate=betas[0], beta_up=betas[1])
    glu = grouped_glu_fused if x_ND.shape[0] <= FUSED_MAX_TOKENS else grouped_glu
    return glu(x_ND, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD, act=act)


class MoE(nnx.Module):
    """Routed experts (+ optional latent projection) + shared experts. x: [B, T, D] -> [B, T, D]."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, sharder: Sharder | None = None):
        e = cfg.moe
        D, E = cfg.d_model, e.n_experts
        self.sharder, self.capacity_factor = sharder, e.capacity_factor
        self.ep_dispatch = e.ep_dispatch
        if self.ep_dispatch == "auto":
            self.ep_dispatch = "ragged" if platform() in ("gpu", "tpu") else "padded"
        self.n_experts, self.top_k, self.scaling = E, e.top_k, e.routed_scaling
        self.balancer, self.hist_bins = balancing.BALANCERS.get(e.balancing), e.hist_bins
        self.activation, self.betas = cfg.activation, (cfg.situ_beta_gate, cfg.situ_beta_up)
        self.dtype = jnp.dtype(cfg.dtype)
        self.experts = EXPERT_BACKENDS.get(e.expert_impl)
        self.decode_experts = DECODE_EXPERTS.get(e.decode_impl)
        self.decode_any_routes = DECODE_EXPERTS.resolve(e.decode_impl) in ANY_ROUTES_DECODE
        self.decode_route = DECODE_ROUTERS.get(e.decode_route_impl)
        self.expert_capacity = e.expert_capacity
        init = normal(cfg.init_std)
        self.router = param(rngs, init, (D, E), ("embed", "experts"))
        self.router_bias = RouterBias(jnp.zeros((E,), jnp.float32), out_sharding=("experts",))
        width = e.latent_dim if e.latent_dim > 0 else D
        if e.latent_dim > 0:
            self.w_down_latent = param(rngs, init, (D, width), ("embed", "latent"))
            self.latent_norm = RMSNorm(width, cfg.norm_eps, rngs=rngs)
            self.w_up_latent = param(rngs, init, (width, D), ("latent", "embed"))
        else:
            self.w_down_latent = self.latent_norm = self.w_up_latent = None
        self.w_gate = param(rngs, init, (E, width, e.expert_dim), ("experts", "expert_embed", "expert_mlp"))
        self.w_up = param(rngs, init, (E, width, e.expert_dim), ("experts", "expert_embed", "expert_mlp"))
        self.w_down = param(rngs, init, (E, e.expert_dim, width), ("experts", "expert_mlp", "expert_embed"))
        self.shared = (GLUMLP(D, e.shared_dim, activation=cfg.activation, init_std=cfg.init_std,
                              dtype=self.dtype, rngs=rngs, beta_gate=cfg.situ_beta_gate,
                              beta_up=cfg.situ_beta_up) if e.shared_dim > 0 else None)

    def route(self, x_ND: jax.Array, logits_NE: jax.Array | None = None):
        """Router: (expert ids [N, k], combine weights [N, k] fp32, scores [N, E], alpha [N] or None),
        from x [N, D], or from its fp32 logits [N, E] when they are given (`project_inputs`)."""
        scores = jax.nn.sigmoid(router_logits(x_ND, self.router[...]) if logits_NE is None else logits_NE)
        bias = jax.lax.stop_gradient(self.router_bias[...])
        idx, alpha = balancing.topk_route(jax.lax.stop_gradient(scores), bias, self.top_k,
                                          extra=self.balancer.extra_routes)
        return idx, combine_weights(scores, idx, self.scaling), scores, alpha

    def __call__(self, x_BTD: jax.Array, decode: bool = False):
        """y [B, T, D] and routing statistics {'load': [E] token counts, 'balance': see `stats`}.

        decode: a decoding step (`k3.decode`): with fewer routes than experts the `DECODE_EXPERTS`
        backend runs the routed experts."""
        B, T, D = x_BTD.shape
        x = x_BTD.reshape(B * T, D).astype(self.dtype)
        h, shared_hidden, logits = self.project_inputs(x)
        idx, weights, scores, alpha = self.route(x, logits[:, :self.n_experts])
        w_gate, w_up, w_down = (cast(w, self.dtype) for w in (self.w_gate, self.w_up, self.w_down))
        if self.sharder is not None:
            y, stats = self._routed_sharded(h, idx, weights, scores, alpha, (B, T), w_gate, w_up, w_down)
        else:
            stats = self.stats(idx, scores, alpha)
            with jax.named_scope("routed_experts"):
                if decode and self._decode_backend_takes(idx.shape[0], idx.size, w_gate.shape[1:]):
                    # The same selection as `route`'s (whose XLA ops then only feed the unused statistics).
                    idx, weights = self.decode_route(logits, jax.lax.stop_gradient(self.router_bias[...]),
                                                     self.top_k, self.scaling)
                    out_NkL = self.decode_experts(h, idx, w_gate, w_up, w_down, self.activation, self.betas)
                    dropped = jnp.zeros((), jnp.int32)
                else:
                    out_NkL, dropped = self.experts(h, idx, w_gate, w_up, w_down, self.activation, self.betas,
                                                    self.capacity(idx.shape[0], decode))
            stats["dropped"] = dropped.astype(jnp.float32)
            y = combine_routes(out_NkL, weights)
        y = y.astype(self.dtype)
        if self.shared is not None and shared_hidden is None:
            shared_hidden = self.shared.hidden(x)
        fused = getattr(self, FUSED_OUTPUTS, None)
        if fused is not None:  # served: [norm(y) | shared hidden] times one stacked matrix (`fuse_outputs`)
            z = jnp.concatenate([self.latent_norm(y), shared_hidden.astype(self.dtype)], axis=-1)
            return (z @ cast(fused, self.dtype)).reshape(B, T, D), stats
        if self.w_up_latent is not None:
            y = self.latent_norm(y) @ cast(self.w_up_latent, self.dtype)
        if self.shared is not None:
            y = y + self.shared.down(shared_hidden)
        return y.reshape(B, T, D), stats

    def project_inputs(self, x_ND: jax.Array):
        """(the experts' input h [N, W] (x itself without a latent space), the shared experts' hidden
        act(x W_gate, x W_up) [N, F_s] or None, fp32 [N, C >= E] whose first E columns are the router's
        logits) of x [N, D] in the compute dtype. With `fuse_inputs`' matrix the three come from one
        matmul, whose whole output is the third (the routing kernel reads its first columns in place);
        None for the shared hidden then means the layer has no shared experts, else that the caller
        forms it."""
        fused = getattr(self, FUSED_INPUTS, None)
        if fused is None:
            h = x_ND if self.w_down_latent is None else x_ND @ cast(self.w_down_latent, self.dtype)
            return h, None, router_logits(x_ND, self.router[...])
        E = self.n_experts
        if jnp.dtype(fused.dtype) == self.dtype or self.dtype == jnp.float32:
            # Stored in the compute dtype, the router's products are the stored values' exact products
            # in fp32 either way, so one matmul with fp32 outputs gives every column.
            logits = jnp.dot(x_ND, cast(fused, self.dtype), preferred_element_type=jnp.float32)
            z = logits[:, E:]
        else:  # stored wider (fp32 weights, bf16 compute): the router reads its columns unrounded
            logits = router_logits(x_ND, fused[:, :E])
            z = jnp.dot(x_ND, cast(fused[:, E:], self.dtype), preferred_element_type=jnp.float32)
        L, F = self.fused_widths  # z: [latent | shared gate | shared up]
        h = x_ND if L == 0 else z[:, :L].astype(self.dtype)
        if F == 0:
            return h, None, logits
        gate, up = z[:, L:L + F].astype(self.dtype), z[:, L + F:L + 2 * F].astype(self.dtype)
        return h, glu_activation(gate, up, self.activation, *self.betas), logits

    def fuse_inputs(self) -> None:
        """For serving (`k3.model.served`): the matrices that read the layer's input, the router [D, E],
        the latent down-projection [D, L] (if any) and the shared experts' gate and up [D, F_s] (if any),
        stacked in that order into one [D, E + L + 2 F_s] parameter `FUSED_INPUTS`, in place, so the
        router is not a matmul launch of its own at each decoding step (compiled for an H100, K3 d_model
        1024 with 15 MoE layers: 322 -> 307 kernels a step at batch 8). Its logits stay fp32 from the
        stored values (`project_inputs`). A layer with neither a latent space nor shared experts is left
        as it is; inference only, as `fuse_outputs`."""
        if getattr(self, FUSED_INPUTS, None) is not None or (self.w_down_latent is None and self.shared is None):
            return
        parts = [self.router[...]] + ([] if self.w_down_latent is None else [self.w_down_latent[...]])
        if self.shared is not None:
            parts += [self.shared.w_gate[...], self.shared.w_up[...]]
        dtype = jnp.result_type(*parts)
        setattr(self, FUSED_INPUTS, nnx.Param(jnp.concatenate([p.astype(dtype) for p in parts], axis=1),
                                              out_sharding=("embed", None)))
        self.fused_widths = (0 if self.w_down_latent is None else self.w_down_latent.shape[1],
                             0 if self.shared is None else self.shared.w_gate.shape[1])
        self.w_down_latent = self.router = None
        if self.shared is not None:
            self.shared.w_gate = self.shared.w_up = None

    def fuse_outputs(self) -> None:
        """For serving (`k3.model.served`): the latent up-projection [L, D] and the shared experts'
        down-projection [F_s, D] stacked into one [L + F_s, D] parameter `FUSED_OUTPUTS`, in place, so
        the layer's two output matmuls and their sum are one matmul over [norm(y) | shared hidden]
        (compiled for an H100 at batch 8: 3 kernels instead of 5). A layer without a latent space or
        shared experts is left as it is. Training the stacked matrix would orthogonalise it as one
        under Muon, so it is for inference only."""
        if self.w_up_latent is None or self.shared is None or getattr(self, FUSED_OUTPUTS, None) is not None:
            return
        stacked = jnp.concatenate([self.w_up_latent[...], self.shared.w_down[...]], axis=0)
        setattr(self, FUSED_OUTPUTS, nnx.Param(stacked, out_sharding=(None, "embed")))
        self.w_up_latent = None
        self.shared.w_down = None

    def _decode_backend_takes(self, n_tokens: int, n_routes: int, expert_DF: tuple[int, int]) -> bool:
        """Whether the `DECODE_EXPERTS` backend runs a decoding call's routed experts: with fewer routes
        than experts, or for `ANY_ROUTES_DECODE` backends with at most `DROPLESS_DECODE_TOKENS` tokens."""
        if self.decode_experts is None:
            return False
        if n_routes < self.n_experts:
            return True
        from pallas_kernels.moe_decode import routed_glu_supported

        return (self.decode_any_routes and n_tokens <= DROPLESS_DECODE_TOKENS
                and routed_glu_supported(*expert_DF))

    def capacity(self, n_tokens: int, decode: bool) -> float:
        """The 'capacity' backend's factor for a call of ``n_tokens``: the configured one, or for a
        decoding call of at most `DROPLESS_DECODE_TOKENS` tokens one whose C (`expert_capacity`) is at
        least ``n_tokens``, the most routes one expert can get."""
        if decode and n_tokens <= DROPLESS_DECODE_TOKENS:
            return max(self.expert_capacity, self.n_experts / self.top_k)
        return self.expert_capacity

    def _routed_sharded(self, h_NW, idx_Nk, weights_Nk, scores_NE, alpha_N, bt, w_gate, w_up, w_down):
        """Expert-parallel routed experts on the mesh; statistics summed over the devices."""
        B, T = bt
        to_bt = lambda a: a.reshape((B, T) + a.shape[1:])  # noqa: E731
        bias = jax.lax.stop_gradient(self.router_bias[...])
        E, bins, rule = self.n_experts, self.hist_bins, self.balancer
        if rule.balance is not None and rule.summable:  # per device, summed with the loads
            def stats_fn(idx, scores, alpha):
                return {"load": balancing.expert_load(idx, E),
                        "balance": rule.balance(scores, alpha, bias, self.top_k, bins)}
            stats_inputs = (to_bt(jax.lax.stop_gradient(scores_NE)), to_bt(alpha_N))
        else:
            def stats_fn(idx):
                return {"load": balancing.expert_load(idx, E)}
            stats_inputs = ()
        y, dropped, stats = routed_experts_sharded(
            self.sharder, to_bt(h_NW), to_bt(idx_Nk), to_bt(weights_Nk), w_gate, w_up, w_down,
            activation=self.activation, betas=self.betas, capacity_factor=self.capacity_factor,
            stats_fn=stats_fn, stats_inputs=stats_inputs, dispatch=self.ep_dispatch)
        if rule.balance is not None and not rule.summable:  # e.g. the exact quantile: every token at once
            stats["balance"] = rule.balance(jax.lax.stop_gradient(scores_NE), alpha_N, bias, self.top_k, bins)
        stats["dropped"] = dropped.astype(jnp.float32)
        return y.reshape(B * T, -1), stats

    def stats(self, idx_Nk, scores_NE, alpha_N) -> dict:
        """Statistics for the bias update: 'load' [E] always; 'balance' when the rule has one
        (`k3.moe.balancing.Balancer`): the QB histogram [E, bins] int32 ('quantile_hist', summable over
        micro-batches and devices) or the exact QB bias [E] ('quantile')."""
        out = {"load": balancing.expert_load(idx_Nk, self.n_experts)}
        if self.balancer.balance is not None:
            out["balance"] = self.balancer.balance(jax.lax.stop_gradient(scores_NE), alpha_N,
                                                   jax.lax.stop_gradient(self.router_bias[...]), self.top_k,
                                                   self.hist_bins)
        return out


def new_bias(bias_E, stats: dict, moe_cfg, n_tokens) -> jax.Array:
    """The next step's router bias [E] for one MoE layer from its statistics (see `MoE.stats`)."""
    return balancing.BALANCERS.get(moe_cfg.balancing).update(bias_E, stats, moe_cfg, n_tokens)
