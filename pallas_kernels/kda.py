"""Chunked Kimi Delta Attention in Pallas: forward and backward kernels for a lower-bounded gate.

Math (per row b, head h; fla's conventions, see `k3.kda.ops`): within a chunk of C tokens with
Gamma = cumsum(g) (chunk-local, fp32) and tokens i, j of the same document,

    Aqk[i, j] = scale * sum_d q_id k_jd exp(Gamma_id - Gamma_jd)    (j <= i)
    L[i, j]   = beta_i * sum_d k_id k_jd exp(Gamma_id - Gamma_jd)   (j < i)
    T = (I + L)^-1,  w = T (beta k exp(Gamma)),  u = T (beta v)
    v_new = u - w S,  o = (scale q exp(Gamma)) S + Aqk v_new
    S <- Diag(exp(Gamma_last)) S + (k exp(Gamma_last - Gamma))^T v_new

Why the lower bound matters. Aqk and L need exp(Gamma_i - Gamma_j) as a matmul, i.e. split into a
row factor exp(Gamma_i - mu) and a column factor exp(mu - Gamma_j) around a reference mu. Over a
whole 64-token chunk the factors overflow; over a 16-token sub-tile they cannot when g >= -5
(|Gamma - mu| <= 8 * 5 = 40 nats around the sub-tile's middle token). So every 16 x 16 sub-tile is
one dense matmul: diagonal tiles around their middle token, off-diagonal tiles (row block r, column
block c < r) around Gamma at the last token of block c, where both factors are <= 1 for any gate.
There is no element-wise pairwise-decay path. The kernel accepts -10 <= lower_bound < 0 (40 -> 80
nats, still finite in fp32) and clamps g into [lower_bound, 0]; an unbounded (softplus) gate must use
the reference path (`k3.kda.ops.kda_core` does this).

Kernels (each one `pallas_call`; grids over chunks are parallel, grids over value blocks walk the
chunks in a `fori_loop` with the fp32 state in registers):

    forward   _intra_fwd   (NT, H, B)       Aqk, L by sub-tiles; T by 16x16 Neumann blocks; w, u
              _state_fwd   (V/BV, H, B)     the state chain (two matmuls a step): v_new, per-chunk states
              _output_fwd  (NT, H, B)       o = qg S_in + Aqk v_new
    backward  _state_bwd   (V/BV, H, B)     reverse chain: dh per chunk, dv_new, d initial state
              _inter_bwd   (NT, K/BK, H, B) the terms through the states (dq, dk, dGamma parts; dw)
              _pairs_bwd   (NT, H, B)       whole-chunk: dv, dbeta (values), dL = -T^T dT T^T, dAqk
              _intra_bwd   (NT, K/BK, H, B) by sub-tiles: the rest of dq, dk, dGamma, dbeta (keys)

Gamma's cumsum, padding and the masks for packed documents are plain XLA around a `custom_vjp`
core, so JAX differentiates them (dg is the reverse cumsum of dGamma).

Document boundaries (`segment_ids`) are masks inside the kernels: pairs of tokens from different
documents are zeroed in Aqk and L (T is then block diagonal over documents), tokens of a document
that starts inside a chunk do not see the incoming state, and only the chunk's last document writes
the outgoing state. T need not be a multiple of C: padding with k = v = beta = g = 0 leaves the state
unchanged.

Backend. The GPU path is the Pallas Triton lowering: it lowers `dot_general` with 16-row operands,
which is exactly the 16 x 16 sub-tile structure above, and the same kernel source runs in interpret
mode on the CPU (JAX 0.10.2) and compiled on the H200 (JAX 0.11.2). Mosaic GPU, the backend JAX
recommends, has no `dot_general` lowering; its wgmma needs M % 64 == 0 and its Python API changes
between the two JAX versions this code must support, so a Mosaic GPU variant would be a second
kernel that the CPU tests cannot interpret. Measured on the H200 (BENCHMARKS.md): the compiled
kernels agree with fla to bf16 level and pass the tests; with matmul_dtype='bfloat16' they take
2.2-2.8x fla's time forward+backward, and the sub-tile kernels are the largest share.

Precision: gates, Gamma, the state and every accumulator are fp32, and the 16 x 16 inverses (and
their backward, dL = -T^T dT T^T) are full fp32. With fp32 inputs every matmul is full fp32. With
bf16 inputs the other matmuls take fp32 operands that the GPU runs as TF32 (`matmul_dtype=
'float32'`, the default), or bf16 operands and bf16 storage of the intermediates
(`matmul_dtype='bfloat16'`). Rounding the output to bf16 alone costs a relative error of about
1.1e-3. Against the float64 recurrence on bf16 inputs (T = 1000, K = 32) the forward error
measured 1.7e-3 with fp32 intermediates and 3.2e-3 with bf16 ones, so only the former meets a 2e-3
bound; with TF32 on the H200 the bf16 tests (bound 2e-3) pass.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import default_interpret, document_index, pow2_at_least_16
from pallas_kernels.kda_inputs import validate_kda_inputs

__all__ = ["chunk_kda"]

_SUB = 16  # sub-tile: the unit of every dense matmul inside a chunk
_CHUNKS = (16, 32, 64)
_MIN_LOWER_BOUND = -10.0  # 8 tokens * 10 nats = 80 < log(float32 max) = 88.7


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Static configuration shared by the kernels (hashable: it is a custom_vjp nondiff argument)."""

    C: int  # chunk
    K: int  # padded key dim
    V: int  # padded value dim
    BV: int  # value block of the sequential kernels
    BK: int  # key block of the K-blocked backward kernels (and column block of the pair kernel)
    NT: int  # chunks per row
    scale: float
    mm_dtype: str  # operand and storage dtype of the large matmuls: 'bfloat16' or 'float32'
    h_dtype: str  # storage of the per-chunk states and their gradients
    interpret: bool
    exact: bool  # full-fp32 matmuls; otherwise fp32 operands may run as TF32 on the GPU
    intra_warps: int = 8  # Triton warps of the chunk-parallel kernels (the state kernels use 4)

    @property
    def md(self):
        return jnp.dtype(self.mm_dtype)

    @property
    def prec_mm(self):
        return lax.Precision.HIGHEST if self.exact else lax.Precision.DEFAULT

    @property
    def prec_tile(self):
        return lax.Precision.HIGHEST if self.exact else lax.Precision.DEFAULT


