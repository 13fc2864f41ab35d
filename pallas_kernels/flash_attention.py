"""Causal flash attention over packed documents, visiting only the key blocks of the query's document.

Math (per row b, head h): o_i = sum_j p_ij v_j with p_ij = softmax_j(scale * q_i . k_j) over the keys
j <= i of token i's document. Packed training rows hold many documents (contiguous runs of one segment
id), so most (query block, key block) pairs of a causal [T x T] product have no valid pair at all: with
documents of 512 in rows of 4096, 7 of every 8 causal blocks. A dense kernel (cuDNN with a mask) still
computes them. Here each query block starts its key loop at the block holding its first query's
document start, and each key block ends its query loop at the block holding its last key's document
end, so the work grows with sum(doc_len^2), not T^2.

Kernels (Pallas Triton; grids are (blocks, heads, rows), fp32 softmax statistics and accumulators):

    forward   _fwd    (T/BQ, H, B)   online softmax over key blocks [doc start, diagonal]: o, lse
    backward  _dkdv   (T/BK, H, B)   over query blocks [diagonal, doc end]: dk, dv
              _dq     (T/BQ, H, B)   over key blocks [doc start, diagonal]: dq

delta = rowsum(o * do) is plain XLA between them. Probabilities and dS enter the matmuls in the input
dtype (bf16 on the GPU), as in every flash attention; scores, statistics and accumulators stay fp32.

Contract: documents are contiguous runs of equal ``segment_ids`` (what a packer produces). The ids
are renumbered into run indices before the kernels, so two runs that reuse one id are two documents
here (a dense "same id" mask would join them; the packer never reuses an id within a row), and any
integer ids work. Inside the visited blocks the mask is causal and same-run. Head dims are zero-padded
to a power of two >= 16 (zeros change no dot product); T is padded to a block multiple with a run of
its own. Matmuls take the input dtype: bf16 operands with fp32 accumulation, or for fp32 inputs full
fp32 (HIGHEST, not TF32). The same source runs in interpret mode on a CPU (the tests) and compiled on
a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from pallas_kernels.common import (ATTENTION_RESIDUALS, default_interpret, document_index, pow2_at_least_16,
                                    tile_dot, triton_params)

__all__ = ["flash_attention", "document_bounds"]

_PAD_RUN = -1  # the run index of padding tokens (real runs are numbered from 1)
_NEG = -1e30  # finite "minus infinity" for the running max: exp(-inf - -inf) would be NaN


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Static kernel configuration (hashable: a custom_vjp nondiff argument)."""

    BQ: int  # query block
    BK: int  # key block
    Tp: int  # padded length (a multiple of BQ and BK)
    Dk: int  # padded q/k head dim
    Dv: int  # padded v head dim
    scale: float
    interpret: bool
    exact: bool  # fp32 inputs: full-precision dots (Triton would otherwise use TF32)
    num_warps: int = 4
    num_stages: int = 2


def _dot(a, b, dims, cfg):
    return tile_dot(a, b, dims, cfg.exact)


def _mm(a, b, cfg):
    """[M, K] @ [K, N] -> [M, N] fp32."""
    return _dot(a, b, ((1,), (0,)), cfg)


def _mm_nt(a, b, cfg):
    """[M, K] @ [N, K]^T -> [M, N] fp32."""
    return _dot(a, b, ((1,), (1,)), cfg)


def _mm_tn(a, b, cfg):
    """[K, M]^T @ [K, N] -> [M, N] fp32."""
    return _dot(a, b, ((0,), (0,)), cfg)


def document_bounds(segment_ids_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """First and last index of each token's document (a contiguous run of one id): two [B, T] int32."""
    B, T = segment_ids_BT.shape
    idx = jnp.arange(T, dtype=jnp.int32)[None, :]
    change = segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]
    edge = jnp.ones((B, 1), bool)
    first = jnp.concatenate([edge, change], axis=1)
    last = jnp.concatenate([change, edge], axis=1)
    start = lax.cummax(jnp.where(first, idx, 0), axis=1)
    end = lax.cummin(jnp.where(last, idx, T - 1), axis=1, reverse=True)
    return start.astype(jnp.int32), end.astype(jnp.int32)


def _scores(q, k, seg_q, seg_k, q0, k0, cfg, BQ, BK):
    """Masked scaled scores [BQ, BK] fp32 (-inf outside the causal in-document pairs)."""
    s = _mm_nt(q, k, cfg) * cfg.scale
    qpos = q0 + lax.broadcasted_iota(jnp.int32, (BQ, BK), 0)
    kpos = k0 + lax.broadcasted_iota(jnp.int32, (BQ, BK), 1)
    ok = (qpos >= kpos) & (seg_q[:, None] == seg_k[None, :])
    return jnp.where(ok, s, -jnp.inf)


