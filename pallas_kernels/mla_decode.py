"""Split-S (flash-decoding) attention of a few new tokens over MLA's latent cache, as a Pallas kernel.

What it computes. `k3.mla.layer.MLA.extend` attends T new tokens per row (T = 1 in a decode step,
a few in speculative verification) to the row's cached past with weight absorption. The part over
the OLD cache is, per row b, new token t, head h and cache position s < start_B[b]:

    s[b,t,h,s] = scale * (q_lat[b,t,h,:] . c[b,s,:] + q_rope[b,t,h,:] . r[b,s,:])
    m[b,t,h]   = max_s s[b,t,h,s]
    l[b,t,h]   = sum_s exp(s[b,t,h,s] - m[b,t,h])
    o[b,t,h,:] = sum_s exp(s[b,t,h,s] - m[b,t,h]) c[b,s,:]            (un-normalised, fp32)

Positions s >= start_B[b] are ignored. ``latent_attention_partial`` returns (o, m, l); the caller
merges them with the new tokens' own part (o2, m2, l2) by the log-sum-exp rule:

    M = max(m, m2);  a = exp(m - M);  a2 = exp(m2 - M)
    out = (a * o + a2 * o2) / (a * l + a2 * l2)

Empty old part (start_B[b] = 0): o = 0, l = 0 and m = -1e30 (finite, not -inf, so that exp(m - M)
is 0 and never NaN); the merge then returns the new part alone (its m2 is a real score).

Shapes: q_lat [B, T, H, R], q_rope [B, T, H, E], c [B, S, R], r [B, S, E], start_B [B] int32;
o [B, T, H, R] fp32, m and l [B, T, H] fp32. R = kv_lora (e.g. 256), E = rope dim (16-64), S the
cache capacity.

Why a kernel. At long context reading the cache is the whole cost of a decode step: it reads
B * start * (R + E) * itemsize bytes (B = 8, start = 128K, R + E = 288, bf16: 604 MB per layer),
and everything else (queries, outputs, statistics) is tiny. XLA's einsum path reads it at ~0.4 TB/s
on an H200 (peak 4.8 TB/s). Here every cache byte is read once, and only up to each row's start.

Design (Pallas Triton; fp32 scores, statistics and accumulators):
  * The T*H query rows of a cache row share its keys, so they are folded into the matmul M
    dimension: q -> [B, M, R] with M = T*H zero-padded to a power of two >= 16; M is cut into
    tiles of ``block_m`` (<= 64, bounding the [block_m, R] fp32 accumulator's registers). With one
    tile (T*H <= 64) the cache is read exactly once; with more, once per tile (the tiles of one
    slice run next to each other, grid axis 0, so the repeats mostly hit L2).
  * grid (M tiles, splits, B). Program (i, j, b) takes row b's nb = ceil(start_B[b] / block_s)
    key blocks, its share j of ceil(nb / splits) consecutive blocks, and runs an online softmax
    over them: per block it loads c [block_s, R] and r [block_s, E] once, scores
    [block_m, block_s] = q_lat @ c^T + q_rope @ r^T, masks positions >= start, and accumulates
    p @ c (p rounded to the cache dtype, fp32 accumulation). It writes its (o, m, l); the splits
    are merged by the same log-sum-exp rule in XLA (B * splits * M * R * 4 bytes: ~2-3% of the
    cache read at 128K). Splitting each row's actual length, not the capacity, keeps every
    program busy whatever the rows' lengths are.
  * ``num_splits`` defaults to about 4 * 132 programs in all (H200: 132 SMs), but at least 4 key
    blocks per split: B = 8, one M tile, S = 128K -> 66 splits of ~31 blocks of 64.
  * R and E are zero-padded to powers of two >= 16 (zeros change no dot product). Padding the
    cache copies it, so keep R and E powers of two >= 16 (256 and 16..64 are) to avoid that; the
    same holds for S: it must be a multiple of block_s (block_s is halved down to 16 to divide S;
    otherwise S is padded, again a copy). Padded positions lie >= start and are masked.
  * fp32 inputs use full-precision dots (HIGHEST), bf16 inputs bf16 dots with fp32 accumulation.
The same source runs in Pallas interpret mode on a CPU (the tests) and compiled on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import default_interpret, pow2_at_least_16, tile_dot, triton_params

__all__ = ["latent_attention_partial", "latent_decode_step", "merge_partials", "EMPTY_M"]

EMPTY_M = -1e30  # m of an empty part (finite "minus infinity": exp(EMPTY_M - M) = 0, never NaN)
_TARGET_PROGRAMS = 4 * 132  # ~4 programs per H200 SM
_MIN_BLOCKS_PER_SPLIT = 4
_START_LANES = 16  # start_B is passed as [B, 16] (a power-of-two block) and reduced in the kernel


@dataclasses.dataclass(frozen=True)
class _Cfg:
    BM: int  # query rows per program (tile of the padded T*H)
    BS: int  # key block
    Rp: int  # padded latent dim
    Ep: int  # padded rope dim
    splits: int
    scale: float
    interpret: bool
    exact: bool  # fp32 inputs: full-precision dots (Triton would otherwise use TF32)
    num_warps: int = 4
    num_stages: int = 2


def _dot(a, b, dims, cfg):
    return tile_dot(a, b, dims, cfg.exact)


def _kernel(q_ref, qr_ref, c_ref, r_ref, start_ref, o_ref, m_ref, l_ref, *, cfg: _Cfg):
    """One (M tile, split, row): online softmax over the split's share of the row's key blocks."""
    BS = cfg.BS
    j = pl.program_id(1)
    q, qr = q_ref[...], qr_ref[...]
    start = jnp.max(start_ref[...])
    nb = (start + BS - 1) // BS
    per = (nb + cfg.splits - 1) // cfg.splits
    lo = j * per
    hi = jnp.minimum(lo + per, nb)

    def body(k, carry):
        m, l, acc = carry
        ks = pl.ds(pl.multiple_of(k * BS, BS), BS)
        c, r = c_ref[ks, :], r_ref[ks, :]
        s = (_dot(q, c, ((1,), (1,)), cfg) + _dot(qr, r, ((1,), (1,)), cfg)) * cfg.scale
        pos = k * BS + lax.broadcasted_iota(jnp.int32, (cfg.BM, BS), 1)
        s = jnp.where(pos < start, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        acc = acc * alpha[:, None] + _dot(p.astype(c.dtype), c, ((1,), (0,)), cfg)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    init = (jnp.full((cfg.BM,), EMPTY_M, jnp.float32), jnp.zeros((cfg.BM,), jnp.float32),
            jnp.zeros((cfg.BM, cfg.Rp), jnp.float32))
    m, l, acc = lax.fori_loop(lo, hi, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def merge_partials(o1, m1, l1, o2, m2, l2):
    """Log-sum-exp merge of two partial results (o [..., R], m [...], l [...]) -> (o, m, l)."""
    m = jnp.maximum(m1, m2)
    a1, a2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
    return a1[..., None] * o1 + a2[..., None] * o2, m, a1 * l1 + a2 * l2


def _auto_splits(B, n_mt, n_blocks):
    want = -(-_TARGET_PROGRAMS // (B * n_mt))
    return max(1, min(want, n_blocks // _MIN_BLOCKS_PER_SPLIT))


def latent_attention_partial(q_lat_BTHR, q_rope_BTHE, c_BSR, r_BSE, start_B, *, scale, block_s=64,
                             block_m=64, num_splits=None, interpret=None, num_warps=4, num_stages=2):
    """Attention of T new tokens per row over the cached positions s < start_B[b] of an MLA cache.

    q_lat [B, T, H, R] (cast to c's dtype), q_rope [B, T, H, E] (cast to r's dtype), c [B, S, R],
    r [B, S, E] (bf16 or fp32), start_B [B] int (clipped to [0, S]), ``scale`` a float.
    Returns (o [B, T, H, R] fp32 un-normalised sum_s e^{s - m} c_s, m [B, T, H] fp32 max score,
    l [B, T, H] fp32 sum_s e^{s - m}); o / l is the attention output over the old part. A row with
    start 0 gives o = 0, l = 0, m = EMPTY_M (-1e30), which `merge_partials` (the log-sum-exp rule)
    merges away. ``block_s``: key block (power of two 16..256; halved to divide S); ``block_m``:
    query-row tile (power of two >= 16); ``num_splits``: S splits per row (None: see the module
    docstring). ``interpret=None``: compiled on a GPU, interpreted elsewhere (`default_interpret`).
    """
    q, qr, c, r, start, cfg, n_mt = _prepare(q_lat_BTHR, q_rope_BTHE, c_BSR, r_BSE, start_B, scale, block_s, block_m,
                                             num_splits, interpret, num_warps, num_stages, "latent_attention_partial")
    B, T, H, R = q_lat_BTHR.shape
    o, m, l = _split_partials(q, qr, c, r, start, cfg, n_mt, B)
    # Merge the splits (log-sum-exp rule); empty splits carry m = EMPTY_M, l = 0, o = 0.
    m_all = jnp.max(m, axis=1)  # [B, Mp]
    w = jnp.exp(m - m_all[:, None])  # [B, splits, Mp]
    o = jnp.einsum("bjm,bjmr->bmr", w, o, precision=lax.Precision.HIGHEST)
    l = jnp.sum(w * l, axis=1)
    o = o[:, : T * H, :R].reshape(B, T, H, R)
    return o, m_all[:, : T * H].reshape(B, T, H), l[:, : T * H].reshape(B, T, H)


def _prepare(q_lat_BTHR, q_rope_BTHE, c_BSR, r_BSE, start_B, scale, block_s, block_m, num_splits, interpret,
             num_warps, num_stages, who: str):
    """Checked, padded kernel inputs (q [B, Mp, Rp], qr [B, Mp, Ep], c [B, Sp, Rp], r [B, Sp, Ep], start
    [B, 16]), the kernel config and the number of query-row tiles; ``who`` names the caller in errors."""
    if q_lat_BTHR.ndim != 4 or q_rope_BTHE.shape[:3] != q_lat_BTHR.shape[:3]:
        raise ValueError(f"{who}: q_lat must be [B, T, H, R] and q_rope [B, T, H, E]; "
                         f"got {q_lat_BTHR.shape}, {q_rope_BTHE.shape}")
    B, T, H, R = q_lat_BTHR.shape
    E = q_rope_BTHE.shape[-1]
    S = c_BSR.shape[1]
    if c_BSR.shape != (B, S, R) or r_BSE.shape != (B, S, E) or tuple(start_B.shape) != (B,):
        raise ValueError(f"{who}: expected c [B, S, R] = {(B, S, R)}, r [B, S, E] = "
                         f"{(B, S, E)}, start [B]; got {c_BSR.shape}, {r_BSE.shape}, {start_B.shape}")
    for name, v in (("block_s", block_s), ("block_m", block_m)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{who}: {name} must be a power of two >= 16; got {v}")
    interpret = default_interpret() if interpret is None else bool(interpret)
    while block_s > 16 and S % block_s:
        block_s //= 2
    Sp = -(-S // block_s) * block_s
    Rp, Ep = pow2_at_least_16(R), pow2_at_least_16(E)
    Mp = pow2_at_least_16(T * H)
    BM = min(Mp, block_m)
    n_mt = Mp // BM
    splits = _auto_splits(B, n_mt, Sp // block_s) if num_splits is None else int(num_splits)
    if splits < 1:
        raise ValueError(f"{who}: num_splits must be >= 1; got {splits}")
    exact = all(jnp.dtype(x.dtype).itemsize >= 4 for x in (c_BSR, r_BSE))
    cfg = _Cfg(BM=BM, BS=block_s, Rp=Rp, Ep=Ep, splits=splits, scale=float(scale), interpret=interpret,
               exact=exact, num_warps=num_warps, num_stages=num_stages)

    # Pads are no-ops (no copy) when R, E are powers of two >= 16 and block_s divides S.
    c = jnp.pad(c_BSR, ((0, 0), (0, Sp - S), (0, Rp - R))) if (Sp, Rp) != (S, R) else c_BSR
    r = jnp.pad(r_BSE, ((0, 0), (0, Sp - S), (0, Ep - E))) if (Sp, Ep) != (S, E) else r_BSE
    q = q_lat_BTHR.astype(c.dtype).reshape(B, T * H, R)
    q = jnp.pad(q, ((0, 0), (0, Mp - T * H), (0, Rp - R)))
    qr = q_rope_BTHE.astype(r.dtype).reshape(B, T * H, E)
    qr = jnp.pad(qr, ((0, 0), (0, Mp - T * H), (0, Ep - E)))
    start = jnp.clip(jnp.asarray(start_B).astype(jnp.int32), 0, S)
    start = jnp.broadcast_to(start[:, None], (B, _START_LANES))
    return q, qr, c, r, start, cfg, n_mt


def _split_partials(q, qr, c, r, start, cfg: _Cfg, n_mt: int, B: int):
    """The split kernel's (o [B, splits, Mp, Rp], m [B, splits, Mp], l [B, splits, Mp]) for padded inputs."""
    Sp, Rp, Ep, BM, splits = c.shape[1], cfg.Rp, cfg.Ep, cfg.BM, cfg.splits
    Mp = q.shape[1]
    return pl.pallas_call(
        functools.partial(_kernel, cfg=cfg), grid=(n_mt, splits, B),
        in_specs=[pl.BlockSpec((None, BM, Rp), lambda i, j, b: (b, i, 0)),
                  pl.BlockSpec((None, BM, Ep), lambda i, j, b: (b, i, 0)),
                  pl.BlockSpec((None, Sp, Rp), lambda i, j, b: (b, 0, 0)),
                  pl.BlockSpec((None, Sp, Ep), lambda i, j, b: (b, 0, 0)),
                  pl.BlockSpec((None, _START_LANES), lambda i, j, b: (b, 0))],
        out_specs=[pl.BlockSpec((None, None, BM, Rp), lambda i, j, b: (b, j, i, 0)),
                   pl.BlockSpec((None, None, BM), lambda i, j, b: (b, j, i)),
                   pl.BlockSpec((None, None, BM), lambda i, j, b: (b, j, i))],
        out_shape=[jax.ShapeDtypeStruct((B, splits, Mp, Rp), jnp.float32),
                   jax.ShapeDtypeStruct((B, splits, Mp), jnp.float32),
                   jax.ShapeDtypeStruct((B, splits, Mp), jnp.float32)],
        interpret=cfg.interpret, name="mla_latent_decode",
        compiler_params=triton_params(cfg.interpret, cfg.num_warps, cfg.num_stages),
    )(q, qr, c, r, start)


