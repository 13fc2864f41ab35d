"""One KDA decode step (a single new token per row) as one Pallas kernel that updates the cache in place.

What it computes, per row b and head h, from the layer's projections of the new token:

    q, k, v = SiLU(conv(ring, new))                  the depthwise causal conv continued from the ring
    q, k    = q / |q|, k / |k|                         (L2, eps inside the root)
    z       = fa W_fb[:, h]                            the decay path's low-rank up-projection, [K]
    g       = gate(z + dt_bias, A_log)                 bounded or softplus log decay, [K]
    beta    = sigmoid(beta logit)
    S       = S * exp(g)[:, None]                     state [K, V], fp32
    S       = S + beta k (v - k^T S)                  the delta rule
    o       = sigmoid(gate) * RMSNorm((scale q)^T S) * o_norm

and appends the new pre-conv inputs to the conv ring. A row whose ``n_valid`` is 0 keeps its state
and ring (g = 0, beta = 0: the identity step), as `k3.kda.layer.KDA.extend` does for padding.

Why a kernel. Left to XLA the step is a conv fusion, a state fusion with the gates, an output fusion
and a copy of the state and of the ring per layer: the state fusion contains a dot, so XLA cannot write
it into the donated cache buffer and copies it there afterwards (compiled for the H200, K3 d_model
1024, 16 layers: 24 copies in a 457-kernel step). Here the state and ring are read and written once,
in place (``input_output_aliases``), and everything between the input projections and W_o is one
launch, the decay path's [r] x [r, H K] up-projection included (a GEMM kernel of its own otherwise).

Design (Pallas Triton). Grid (B, H); a program owns one (row, head): its K columns of the q, k and v
ring and projections, its [K, V] state tile (V = K) and its K outputs, so programs never touch each
other's memory and in-place updates are safe. Products are fp32 broadcasts and sums (nothing for
tensor cores in a matrix-vector step). The projections arrive as one [B, N] array with the columns'
offsets (the served layout's fused input projection as it comes out of its matmul), so XLA does not
copy column slices out of it for the call. K must be a power of two >= 16 (`kda_decode_supported`).
The same source runs in Pallas interpret mode on a CPU (the tests) and compiled on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import default_interpret, pow2_from_16, triton_params


def kda_decode_supported(head_dim: int) -> bool:
    """Whether `kda_decode_step` takes heads of this width (a power of two >= 16)."""
    return pow2_from_16(head_dim)


def _kernel(n_ref, y_ref, wfb_ref, wq_ref, wk_ref, wv_ref, dtb_ref, alog_ref, onw_ref, s_ref, r_ref,
            o_ref, s_out, r_out, *, H, K, R, fa_col, beta_col, gate_col, bounded, lower_bound, eps, l2_eps,
            scale):
    b, h = pl.program_id(0), pl.program_id(1)
    valid = n_ref[b] > 0
    f32 = jnp.float32

    def branch(j, w_ref):
        cols = pl.ds(j * H * K + h * K, K)
        new = y_ref[b, cols].astype(f32)
        rows = [r_ref[b, i, cols] for i in range(R)]  # all read before any is written (in place)
        head = pl.ds(h * K, K)
        acc = new * w_ref[R, head].astype(f32)
        for i in range(R):
            acc = acc + rows[i] * w_ref[i, head].astype(f32)
        for i in range(R):
            r_out[b, i, cols] = jnp.where(valid, rows[i + 1] if i + 1 < R else new, rows[i])
        return acc * jax.nn.sigmoid(acc)

    q, k, v = branch(0, wq_ref), branch(1, wk_ref), branch(2, wv_ref)
    q = q * lax.rsqrt(jnp.sum(q * q) + l2_eps)
    k = k * lax.rsqrt(jnp.sum(k * k) + l2_eps)
    rank = wfb_ref.shape[0]
    fa = y_ref[b, pl.ds(fa_col, rank)].astype(f32)
    # The weight in the compute dtype (y's) and z rounded to it, as the layer's own einsum does.
    w = wfb_ref[:, pl.ds(h * K, K)].astype(y_ref.dtype).astype(f32)
    z = jnp.sum(fa[:, None] * w, axis=0).astype(y_ref.dtype).astype(f32) + dtb_ref[h, :].astype(f32)
    rate = jnp.exp(alog_ref[h].astype(f32))
    g = lower_bound * jax.nn.sigmoid(rate * z) if bounded else -rate * jax.nn.softplus(z)
    g = jnp.where(valid, g, 0.0)
    beta = jnp.where(valid, jax.nn.sigmoid(y_ref[b, beta_col + h].astype(f32)), 0.0)

    S = s_ref[b, h, :, :] * jnp.exp(g)[:, None]
    kS = jnp.sum(k[:, None] * S, axis=0)
    S = S + k[:, None] * (beta * (v - kS))[None, :]
    s_out[b, h, :, :] = S
    o = jnp.sum((scale * q)[:, None] * S, axis=0)
    o = o * lax.rsqrt(jnp.mean(o * o) + eps) * onw_ref[:].astype(f32)
    gate = y_ref[b, pl.ds(gate_col + h * K, K)].astype(f32)
    o_ref[b, h, :] = (o * jax.nn.sigmoid(gate)).astype(o_ref.dtype)


def kda_decode_step(y_BN, w_fb_RC, conv_q_WC, conv_k_WC, conv_v_WC, dt_bias_HK, A_log_H, o_norm_K, state_BHKK,
                    ring_BRC, n_valid_B, *,
                    fa_col: int, beta_col: int, gate_col: int, gate_kind: str = "bounded", lower_bound: float = -5.0,
                    eps: float = 1e-6, l2_eps: float = 1e-6, scale: float | None = None, out_dtype=None,
                    num_warps: int = 1, interpret: bool | None = None):
    """One decode token through a KDA layer's conv, gates, delta rule and gated norm (module docstring).

    y: [B, N] the token's input projections: columns [0, 3 H K) the pre-conv q, k and v (head-major
    within each), [fa_col, fa_col + r) the decay path's low-rank down-projection fa, [beta_col,
    beta_col + H) the beta logits, [gate_col, gate_col + H K) the output gate; w_fb: [r, H K] the decay
    path's up-projection in its stored dtype (z = fa w_fb, before dt_bias, with w_fb rounded to y's dtype;
    r a power of two >= 16); conv_q, conv_k, conv_v: [R + 1, H K]
    the branches' conv weights (row R multiplies the new token); dt_bias: [H, K]; A_log: [H];
    o_norm: [K]; state: [B, H, K, K] fp32; ring: [B, R, 3 H K] fp32, the last R pre-conv inputs;
    n_valid: [B] int, 0 or 1 (0 leaves the row's cache as it was); gate_kind: 'bounded' or 'softplus'.

    Returns (o [B, H, K] in ``out_dtype`` (y's by default), the new state, the new ring). The state
    and ring are updated in place: the call donates their buffers when the caller's jit does.
    """
    B, N = y_BN.shape
    H, K = dt_bias_HK.shape
    R = conv_q_WC.shape[0] - 1
    C = 3 * H * K
    r = w_fb_RC.shape[0]
    want = {"w_fb": (w_fb_RC.shape, (r, H * K)), "conv_q": (conv_q_WC.shape, (R + 1, H * K)),
            "conv_k": (conv_k_WC.shape, (R + 1, H * K)), "conv_v": (conv_v_WC.shape, (R + 1, H * K)),
            "A_log": (A_log_H.shape, (H,)), "o_norm": (o_norm_K.shape, (K,)),
            "state": (state_BHKK.shape, (B, H, K, K)),
            "ring": (ring_BRC.shape, (B, R, C)), "n_valid": (n_valid_B.shape, (B,))}
    bad = {name: got for name, (got, shape) in want.items() if tuple(got) != shape}
    if bad or N < C or fa_col + r > N or beta_col + H > N or gate_col + H * K > N:
        raise ValueError(f"kda_decode_step: shapes {bad or ''} do not match y {y_BN.shape} with H={H}, K={K}, "
                         f"R={R} (fa_col={fa_col}, beta_col={beta_col}, gate_col={gate_col})")
    if not kda_decode_supported(K):
        raise ValueError(f"kda_decode_step: head_dim {K} must be a power of two >= 16")
    if not kda_decode_supported(r):
        raise ValueError(f"kda_decode_step: the decay rank {r} must be a power of two >= 16")
    if gate_kind not in ("bounded", "softplus"):
        raise ValueError(f"kda_decode_step: gate_kind must be 'bounded' or 'softplus'; got {gate_kind!r}")
    interpret = default_interpret() if interpret is None else interpret
    out_dtype = y_BN.dtype if out_dtype is None else out_dtype
    whole = lambda x: pl.BlockSpec(x.shape, lambda b, h: (0,) * x.ndim)  # noqa: E731
    args = (n_valid_B.astype(jnp.int32), y_BN, w_fb_RC, conv_q_WC, conv_k_WC, conv_v_WC, dt_bias_HK, A_log_H,
            o_norm_K, state_BHKK.astype(jnp.float32), ring_BRC.astype(jnp.float32))
    kernel = functools.partial(_kernel, H=H, K=K, R=R, fa_col=fa_col, beta_col=beta_col, gate_col=gate_col,
                               bounded=gate_kind == "bounded", lower_bound=float(lower_bound), eps=float(eps),
                               l2_eps=float(l2_eps), scale=float(K ** -0.5 if scale is None else scale))
    out_shape = (jax.ShapeDtypeStruct((B, H, K), out_dtype), jax.ShapeDtypeStruct(args[9].shape, jnp.float32),
                 jax.ShapeDtypeStruct(args[10].shape, jnp.float32))
    return pl.pallas_call(
        kernel, grid=(B, H), in_specs=[whole(a) for a in args], out_specs=tuple(whole(s) for s in out_shape),
        out_shape=out_shape, input_output_aliases={9: 1, 10: 2}, interpret=interpret,
        compiler_params=triton_params(interpret, num_warps, 1), name="kda_decode_step",
    )(*args)