_HI = lax.Precision.HIGHEST


def _mm(a, b, prec):
    """[M, K] @ [K, N] -> [M, N] fp32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=prec,
                           preferred_element_type=jnp.float32)


def _mm_nt(a, b, prec):
    """[M, K] @ [N, K]^T -> [M, N] fp32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec,
                           preferred_element_type=jnp.float32)


def _mm_tn(a, b, prec):
    """[K, M]^T @ [K, N] -> [M, N] fp32."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=prec,
                           preferred_element_type=jnp.float32)


def _tile_masks():
    row = lax.broadcasted_iota(jnp.int32, (_SUB, _SUB), 0)
    col = lax.broadcasted_iota(jnp.int32, (_SUB, _SUB), 1)
    return (row == col).astype(jnp.float32), row >= col, row > col


def _neumann_inverse(L, eye):
    """(I + L)^-1 of a strictly lower 16 x 16 tile: (I - L)(I + L^2)(I + L^4)(I + L^8), exact as L^16 = 0."""
    P = eye - L
    X = _mm(L, L, _HI)
    for _ in range(3):
        P = P + _mm(P, X, _HI)
        X = _mm(X, X, _HI)
    return P


class _Tile:
    """Sub-tile r (16 tokens) of a chunk. Every entry is loaded or computed when it is asked for, so a
    kernel keeps only the tiles it is working on live (a chunk's worth of 16 x K fp32 arrays spills)."""

    def __init__(self, q_ref, k_ref, G_ref, beta_ref, doc_ref, mf_ref, r):
        self._refs = (q_ref, k_ref, G_ref, beta_ref, doc_ref, mf_ref)
        self._rows = pl.ds(r * _SUB, _SUB)
        self._r = r

    def _row(self, i):
        return self._refs[2][pl.ds(self._r * _SUB + i, 1), :]

    @property
    def q(self):
        return self._refs[0][self._rows, :].astype(jnp.float32)

    @property
    def k(self):
        return self._refs[1][self._rows, :].astype(jnp.float32)

    @property
    def G(self):
        return self._refs[2][self._rows, :]

    @property
    def G_first(self):
        return self._row(0)

    @property
    def G_mid(self):
        return self._row(_SUB // 2)

    @property
    def beta(self):
        return self._refs[3][self._rows].astype(jnp.float32)[:, None]

    @property
    def doc(self):
        return self._refs[4][self._rows]

    @property
    def mf(self):
        return self._refs[5][self._rows][:, None]


def _tiles(q_ref, k_ref, G_ref, beta_ref, doc_ref, mf_ref, nb):
    return [_Tile(q_ref, k_ref, G_ref, beta_ref, doc_ref, mf_ref, r) for r in range(nb)]


def _pair(tiles, r, c):
    """Operands of sub-tile (r, c <= r): (q rows, k rows, row factor, k columns, column factor).

    Diagonal tiles factor around the tile's middle token (factors within e^{+-8 |lower_bound|});
    off-diagonal ones around the first token of row tile r, where both factors are <= 1.
    """
    tr, tc = tiles[r], tiles[c]
    G = tr.G
    mu = tr.G_mid if r == c else tr.G_first
    row_f = jnp.exp(G - mu)
    col_f = jnp.exp(mu - (G if r == c else tc.G))
    return tr.q * row_f, tr.k * row_f, row_f, tc.k * col_f, col_f


# ----------------------------------------------------------------------------------------------------
# Forward kernels
# ----------------------------------------------------------------------------------------------------


def _intra_fwd_kernel(q_ref, k_ref, v_ref, G_ref, beta_ref, doc_ref, mf_ref,
                      w_ref, u_ref, aqk_ref, t_ref, *, cfg: _Cfg):
    """One chunk: Aqk [C, C], T = (I + L)^-1 [C, C], w [C, K], u [C, V]."""
    nb, md, pt = cfg.C // _SUB, cfg.md, cfg.prec_tile
    eye, causal, strict = _tile_masks()
    tiles = _tiles(q_ref, k_ref, G_ref, beta_ref, doc_ref, mf_ref, nb)
    zero = jnp.zeros((_SUB, _SUB), jnp.float32)

    Lb = [[None] * nb for _ in range(nb)]
    for r in range(nb):
        for c in range(nb):
            cols = pl.ds(c * _SUB, _SUB)
            if c > r:
                aqk_ref[pl.ds(r * _SUB, _SUB), cols] = zero.astype(aqk_ref.dtype)
                continue
            rq, rk, _, col, _ = _pair(tiles, r, c)
            same = tiles[r].doc[:, None] == tiles[c].doc[None, :]
            qk = _mm_nt(rq, col, pt)
            kk = _mm_nt(rk, col, pt)
            mask_a, mask_l = (causal & same, strict & same) if r == c else (same, same)
            aqk_ref[pl.ds(r * _SUB, _SUB), cols] = jnp.where(mask_a, cfg.scale * qk, 0.0).astype(aqk_ref.dtype)
            Lb[r][c] = jnp.where(mask_l, tiles[r].beta * kk, 0.0)

    # Block forward substitution: T_rr = (I + L_rr)^-1, T_rc = -T_rr sum_{m=c}^{r-1} L_rm T_mc.
    Tb = [[None] * nb for _ in range(nb)]
    for r in range(nb):
        Tb[r][r] = _neumann_inverse(Lb[r][r], eye)
        for c in range(r - 1, -1, -1):
            acc = _mm(Lb[r][c], Tb[c][c], _HI)
            for m in range(c + 1, r):
                acc = acc + _mm(Lb[r][m], Tb[m][c], _HI)
            Tb[r][c] = -_mm(Tb[r][r], acc, _HI)
        for c in range(nb):
            t_ref[pl.ds(r * _SUB, _SUB), pl.ds(c * _SUB, _SUB)] = (Tb[r][c] if c <= r else zero)

    def kb(c):
        t = tiles[c]
        return (t.beta * t.mf * t.k * jnp.exp(t.G)).astype(md)

    def vb(c):
        return (tiles[c].beta * v_ref[pl.ds(c * _SUB, _SUB), :].astype(jnp.float32)).astype(md)

    for r in range(nb):
        w = sum(_mm(Tb[r][c].astype(md), kb(c), cfg.prec_mm) for c in range(r + 1))
        u = sum(_mm(Tb[r][c].astype(md), vb(c), cfg.prec_mm) for c in range(r + 1))
        w_ref[pl.ds(r * _SUB, _SUB), :] = w.astype(w_ref.dtype)
        u_ref[pl.ds(r * _SUB, _SUB), :] = u.astype(u_ref.dtype)


def _chunk_decays(q_ref, k_ref, G_ref, mf_ref, ml_ref, n, cfg):
    """Decayed queries qg [C, K], keys kg [C, K] and the state decay [1, K] of chunk n."""
    C = cfg.C
    rows = pl.ds(n * C, C)
    G = G_ref[rows, :]
    G_last = G_ref[pl.ds(n * C + C - 1, 1), :]
    mf, ml = mf_ref[rows][:, None], ml_ref[rows][:, None]
    qg = cfg.scale * q_ref[rows, :].astype(jnp.float32) * jnp.exp(G) * mf
    kg = k_ref[rows, :].astype(jnp.float32) * jnp.exp(G_last - G) * ml
    # The old state survives the chunk only if the chunk's last token still belongs to its document.
    decay = jnp.exp(G_last) * mf_ref[pl.ds(n * C + C - 1, 1)][None, :]
    return qg, kg, decay


def _state_fwd_kernel(k_ref, G_ref, w_ref, u_ref, mf_ref, ml_ref, h0_ref,
                      vn_ref, h_ref, ht_ref, *, cfg: _Cfg):
    """One (row, head, value block): the chunk chain, two matmuls a step. The state is kept
    transposed, St = S^T [BV, K]; the state entering each chunk is saved for the output kernel."""
    C, md, pm = cfg.C, cfg.md, cfg.prec_mm
    j = pl.program_id(0)

    def body(n, St):
        rows = pl.ds(n * C, C)
        G = G_ref[rows, :]
        G_last = G_ref[pl.ds(n * C + C - 1, 1), :]
        kg = k_ref[rows, :].astype(jnp.float32) * jnp.exp(G_last - G) * ml_ref[rows][:, None]
        # The old state survives the chunk only if the chunk's last token still belongs to its document.
        decay = jnp.exp(G_last) * mf_ref[pl.ds(n * C + C - 1, 1)][None, :]
        h_ref[pl.ds(n * cfg.V + j * cfg.BV, cfg.BV), :] = St.astype(h_ref.dtype)
        vn = u_ref[rows, :].astype(jnp.float32) - _mm_nt(w_ref[rows, :], St.astype(md), pm)
        vnm = vn.astype(md)
        vn_ref[rows, :] = vnm.astype(vn_ref.dtype)
        return St * decay + _mm_tn(vnm, kg.astype(md), pm)

    ht_ref[...] = lax.fori_loop(0, cfg.NT, body, h0_ref[...].astype(jnp.float32))


def _output_fwd_kernel(q_ref, G_ref, mf_ref, h_ref, aqk_ref, vn_ref, o_ref, *, cfg: _Cfg):
    """One chunk: o = (scale q e^Gamma) S_in + Aqk v_new [C, V] (rows of a document that starts inside
    the chunk do not see S_in)."""
    md, pm = cfg.md, cfg.prec_mm
    qg = cfg.scale * q_ref[...].astype(jnp.float32) * jnp.exp(G_ref[...]) * mf_ref[...][:, None]
    o = _mm_nt(qg.astype(md), h_ref[...].astype(md), pm) + _mm(aqk_ref[...], vn_ref[...].astype(md), pm)
    o_ref[...] = o.astype(o_ref.dtype)


# ----------------------------------------------------------------------------------------------------
# Backward kernels
# ----------------------------------------------------------------------------------------------------


def _state_bwd_kernel(q_ref, k_ref, G_ref, w_ref, aqk_ref, do_ref, mf_ref, ml_ref, dht_ref,
                      dh_ref, dvn_ref, dh0_ref, *, cfg: _Cfg):
    """Reverse chunk chain: dh_n (gradient of the state leaving chunk n), dv_new, d initial state."""
    C, md, pm, NT = cfg.C, cfg.md, cfg.prec_mm, cfg.NT
    j = pl.program_id(0)

    def body(i, dSt):
        n = NT - 1 - i
        rows = pl.ds(n * C, C)
        qg, kg, decay = _chunk_decays(q_ref, k_ref, G_ref, mf_ref, ml_ref, n, cfg)
        dh_ref[pl.ds(n * cfg.V + j * cfg.BV, cfg.BV), :] = dSt.astype(dh_ref.dtype)
        dO = do_ref[rows, :].astype(md)
        dvn = _mm_tn(aqk_ref[rows, :], dO, pm) + _mm_nt(kg.astype(md), dSt.astype(md), pm)
        dvn_ref[rows, :] = dvn
        return dSt * decay + _mm_tn(dO, qg.astype(md), pm) - _mm_tn(dvn.astype(md), w_ref[rows, :], pm)

    dh0_ref[...] = lax.fori_loop(0, NT, body, dht_ref[...].astype(jnp.float32))


def _inter_bwd_kernel(q_ref, k_ref, G_ref, mf_ref, ml_ref, h_ref, dh_ref, do_ref, vn_ref, dvn_ref,
                      dq_ref, dk_ref, dG_ref, dw_ref, *, cfg: _Cfg):
    """One chunk, the terms through the states: o = qg S_in, S_out = decay S_in + kg^T v_new,
    v_new = u - w S_in. One key block [C, BK]; writes the first parts of dq, dk, dGamma and dw."""
    f32, md, pm, C = jnp.float32, cfg.md, cfg.prec_mm, cfg.C
    G = G_ref[...]
    G_end = G_ref[pl.ds(C - 1, 1), :]
    keep_state = mf_ref[pl.ds(C - 1, 1)][None, :]
    Sh = h_ref[...].astype(md)  # S_in^T [V, K]
    dSh = dh_ref[...].astype(md)  # dS_out^T [V, K]
    dd = jnp.sum(h_ref[...].astype(f32) * dh_ref[...].astype(f32), axis=0)[None, :]  # d decay [1, K]
    # qg = scale q e^Gamma on the rows that see the state
    dq = cfg.scale * jnp.exp(G) * mf_ref[...][:, None] * _mm(do_ref[...].astype(md), Sh, pm)
    # kg = k e^{Gamma_end - Gamma} on the rows of the chunk's last document
    dk = jnp.exp(G_end - G) * ml_ref[...][:, None] * _mm(vn_ref[...].astype(md), dSh, pm)
    kg_dkg = k_ref[...].astype(f32) * dk
    dG_end = keep_state * jnp.exp(G_end) * dd + jnp.sum(kg_dkg, axis=0)[None, :]
    last_row = lax.broadcasted_iota(jnp.int32, (C, 1), 0) == C - 1
    dq_ref[...] = dq
    dk_ref[...] = dk
    dG_ref[...] = q_ref[...].astype(f32) * dq - kg_dkg + jnp.where(last_row, dG_end, 0.0)
    dw_ref[...] = -_mm(dvn_ref[...].astype(md), Sh, pm)


def _pairs_bwd_kernel(k_ref, v_ref, G_ref, beta_ref, doc_ref, mf_ref, t_ref, do_ref, vn_ref,
                      dvn_ref, dw_ref, dv_ref, dbeta_ref, da_ref, dl_ref, *, cfg: _Cfg):
    """One chunk, whole-chunk matmuls (no decay factors needed): from dv_new and dw back through
    u = T (beta v), w = T kb and T = (I + L)^-1 to dv, the value part of dbeta, dL [C, C] and
    dAqk [C, C] (both masked to the pairs that exist)."""
    f32, pm, pt, C = jnp.float32, cfg.prec_mm, cfg.prec_tile, cfg.C
    T = t_ref[...]
    beta = beta_ref[...].astype(f32)[:, None]
    bmf = beta * mf_ref[...][:, None]
    # Column blocks keep only [C, BK] slices of the [C, V] and [C, K] operands live (whole ones spill).
    dT = jnp.zeros((C, C), f32)
    dbeta = jnp.zeros((C,), f32)
    for j in range(cfg.V // cfg.BK):
        cols = pl.ds(j * cfg.BK, cfg.BK)
        dvn, v = dvn_ref[:, cols], v_ref[:, cols].astype(f32)
        dvb = _mm_tn(T, dvn, pt)
        dv_ref[:, cols] = (beta * dvb).astype(dv_ref.dtype)
        dbeta = dbeta + jnp.sum(v * dvb, axis=1)
        dT = dT + _mm_nt(dvn, beta * v, pt)
    for j in range(cfg.K // cfg.BK):
        cols = pl.ds(j * cfg.BK, cfg.BK)
        kb = bmf * k_ref[:, cols].astype(f32) * jnp.exp(G_ref[:, cols])
        dT = dT + _mm_nt(dw_ref[:, cols], kb, pt)
    dbeta_ref[...] = dbeta
    row = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    doc = doc_ref[...]
    same = doc[:, None] == doc[None, :]
    dL = -_mm_nt(_mm_tn(T, dT, _HI), T, _HI)
    dl_ref[...] = jnp.where((row > col) & same, dL, 0.0)
    dA = cfg.scale * _mm_nt(do_ref[...].astype(cfg.md), vn_ref[...].astype(cfg.md), pm)
    da_ref[...] = jnp.where((row >= col) & same, dA, 0.0)


def _intra_bwd_kernel(q_ref, k_ref, G_ref, beta_ref, doc_ref, mf_ref, t_ref, dw_ref, da_ref, dl_ref,
                      dq0_ref, dk0_ref, dG0_ref, dq_ref, dk_ref, dG_ref, dbeta_ref, *, cfg: _Cfg):
    """One chunk and key block [C, BK], by sub-tiles: from dw (w = T kb) and dL, dAqk back through the
    sub-tile factorisation to dq, dk, dGamma (added to the inter-chunk parts) and this key block's
    part of dbeta."""
    f32, pt, C = jnp.float32, cfg.prec_tile, cfg.C
    nb = C // _SUB
    tiles = _tiles(q_ref, k_ref, G_ref, beta_ref, doc_ref, mf_ref, nb)

    def rows(r):
        return pl.ds(r * _SUB, _SUB)

    dq = [dq0_ref[rows(r), :] for r in range(nb)]
    dk = [dk0_ref[rows(r), :] for r in range(nb)]
    dG = [dG0_ref[rows(r), :] for r in range(nb)]

    dbeta = []
    for c in range(nb):
        dkb_c = sum(_mm_tn(t_ref[rows(r), rows(c)], dw_ref[rows(r), :], pt) for r in range(c, nb))
        t = tiles[c]
        eG = jnp.exp(t.G)
        k_eG_dkb = t.k * eG * dkb_c
        dbeta.append(t.mf[:, 0] * jnp.sum(k_eG_dkb, axis=1))
        dk[c] = dk[c] + t.beta * t.mf * eG * dkb_c
        dG[c] = dG[c] + t.beta * t.mf * k_eG_dkb

    for r in range(nb):
        t = tiles[r]
        for c in range(r + 1):
            rq, rk, row_f, col, col_f = _pair(tiles, r, c)
            dA = da_ref[rows(r), rows(c)]
            dL = dl_ref[rows(r), rows(c)]
            dbeta[r] = dbeta[r] + jnp.sum(dL * _mm_nt(rk, col, pt), axis=1)
            dP = t.beta * dL
            Xq = _mm(dA, col, pt)
            Xk = _mm(dP, col, pt)
            dq[r] = dq[r] + row_f * Xq
            dk[r] = dk[r] + row_f * Xk
            dG[r] = dG[r] + rq * Xq + rk * Xk
            Y = _mm_tn(dA, rq, pt) + _mm_tn(dP, rk, pt)
            dk[c] = dk[c] + col_f * Y
            dG[c] = dG[c] - col * Y

    for r in range(nb):
        dq_ref[rows(r), :] = dq[r].astype(dq_ref.dtype)
        dk_ref[rows(r), :] = dk[r].astype(dk_ref.dtype)
        dbeta_ref[rows(r)] = dbeta[r]
        dG_ref[rows(r), :] = dG[r]


# ----------------------------------------------------------------------------------------------------
# pallas_call wrappers
# ----------------------------------------------------------------------------------------------------


def _compiler_params(cfg, num_warps):
    """Triton launch parameters; the chunk kernels hold many 16 x K tiles, so they get more warps."""
    if cfg.interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=1)


def _chunk_specs(cfg, B, H):
    """BlockSpecs for the chunk-parallel grid (NT, H, B)."""
    C = cfg.C

    def tok(D):
        return pl.BlockSpec((None, C, None, D), lambda n, h, b: (b, n, h, 0))

    per_tok = pl.BlockSpec((None, C, None), lambda n, h, b: (b, n, h))
    per_row = pl.BlockSpec((None, C), lambda n, h, b: (b, n))
    state = pl.BlockSpec((None, None, cfg.V, cfg.K), lambda n, h, b: (b, h, n, 0))
    return tok, per_tok, per_row, state


def _seq_specs(cfg):
    """BlockSpecs for the value-block grid (V / BV, H, B): whole rows, walked inside the kernel."""
    Tp = cfg.NT * cfg.C

    def tok(D):
        return pl.BlockSpec((None, Tp, None, D), lambda j, h, b: (b, 0, h, 0))

    vblk = pl.BlockSpec((None, Tp, None, cfg.BV), lambda j, h, b: (b, 0, h, j))
    per_row = pl.BlockSpec((None, Tp), lambda j, h, b: (b, 0))
    # Per-chunk states [B, H, NT * V, K]: every value block of a (row, head) writes its own rows of
    # the one shared block, so the stores are plain row slices like the outputs'.
    states = pl.BlockSpec((None, None, cfg.NT * cfg.V, cfg.K), lambda j, h, b: (b, h, 0, 0))
    one_state = pl.BlockSpec((None, None, cfg.BV, cfg.K), lambda j, h, b: (b, h, j, 0))
    return tok, vblk, per_row, states, one_state


def _intra_fwd(cfg, q, k, v, G, beta, doc, mf):
    """w [B, Tp, H, K], u [B, Tp, H, V], Aqk and T [B, Tp, H, C] for every chunk."""
    B, Tp, H, _ = q.shape
    C, K, V, NT, md = cfg.C, cfg.K, cfg.V, cfg.NT, cfg.md
    tok, per_tok, per_row, _ = _chunk_specs(cfg, B, H)
    return pl.pallas_call(
        functools.partial(_intra_fwd_kernel, cfg=cfg),
        grid=(NT, H, B),
        in_specs=[tok(K), tok(K), tok(V), tok(K), per_tok, per_row, per_row],
        out_specs=[tok(K), tok(V), tok(C), tok(C)],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, K), md), jax.ShapeDtypeStruct((B, Tp, H, V), md),
                   jax.ShapeDtypeStruct((B, Tp, H, C), md),
                   jax.ShapeDtypeStruct((B, Tp, H, C), jnp.float32)],
        interpret=cfg.interpret, compiler_params=_compiler_params(cfg, cfg.intra_warps), name="kda_intra_fwd",
    )(q, k, v, G, beta, doc, mf)