def _merge_kernel(o_ref, m_ref, l_ref, q_ref, qr_ref, cn_ref, rn_ref, out_ref, *, splits, scale):
    """One (row, query-row tile, latent column block): the splits' log-sum-exp merge, then the new
    token's own key, then the division by the softmax sum."""
    def top(j, mx):
        return jnp.maximum(mx, m_ref[j])

    m_all = lax.fori_loop(0, splits, top, jnp.full(m_ref.shape[1:], EMPTY_M, jnp.float32))

    def add(j, carry):
        o, l = carry
        w = jnp.exp(m_ref[j] - m_all)
        return o + w[:, None] * o_ref[j], l + w * l_ref[j]

    o, l = lax.fori_loop(0, splits, add, (jnp.zeros(out_ref.shape, jnp.float32), jnp.zeros(m_all.shape, jnp.float32)))
    # The new token's score against itself; its softmax weight relative to its own max is exp(0) = 1.
    f32 = jnp.float32
    s_new = scale * (jnp.sum(q_ref[...].astype(f32) * cn_ref[...].astype(f32)[None, :], axis=1)
                     + jnp.sum(qr_ref[...].astype(f32) * rn_ref[...].astype(f32)[None, :], axis=1))
    mx = jnp.maximum(m_all, s_new)
    a_old, a_new = jnp.exp(m_all - mx), jnp.exp(s_new - mx)
    j = pl.program_id(2)
    bR = out_ref.shape[1]
    c_cols = cn_ref[pl.ds(j * bR, bR)].astype(f32)
    out_ref[...] = (a_old[:, None] * o + a_new[:, None] * c_cols[None, :]) / (a_old * l + a_new)[:, None]