def _fwd_kernel(q_ref, k_ref, v_ref, segq_ref, segk_ref, start_ref, o_ref, lse_ref, *, cfg: _Cfg):
    """One (query block, head, row): online softmax over the key blocks of its documents."""
    BQ, BK = cfg.BQ, cfg.BK
    i = pl.program_id(0)
    q = q_ref[...]
    seg_q = segq_ref[...]
    lo = jnp.min(start_ref[...]) // BK
    hi = ((i + 1) * BQ + BK - 1) // BK

    def body(j, carry):
        m, l, acc = carry
        ks = pl.ds(pl.multiple_of(j * BK, BK), BK)
        s = _scores(q, k_ref[ks, :], seg_q, segk_ref[ks], i * BQ, j * BK, cfg, BQ, BK)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        v = v_ref[ks, :]
        acc = acc * alpha[:, None] + _mm(p.astype(v.dtype), v, cfg)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    init = (jnp.full((BQ,), _NEG, jnp.float32), jnp.zeros((BQ,), jnp.float32),
            jnp.zeros((BQ, cfg.Dv), jnp.float32))
    m, l, acc = lax.fori_loop(lo, hi, body, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, segq_ref, segk_ref, end_ref,
                 dk_ref, dv_ref, *, cfg: _Cfg):
    """One (key block, head, row): dk, dv over the query blocks that can see it."""
    BQ, BK = cfg.BQ, cfg.BK
    j = pl.program_id(0)
    k, v, seg_k = k_ref[...], v_ref[...], segk_ref[...]
    lo = (j * BK) // BQ
    hi = (jnp.max(end_ref[...]) + BQ) // BQ

    def body(i, carry):
        dk, dv = carry
        qs = pl.ds(pl.multiple_of(i * BQ, BQ), BQ)
        q, do = q_ref[qs, :], do_ref[qs, :]
        s = _scores(q, k, segq_ref[qs], seg_k, i * BQ, j * BK, cfg, BQ, BK)
        p = jnp.exp(s - lse_ref[qs][:, None])  # 0 where masked
        dv = dv + _mm_tn(p.astype(do.dtype), do, cfg)
        ds = p * (_mm_nt(do, v, cfg) - delta_ref[qs][:, None])
        dk = dk + _mm_tn(ds.astype(q.dtype), q, cfg)
        return dk, dv

    init = (jnp.zeros((BK, cfg.Dk), jnp.float32), jnp.zeros((BK, cfg.Dv), jnp.float32))
    dk, dv = lax.fori_loop(lo, hi, body, init)
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, segq_ref, segk_ref, start_ref, dq_ref,
               *, cfg: _Cfg):
    """One (query block, head, row): dq over the key blocks of its documents."""
    BQ, BK = cfg.BQ, cfg.BK
    i = pl.program_id(0)
    q, do, seg_q = q_ref[...], do_ref[...], segq_ref[...]
    lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
    lo = jnp.min(start_ref[...]) // BK
    hi = ((i + 1) * BQ + BK - 1) // BK

    def body(j, dq):
        ks = pl.ds(pl.multiple_of(j * BK, BK), BK)
        k = k_ref[ks, :]
        p = jnp.exp(_scores(q, k, seg_q, segk_ref[ks], i * BQ, j * BK, cfg, BQ, BK) - lse)
        ds = p * (_mm_nt(do, v_ref[ks, :], cfg) - delta)
        return dq + _mm(ds.astype(k.dtype), k, cfg)

    dq = lax.fori_loop(lo, hi, body, jnp.zeros((BQ, cfg.Dk), jnp.float32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


# ----------------------------------------------------------------------------------------------------
# pallas_call wrappers; arrays are [B, Tp, H, D] (q, k, v, o), [B, H, Tp] (lse, delta), [B, Tp] (ids)


def _specs(cfg, blk):
    """(block of D columns, whole row of D columns, per-token stat block, whole stat row, id block, id row)."""
    Tp = cfg.Tp
    return (lambda D: pl.BlockSpec((None, blk, None, D), lambda n, h, b: (b, n, h, 0)),
            lambda D: pl.BlockSpec((None, Tp, None, D), lambda n, h, b: (b, 0, h, 0)),
            pl.BlockSpec((None, None, blk), lambda n, h, b: (b, h, n)),
            pl.BlockSpec((None, None, Tp), lambda n, h, b: (b, h, 0)),
            pl.BlockSpec((None, blk), lambda n, h, b: (b, n)),
            pl.BlockSpec((None, Tp), lambda n, h, b: (b, 0)))


def _forward(cfg, q, k, v, seg, start):
    B, Tp, H, _ = q.shape
    blk, row, stat, _, ids, id_row = _specs(cfg, cfg.BQ)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg), grid=(Tp // cfg.BQ, H, B),
        in_specs=[blk(cfg.Dk), row(cfg.Dk), row(cfg.Dv), ids, id_row, ids],
        out_specs=[blk(cfg.Dv), stat],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, cfg.Dv), v.dtype),
                   jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)],
        interpret=cfg.interpret, name="flash_doc_fwd",
        compiler_params=triton_params(cfg.interpret, cfg.num_warps, cfg.num_stages),
    )(q, k, v, seg, seg, start)


