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

import math

import jax
import jax.numpy as jnp
from jax import lax

from k3.backends import Table
from k3.nn import compute_dtype
from pallas_kernels.common import document_index
from pallas_kernels.kda_inputs import validate_kda_inputs

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

# The KDA cores by `model.kda.impl` ('reference' is another name for 'chunk'); 'auto' runs the
# Pallas kernel on GPUs and the jnp chunked form elsewhere. Entries are registered under Dispatch.
KDA_CORES = Table("model.kda.impl", default="chunk", auto={"gpu": "pallas"})


# ----------------------------------------------------------------------------------------------------
# Validation and input preparation
# ----------------------------------------------------------------------------------------------------


def _initial_state(initial_state, B, H, K, V, dtype):
    if initial_state is None:
        return jnp.zeros((B, H, K, V), dtype)
    return jnp.asarray(initial_state).astype(dtype)


# ----------------------------------------------------------------------------------------------------
# Token recurrence
# ----------------------------------------------------------------------------------------------------


def recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, segment_ids=None,
                  cu_seqlens=None):
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
    B, T, H, K, V = validate_kda_inputs(q, k, v, g, beta, initial_state, segment_ids, cu_seqlens)
    scale = K**-0.5 if scale is None else scale
    dtype = compute_dtype(q, k, v, g, beta)
    doc_BT = document_index(segment_ids, cu_seqlens, B, T)
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


def _apply_unit_lower_inverse(L_XCC, rhs_XCM, order=None):
    """(I + L)^-1 rhs for nilpotent L [..., C, C] (L^order = 0), as a product of log2(order) factors.

    (I + L)^-1 = sum_i (-L)^i = prod_j (I + (-L)^(2^j)). Matmuls only: XLA's CPU triangular solve can
    stall under autodiff inside a scan for some batch sizes. `order` defaults to C (strictly lower L).
    """
    order = L_XCC.shape[-1] if order is None else order
    power_XCC = -L_XCC
    out_XCM = rhs_XCM + jnp.einsum("...ij,...jm->...im", power_XCC, rhs_XCM, precision=_PRECISION)
    span = 2
    while span < order:
        # Two operands that XLA cannot prove equal: under vmap of the train step, XLA's CPU compiler
        # (jaxlib 0.10.2) rewrites a batched dot of an array with itself into one that fails its verifier.
        lhs_XCC, rhs_XCC = jax.lax.optimization_barrier((power_XCC, power_XCC))
        power_XCC = jnp.einsum("...ij,...jk->...ik", lhs_XCC, rhs_XCC, precision=_PRECISION)
        out_XCM = out_XCM + jnp.einsum("...ij,...jm->...im", power_XCC, out_XCM, precision=_PRECISION)
        span *= 2
    return out_XCM


# Sub-tile size of the intra-chunk work (see `_decayed_scores` and `_solve_unit_lower`). Small tiles
# keep the pairwise decay tensor small, which is what dominates the chunked form's cost on CPU.
_SUBTILE = 8


def _pad_axis(x, axis, size, mode="constant"):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, mode=mode)


