"""Block AttnRes depth mix as two Pallas kernels: one pass over the candidates forward, one backward.

The math is `k3.attn_res.depth_mix`'s (that function is the reference and the portable backend):
per token, logit_m = (v_m . w) r_m with r_m = rsqrt(mean(v_m^2) + eps), p = softmax over the valid
candidates, out = sum_m p_m v_m; and backward, with g_m = dout . v_m and gbar = sum_m p_m g_m,
    dlogit_m = p_m (g_m - gbar),  dv_m = p_m dout + dlogit_m (r_m w - logit_m r_m^2 v_m / D),
    dw = sum over tokens of dlogit_m r_m v_m.
XLA splits this into several fusions that each re-read the [M, N, D] candidates, some at 20% of HBM
bandwidth (a row reduction and the broadcast that consumes it in one fusion). Here one program owns
``block`` whole tokens of every candidate: the forward loads each candidate block twice (statistics,
then the mix; the repeat should come from cache, which the profile has not checked) and writes the
mix plus per-token statistics p, logit, r ([n + 1, N] fp32 each); the backward reads candidates
and dout, and writes the candidates' gradients and one partial dw row per program (``steps``
blocks), summed by XLA. Only the first n bank slots are touched: a static count (the bank's slots
fill one block at a time, and unrolled layers know how many are filled) keeps the empty ones out
of both passes. On the H200 at K3 1024:12's shape the pair ran at 42% of HBM bandwidth, 2.2x the
jnp mix (BENCHMARKS.md).

Kernels (Pallas Triton; N = B T tokens, fp32 math):
    _fwd  grid (N / block,): bank [M, N, D] (first n read), extra [N, D] -> out [N, D], p / logit / r [n + 1, N]
    _bwd  grid (N / (block steps),): bank, extra, dout, statistics -> d bank [n, N, D], d extra,
          dw partials [N / (block steps), D]

Contract: D (the model width) is a power of two >= 16, as Triton's tiles need (`k3.attn_res`'s
'pallas' backend sends other widths to the reference). Where N is not a multiple of block * steps,
both are halved until it is (one token per program at worst), so nothing is padded or copied.
The same source runs interpreted on a CPU (the tests) and compiled on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import compute_dtype, default_interpret, pow2_from_16, triton_params

__all__ = ["depth_mix_pallas", "kernel_width_ok", "mix_tiles"]


def kernel_width_ok(d_model: int) -> bool:
    """Whether the kernels take rows of this width: a power of two >= 16 (Triton's tile sides)."""
    return pow2_from_16(d_model)


def _candidate(cands_ref, extra_ref, m, n, dt, rows=slice(None)):
    return (cands_ref[m, rows, :] if m < n else extra_ref[rows, :]).astype(dt)


def _fwd_kernel(cands_ref, extra_ref, valid_ref, w_ref, wg_ref, gamma_ref, out_ref, p_ref, lg_ref, r_ref, ro_ref, *,
                n, D, eps, norm_eps):
    dt = p_ref.dtype
    w = w_ref[...].astype(dt) * wg_ref[...].astype(dt)  # [1, D]
    logits, rs, masked = [], [], []
    for m in range(n + 1):
        v = _candidate(cands_ref, extra_ref, m, n, dt)
        r = lax.rsqrt(jnp.sum(v * v, axis=1) / D + eps)
        lg = jnp.sum(v * w, axis=1) * r
        ok = jnp.max(valid_ref[m, :]) > 0.5  # the flag is replicated along a 16-wide row
        logits.append(lg)
        rs.append(r)
        masked.append(jnp.where(ok, lg, -jnp.inf))
    top = functools.reduce(jnp.maximum, masked)
    top = jnp.where(top > -jnp.inf, top, 0.0)
    e = [jnp.exp(lg - top) for lg in masked]
    z = functools.reduce(jnp.add, e)
    z = jnp.where(z > 0, z, 1.0)  # no valid candidate: a zero mix instead of 0 / 0
    out = None
    for m in range(n + 1):
        p = e[m] / z
        term = p[:, None] * _candidate(cands_ref, extra_ref, m, n, dt)
        out = term if out is None else out + term
        p_ref[m, :] = p
        lg_ref[m, :] = logits[m]
        r_ref[m, :] = rs[m]
    if norm_eps is not None:  # the RMSNorm that reads the mix, on the fp32 mix
        ro = lax.rsqrt(jnp.sum(out * out, axis=1) / D + norm_eps)
        ro_ref[0, :] = ro
        out = out * ro[:, None] * gamma_ref[...].astype(dt)
    out_ref[...] = out.astype(out_ref.dtype)


def _bwd_kernel(cands_ref, extra_ref, dout_ref, w_ref, wg_ref, gamma_ref, p_ref, lg_ref, r_ref, ro_ref, dc_ref,
                de_ref, dw_ref, dg_ref, *, n, D, block, steps, norm):
    """``steps`` sub-blocks of ``block`` tokens in a loop (not unrolled: unrolled, the compiler kept
    several sub-blocks live and spilled), so that a program's partial dw row covers block * steps
    tokens. With the norm, dout is the normed output's cotangent: the mix is rebuilt from the
    candidates and p, and the norm's backward gives the mix's cotangent (and a partial row of the
    gain's gradient)."""
    dt = p_ref.dtype
    w = w_ref[...].astype(dt) * wg_ref[...].astype(dt)

    def sub_block(s, acc):
        dw, dg = acc
        rows = pl.ds(pl.multiple_of(s * block, block), block)
        d = dout_ref[rows, :].astype(dt)
        p = [p_ref[m, rows] for m in range(n + 1)]
        if norm:
            mix = functools.reduce(jnp.add, [p[m][:, None] * _candidate(cands_ref, extra_ref, m, n, dt, rows)
                                             for m in range(n + 1)])
            ro = ro_ref[0, rows][:, None]
            xh, u = mix * ro, d * gamma_ref[...].astype(dt)
            dg = dg + jnp.sum(d * xh, axis=0, keepdims=True)
            d = ro * (u - xh * (jnp.sum(u * xh, axis=1, keepdims=True) / D))
        g = [jnp.sum(d * _candidate(cands_ref, extra_ref, m, n, dt, rows), axis=1) for m in range(n + 1)]
        gbar = functools.reduce(jnp.add, [pm * gm for pm, gm in zip(p, g)])
        for m in range(n + 1):
            v = _candidate(cands_ref, extra_ref, m, n, dt, rows)
            r, lg = r_ref[m, rows], lg_ref[m, rows]
            dl = p[m] * (g[m] - gbar)
            dv = p[m][:, None] * d + dl[:, None] * (r[:, None] * w - (lg * r * r / D)[:, None] * v)
            if m < n:
                dc_ref[m, rows, :] = dv.astype(dc_ref.dtype)
            else:
                de_ref[rows, :] = dv.astype(de_ref.dtype)
            dw = dw + jnp.sum((dl * r)[:, None] * v, axis=0, keepdims=True)
        return dw, dg

    dw, dg = lax.fori_loop(0, steps, sub_block, (jnp.zeros_like(w), jnp.zeros_like(w)))
    dw_ref[...] = dw
    dg_ref[...] = dg


def _specs(M, n, BN, D):
    """(the bank [M, N, D] read, its first n slots written, a token block [N, D], per-candidate
    token stats [n + 1, N], a whole array) for token blocks of BN."""
    return (pl.BlockSpec((M, BN, D), lambda i: (0, i, 0)), pl.BlockSpec((n, BN, D), lambda i: (0, i, 0)),
            pl.BlockSpec((BN, D), lambda i: (i, 0)), pl.BlockSpec((n + 1, BN), lambda i: (0, i)),
            lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape)))