def _backward(cfg, q, k, v, seg, start, end, o, lse, do):
    B, Tp, H, _ = q.shape
    delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
    kblk, row, _, stat_row, kids, id_row = _specs(cfg, cfg.BK)
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, cfg=cfg), grid=(Tp // cfg.BK, H, B),
        in_specs=[row(cfg.Dk), kblk(cfg.Dk), kblk(cfg.Dv), row(cfg.Dv), stat_row, stat_row, id_row, kids, kids],
        out_specs=[kblk(cfg.Dk), kblk(cfg.Dv)],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        interpret=cfg.interpret, name="flash_doc_dkdv",
        compiler_params=triton_params(cfg.interpret, cfg.num_warps, cfg.num_stages),
    )(q, k, v, do, lse, delta, seg, seg, end)
    qblk, row, stat, _, qids, id_row = _specs(cfg, cfg.BQ)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg), grid=(Tp // cfg.BQ, H, B),
        in_specs=[qblk(cfg.Dk), row(cfg.Dk), row(cfg.Dv), qblk(cfg.Dv), stat, stat, qids, id_row, qids],
        out_specs=qblk(cfg.Dk),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=cfg.interpret, name="flash_doc_dq",
        compiler_params=triton_params(cfg.interpret, cfg.num_warps, cfg.num_stages),
    )(q, k, v, do, lse, delta, seg, seg, start)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(cfg, q, k, v, seg, start, end):
    return _forward(cfg, q, k, v, seg, start)[0]


def _attend_fwd(cfg, q, k, v, seg, start, end):
    o, lse = _forward(cfg, q, k, v, seg, start)
    o, lse = checkpoint_name((o, lse), ATTENTION_RESIDUALS)
    return o, (q, k, v, seg, start, end, o, lse)


def _attend_bwd(cfg, res, do):
    q, k, v, seg, start, end, o, lse = res
    dq, dk, dv = _backward(cfg, q, k, v, seg, start, end, o, lse, do)
    return dq, dk, dv, None, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def flash_attention(q_BTHD, k_BTHD, v_BTHE, segment_ids_BT=None, *, scale=None, block_q=64, block_k=64,
                    interpret=None, num_warps=4, num_stages=2):
    """Causal softmax attention within documents. q, k: [B, T, H, D]; v: [B, T, H, E] -> [B, T, H, E].

    ``segment_ids_BT`` [B, T] int (None: one document per row); see the module docstring for the
    contract. ``scale`` defaults to D^-0.5. Differentiable in q, k, v. ``interpret=None`` runs the
    kernels compiled on a GPU and interpreted elsewhere (or as ``K3_PALLAS_INTERPRET`` says).
    """
    if q_BTHD.ndim != 4 or k_BTHD.shape != q_BTHD.shape or v_BTHE.shape[:3] != q_BTHD.shape[:3]:
        raise ValueError(f"flash_attention: q and k must be [B, T, H, D] of one shape and v [B, T, H, E]; "
                         f"got {q_BTHD.shape}, {k_BTHD.shape}, {v_BTHE.shape}")
    B, T, H, D0 = q_BTHD.shape
    E0 = v_BTHE.shape[-1]
    if segment_ids_BT is not None and segment_ids_BT.shape != (B, T):
        raise ValueError(f"flash_attention: segment_ids must be [B, T] = {(B, T)}; got {segment_ids_BT.shape}")
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"flash_attention: {name} must be a power of two >= 16; got {b}")
    scale = D0 ** -0.5 if scale is None else float(scale)
    interpret = default_interpret() if interpret is None else bool(interpret)
    blk = max(block_q, block_k)
    Tp = -(-T // blk) * blk
    exact = all(jnp.dtype(x.dtype).itemsize >= 4 for x in (q_BTHD, k_BTHD, v_BTHE))
    cfg = _Cfg(BQ=block_q, BK=block_k, Tp=Tp, Dk=pow2_at_least_16(D0), Dv=pow2_at_least_16(E0),
               scale=scale, interpret=interpret, exact=exact, num_warps=num_warps, num_stages=num_stages)

    def pad(x, D):
        return jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, D - x.shape[-1])))

    # Run index 1, 2, ... of each token is what the kernels compare: any id dtype, reused ids apart.
    runs = 1 + document_index(segment_ids_BT, None, B, T)
    seg = jnp.pad(runs, ((0, 0), (0, Tp - T)), constant_values=_PAD_RUN)
    start, end = document_bounds(seg)
    out = _attend(cfg, pad(q_BTHD, cfg.Dk), pad(k_BTHD, cfg.Dk), pad(v_BTHE, cfg.Dv), seg, start, end)
    return out[:, :T, :, :E0]
