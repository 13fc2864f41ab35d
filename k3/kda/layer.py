"""Kimi Delta Attention layer (K3's linear-attention token mixer).

q, k = L2Norm(SiLU(ShortConv(W x))), v = SiLU(ShortConv(W_v x))     depthwise causal conv, width 4
z    = W_fb W_fa x + dt_bias                                          low-rank decay path, per channel
g    = lower_bound * sigmoid(exp(A_log[h]) * z)    (K3)   or   -exp(A_log[h]) * softplus(z)  (Kimi Linear)
beta = sigmoid(W_b x)                                                  per head
o    = W_o (sigmoid(W_g x) * RMSNorm_head(KDA(q, k, v, g, beta)))

The delta-rule core goes through the single dispatch point `k3.kda.ops.kda_core`, so the Pallas
kernel is selected by ``model.kda.impl``; the three conv branches go through `CONV_BACKENDS`
(``model.kda.conv_impl``: one Pallas kernel forward and one backward per branch on a GPU). Gate,
beta and state math run in fp32.

Decoding is the layer's too: its fixed-size cache (`KDA.init_cache`), running new tokens on it
(`KDA.extend`) and rebuilding it after a prefix of them for speculative rollback (`replay_kda`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from k3.backends import Table
from k3.nn import (cast, compute_dtype, fuse_inputs, normal, ones, param, project_columns, project_inputs, rms_norm,
                   zeros)
from k3.kda.ops import KDA_CORES, kda_core, kda_gate_bounded, kda_gate_softplus, l2_normalize
from k3.kda.parallel import kda_core_sharded
from k3.sharding import Sharder, spec_axes
from pallas_kernels.kda_decode import kda_decode_step, kda_decode_supported
from pallas_kernels.short_conv import conv_silu_pallas


def causal_conv(x_BTC: jax.Array, w_WC: jax.Array, segment_ids_BT: jax.Array | None) -> jax.Array:
    """Depthwise causal convolution: out_t = sum_i w[W-1-i] * x_{t-i}, never across documents.

    x: [B, T, C]; w: [W, C] (w[W-1] multiplies the current token). Computed in fp32 (float64 for
    float64 x).
    """
    W = w_WC.shape[0]
    dt = compute_dtype(x_BTC)
    x = x_BTC.astype(dt)
    w = w_WC.astype(dt)
    out = x * w[W - 1]
    for i in range(1, W):
        shifted = jnp.pad(x, ((0, 0), (i, 0), (0, 0)))[:, : x.shape[1]]
        if segment_ids_BT is not None:
            seg_shifted = jnp.pad(segment_ids_BT, ((0, 0), (i, 0)), constant_values=-1)[:, : x.shape[1]]
            shifted = jnp.where((seg_shifted == segment_ids_BT)[..., None], shifted, 0.0)
        out = out + shifted * w[W - 1 - i]
    return out


L2_EPS = 1e-6  # `l2_normalize`'s, for q and k


def conv_branch_xla(y_BTC: jax.Array, w_WC: jax.Array, segment_ids_BT: jax.Array | None, head_dim: int,
                    eps: float = L2_EPS) -> jax.Array:
    """One conv branch: silu(causal_conv(y)), then (head_dim > 0, q and k) each group of head_dim
    channels L2-normalised: [B, T, C] in y's dtype, the math in fp32.

    y: [B, T, C] projections (C = heads * head_dim); w: [W, C]; segment_ids: optional [B, T].
    """
    B, T, C = y_BTC.shape
    a = jax.nn.silu(causal_conv(y_BTC, w_WC, segment_ids_BT))
    if head_dim:
        a = l2_normalize(a.reshape(B, T, C // head_dim, head_dim), eps).reshape(B, T, C)
    return a.astype(y_BTC.dtype)


# Who computes the conv branches (``model.kda.conv_impl``): 'xla' the jnp `conv_branch_xla`,
# 'pallas' one Pallas kernel forward and one backward (`pallas_kernels.short_conv`).
CONV_BACKENDS = Table("model.kda.conv_impl", default="xla", auto={"gpu": "pallas"})
CONV_BACKENDS.register("xla")(conv_branch_xla)


@CONV_BACKENDS.register("pallas")
def conv_branch_kernels(y_BTC, w_WC, segment_ids_BT, head_dim, eps=L2_EPS):
    """`conv_branch_xla` through the Pallas kernels where the head dim suits their tiles (a power of
    two); other head dims run `conv_branch_xla` itself."""
    if head_dim & (head_dim - 1):
        return conv_branch_xla(y_BTC, w_WC, segment_ids_BT, head_dim, eps)
    return conv_silu_pallas(y_BTC, w_WC, segment_ids_BT, head_dim, eps)


# Who runs a one-token decode step (``model.kda.decode_impl``): 'xla' the layer's own ops (`KDA.extend`),
# 'pallas' `pallas_kernels.kda_decode.kda_decode_step`, one kernel from the input projections to the
# gated norm with the state and conv ring updated in place (head dims that are not a power of two >= 16
# and meshes of more than one device take 'xla'). Several tokens at once (prompts, draft verification,
# kept inputs for rollback) always take `KDA.extend`'s general path.
# 'auto' is 'pallas' on a GPU: its tests pass compiled on an H100, and there (`experiments.bench_decode`,
# K3 d_model 1024, 16 layers, batch 8, 4K context, routed-expert kernel) a step took 1.821 ms against 1.926.
DECODE_STEPS = Table("model.kda.decode_impl", default="xla", auto={"gpu": "pallas"})
DECODE_STEPS.register("xla")(None)


@DECODE_STEPS.register("pallas")
def decode_step_kernel(layer: "KDA", x_BD: jax.Array, cache: dict, n_valid_B: jax.Array):
    """One token per row through ``layer`` by `kda_decode_step`: (y [B, D], new cache). x: [B, D]."""
    H, K = layer.n_heads, layer.head_dim
    y_BN, cols = project_columns(layer, x_BD[:, None], layer.INPUTS, layer.dtype)
    y_BN = y_BN[:, 0]
    w_fb = layer.w_fb[...]
    conv = [c[...].reshape(-1, H * K) for c in (layer.conv_q, layer.conv_k, layer.conv_v)]
    o, state, ring = kda_decode_step(
        y_BN, w_fb.reshape(w_fb.shape[0], H * K), *conv, layer.dt_bias[...], layer.A_log[...], layer.o_norm[...],
        cache["state"], cache["conv"], n_valid_B, fa_col=cols["w_fa"], beta_col=cols["w_beta"],
        gate_col=cols["w_gate"], gate_kind=layer.gate_kind,
        lower_bound=layer.lower_bound, eps=layer.eps, l2_eps=L2_EPS, out_dtype=layer.dtype)
    return jnp.einsum("bhk,hkd->bd", o, cast(layer.w_o, layer.dtype)), {"state": state, "conv": ring}


def conv_ring(ring_BWC: jax.Array, new_BTC: jax.Array, n_valid_B: jax.Array) -> jax.Array:
    """The conv ring after appending each row's first n_valid new inputs: its last W inputs, [B, W, C].

    ring: [B, W, C] the inputs before; new: [B, T, C]; n_valid: [B] int.
    """
    full = jnp.concatenate([ring_BWC, new_BTC], axis=1)
    # The last W inputs of row b end at its last valid token: full[n : n + W].
    idx = n_valid_B[:, None] + jnp.arange(ring_BWC.shape[1])[None, :]
    return jnp.take_along_axis(full, idx[..., None], axis=1)


# Log decay per gate kind (``model.kda.gate``): (z [.., H, K] fp32, A_log [H], lower_bound) -> g fp32.
GATES = {"bounded": kda_gate_bounded, "softplus": lambda z, A_log, lower_bound: kda_gate_softplus(z, A_log)}


def gate_values(z_BTHK, b_BTH, dt_bias_HK, A_log_H, kind: str, lower_bound: float):
    """(g [B, T, H, K], beta [B, T, H]), both fp32, from the decay path's low-rank output z (before
    dt_bias) and the beta projection, any float dtype; ``kind`` a key of `GATES`."""
    z = z_BTHK.astype(jnp.float32) + dt_bias_HK.astype(jnp.float32)
    g = GATES[kind](z, A_log_H.astype(jnp.float32), lower_bound)
    return g, jax.nn.sigmoid(b_BTH.astype(jnp.float32))


@functools.partial(jax.checkpoint, static_argnums=(3, 4))
def gated_norm(o_BTHV, weight_V, gate_BTHV, eps: float, dtype):
    """sigmoid(gate) * RMSNorm(o) per head, computed in fp32 and returned in ``dtype``: o and gate
    [B, T, H, V], weight [V].

    Under `jax.checkpoint` autodiff keeps o and gate as given (bf16) and runs the chain again in the
    backward, instead of keeping three fp32 intermediates of o's size; compiled for the H200 (K3
    1024:12, 32K tokens, no remat) the step moves 1.2 GB less. The decay gate (`gate_values`) is left
    to XLA: the same treatment there moved 3 GB more."""
    o = rms_norm(o_BTHV, weight_V, eps).astype(jnp.float32)
    return (o * jax.nn.sigmoid(gate_BTHV.astype(jnp.float32))).astype(dtype)


def _dt_bias_init(key, shape, dtype=jnp.float32):
    """Mamba-2 style: dt ~ logU(1e-3, 1e-1) floored at 1e-4, stored as softplus^-1(dt)."""
    u = jax.random.uniform(key, shape, jnp.float32)
    dt = jnp.exp(u * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3))
    dt = jnp.maximum(dt, 1e-4)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def _a_log_softplus_init(key, shape, dtype=jnp.float32):
    """Kimi-Linear gate: A ~ U(1, 16), stored as log A."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