def _state_fwd(cfg, k, G, w, u, mf, ml, h0t):
    """v_new [B, Tp, H, V], per-chunk states [B, H, NT * V, K], final state^T [B, H, V, K]."""
    B, Tp, H, K = k.shape
    V, NT = cfg.V, cfg.NT
    stok, vblk, srow, states, one_state = _seq_specs(cfg)
    return pl.pallas_call(
        functools.partial(_state_fwd_kernel, cfg=cfg),
        grid=(V // cfg.BV, H, B),
        in_specs=[stok(K), stok(K), stok(K), vblk, srow, srow, one_state],
        out_specs=[vblk, states, one_state],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, V), cfg.md),
                   jax.ShapeDtypeStruct((B, H, NT * V, K), cfg.h_dtype),
                   jax.ShapeDtypeStruct((B, H, V, K), jnp.float32)],
        interpret=cfg.interpret, compiler_params=_compiler_params(cfg, 4), name="kda_state_fwd",
    )(k, G, w, u, mf, ml, h0t)


def _output_fwd(cfg, q, G, mf, h, aqk, vn, out_dtype):
    """o [B, Tp, H, V] from the saved states, Aqk and v_new, every chunk in parallel."""
    B, Tp, H, K = q.shape
    C, V, NT = cfg.C, cfg.V, cfg.NT
    tok, _, per_row, state = _chunk_specs(cfg, B, H)
    return pl.pallas_call(
        functools.partial(_output_fwd_kernel, cfg=cfg),
        grid=(NT, H, B),
        in_specs=[tok(K), tok(K), per_row, state, tok(C), tok(V)],
        out_specs=tok(V),
        out_shape=jax.ShapeDtypeStruct((B, Tp, H, V), out_dtype),
        interpret=cfg.interpret, compiler_params=_compiler_params(cfg, 4), name="kda_output_fwd",
    )(q, G, mf, h, aqk, vn)


