"""The split-S MLA latent decode-attention kernel (`pallas_kernels.mla_decode`) against float64 numpy.

The reference: scores scale * (q_lat . c_s + q_rope . r_s) over the positions s < start_B[b], their
max m, l = sum exp(s - m) and o = sum exp(s - m) c_s. The kernel runs in Pallas interpret mode on a
CPU (`interpret=True`), at awkward sizes: S = 192 in blocks of 64 (three blocks), starts at block
edges and off them (0, 1, 63, 64, 191, 192), H = 5 and T = 3 (M = 15, padded to 16), R = 40 and
E = 12 (padded to 64 and 16), several splits per row (some of them empty). bf16 cases compare with
the reference on the same bf16-rounded inputs; the kernel rounds p to bf16 before p @ c (as
`MLA.extend` does), hence the looser tolerance.
"""

import numpy as np
import pytest
import jax.numpy as jnp

from pallas_kernels.mla_decode import EMPTY_M, latent_attention_partial, latent_decode_step, merge_partials

STARTS = [0, 1, 63, 64, 191, 192]
# Measured (CPU, interpret): o / l error 6e-8 .. 2e-7 (fp32), 3e-4 .. 4e-4 (bf16: p rounded to bf16);
# m and m + log l are fp32 computations either way: <= 8e-7. Bounds leave ~5-10x.
TOL = {"float32": 1e-5, "bfloat16": 3e-3}
STAT_TOL = 1e-5


def _inputs(rng, B, T, H, S, R, E, dtype):
    def mk(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)

    return mk(B, T, H, R), mk(B, T, H, E), mk(B, S, R), mk(B, S, E)


def _f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _scores(q, qr, c, r, scale):
    return scale * (np.einsum("bthr,bsr->bths", _f64(q), _f64(c)) + np.einsum("bthe,bse->bths", _f64(qr), _f64(r)))


def _reference(q, qr, c, r, start, scale):
    """(o, m, l) in float64; rows with start 0: o = 0, l = 0, m = -inf."""
    s = _scores(q, qr, c, r, scale)
    valid = np.arange(c.shape[1])[None, :] < np.asarray(start)[:, None]  # [B, S]
    s = np.where(valid[:, None, None, :], s, -np.inf)
    m = s.max(-1)
    e = np.where(np.isfinite(m)[..., None], np.exp(s - np.where(np.isfinite(m), m, 0.0)[..., None]), 0.0)
    return np.einsum("bths,bsr->bthr", e, _f64(c)), m, e.sum(-1)