def _solve_unit_lower(L_XCC, rhs_XCM, tile):
    """(I + L)^-1 rhs for strictly lower-triangular L [X, C, C] and rhs [X, C, M].

    With tokens in sub-tiles of `tile`, split L = D + E into its block diagonal D and the part E
    below it. Then I + L = (I + D)(I + F) with F = (I + D)^-1 E strictly block-lower, so
      (I + L)^-1 rhs = (I + F)^-1 (I + D)^-1 rhs,
    where (I + D)^-1 is C / tile independent [tile, tile] inverses and (I + F)^-1 needs only
    log2(C / tile) doubling steps instead of log2(C).
    """
    X, C, M = rhs_XCM.shape
    n_tiles = -(-C // tile)
    Cp = n_tiles * tile  # zero rows and columns past C leave the first C rows of the solution alone
    L_XCC = _pad_axis(_pad_axis(L_XCC, 1, Cp), 2, Cp)
    rhs_XCM = _pad_axis(rhs_XCM, 1, Cp)

    L_XTSTS = L_XCC.reshape(X, n_tiles, tile, n_tiles, tile)
    L_diag_XTSS = jnp.moveaxis(jnp.diagonal(L_XTSTS, axis1=1, axis2=3), -1, 1)
    eye_XTSS = jnp.broadcast_to(jnp.eye(tile, dtype=L_XCC.dtype), L_diag_XTSS.shape)
    inv_diag_XTSS = _apply_unit_lower_inverse(L_diag_XTSS, eye_XTSS)

    def inv_diag_times(y_XCD):
        y_XTSD = y_XCD.reshape(X, n_tiles, tile, -1)
        return jnp.einsum("xtij,xtjd->xtid", inv_diag_XTSS, y_XTSD, precision=_PRECISION).reshape(y_XCD.shape)

    out_XCM = inv_diag_times(rhs_XCM)
    if n_tiles > 1:
        tile_C = jnp.arange(Cp) // tile
        F_XCC = inv_diag_times(jnp.where(tile_C[:, None] == tile_C[None, :], 0.0, L_XCC))
        out_XCM = _apply_unit_lower_inverse(F_XCC, out_XCM, order=n_tiles)
    return out_XCM[:, :C]


def _decayed_scores(x_list, k_XCK, Gamma_XCK, tile):
    """For each x in x_list: sum_d x_id k_jd exp(Gamma_id - Gamma_jd) for j <= i, 0 for j > i.

    Shapes: x, k, Gamma [..., C, K] -> [..., C, C]. Tokens are grouped into sub-tiles of `tile`.
    Pairs within a sub-tile use the pairwise decay [tile, tile, K], masked before exp. For j in an
    earlier sub-tile than i, the decay factors through r, the last token before i's sub-tile
    (j <= r < i):
      exp(Gamma_i - Gamma_j) = exp(Gamma_i - Gamma_r) * exp(Gamma_r - Gamma_j),
    with both exponents <= 0, so those pairs are plain matmuls and no exponent is ever positive.
    """
    *batch, C, K = k_XCK.shape
    n_tiles = -(-C // tile)
    Cp = n_tiles * tile
    # One flat batch axis keeps every intermediate at rank <= 5 (XLA:CPU has crashed on the gradient
    # of rank-7 broadcast products with a unit axis). Tokens past C have x = k = 0 and repeat the last
    # Gamma, so their exponents stay <= 0 too.
    x_list = [_pad_axis(x.reshape(-1, C, K), 1, Cp) for x in x_list]
    k_XCK = _pad_axis(k_XCK.reshape(-1, C, K), 1, Cp)
    Gamma_XCK = _pad_axis(Gamma_XCK.reshape(-1, C, K), 1, Cp, mode="edge")

    def tiles(x_XCK):
        return x_XCK.reshape(-1, n_tiles, tile, K)  # [X, T, S, K]: T sub-tiles of S tokens

    # Within a sub-tile: pairwise decay [X, T, S, S, K], placed on the block diagonal of [T, S, T, S].
    Gamma_XTSK = tiles(Gamma_XCK)
    causal_SS1 = jnp.tril(jnp.ones((tile, tile), bool))[..., None]
    diff_XTSSK = Gamma_XTSK[..., :, None, :] - Gamma_XTSK[..., None, :, :]
    k_decayed_XTSSK = tiles(k_XCK)[..., None, :, :] * jnp.exp(jnp.where(causal_SS1, diff_XTSSK, -jnp.inf))
    eye_TT = jnp.eye(n_tiles, dtype=k_XCK.dtype)
    scores_XTSTS = []
    for x_XCK in x_list:
        within_XTSS = jnp.einsum("xtik,xtijk->xtij", tiles(x_XCK), k_decayed_XTSSK, precision=_PRECISION)
        scores_XTSTS.append(jnp.einsum("xtij,tu->xtiuj", within_XTSS, eye_TT))

    if n_tiles > 1:
        # Across sub-tiles, through Gamma_r of the token before each sub-tile (none before the first).
        Gamma_ref_XT1K = jnp.concatenate(
            [jnp.zeros_like(Gamma_XTSK[:, :1, -1:]), Gamma_XTSK[:, :-1, -1:]], axis=1
        )
        earlier_TC1 = (jnp.arange(Cp)[None, :] < tile * jnp.arange(n_tiles)[:, None])[..., None]
        to_ref_XTCK = jnp.where(earlier_TC1, Gamma_ref_XT1K - Gamma_XCK[:, None], -jnp.inf)
        k_ref_XTCK = k_XCK[:, None] * jnp.exp(to_ref_XTCK)
        from_ref_XTSK = jnp.exp(Gamma_XTSK - Gamma_ref_XT1K)
        scores_XTSTS = [
            s_XTSTS
            + jnp.einsum(
                "xtik,xtck->xtic", tiles(x_XCK) * from_ref_XTSK, k_ref_XTCK, precision=_PRECISION
            ).reshape(s_XTSTS.shape)
            for s_XTSTS, x_XCK in zip(scores_XTSTS, x_list)
        ]
    return [s_XTSTS.reshape(-1, Cp, Cp)[:, :C, :C].reshape(*batch, C, C) for s_XTSTS in scores_XTSTS]


def chunk_kda_reference(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        segment_ids=None, cu_seqlens=None, chunk_size=64):
    """KDA in the chunked WY/UT form (fla's algorithm) in plain jnp.

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

    Everything that does not involve S (Gamma, Aqk, L, w, u and the decayed q and k) is computed for
    all chunks at once; only the state recurrence (v_new and the S update) is a `lax.scan` over
    chunks, and the outputs are assembled from the per-chunk incoming states after it. Inside a chunk,
    Aqk, L and (I + L)^-1 are built from sub-tiles of `_SUBTILE` = 8 tokens (`_decayed_scores`,
    `_solve_unit_lower`), so the pairwise decay tensor is [..., C / 8, 8, 8, K], not [..., C, C, K].

    Args: those of `recurrent_kda` (same shapes and meaning), and
      chunk_size: C, tokens per chunk. T need not be a multiple of it.

    Returns:
      (o [B, T, H, V] in v.dtype, final_state [B, H, K, V] float32 (float64 for float64 inputs) or None).
    """
    B, T, H, K, V = validate_kda_inputs(q, k, v, g, beta, initial_state, segment_ids, cu_seqlens)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
    scale = K**-0.5 if scale is None else scale
    dtype = compute_dtype(q, k, v, g, beta)
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
    doc_BT = jnp.pad(document_index(segment_ids, cu_seqlens, B, T), [(0, 0), (0, pad)], mode="edge")
    doc_NBC = doc_BT.reshape(B, N, C).transpose(1, 0, 2)
    # Document of the token just before each chunk; chunk 0 treats initial_state as the first
    # document's past.
    prev_doc_NB = jnp.concatenate([doc_NBC[:1, :, 0], doc_NBC[:-1, :, -1]], axis=0)

    # ---- Intra-chunk terms, for all chunks at once ----
    Gamma_NBHCK = jnp.cumsum(g_NBHCK, axis=-2)
    Gamma_last_NBH1K = Gamma_NBHCK[..., -1:, :]

    # The causal mask is applied before exp inside `_decayed_scores`; within the causal triangle no
    # exponent is positive, so the document mask can come after.
    tile = min(C, _SUBTILE)
    qk_NBHCC, kk_NBHCC = _decayed_scores([q_NBHCK, k_NBHCK], k_NBHCK, Gamma_NBHCK, tile)
    same_doc_NB1CC = (doc_NBC[..., :, None] == doc_NBC[..., None, :])[:, :, None]
    causal_CC = jnp.tril(jnp.ones((C, C), bool))
    strict_CC = jnp.tril(jnp.ones((C, C), bool), k=-1)
    Aqk_NBHCC = jnp.where(causal_CC & same_doc_NB1CC, scale * qk_NBHCC, 0.0)
    L_NBHCC = beta_NBHC1 * jnp.where(strict_CC & same_doc_NB1CC, kk_NBHCC, 0.0)

    # One application of T = (I + L)^-1 to both right-hand sides (matmuls only, no triangular solve).
    rhs_NBHCM = jnp.concatenate([beta_NBHC1 * k_NBHCK * jnp.exp(Gamma_NBHCK), beta_NBHC1 * v_NBHCV], -1)
    wu_NBHCM = _solve_unit_lower(
        L_NBHCC.reshape(N * B * H, C, C), rhs_NBHCM.reshape(N * B * H, C, K + V), tile
    ).reshape(N, B, H, C, K + V)

    # Tokens of documents that start inside a chunk never see the incoming state. T is block
    # diagonal over documents, so zeroing rows of w equals zeroing them in the right-hand side.
    sees_state_NB1C1 = (doc_NBC == prev_doc_NB[..., None])[:, :, None, :, None]
    w_NBHCK = jnp.where(sees_state_NB1C1, wu_NBHCM[..., :K], 0.0)
    u_NBHCV = wu_NBHCM[..., K:]
    q_decayed_NBHCK = jnp.where(sees_state_NB1C1, scale * q_NBHCK * jnp.exp(Gamma_NBHCK), 0.0)

    # The outgoing state belongs to the chunk's last document: earlier documents' writes are
    # dropped, and so is the old state if that document started inside the chunk.
    in_last_doc_NB1C1 = (doc_NBC == doc_NBC[..., -1:])[:, :, None, :, None]
    k_decayed_NBHCK = jnp.where(in_last_doc_NB1C1, k_NBHCK * jnp.exp(Gamma_last_NBH1K - Gamma_NBHCK), 0.0)
    state_decay_NBHK1 = jnp.where(
        sees_state_NB1C1[..., -1:, :], jnp.exp(Gamma_last_NBH1K), 0.0
    ).swapaxes(-1, -2)

    # ---- State recurrence over chunks ----
    def step(S_BHKV, xs):
        w_BHCK, u_BHCV, k_decayed_BHCK, state_decay_BHK1 = xs
        v_new_BHCV = u_BHCV - jnp.einsum("bhck,bhkv->bhcv", w_BHCK, S_BHKV, precision=_PRECISION)
        S_next_BHKV = state_decay_BHK1 * S_BHKV + jnp.einsum(
            "bhck,bhcv->bhkv", k_decayed_BHCK, v_new_BHCV, precision=_PRECISION
        )
        return S_next_BHKV, (S_BHKV, v_new_BHCV)

    S0_BHKV = _initial_state(initial_state, B, H, K, V, dtype)
    xs = (w_NBHCK, u_NBHCV, k_decayed_NBHCK, state_decay_NBHK1)
    S_BHKV, (S_in_NBHKV, v_new_NBHCV) = lax.scan(step, S0_BHKV, xs)

    # ---- Outputs, for all chunks at once ----
    o_NBHCV = jnp.einsum("nbhck,nbhkv->nbhcv", q_decayed_NBHCK, S_in_NBHKV, precision=_PRECISION)
    o_NBHCV = o_NBHCV + jnp.einsum("nbhij,nbhjv->nbhiv", Aqk_NBHCC, v_new_NBHCV, precision=_PRECISION)
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
    x32 = x.astype(compute_dtype(x))
    rnorm = lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * rnorm).astype(x.dtype)


# ----------------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------------


@KDA_CORES.register("chunk")
@KDA_CORES.register("reference")
def _chunk_core(q, k, v, g, beta, *, chunk_size, gate_lower_bound, matmul_dtype, **kwargs):
    del gate_lower_bound, matmul_dtype
    return chunk_kda_reference(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)


@KDA_CORES.register("recurrent")
def _recurrent_core(q, k, v, g, beta, *, chunk_size, gate_lower_bound, matmul_dtype, **kwargs):
    del chunk_size, gate_lower_bound, matmul_dtype
    return recurrent_kda(q, k, v, g, beta, **kwargs)


@KDA_CORES.register("pallas")
def _pallas_core(q, k, v, g, beta, *, chunk_size, gate_lower_bound, matmul_dtype, **kwargs):
    if gate_lower_bound is None:  # the kernel's dense sub-tiles need the bounded gate
        return chunk_kda_reference(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)
    return _pallas_chunk_kda()(q, k, v, g, beta, chunk_size=chunk_size, lower_bound=gate_lower_bound,
                               matmul_dtype=matmul_dtype, **kwargs)


def _pallas_chunk_kda():
    try:  # on first use: importing Pallas costs start-up time that CPU-only users need not pay
        from pallas_kernels.kda import chunk_kda
        return chunk_kda
    except ImportError as err:
        raise ImportError(
            "impl='pallas': the Pallas KDA kernel is not available "
            f"(pallas_kernels.kda.chunk_kda could not be loaded: {err}); use impl='chunk' or 'recurrent'"
        ) from err


# jax-linear-attention's Mosaic GPU KDA kernels (Apache-2.0; setup.cfg extra 'jla', Python >= 3.12 with
# JAX 0.11.2): Hopper only, bf16 q/k/v, head dims in JLA_HEAD_DIMS with H * K a multiple of 128, chunk
# 64, and an exact intra-chunk decay for any gate, so neither chunk_size nor the bound is needed.
JLA_HEAD_DIMS = (64, 128)


@KDA_CORES.register("jla", platforms=("gpu",))
def _jla_core(q, k, v, g, beta, *, chunk_size, gate_lower_bound, matmul_dtype, **kwargs):
    del chunk_size, gate_lower_bound, matmul_dtype
    bf16 = jnp.bfloat16
    o, final = _jla_kda()(q.astype(bf16), k.astype(bf16), v.astype(bf16), g.astype(jnp.float32),
                          beta.astype(jnp.float32), **kwargs)
    return o.astype(v.dtype), final


def _jla_kda():
    try:  # optional: only the 'jla' backend needs it
        from jla.ops.mosaic_gpu.kda import kda
        return kda
    except ImportError as err:
        raise ImportError(
            "model.kda.impl='jla' needs the jax-linear-attention package (pip install '.[jla]': Python >= 3.12, "
            f"JAX 0.11.2; it could not be imported: {err}); use impl='pallas' or 'auto'"
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
    gate_lower_bound=-5.0,
    matmul_dtype=None,
):
    """The one entry point the layer calls: runs KDA with the implementation named by `impl`.

    Args:
      q, k: [B, T, H, K] queries and keys (L2-normalised by the caller).
      v: [B, T, H, V] values.
      g: [B, T, H, K] per-channel log decay (<= 0).
      beta: [B, T, H] delta-rule learning rate.
      impl: a `KDA_CORES` key: 'chunk' or 'reference' (`chunk_kda_reference`), 'recurrent'
        (`recurrent_kda`), 'pallas' (`pallas_kernels.kda.chunk_kda`, imported on first use), 'jla'
        (jax-linear-attention's Mosaic GPU kernels: Hopper, head dims 64 or 128, computed in bf16)
        or 'auto' (the Pallas kernel on GPUs, 'chunk' elsewhere).
      scale: query scale; defaults to K ** -0.5.
      initial_state: optional [B, H, K, V] state before the first token.
      output_final_state: whether to return the state after the last token.
      segment_ids: optional [B, T] ints marking packed documents.
      chunk_size: tokens per chunk for 'chunk' and 'pallas'; ignored by 'recurrent'.
      gate_lower_bound: the bound g >= gate_lower_bound the gate guarantees, or None for an unbounded
        gate. The Pallas kernel relies on it (16-token sub-tiles as dense matmuls), so 'pallas' with
        None runs the chunked reference instead.
      matmul_dtype: the Pallas kernel's matmul operand dtype ('float32' or 'bfloat16'; None: its default).

    Returns:
      (o [B, T, H, V] in v.dtype, final_state [B, H, K, V] float32 or None).
    """
    core = KDA_CORES.get(impl)
    validate_kda_inputs(q, k, v, g, beta, initial_state, segment_ids)
    return core(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                segment_ids=segment_ids, chunk_size=chunk_size, gate_lower_bound=gate_lower_bound,
                matmul_dtype=matmul_dtype)
