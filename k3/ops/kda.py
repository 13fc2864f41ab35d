"""Kimi Delta Attention (KDA): reference implementations in plain JAX, the gates, and the dispatch point.

KDA is a gated delta rule with a per-channel decay (arXiv 2510.26692). Layout and conventions follow
flash-linear-attention (fla):

    q, k   [B, T, H, K]     queries and keys (the layer L2-normalises them first, see `l2_normalize`)
    v      [B, T, H, V]     values
    g      [B, T, H, K]     per-channel LOG decay, g <= 0, so the decay is alpha_t = exp(g_t)
    beta   [B, T, H]        delta-rule learning rate
    state  [B, H, K, V]     always float32 (float64 when the inputs are float64)

Per token, with S the [K, V] state of one (row, head):

    S <- Diag(exp(g_t)) S                       decay the K rows
    S <- S + beta_t k_t (v_t - k_t^T S)^T       delta-rule write
    o_t = S^T (scale * q_t)

i.e. S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T.

Packed documents: `segment_ids` [B, T] marks documents; a change of id between neighbouring tokens
starts a new document whose state starts from zero. `initial_state` applies to the first document of
each row only, and the final state is the state after the last token of each row. `cu_seqlens` [N+1]
(FlashAttention convention, B == 1) is another spelling of the same thing.
"""

from __future__ import annotations

import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "chunk_kda_reference",
    "kda_core",
    "kda_gate_bounded",
    "kda_gate_softplus",
    "l2_normalize",
    "recurrent_kda",
]

# These are references: fp32 matmuls must not silently drop to TF32/bf16 passes on GPU/TPU.
_PRECISION = lax.Precision.HIGHEST

_IMPLS = ("chunk", "recurrent", "pallas")


# ----------------------------------------------------------------------------------------------------
# Validation and input preparation
# ----------------------------------------------------------------------------------------------------


def _validate(q, k, v, g, beta, initial_state=None, segment_ids=None, cu_seqlens=None):
    """Checks the shapes of the core's arguments; returns (B, T, H, K, V)."""
    q_shape = jnp.shape(q)
    if len(q_shape) != 4:
        raise ValueError(f"q must be [B, T, H, K]; got shape {q_shape}")
    B, T, H, K = q_shape
    if jnp.shape(k) != q_shape:
        raise ValueError(f"k must have the shape of q {q_shape} ([B, T, H, K]); got {jnp.shape(k)}")
    v_shape = jnp.shape(v)
    if len(v_shape) != 4 or v_shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] with (B, T, H) = {(B, T, H)}; got shape {v_shape}")
    V = v_shape[3]
    if jnp.shape(g) != q_shape:
        raise ValueError(f"g must have the shape of q {q_shape} ([B, T, H, K]); got {jnp.shape(g)}")
    if jnp.shape(beta) != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {(B, T, H)}; got shape {jnp.shape(beta)}")
    if initial_state is not None and jnp.shape(initial_state) != (B, H, K, V):
        raise ValueError(
            f"initial_state must be [B, H, K, V] = {(B, H, K, V)}; got shape {jnp.shape(initial_state)}"
        )
    if segment_ids is not None and jnp.shape(segment_ids) != (B, T):
        raise ValueError(f"segment_ids must be [B, T] = {(B, T)}; got shape {jnp.shape(segment_ids)}")
    if cu_seqlens is not None:
        _validate_cu_seqlens(cu_seqlens, B, T, segment_ids)
    return B, T, H, K, V


def _validate_cu_seqlens(cu_seqlens, B, T, segment_ids):
    if segment_ids is not None:
        raise ValueError("pass either segment_ids or cu_seqlens, not both")
    if B != 1:
        raise ValueError(f"cu_seqlens requires batch size 1 (packed rows); got B = {B}")
    cu_shape = jnp.shape(cu_seqlens)
    if len(cu_shape) != 1 or cu_shape[0] < 2:
        raise ValueError(f"cu_seqlens must be [N + 1] with N >= 1; got shape {cu_shape}")
    try:
        cu = np.asarray(cu_seqlens)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return  # traced values can only be checked for shape
    if cu[0] != 0 or cu[-1] != T or np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {T}; got {cu.tolist()}")


def _compute_dtype(*xs):
    """float64 when any input is float64 (only possible with x64 enabled), else float32."""
    return jnp.float64 if jnp.result_type(*xs) == jnp.float64 else jnp.float32