def _err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(float(np.max(np.abs(b))), 1.0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T,H", [(1, 2), (3, 5)])
def test_matches_reference(dtype, T, H):
    rng = np.random.default_rng(T * 10 + H)
    B, S, R, E, scale = len(STARTS), 192, 40, 12, 0.15
    q, qr, c, r = _inputs(rng, B, T, H, S, R, E, jnp.dtype(dtype))
    start = jnp.asarray(STARTS, jnp.int32)
    o, m, l = latent_attention_partial(q, qr, c, r, start, scale=scale, block_s=64, num_splits=2,
                                       interpret=True)
    assert o.shape == (B, T, H, R) and m.shape == l.shape == (B, T, H)
    assert o.dtype == m.dtype == l.dtype == jnp.float32
    o_ref, m_ref, l_ref = _reference(q, qr, c, r, STARTS, scale)
    live = np.asarray(STARTS) > 0
    o, m, l = np.asarray(o), np.asarray(m), np.asarray(l)
    # Empty rows: the documented neutral element.
    assert np.all(o[~live] == 0) and np.all(l[~live] == 0) and np.all(m[~live] == EMPTY_M)
    tol = TOL[dtype]
    out, out_ref = o[live] / l[live][..., None], o_ref[live] / l_ref[live][..., None]
    assert _err(out, out_ref) < tol, _err(out, out_ref)
    # (m, l) as a pair: the log-sum-exp, and m itself (the max score, computed in fp32).
    lse, lse_ref = m[live] + np.log(l[live]), m_ref[live] + np.log(l_ref[live])
    assert np.max(np.abs(lse - lse_ref)) < STAT_TOL
    assert np.max(np.abs(m[live] - m_ref[live])) < STAT_TOL
    assert np.all(l[live] >= 1 - 1e-5)  # the max position contributes exp(0) = 1


@pytest.mark.parametrize("splits", [1, 3, None])
def test_split_counts_agree(splits):
    """More splits than a short row has blocks (empty splits) and the automatic count give one answer."""
    rng = np.random.default_rng(7)
    q, qr, c, r = _inputs(rng, 3, 1, 4, 256, 32, 16, jnp.float32)
    start = jnp.asarray([5, 130, 256], jnp.int32)
    o, m, l = latent_attention_partial(q, qr, c, r, start, scale=0.2, block_s=32, num_splits=splits,
                                       interpret=True)
    o_ref, m_ref, l_ref = _reference(q, qr, c, r, np.asarray(start), 0.2)
    assert _err(np.asarray(o) / np.asarray(l)[..., None], o_ref / l_ref[..., None]) < 1e-5
    assert np.max(np.abs(np.asarray(m) + np.log(np.asarray(l)) - (m_ref + np.log(l_ref)))) < STAT_TOL


def _merged(part, q, qr, c2, r2, scale, dtype):
    """Merges `part` with the full attention over keys (c2, r2) computed by the kernel too."""
    B, T = q.shape[:2]
    n = c2.shape[1]
    new = latent_attention_partial(q, qr, c2, r2, jnp.full((B,), n, jnp.int32), scale=scale, block_s=16,
                                   interpret=True)
    o, m, l = merge_partials(*part, *new)
    return np.asarray(o / l[..., None], np.float64), np.asarray(m), np.asarray(l)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merge_with_second_block_equals_joint_attention(dtype):
    """Old part (per-row starts) merged with a second block of keys by the LSE rule = attention over both."""
    rng = np.random.default_rng(3)
    B, T, H, S, R, E, n_new, scale = 4, 3, 5, 128, 40, 12, 16, 0.15
    dt = jnp.dtype(dtype)
    q, qr, c, r = _inputs(rng, B, T, H, S, R, E, dt)
    _, _, c2, r2 = _inputs(rng, B, T, H, n_new, R, E, dt)
    starts = [0, 1, 77, 128]
    part = latent_attention_partial(q, qr, c, r, jnp.asarray(starts, jnp.int32), scale=scale, block_s=64,
                                    interpret=True)
    out, m, l = _merged(part, q, qr, c2, r2, scale, dt)
    # Joint reference: each row's valid old keys followed by the n_new new keys.
    for b, st in enumerate(starts):
        cb = np.concatenate([_f64(c[b, :st]), _f64(c2[b])])
        rb = np.concatenate([_f64(r[b, :st]), _f64(r2[b])])
        s = scale * (np.einsum("thr,sr->ths", _f64(q[b]), cb) + np.einsum("the,se->ths", _f64(qr[b]), rb))
        p = np.exp(s - s.max(-1, keepdims=True))
        ref = np.einsum("ths,sr->thr", p / p.sum(-1, keepdims=True), cb)
        assert _err(out[b], ref) < TOL[dtype], (b, st, _err(out[b], ref))
        assert np.all(np.isfinite(m[b])) and np.all(l[b] > 0)


def test_empty_rows_merge_to_new_part_alone():
    rng = np.random.default_rng(5)
    B, T, H, S, R, E, scale = 2, 1, 2, 64, 32, 16, 0.3
    q, qr, c, r = _inputs(rng, B, T, H, S, R, E, jnp.float32)
    _, _, c2, r2 = _inputs(rng, B, T, H, 16, R, E, jnp.float32)
    part = latent_attention_partial(q, qr, c, r, jnp.zeros((B,), jnp.int32), scale=scale, interpret=True)
    new = latent_attention_partial(q, qr, c2, r2, jnp.full((B,), 16, jnp.int32), scale=scale, interpret=True)
    o, m, l = merge_partials(*part, *new)
    assert np.array_equal(np.asarray(o), np.asarray(new[0]))
    assert np.array_equal(np.asarray(m), np.asarray(new[1]))
    assert np.array_equal(np.asarray(l), np.asarray(new[2]))
    # Whatever lies at positions >= start (here inf) never reaches the result.
    c_bad = c.at[:, :].set(jnp.inf)
    part_bad = latent_attention_partial(q, qr, c_bad, r, jnp.zeros((B,), jnp.int32), scale=scale, interpret=True)
    assert np.all(np.asarray(part_bad[0]) == 0) and np.all(np.asarray(part_bad[2]) == 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("splits,block_r", [(1, 32), (3, 16), (None, 64)])
def test_decode_step_merges_the_splits_and_the_new_token(dtype, splits, block_r):
    """`latent_decode_step` (split kernel + merge kernel) against float64 attention over the cached
    positions s < start and the new token itself, normalised: starts at block edges and 0 (the new
    token alone), R = 40 and E = 12 padded, several latent column blocks per program row."""
    rng = np.random.default_rng(7 + (splits or 0) + block_r)
    B, H, S, R, E, scale = len(STARTS), 5, 192, 40, 12, 0.15
    q, qr, c, r = _inputs(rng, B, 1, H, S, R, E, jnp.dtype(dtype))
    _, _, c_new, r_new = _inputs(rng, B, 1, 1, 1, R, E, jnp.dtype(dtype))
    start = jnp.asarray(STARTS, jnp.int32)
    got = latent_decode_step(q, qr, c, r, c_new, r_new, start, scale=scale, block_s=64, num_splits=splits,
                             block_r=block_r, interpret=True)
    assert got.shape == (B, 1, H, R) and got.dtype == jnp.float32
    # float64: the cache padded with the new token at position start[b], attended up to start[b] + 1.
    c_all = np.concatenate([_f64(c), np.zeros((B, 1, R))], axis=1)
    r_all = np.concatenate([_f64(r), np.zeros((B, 1, E))], axis=1)
    for b, s0 in enumerate(STARTS):
        c_all[b, s0], r_all[b, s0] = _f64(c_new)[b, 0], _f64(r_new)[b, 0]
    o, _, l = _reference(q, qr, c_all, r_all, start + 1, scale)
    assert _err(got, o / l[..., None]) < TOL[dtype]


def test_decode_step_rejects_more_than_one_token():
    rng = np.random.default_rng(0)
    q, qr, c, r = _inputs(rng, 2, 2, 2, 32, 16, 16, jnp.float32)
    with pytest.raises(ValueError, match="one new token per row"):
        latent_decode_step(q, qr, c, r, c[:, :2], r[:, :2], jnp.zeros((2,), jnp.int32), scale=0.1, interpret=True)