def _forward(cfg, q, k, v, G, beta, h0t, doc, mf, ml):
    w, u, aqk, T = _intra_fwd(cfg, q, k, v, G, beta, doc, mf)
    vn, h, ht = _state_fwd(cfg, k, G, w, u, mf, ml, h0t)
    o = _output_fwd(cfg, q, G, mf, h, aqk, vn, q.dtype)
    return o, ht, (w, aqk, T, h, vn)


def _state_bwd(cfg, q, k, G, w, aqk, do, mf, ml, dht):
    """dh [B, H, NT * V, K], dv_new [B, Tp, H, V], d initial state^T [B, H, V, K]."""
    B, Tp, H, _ = q.shape
    C, K, V, NT = cfg.C, cfg.K, cfg.V, cfg.NT
    stok, vblk, srow, states, one_state = _seq_specs(cfg)
    return pl.pallas_call(
        functools.partial(_state_bwd_kernel, cfg=cfg),
        grid=(V // cfg.BV, H, B),
        in_specs=[stok(K), stok(K), stok(K), stok(K), stok(C), vblk, srow, srow, one_state],
        out_specs=[states, vblk, one_state],
        out_shape=[jax.ShapeDtypeStruct((B, H, NT * V, K), cfg.h_dtype),
                   jax.ShapeDtypeStruct((B, Tp, H, V), jnp.float32),
                   jax.ShapeDtypeStruct((B, H, V, K), jnp.float32)],
        interpret=cfg.interpret, compiler_params=_compiler_params(cfg, 4), name="kda_state_bwd",
    )(q, k, G, w, aqk, do, mf, ml, dht)


def _inter_bwd(cfg, q, k, G, mf, ml, h, dh, do, vn, dvn):
    """Inter-chunk parts of dq, dk, dGamma and dw, each [B, Tp, H, K] fp32; every term is per key
    channel, so the grid splits the keys into blocks."""
    B, Tp, H, K = q.shape
    C, BK, V, NT = cfg.C, cfg.BK, cfg.V, cfg.NT
    kblk = pl.BlockSpec((None, C, None, BK), lambda n, j, h, b: (b, n, h, j))
    vtok = pl.BlockSpec((None, C, None, V), lambda n, j, h, b: (b, n, h, 0))
    per_row = pl.BlockSpec((None, C), lambda n, j, h, b: (b, n))
    state = pl.BlockSpec((None, None, V, BK), lambda n, j, h, b: (b, h, n, j))
    f32 = jax.ShapeDtypeStruct((B, Tp, H, K), jnp.float32)
    return pl.pallas_call(
        functools.partial(_inter_bwd_kernel, cfg=cfg),
        grid=(NT, K // BK, H, B),
        in_specs=[kblk, kblk, kblk, per_row, per_row, state, state, vtok, vtok, vtok],
        out_specs=[kblk] * 4,
        out_shape=[f32] * 4,
        interpret=cfg.interpret, compiler_params=_compiler_params(cfg, 4), name="kda_inter_bwd",
    )(q, k, G, mf, ml, h, dh, do, vn, dvn)


def _pairs_bwd(cfg, k, v, G, beta, doc, mf, T, do, vn, dvn, dw):
    """dv [B, Tp, H, V], the value part of dbeta [B, Tp, H] fp32, dL and dAqk [B, Tp, H, C] fp32."""
    B, Tp, H, K = k.shape
    C, V, NT = cfg.C, cfg.V, cfg.NT
    tok, per_tok, per_row, _ = _chunk_specs(cfg, B, H)
    pairs = jax.ShapeDtypeStruct((B, Tp, H, C), jnp.float32)
    return pl.pallas_call(
        functools.partial(_pairs_bwd_kernel, cfg=cfg),
        grid=(NT, H, B),
        in_specs=[tok(K), tok(V), tok(K), per_tok, per_row, per_row, tok(C), tok(V), tok(V), tok(V),
                  tok(K)],
        out_specs=[tok(V), per_tok, tok(C), tok(C)],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, V), v.dtype), jax.ShapeDtypeStruct((B, Tp, H), jnp.float32),
                   pairs, pairs],
        interpret=cfg.interpret, compiler_params=_compiler_params(cfg, cfg.intra_warps), name="kda_pairs_bwd",
    )(k, v, G, beta, doc, mf, T, do, vn, dvn, dw)