def _forward(cands_MND, extra_ND, valid_n1, w_D, wg_D, gamma_D, eps, norm_eps, n, block, interpret, num_warps):
    M, N, D = cands_MND.shape
    dt = compute_dtype(cands_MND)
    cand, _, tok, stat, whole = _specs(M, n, block, D)
    valid = jnp.broadcast_to(valid_n1.astype(dt)[:, None], (n + 1, 16))
    stat_shape = jax.ShapeDtypeStruct((n + 1, N), dt)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, n=n, D=D, eps=eps, norm_eps=norm_eps), grid=(N // block,),
        in_specs=[cand, tok, whole((n + 1, 16)), whole((1, D)), whole((1, D)), whole((1, D))],
        out_specs=[tok, stat, stat, stat, pl.BlockSpec((1, block), lambda i: (0, i))],
        out_shape=[jax.ShapeDtypeStruct((N, D), cands_MND.dtype), stat_shape, stat_shape, stat_shape,
                   jax.ShapeDtypeStruct((1, N), dt)],
        interpret=interpret, name="attn_res_mix_norm_fwd" if norm_eps is not None else "attn_res_mix_fwd",
        compiler_params=triton_params(interpret, num_warps, 1),
    )(cands_MND, extra_ND, valid, w_D[None, :], wg_D[None, :], gamma_D[None, :])