def _document_index(segment_ids_BT, cu_seqlens, B, T):
    """[B, T] int32 index of each token's document within its row: 0, 0, ..., 1, 1, ..., 2, ...

    Counting id changes (rather than comparing ids) makes documents contiguous runs, so masks built
    from "same document" can never join two separate runs that happen to reuse an id.
    """
    if cu_seqlens is not None:
        token_BT = jnp.arange(T)[None, :]
        return (jnp.searchsorted(jnp.asarray(cu_seqlens), token_BT, side="right") - 1).astype(jnp.int32)
    if segment_ids_BT is None:
        return jnp.zeros((B, T), jnp.int32)
    seg_BT = jnp.asarray(segment_ids_BT)
    starts_BT1 = (seg_BT[:, 1:] != seg_BT[:, :-1]).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.cumsum(starts_BT1, axis=1)], axis=1)


def _initial_state(initial_state, B, H, K, V, dtype):
    if initial_state is None:
        return jnp.zeros((B, H, K, V), dtype)
    return jnp.asarray(initial_state).astype(dtype)


# ----------------------------------------------------------------------------------------------------
# Token recurrence
# ----------------------------------------------------------------------------------------------------


def recurrent_kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    segment_ids=None,
    cu_seqlens=None,
):
    """KDA as a `lax.scan` over tokens: the simple reference (and the natural decode path).

    Args:
      q, k: [B, T, H, K] queries and keys.
      v: [B, T, H, V] values.
      g: [B, T, H, K] per-channel log decay (<= 0).
      beta: [B, T, H] delta-rule learning rate.
      scale: query scale; defaults to K ** -0.5.
      initial_state: optional [B, H, K, V] state before the first token (first document of each row).
      output_final_state: whether to return the state after the last token.
      segment_ids: optional [B, T] ints; a change of id starts a new document with a zero state.
      cu_seqlens: optional [N + 1] document boundaries (requires B == 1); alternative to segment_ids.

    Returns:
      (o [B, T, H, V] in v.dtype, final_state [B, H, K, V] float32 (float64 for float64 inputs) or None).
    """
    B, T, H, K, V = _validate(q, k, v, g, beta, initial_state, segment_ids, cu_seqlens)
    scale = K**-0.5 if scale is None else scale
    dtype = _compute_dtype(q, k, v, g, beta)
    doc_BT = _document_index(segment_ids, cu_seqlens, B, T)
    new_doc_BT = jnp.concatenate([jnp.zeros((B, 1), bool), doc_BT[:, 1:] != doc_BT[:, :-1]], axis=1)

    def step(S_BHKV, xs):
        q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, new_doc_B = xs
        S_BHKV = jnp.where(new_doc_B[:, None, None, None], 0.0, S_BHKV)
        S_BHKV = S_BHKV * jnp.exp(g_BHK)[..., None]
        kS_BHV = jnp.einsum("bhk,bhkv->bhv", k_BHK, S_BHKV, precision=_PRECISION)
        delta_BHV = beta_BH[..., None] * (v_BHV - kS_BHV)
        S_BHKV = S_BHKV + k_BHK[..., :, None] * delta_BHV[..., None, :]
        o_BHV = jnp.einsum("bhk,bhkv->bhv", scale * q_BHK, S_BHKV, precision=_PRECISION)
        return S_BHKV, o_BHV

    time_major = [jnp.moveaxis(jnp.asarray(x).astype(dtype), 1, 0) for x in (q, k, v, g, beta)]
    S0_BHKV = _initial_state(initial_state, B, H, K, V, dtype)
    S_BHKV, o_TBHV = lax.scan(step, S0_BHKV, (*time_major, jnp.moveaxis(new_doc_BT, 1, 0)))
    o_BTHV = jnp.moveaxis(o_TBHV, 0, 1).astype(jnp.asarray(v).dtype)
    return o_BTHV, (S_BHKV if output_final_state else None)


# ----------------------------------------------------------------------------------------------------
# Chunked WY/UT form
# ----------------------------------------------------------------------------------------------------