def _intra_bwd(cfg, q, k, G, beta, doc, mf, T, dw, dA, dL, dq0, dk0, dG0):
    """dq, dk [B, Tp, H, K], dGamma [B, Tp, H, K] fp32, and the key blocks' parts of dbeta
    [K / BK, B, Tp, H] fp32."""
    B, Tp, H, K = q.shape
    C, BK, NT = cfg.C, cfg.BK, cfg.NT
    nk = K // BK
    kblk = pl.BlockSpec((None, C, None, BK), lambda n, j, h, b: (b, n, h, j))
    pairs = pl.BlockSpec((None, C, None, C), lambda n, j, h, b: (b, n, h, 0))
    per_tok = pl.BlockSpec((None, C, None), lambda n, j, h, b: (b, n, h))
    per_row = pl.BlockSpec((None, C), lambda n, j, h, b: (b, n))
    part = pl.BlockSpec((None, None, C, None), lambda n, j, h, b: (j, b, n, h))
    return pl.pallas_call(
        functools.partial(_intra_bwd_kernel, cfg=cfg),
        grid=(NT, nk, H, B),
        in_specs=[kblk, kblk, kblk, per_tok, per_row, per_row, pairs, kblk, pairs, pairs, kblk, kblk, kblk],
        out_specs=[kblk, kblk, kblk, part],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, K), q.dtype), jax.ShapeDtypeStruct((B, Tp, H, K), k.dtype),
                   jax.ShapeDtypeStruct((B, Tp, H, K), jnp.float32),
                   jax.ShapeDtypeStruct((nk, B, Tp, H), jnp.float32)],
        interpret=cfg.interpret, compiler_params=_compiler_params(cfg, 4), name="kda_intra_bwd",
    )(q, k, G, beta, doc, mf, T, dw, dA, dL, dq0, dk0, dG0)