def latent_decode_step(q_lat_BTHR, q_rope_BTHE, c_old_BSR, r_old_BSE, c_new_BTR, r_new_BTE, start_B, *, scale,
                       block_s=64, block_m=64, block_r=32, num_splits=None, interpret=None, num_warps=4,
                       num_stages=2):
    """Attention of one new token per row (T = 1) over its cached positions s < start_B[b] and itself:
    o [B, 1, H, R] fp32, normalised. The split kernel's partial sums, the new token's own score and the
    softmax division are merged in a second kernel (grid: rows x query-row tiles x latent column blocks
    of ``block_r``), instead of about five XLA kernels. Shapes as `latent_attention_partial`, with
    c_new [B, 1, R] and r_new [B, 1, E] the new token's cache entries (in the cache dtype)."""
    B, T, H, R = q_lat_BTHR.shape
    E = q_rope_BTHE.shape[-1]
    if T != 1 or c_new_BTR.shape != (B, 1, R) or r_new_BTE.shape != (B, 1, E):
        raise ValueError(f"latent_decode_step: one new token per row: q_lat {q_lat_BTHR.shape}, c_new "
                         f"{c_new_BTR.shape}, r_new {r_new_BTE.shape}")
    q, qr, c, r, start, cfg, n_mt = _prepare(q_lat_BTHR, q_rope_BTHE, c_old_BSR, r_old_BSE, start_B, scale, block_s,
                                             block_m, num_splits, interpret, num_warps, num_stages,
                                             "latent_decode_step")
    o, m, l = _split_partials(q, qr, c, r, start, cfg, n_mt, B)
    Rp, Ep, BM = cfg.Rp, cfg.Ep, cfg.BM
    Mp = q.shape[1]
    bR = min(block_r, Rp)
    cn = jnp.pad(c_new_BTR[:, 0].astype(c.dtype), ((0, 0), (0, Rp - R)))
    rn = jnp.pad(r_new_BTE[:, 0].astype(r.dtype), ((0, 0), (0, Ep - E)))
    out = pl.pallas_call(
        functools.partial(_merge_kernel, splits=cfg.splits, scale=cfg.scale),
        grid=(B, n_mt, Rp // bR),
        in_specs=[pl.BlockSpec((None, cfg.splits, BM, bR), lambda b, i, j: (b, 0, i, j)),
                  pl.BlockSpec((None, cfg.splits, BM), lambda b, i, j: (b, 0, i)),
                  pl.BlockSpec((None, cfg.splits, BM), lambda b, i, j: (b, 0, i)),
                  pl.BlockSpec((None, BM, Rp), lambda b, i, j: (b, i, 0)),
                  pl.BlockSpec((None, BM, Ep), lambda b, i, j: (b, i, 0)),
                  pl.BlockSpec((None, Rp), lambda b, i, j: (b, 0)),
                  pl.BlockSpec((None, Ep), lambda b, i, j: (b, 0))],
        out_specs=pl.BlockSpec((None, BM, bR), lambda b, i, j: (b, i, j)),
        out_shape=jax.ShapeDtypeStruct((B, Mp, Rp), jnp.float32),
        interpret=cfg.interpret, name="mla_latent_decode_merge",
        compiler_params=triton_params(cfg.interpret, cfg.num_warps, 1),
    )(o, m, l, q, qr, cn, rn)
    return out[:, :H, :R].reshape(B, 1, H, R)