class KDA(nnx.Module):
    """Kimi Delta Attention layer; see the module docstring. x: [B, T, D] -> [B, T, D]."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, sharder: Sharder | None = None):
        k = cfg.kda
        D, H, K = cfg.d_model, k.n_heads, k.head_dim
        self.sharder = sharder
        self.n_heads, self.head_dim, self.eps = H, K, cfg.norm_eps
        self.gate_kind, self.lower_bound = k.gate, k.gate_lower_bound
        # 'auto' is resolved here, once: the sharded path below and `extend` test the concrete name.
        self.impl, self.chunk_size = KDA_CORES.resolve(k.impl), k.chunk_size
        self.conv_size, self.conv_impl = k.conv_size, CONV_BACKENDS.resolve(k.conv_impl)
        one_device = sharder is None or sharder.mesh.size == 1
        self.decode_step = DECODE_STEPS.get(k.decode_impl) if one_device and kda_decode_supported(k.head_dim) else None
        self.dtype = jnp.dtype(cfg.dtype)
        # The Pallas kernel's matmuls follow the compute dtype (bf16 operands, fp32 accumulation).
        self.matmul_dtype = "bfloat16" if self.dtype == jnp.bfloat16 else "float32"
        init = normal(cfg.init_std)
        self.w_q = param(rngs, init, (D, H, K), ("embed", "heads", "head_dim"))
        self.w_k = param(rngs, init, (D, H, K), ("embed", "heads", "head_dim"))
        self.w_v = param(rngs, init, (D, H, K), ("embed", "heads", "head_dim"))
        conv_init = normal(1.0 / math.sqrt(k.conv_size))
        self.conv_q = param(rngs, conv_init, (k.conv_size, H, K), ("conv", "heads", "head_dim"))
        self.conv_k = param(rngs, conv_init, (k.conv_size, H, K), ("conv", "heads", "head_dim"))
        self.conv_v = param(rngs, conv_init, (k.conv_size, H, K), ("conv", "heads", "head_dim"))
        self.w_fa = param(rngs, init, (D, K), ("embed", "decay_rank"))
        self.w_fb = param(rngs, init, (K, H, K), ("decay_rank", "heads", "head_dim"))
        self.dt_bias = param(rngs, _dt_bias_init, (H, K), ("heads", "head_dim"))
        a_init = zeros if k.gate == "bounded" else _a_log_softplus_init
        self.A_log = param(rngs, a_init, (H,), ("heads",))
        self.w_beta = param(rngs, init, (D, H), ("embed", "heads"))
        self.w_gate = param(rngs, init, (D, H, K), ("embed", "heads", "head_dim"))
        self.o_norm = param(rngs, ones, (K,), ("head_dim",))
        self.w_o = param(rngs, init, (H, K, D), ("heads", "head_dim", "embed"))

    # Weights that read the layer's input x, in the order of their fused serving layout.
    INPUTS = ("w_q", "w_k", "w_v", "w_fa", "w_beta", "w_gate")

    def fuse_inputs(self) -> None:
        """Serving layout: the input projections as one matrix (`k3.nn.fuse_inputs`)."""
        fuse_inputs(self, self.INPUTS)

    def _branch(self, y, conv, segment_ids, norm: bool):
        """Conv and SiLU (and per-head L2 norm when ``norm``) of a projection y [B, T, H, K]: [B, T, H, K]
        in the compute dtype."""
        sh = self.sharder
        split = self.conv_impl == "pallas" and sh is not None and sh.mesh.size > 1
        # The kernels see whole rows of their device's tokens and heads; a split sequence would need
        # the neighbour's last conv_size - 1 tokens, so that case stays with XLA's conv.
        fn = conv_branch_xla if split and sh.size("context") > 1 else CONV_BACKENDS.get(self.conv_impl)

        def run(y_BTHK, w_WHK, seg_BT):
            B, T, H, K = y_BTHK.shape
            out = fn(y_BTHK.reshape(B, T, H * K), w_WHK.reshape(-1, H * K), seg_BT, K if norm else 0)
            return out.reshape(B, T, H, K)

        if split and sh.size("context") == 1:
            B, T, H, _ = y.shape
            y_spec = sh.spec(("batch", "seq", "act_heads", None), y.shape)
            seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids
            return jax.shard_map(run, mesh=sh.mesh, in_specs=(y_spec, PartitionSpec(None, y_spec[2], None),
                                                                PartitionSpec(*y_spec[:2])),
                                 out_specs=y_spec, check_vma=False)(y, conv[...], seg)
        return run(y, conv[...], segment_ids)

    def gates(self, x_BTD: jax.Array):
        """Per-channel log decay g [B, T, H, K] and beta [B, T, H], both fp32."""
        fa, b = project_inputs(self, x_BTD.astype(self.dtype), ("w_fa", "w_beta"), self.dtype)
        return self._gates(fa, b)

    def _gates(self, fa_BTR: jax.Array, b_BTH: jax.Array):
        """g and beta (see `gates`) from the input projections x w_fa [B, T, r] and x w_beta [B, T, H]."""
        z = jnp.einsum("btr,rhk->bthk", fa_BTR, cast(self.w_fb, self.dtype))
        return gate_values(z, b_BTH, self.dt_bias[...], self.A_log[...], self.gate_kind, self.lower_bound)

    def __call__(self, x_BTD: jax.Array, segment_ids_BT: jax.Array | None = None,
                 initial_state=None, return_state: bool = False):
        x = x_BTD.astype(self.dtype)
        yq, yk, yv, fa, b, gate = project_inputs(self, x, self.INPUTS, self.dtype)
        q = self._branch(yq, self.conv_q, segment_ids_BT, norm=True)
        k = self._branch(yk, self.conv_k, segment_ids_BT, norm=True)
        v = self._branch(yv, self.conv_v, segment_ids_BT, norm=False)
        g, beta = self._gates(fa, b)
        kwargs = dict(impl=self.impl, initial_state=initial_state, output_final_state=return_state,
                      chunk_size=self.chunk_size, matmul_dtype=self.matmul_dtype,
                      gate_lower_bound=self.lower_bound if self.gate_kind == "bounded" else None)
        sh = self.sharder
        if sh is not None and (sh.size("context") > 1 or self.impl == "pallas"):
            # The sequence is split (state pairs composed across devices), or the Pallas kernel
            # needs its per-device blocks: run the core per device under shard_map.
            B, T, H, _ = q.shape
            o, state = kda_core_sharded(
                sh.mesh, q, k, v, g, beta, segment_ids_BT, batch_axes=spec_axes(sh.spec(("batch",), (B,))[0]),
                head_axis=sh.spec(("act_heads",), (H,))[0], context_axis="context", **kwargs)
        else:
            with jax.named_scope("kda_core"):
                o, state = kda_core(q, k, v, g, beta, segment_ids=segment_ids_BT, **kwargs)
        o = gated_norm(o, self.o_norm[...], gate, self.eps, self.dtype)
        y = jnp.einsum("bthk,hkd->btd", o, cast(self.w_o, self.dtype))
        return (y, state) if return_state else y

    # ------------------------------------------------------------------------------------------
    # Incremental decoding: a fixed-size cache per row (the recurrent state and the conv rings)

    def init_cache(self, batch: int, max_len: int | None = None, dtype=None) -> dict:
        """Empty decode cache: 'state' [B, H, K, K] fp32 and 'conv', the ring of the last conv_size - 1
        pre-conv inputs of the q, k and v branches side by side, [B, conv_size - 1, 3 H*K] fp32 (one
        ring, so a decode step runs the three branches' conv, SiLU and ring update as one each).
        ``max_len`` and ``dtype`` are accepted so that every mixer's cache is built by one call
        (`k3.decode.init_cache`); they change nothing: the cache has no positions and stays fp32."""
        del max_len, dtype
        H, K = self.n_heads, self.head_dim
        return {"state": jnp.zeros((batch, H, K, K), jnp.float32),
                "conv": jnp.zeros((batch, self.conv_size - 1, 3 * H * K), jnp.float32)}

    def _branches_extend(self, y_BTC, ring_BWC, n_valid_B):
        """The q, k and v conv branches continued from their ring, on their pre-conv projections side by
        side y [B, T, 3 H*K]: (q, k, v [B, T, H, K] fp32 after the conv and SiLU, the new ring)."""
        B, T, _ = y_BTC.shape
        H, K = self.n_heads, self.head_dim
        w = jnp.concatenate([c[...].reshape(-1, H * K) for c in (self.conv_q, self.conv_k, self.conv_v)], axis=1)
        full = jnp.concatenate([ring_BWC, y_BTC], axis=1)
        out = jax.nn.silu(causal_conv(full, w, None)[:, self.conv_size - 1:]).reshape(B, T, 3, H, K)
        return out[:, :, 0], out[:, :, 1], out[:, :, 2], conv_ring(ring_BWC, y_BTC, n_valid_B)

    def extend(self, x_BTD: jax.Array, cache: dict, start_B: jax.Array, n_valid_B: jax.Array,
               keep_inputs: bool = False):
        """Runs T new tokens per row from ``cache``; returns (y [B, T, D], new cache).

        Row b's first ``n_valid_B[b]`` tokens are real; the rest are padding that leaves the state and
        the rings untouched (beta = 0 and g = 0 make a delta-rule step the identity) and whose outputs
        are meaningless. ``start_B`` (tokens already cached) is unused: the state has no positions.
        ``keep_inputs`` adds cache['inputs']: the tokens' projected inputs (pre-conv projections
        'pre' [B, T, 3, H*K] fp32; k, v [B, T, H, K]; g [B, T, H, K]; beta [B, T, H]), from which
        `replay_kda` rebuilds the state after any prefix of them (speculative rollback).
        """
        del start_B
        x = x_BTD.astype(self.dtype)
        T = x.shape[1]
        if T == 1 and not keep_inputs and self.decode_step is not None:
            y, new = self.decode_step(self, x[:, 0], cache, n_valid_B)
            return y[:, None], new
        yq, yk, yv, fa, b, gate = project_inputs(self, x, self.INPUTS, self.dtype)
        B, _, H, K = yq.shape
        # With the served layout's fused projections q, k and v are already adjacent columns.
        pre = jnp.concatenate([y.reshape(B, T, H * K) for y in (yq, yk, yv)], axis=-1).astype(jnp.float32)
        q, k, v, ring = self._branches_extend(pre, cache["conv"], n_valid_B)
        pre = pre.reshape(B, T, 3, H * K) if keep_inputs else None
        q, k, v = l2_normalize(q).astype(self.dtype), l2_normalize(k).astype(self.dtype), v.astype(self.dtype)
        g, beta = self._gates(fa, b)
        inputs = {"pre": pre, "k": k, "v": v, "g": g, "beta": beta} if keep_inputs else None
        valid = jnp.arange(T)[None, :] < n_valid_B[:, None]
        g = jnp.where(valid[..., None, None], g, 0.0)
        beta = jnp.where(valid[..., None], beta, 0.0)
        # A few tokens (decode, draft verification) run the token recurrence; a prompt the chunked core.
        impl = "recurrent" if T < self.chunk_size else self.impl
        o, state = kda_core(q, k, v, g, beta, impl=impl, initial_state=cache["state"], output_final_state=True,
                            chunk_size=self.chunk_size, matmul_dtype=self.matmul_dtype,
                            gate_lower_bound=self.lower_bound if self.gate_kind == "bounded" else None)
        o = gated_norm(o, self.o_norm[...], gate, self.eps, self.dtype)
        y = jnp.einsum("bthk,hkd->btd", o, cast(self.w_o, self.dtype))
        new = {"state": state, "conv": ring}
        if keep_inputs:
            new["inputs"] = inputs
        return y, new


# ---------------------------------------------------------------------------------------------
# Speculative rollback: the cache after a prefix of the tokens an ``extend`` ran, from its inputs


def replay_kda(before: dict, inputs: dict, n_B: jax.Array) -> dict:
    """A KDA layer's cache after the first ``n_B[b]`` of the tokens whose ``inputs`` were kept.

    before: the layer's cache before those tokens (`KDA.init_cache`'s layout); inputs: `KDA.extend`'s
    kept inputs for T tokens; n_B: [B] int in 0..T. The state is rebuilt by the delta rule from
    ``before['state']`` over the kept k, v, g, beta (the rest masked to identity steps), the conv
    rings from the kept pre-conv projections: no per-token state is ever stored. `k3.decode.rollback`
    calls it per KDA layer (vmapped over the repeats of a scanned body).
    """
    k, v, g, beta = inputs["k"], inputs["v"], inputs["g"], inputs["beta"]
    valid = jnp.arange(k.shape[1])[None, :] < n_B[:, None]
    g = jnp.where(valid[..., None, None], g, 0.0)
    beta = jnp.where(valid[..., None], beta, 0.0)
    _, state = kda_core(k, k, v, g, beta, impl="recurrent", initial_state=before["state"],
                        output_final_state=True, gate_lower_bound=None)
    B, T = n_B.shape[0], k.shape[1]
    return {"state": state, "conv": conv_ring(before["conv"], inputs["pre"].reshape(B, T, -1), n_B)}