def _backward(cfg, q, k, v, G, beta, doc, mf, ml, w, aqk, T, h, vn, do, dht):
    dh, dvn, dh0 = _state_bwd(cfg, q, k, G, w, aqk, do, mf, ml, dht)
    dq0, dk0, dG0, dw = _inter_bwd(cfg, q, k, G, mf, ml, h, dh, do, vn, dvn)
    dv, dbeta_v, dA, dL = _pairs_bwd(cfg, k, v, G, beta, doc, mf, T, do, vn, dvn, dw)
    dq, dk, dG, dbeta_k = _intra_bwd(cfg, q, k, G, beta, doc, mf, T, dw, dA, dL, dq0, dk0, dG0)
    dbeta = (dbeta_v + jnp.sum(dbeta_k, axis=0)).astype(beta.dtype)
    return dq, dk, dv, dG, dbeta, dh0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda(cfg, q, k, v, G, beta, h0t, doc, mf, ml):
    o, ht, _ = _forward(cfg, q, k, v, G, beta, h0t, doc, mf, ml)
    return o, ht


def _kda_fwd(cfg, q, k, v, G, beta, h0t, doc, mf, ml):
    o, ht, saved = _forward(cfg, q, k, v, G, beta, h0t, doc, mf, ml)
    return (o, ht), (q, k, v, G, beta, doc, mf, ml, *saved)