def _apply_unit_lower_inverse(L_BHCC, rhs_BHCM):
    """(I + L)^-1 rhs for strictly lower-triangular L, as a product of log2(C) factors.

    L is nilpotent (L^C = 0), so (I + L)^-1 = sum_i (-L)^i = prod_j (I + (-L)^(2^j)). Matmuls only:
    XLA's CPU triangular solve can stall under autodiff inside a scan for some batch sizes.
    """
    C = L_BHCC.shape[-1]
    power_BHCC = -L_BHCC
    out_BHCM = rhs_BHCM + jnp.einsum("bhij,bhjm->bhim", power_BHCC, rhs_BHCM, precision=_PRECISION)
    span = 2
    while span < C:
        power_BHCC = jnp.einsum("bhij,bhjk->bhik", power_BHCC, power_BHCC, precision=_PRECISION)
        out_BHCM = out_BHCM + jnp.einsum("bhij,bhjm->bhim", power_BHCC, out_BHCM, precision=_PRECISION)
        span *= 2
    return out_BHCM


def chunk_kda_reference(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    segment_ids=None,
    cu_seqlens=None,
    chunk_size=64,
):
    """KDA in the chunked WY/UT form (fla's algorithm) in plain jnp, a `lax.scan` over chunks.

    Within a chunk of C tokens, Gamma = cumsum(g) and, for tokens i, j of the same document,
      Aqk[i, j] = scale * sum_d q_id k_jd exp(Gamma_id - Gamma_jd)     (j <= i)
      L[i, j]   = beta_i * sum_d k_id k_jd exp(Gamma_id - Gamma_jd)    (j < i)
      w = (I + L)^-1 (beta * k * exp(Gamma)),   u = (I + L)^-1 (beta * v)
    and with the incoming state S:
      v_new = u - w S
      o     = (scale * q * exp(Gamma)) S + Aqk v_new
      S    <- Diag(exp(Gamma_last)) S + (k * exp(Gamma_last - Gamma))^T v_new.
    Only exponents <= 0 are ever exponentiated, so nothing overflows for any gate (including the
    unbounded softplus gate); document resets are masks on these terms.

    Args:
      q, k: [B, T, H, K] queries and keys.
      v: [B, T, H, V] values.
      g: [B, T, H, K] per-channel log decay (<= 0).
      beta: [B, T, H] delta-rule learning rate.
      scale: query scale; defaults to K ** -0.5.
      initial_state: optional [B, H, K, V] state before the first token (first document of each row).
      output_final_state: whether to return the state after the last token.
      segment_ids: optional [B, T] ints; a change of id starts a new document with a zero state.
      cu_seqlens: optional [N + 1] document boundaries (requires B == 1); alternative to segment_ids.
      chunk_size: C, tokens per chunk. T need not be a multiple of it.

    Returns:
      (o [B, T, H, V] in v.dtype, final_state [B, H, K, V] float32 (float64 for float64 inputs) or None).
    """
    B, T, H, K, V = _validate(q, k, v, g, beta, initial_state, segment_ids, cu_seqlens)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
    scale = K**-0.5 if scale is None else scale
    dtype = _compute_dtype(q, k, v, g, beta)
    C = chunk_size
    N = math.ceil(T / C)
    pad = N * C - T

    def to_chunks(x_BTHD):
        # Zero padding (g = beta = k = 0) leaves the state unchanged, so the final state is exact.
        x_BTHD = jnp.pad(jnp.asarray(x_BTHD).astype(dtype), [(0, 0), (0, pad), (0, 0), (0, 0)])
        return x_BTHD.reshape(B, N, C, H, -1).transpose(1, 0, 3, 2, 4)  # [N, B, H, C, D]

    q_NBHCK, k_NBHCK, v_NBHCV, g_NBHCK = map(to_chunks, (q, k, v, g))
    beta_NBHC1 = to_chunks(jnp.asarray(beta)[..., None])

    # Padding continues the row's last document so it cannot reset the final state.
    doc_BT = jnp.pad(_document_index(segment_ids, cu_seqlens, B, T), [(0, 0), (0, pad)], mode="edge")
    doc_NBC = doc_BT.reshape(B, N, C).transpose(1, 0, 2)
    # Document of the token just before each chunk; chunk 0 treats initial_state as the first
    # document's past.
    prev_doc_NB = jnp.concatenate([doc_NBC[:1, :, 0], doc_NBC[:-1, :, -1]], axis=0)

    causal_CC = jnp.tril(jnp.ones((C, C), bool))
    strict_CC = jnp.tril(jnp.ones((C, C), bool), k=-1)
    eye_CC = jnp.eye(C, dtype=dtype)

    def step(S_BHKV, xs):
        q_BHCK, k_BHCK, v_BHCV, g_BHCK, beta_BHC1, doc_BC, prev_doc_B = xs
        Gamma_BHCK = jnp.cumsum(g_BHCK, axis=-2)
        Gamma_last_BH1K = Gamma_BHCK[..., -1:, :]

        same_doc_BCC = doc_BC[:, :, None] == doc_BC[:, None, :]
        pair_B1CC1 = (causal_CC & same_doc_BCC)[:, None, :, :, None]
        # Mask BEFORE exp: for j > i the exponent is positive and unbounded (inf for steep gates,
        # and NaN gradients even when masked afterwards).
        diff_BHCCK = Gamma_BHCK[..., :, None, :] - Gamma_BHCK[..., None, :, :]
        decay_BHCCK = jnp.exp(jnp.where(pair_B1CC1, diff_BHCCK, -jnp.inf))
        Aqk_BHCC = scale * jnp.sum(q_BHCK[..., :, None, :] * k_BHCK[..., None, :, :] * decay_BHCCK, -1)
        kk_BHCC = jnp.sum(k_BHCK[..., :, None, :] * k_BHCK[..., None, :, :] * decay_BHCCK, -1)
        L_BHCC = beta_BHC1 * jnp.where(strict_CC, kk_BHCC, 0.0)

        # One triangular solve applies T = (I + L)^-1 to both right-hand sides.
        rhs_BHCM = jnp.concatenate([beta_BHC1 * k_BHCK * jnp.exp(Gamma_BHCK), beta_BHC1 * v_BHCV], -1)
        wu_BHCM = _apply_unit_lower_inverse(L_BHCC, rhs_BHCM)

        # Tokens of documents that start inside this chunk never see the incoming state. T is block
        # diagonal over documents, so zeroing rows of w equals zeroing them in the right-hand side.
        sees_state_B1C1 = (doc_BC == prev_doc_B[:, None])[:, None, :, None]
        w_BHCK = jnp.where(sees_state_B1C1, wu_BHCM[..., :K], 0.0)
        u_BHCV = wu_BHCM[..., K:]
        v_new_BHCV = u_BHCV - jnp.einsum("bhck,bhkv->bhcv", w_BHCK, S_BHKV, precision=_PRECISION)

        q_decayed_BHCK = jnp.where(sees_state_B1C1, scale * q_BHCK * jnp.exp(Gamma_BHCK), 0.0)
        o_BHCV = jnp.einsum("bhck,bhkv->bhcv", q_decayed_BHCK, S_BHKV, precision=_PRECISION)
        o_BHCV = o_BHCV + jnp.einsum("bhij,bhjv->bhiv", Aqk_BHCC, v_new_BHCV, precision=_PRECISION)

        # The outgoing state belongs to the chunk's last document: earlier documents' writes are
        # dropped, and so is the old state if that document started inside the chunk.
        in_last_doc_B1C1 = (doc_BC == doc_BC[:, -1:])[:, None, :, None]
        k_decayed_BHCK = jnp.where(in_last_doc_B1C1, k_BHCK * jnp.exp(Gamma_last_BH1K - Gamma_BHCK), 0.0)
        S_kept_BHKV = jnp.where(
            sees_state_B1C1[:, :, -1:], jnp.exp(Gamma_last_BH1K).swapaxes(-1, -2) * S_BHKV, 0.0
        )
        S_BHKV = S_kept_BHKV + jnp.einsum(
            "bhck,bhcv->bhkv", k_decayed_BHCK, v_new_BHCV, precision=_PRECISION
        )
        return S_BHKV, o_BHCV

    S0_BHKV = _initial_state(initial_state, B, H, K, V, dtype)
    xs = (q_NBHCK, k_NBHCK, v_NBHCV, g_NBHCK, beta_NBHC1, doc_NBC, prev_doc_NB)
    S_BHKV, o_NBHCV = lax.scan(step, S0_BHKV, xs)
    o_BTHV = o_NBHCV.transpose(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T]
    return o_BTHV.astype(jnp.asarray(v).dtype), (S_BHKV if output_final_state else None)