def _backward(cands_MND, extra_ND, dout_ND, w_D, wg_D, gamma_D, p, lg, r, ro, n, block, steps, norm, interpret,
              num_warps):
    M, N, D = cands_MND.shape
    cand, written, tok, stat, whole = _specs(M, n, block * steps, D)
    nb = N // (block * steps)
    partial = jax.ShapeDtypeStruct((nb, D), p.dtype)
    row = pl.BlockSpec((1, D), lambda i: (i, 0))
    dc, de, dw, dg = pl.pallas_call(
        functools.partial(_bwd_kernel, n=n, D=D, block=block, steps=steps, norm=norm), grid=(nb,),
        in_specs=[cand, tok, tok, whole((1, D)), whole((1, D)), whole((1, D)), stat, stat, stat,
                  pl.BlockSpec((1, block * steps), lambda i: (0, i))],
        out_specs=[written, tok, row, row],
        out_shape=[jax.ShapeDtypeStruct((n, N, D), cands_MND.dtype),
                   jax.ShapeDtypeStruct(extra_ND.shape, extra_ND.dtype), partial, partial],
        interpret=interpret, name="attn_res_mix_norm_bwd" if norm else "attn_res_mix_bwd",
        compiler_params=triton_params(interpret, num_warps, 1),
    )(cands_MND, extra_ND, dout_ND, w_D[None, :], wg_D[None, :], gamma_D[None, :], p, lg, r, ro)
    if n < M:  # the slots past n are invalid: no gradient
        dc = jnp.pad(dc, ((0, M - n), (0, 0), (0, 0)))
    return dc, de, jnp.sum(dw, axis=0), jnp.sum(dg, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11, 12))
def _mix(cands_MND, extra_ND, valid_n1, w_D, wg_D, gamma_D, eps, norm_eps, n, block, steps, interpret, warps):
    """The pseudo-query is w * wg, formed inside the kernels (in a decode step with bf16 weights a
    product or cast outside them is one more launch per mix). warps: (forward, backward) warps per
    program."""
    return _forward(cands_MND, extra_ND, valid_n1, w_D, wg_D, gamma_D, eps, norm_eps, n, block, interpret,
                    warps[0])[0]


def _mix_fwd(cands_MND, extra_ND, valid_n1, w_D, wg_D, gamma_D, eps, norm_eps, n, block, steps, interpret, warps):
    out, p, lg, r, ro = _forward(cands_MND, extra_ND, valid_n1, w_D, wg_D, gamma_D, eps, norm_eps, n, block,
                                 interpret, warps[0])
    return out, (cands_MND, extra_ND, w_D, wg_D, gamma_D, p, lg, r, ro)


def _mix_bwd(eps, norm_eps, n, block, steps, interpret, warps, res, dout_ND):
    del eps
    cands_MND, extra_ND, w_D, wg_D, gamma_D, p, lg, r, ro = res
    dc, de, dq, dg = _backward(cands_MND, extra_ND, dout_ND, w_D, wg_D, gamma_D, p, lg, r, ro, n, block, steps,
                               norm_eps is not None, interpret, warps[1])
    # dq: the gradient of the product q = w * wg.
    dw, dwg = dq * wg_D.astype(dq.dtype), dq * w_D.astype(dq.dtype)
    return dc, de, None, dw.astype(w_D.dtype), dwg.astype(wg_D.dtype), dg.astype(gamma_D.dtype)


_mix.defvjp(_mix_fwd, _mix_bwd)


# Up to this many tokens a call's forward programs take one token each with 4 warps instead of the
# training shape's 2 tokens with 1 warp (`mix_tiles`): with only N / 2 programs on the GPU (4 at a batch-8
# decode step), one warp's serial walk over 2 x D x candidates is the launch's whole latency.
FEW_TOKENS = 64


def mix_tiles(n_tokens: int) -> tuple[int, int]:
    """The forward's (tokens per program, warps per program) for a call of ``n_tokens`` tokens: (2, 1),
    the fastest of 13 settings on the H200 at K3 1024:12's training shape
    (`pallas_kernels/results/bench_attn_res_h200_*.json`), or (1, 4) up to `FEW_TOKENS` tokens."""
    return (1, 4) if n_tokens <= FEW_TOKENS else (2, 1)