def _kda_bwd(cfg, res, cts):
    q, k, v, G, beta, doc, mf, ml, w, aqk, T, h, vn = res
    do, dht = cts
    dq, dk, dv, dG, dbeta, dh0 = _backward(cfg, q, k, v, G, beta, doc, mf, ml, w, aqk, T, h, vn,
                                           do.astype(v.dtype), dht.astype(jnp.float32))
    return dq, dk, dv, dG, dbeta, dh0, jnp.zeros_like(doc), jnp.zeros_like(mf), jnp.zeros_like(ml)


_kda.defvjp(_kda_fwd, _kda_bwd)


# ----------------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------------


def _check_gate_callback(g_min, lower_bound):
    if float(g_min) < lower_bound:
        raise ValueError(f"chunk_kda: the log decay g reaches {float(g_min):.4g}, below lower_bound = "
                         f"{lower_bound}; use the reference path (impl='chunk') for an unbounded gate")


def _prepare(q, k, v, g, beta, *, scale, initial_state, segment_ids, interpret, chunk_size,
             lower_bound, check_gate, matmul_dtype):
    """Static config and the padded kernel inputs (q, k, v, Gamma, beta, h0^T, doc, mf, ml)."""
    B, T, H, K0, V0 = validate_kda_inputs(q, k, v, g, beta, initial_state, segment_ids)
    if chunk_size not in _CHUNKS:
        raise ValueError(f"chunk_kda: chunk_size must be one of {_CHUNKS}; got {chunk_size!r}")
    if not (_MIN_LOWER_BOUND <= float(lower_bound) < 0):
        raise ValueError(f"chunk_kda: lower_bound must be in [{_MIN_LOWER_BOUND}, 0); got {lower_bound}")
    scale = K0**-0.5 if scale is None else float(scale)
    interpret = default_interpret() if interpret is None else bool(interpret)
    low_precision = any(jnp.dtype(x.dtype).itemsize < 4 for x in (q, k, v))
    in_dtype = jnp.bfloat16 if low_precision else jnp.float32
    C = chunk_size
    NT = max(1, math.ceil(T / C))
    Tp, K, V = NT * C, pow2_at_least_16(K0), pow2_at_least_16(V0)
    BV = min(V, 64)
    if matmul_dtype is None:
        matmul_dtype = "float32"
    if matmul_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"chunk_kda: matmul_dtype must be 'float32' or 'bfloat16'; got {matmul_dtype!r}")
    cfg = _Cfg(C=C, K=K, V=V, BV=BV, BK=min(K, V, 32), NT=NT, scale=scale, mm_dtype=matmul_dtype, h_dtype=matmul_dtype,
               interpret=interpret, exact=not low_precision)

    g = jnp.asarray(g).astype(jnp.float32)
    if check_gate:
        jax.debug.callback(functools.partial(_check_gate_callback, lower_bound=float(lower_bound)),
                           jnp.min(g))
    # A select, not jnp.clip: the gradient at g == lower_bound must be 1, not clip's tie-split 0.5.
    g = jnp.where(g < lower_bound, lower_bound, jnp.where(g > 0.0, 0.0, g))

    def pad(x, dtype, D):
        x = jnp.asarray(x).astype(dtype)
        return jnp.pad(x, [(0, 0), (0, Tp - T), (0, 0), (0, D - x.shape[-1])])

    qp, kp, vp = pad(q, in_dtype, K), pad(k, in_dtype, K), pad(v, in_dtype, V)
    gp = pad(g, jnp.float32, K)
    G = jnp.cumsum(gp.reshape(B, NT, C, H, K), axis=2).reshape(B, Tp, H, K)
    betap = jnp.pad(jnp.asarray(beta).astype(jnp.float32), [(0, 0), (0, Tp - T), (0, 0)])

    # Documents as float ids (exact below 2^24), and the two per-token masks: sees the incoming
    # state (same document as the token before the chunk), belongs to the chunk's last document.
    doc = jnp.pad(document_index(segment_ids, None, B, T), [(0, 0), (0, Tp - T)], mode="edge")
    doc_BNC = doc.reshape(B, NT, C)
    prev = jnp.concatenate([doc_BNC[:, :1, 0], doc_BNC[:, :-1, -1]], axis=1)
    mf = (doc_BNC == prev[..., None]).reshape(B, Tp).astype(jnp.float32)
    ml = (doc_BNC == doc_BNC[..., -1:]).reshape(B, Tp).astype(jnp.float32)
    docf = doc.astype(jnp.float32)

    if initial_state is None:
        h0t = jnp.zeros((B, H, V, K), jnp.float32)
    else:
        h0 = jnp.asarray(initial_state).astype(jnp.float32)
        h0t = jnp.pad(h0, [(0, 0), (0, 0), (0, K - K0), (0, V - V0)]).swapaxes(-1, -2)

    return cfg, (qp, kp, vp, G, betap, h0t, docf, mf, ml)


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              segment_ids=None, interpret=None, chunk_size=64, lower_bound=-5.0, check_gate=False,
              matmul_dtype=None):
    """Chunked KDA with Pallas kernels, forward and backward (`jax.custom_vjp`).

    Same layout, conventions and return value as `k3.kda.ops.chunk_kda_reference`.

    Args:
      q, k: [B, T, H, K] queries and keys (used as given; the layer L2-normalises them).
      v: [B, T, H, V] values.
      g: [B, T, H, K] per-channel log decay. Values are clamped into [lower_bound, 0] (the kernel's
        contract: a bounded gate such as `k3.kda.ops.kda_gate_bounded`); with `check_gate=True` a
        value below lower_bound raises instead (at run time, through a host callback).
      beta: [B, T, H] delta-rule learning rate.
      scale: query scale; defaults to K ** -0.5.
      initial_state: optional [B, H, K, V] state before the first token (first document of each row).
      output_final_state: whether to return the state after the last token.
      segment_ids: optional [B, T] ints; a change of id starts a new document with a zero state.
      interpret: run the kernels in Pallas interpret mode; None picks it on any backend but GPU (or
        from the environment variable K3_PALLAS_INTERPRET=0/1).
      chunk_size: C in (16, 32, 64). T need not be a multiple of it.
      lower_bound: the gate's bound, in [-10, 0).
      check_gate: raise when g < lower_bound instead of clamping.
      matmul_dtype: operand and storage dtype of the large matmuls and the saved intermediates
        (w, u, Aqk, v_new, per-chunk states). 'float32' (default): with 16-bit inputs they run as
        TF32 on the GPU; with fp32 inputs as full fp32. 'bfloat16': half the bytes and bf16 tensor
        cores, at about twice the error of a bf16 output.

    Returns:
      (o [B, T, H, V] in v.dtype, final_state [B, H, K, V] float32 or None).
    """
    B, T, H, K0, V0 = validate_kda_inputs(q, k, v, g, beta, initial_state, segment_ids)
    cfg, args = _prepare(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         segment_ids=segment_ids, interpret=interpret, chunk_size=chunk_size,
                         lower_bound=lower_bound, check_gate=check_gate, matmul_dtype=matmul_dtype)
    o, ht = _kda(cfg, *args)
    o = o[:, :T, :, :V0].astype(jnp.asarray(v).dtype)
    final = ht.swapaxes(-1, -2)[:, :, :K0, :V0] if output_final_state else None
    return o, final