# ----------------------------------------------------------------------------------------------------
# Gates and helpers
# ----------------------------------------------------------------------------------------------------


def _validate_gate(z, A_log):
    z_shape, a_shape = jnp.shape(z), jnp.shape(A_log)
    if len(z_shape) < 2 or a_shape != (z_shape[-2],):
        raise ValueError(f"A_log must be [H] for z [..., H, K]; got A_log {a_shape}, z {z_shape}")


def kda_gate_bounded(z, A_log, lower_bound=-5.0):
    """Kimi K3's bounded log decay: g = lower_bound * sigmoid(exp(A_log)[h] * z), in (lower_bound, 0).

    The bound keeps any 16-token span within 16 * |lower_bound| nats, which is what tiled kernels rely on.

    Args:
      z: [..., H, K] gate pre-activation (any float dtype).
      A_log: [H] per-head log rate.
      lower_bound: the most negative log decay per token (< 0).

    Returns:
      g: [..., H, K] float32.
    """
    _validate_gate(z, A_log)
    if isinstance(lower_bound, (int, float)) and lower_bound >= 0:
        raise ValueError(f"lower_bound must be negative; got {lower_bound}")
    rate_H1 = jnp.exp(jnp.asarray(A_log, jnp.float32))[:, None]
    return lower_bound * jax.nn.sigmoid(rate_H1 * jnp.asarray(z, jnp.float32))