def depth_mix_pallas(cands_MBTD: jax.Array, valid_M: jax.Array, extra_BTD: jax.Array, extra_valid: jax.Array,
                     w_D: jax.Array, eps: float, *, n_valid: int | None = None, gamma_D: jax.Array | None = None,
                     norm_eps: float | None = None, w_gain_D: jax.Array | None = None, block: int = 0,
                     steps: int = 1, interpret: bool | None = None, num_warps: int = 0,
                     bwd_warps: int | None = None) -> jax.Array:
    """`k3.attn_res.depth_mix` through the Pallas kernels: [B, T, D] in the candidates' dtype.

    cands: [M, B, T, D]; valid: [M] bool; extra: [B, T, D] with its validity (bool scalar); w: [D]
    (pseudo-query times norm gain, or with ``w_gain_D`` [D] the pseudo-query alone: the kernels form
    the product, in fp32 whatever the parameters' dtype). Differentiable in cands, extra, w, w_gain.
    ``n_valid``: a static count that says the candidates past the first n_valid are invalid (the
    bank's unfilled slots): the kernels neither read them nor write their (zero) gradients; None reads
    all M. ``gamma_D`` and ``norm_eps``: the RMSNorm that reads the mix, applied in the kernels (the
    result is rms_norm(mix) * gamma, from the fp32 mix; differentiable in gamma too). ``block`` tokens
    per program (a power of two) and ``num_warps``; 0: `mix_tiles` of the call's token count. The
    backward's program walks ``steps`` such blocks with ``bwd_warps`` (None: ``num_warps``, or 2 with
    the norm, whose backward also holds the rebuilt mix: compiled for sm_90 at D = 1024 it spills
    0.9-2.8 KB a thread at 1 warp and 0-284 B at 2). ``interpret=None``: compiled on a GPU,
    interpreted elsewhere. D must be a power of two >= 16.
    """
    M, B, T, D = cands_MBTD.shape
    if extra_BTD.shape != (B, T, D) or valid_M.shape != (M,):
        raise ValueError(f"depth_mix_pallas: candidates {cands_MBTD.shape} need extra [B, T, D] = {(B, T, D)} "
                         f"and valid [M] = {(M,)}; got {extra_BTD.shape} and {valid_M.shape}")
    for name, v in (("block", block), ("steps", steps)):
        if v < 0 or v & (v - 1) or (name == "steps" and v == 0):
            raise ValueError(f"depth_mix_pallas: {name} must be a power of two; got {v}")
    if not kernel_width_ok(D):
        raise ValueError(f"depth_mix_pallas: the width D must be a power of two >= 16; got {D}")
    n = M if n_valid is None else int(n_valid)
    if not 0 <= n <= M:
        raise ValueError(f"depth_mix_pallas: n_valid must be in [0, M = {M}]; got {n_valid}")
    interpret = default_interpret() if interpret is None else bool(interpret)
    N = B * T
    auto_block, auto_warps = mix_tiles(N)
    block, num_warps = block or auto_block, num_warps or auto_warps
    # Programs of fewer tokens where N is not a multiple of block * steps (a decode step of one token, an
    # odd-length prompt): padding instead copies the whole bank in and the mix out, XLA kernels of their own.
    while block > 1 and N % block:
        block //= 2
    while steps > 1 and N % (block * steps):
        steps //= 2
    cands, extra = cands_MBTD.reshape(M, N, D), extra_BTD.reshape(N, D)
    if (gamma_D is None) != (norm_eps is None) or (gamma_D is not None and jnp.shape(gamma_D) != (D,)):
        raise ValueError(f"depth_mix_pallas: the norm needs both gamma [D] = {(D,)} and norm_eps; got "
                         f"{None if gamma_D is None else jnp.shape(gamma_D)} and {norm_eps}")
    gamma = jnp.zeros((D,), jnp.float32) if gamma_D is None else gamma_D
    if w_gain_D is not None and jnp.shape(w_gain_D) != (D,):
        raise ValueError(f"depth_mix_pallas: w_gain must be [D] = {(D,)}; got {jnp.shape(w_gain_D)}")
    w_gain = jnp.ones((D,), w_D.dtype) if w_gain_D is None else w_gain_D
    valid = jnp.concatenate([jnp.asarray(valid_M, bool)[:n], jnp.asarray(extra_valid, bool)[None]])
    if bwd_warps is None:
        bwd_warps = num_warps if norm_eps is None else max(num_warps, 2)
    out = _mix(cands, extra, valid, w_D, w_gain, gamma, float(eps), None if norm_eps is None else float(norm_eps),
               n, block, steps, interpret, (num_warps, bwd_warps))
    return out.reshape(B, T, D)