def kda_gate_softplus(z, A_log):
    """Kimi Linear's unbounded log decay: g = -exp(A_log)[h] * softplus(z) (<= 0, no lower bound).

    Args:
      z: [..., H, K] gate pre-activation (any float dtype).
      A_log: [H] per-head log rate.

    Returns:
      g: [..., H, K] float32.
    """
    _validate_gate(z, A_log)
    rate_H1 = jnp.exp(jnp.asarray(A_log, jnp.float32))[:, None]
    return -rate_H1 * jax.nn.softplus(jnp.asarray(z, jnp.float32))


def l2_normalize(x, eps=1e-6):
    """x / sqrt(sum(x**2, -1) + eps) over the last axis, computed in float32 (float64 for float64 x).

    Args:
      x: [..., D] any float dtype.
      eps: added to the squared norm, so an all-zero vector maps to zero.

    Returns:
      [..., D] in x.dtype.
    """
    x = jnp.asarray(x)
    x32 = x.astype(_compute_dtype(x))
    rnorm = lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * rnorm).astype(x.dtype)


# ----------------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------------


def _pallas_chunk_kda():
    try:
        module = importlib.import_module("pallas_kernels.kda")
        return module.chunk_kda
    except (ImportError, AttributeError) as err:
        raise ImportError(
            "impl='pallas': the Pallas KDA kernel is not available "
            f"(pallas_kernels.kda.chunk_kda could not be loaded: {err}); use impl='chunk' or 'recurrent'"
        ) from err


def kda_core(
    q,
    k,
    v,
    g,
    beta,
    *,
    impl="chunk",
    scale=None,
    initial_state=None,
    output_final_state=False,
    segment_ids=None,
    chunk_size=64,
):
    """The one entry point the layer calls: runs KDA with the implementation named by `impl`.

    Args:
      q, k: [B, T, H, K] queries and keys (L2-normalised by the caller).
      v: [B, T, H, V] values.
      g: [B, T, H, K] per-channel log decay (<= 0).
      beta: [B, T, H] delta-rule learning rate.
      impl: 'chunk' (`chunk_kda_reference`), 'recurrent' (`recurrent_kda`) or 'pallas'
        (`pallas_kernels.kda.chunk_kda`, imported on first use).
      scale: query scale; defaults to K ** -0.5.
      initial_state: optional [B, H, K, V] state before the first token.
      output_final_state: whether to return the state after the last token.
      segment_ids: optional [B, T] ints marking packed documents.
      chunk_size: tokens per chunk for 'chunk' and 'pallas'; ignored by 'recurrent'.

    Returns:
      (o [B, T, H, V] in v.dtype, final_state [B, H, K, V] float32 or None).
    """
    if impl not in _IMPLS:
        raise ValueError(f"unknown KDA impl {impl!r}; expected one of {_IMPLS}")
    _validate(q, k, v, g, beta, initial_state, segment_ids)
    kwargs = dict(
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        segment_ids=segment_ids,
    )
    if impl == "recurrent":
        return recurrent_kda(q, k, v, g, beta, **kwargs)
    if impl == "chunk":
        return chunk_kda_reference(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)
    return _pallas_chunk_kda()(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)
