"""Layers against simple references: FFN activations, MLA, KDA layer, Block AttnRes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import depth_mix_plain, tiny_model_cfg
from k3 import attn_res
from k3.ffn import glu_activation
from k3.kda.layer import KDA, causal_conv
from k3.mla.layer import MLA, apply_rope, segment_positions


def _rand(key, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


# ---------------------------------------------------------------- FFN activations
def test_situ_is_bounded_by_100_and_matches_swiglu_near_zero():
    a = jnp.linspace(-1e4, 1e4, 2001)
    gate, up = jnp.meshgrid(a, a)
    out = glu_activation(gate, up, "situ")
    assert float(jnp.max(jnp.abs(out))) <= 100.0
    assert float(jnp.max(out)) > 99.0  # the bound is reached, not just respected
    small_g, small_u = _rand(0, (1000,), 1e-2), _rand(1, (1000,), 1e-2)
    situ = glu_activation(small_g, small_u, "situ")
    swiglu = glu_activation(small_g, small_u, "swiglu")
    # First-order agreement: the difference is third order in the inputs.
    np.testing.assert_allclose(situ, swiglu, rtol=1e-4, atol=1e-9)


def test_situ_negative_gate_tail_goes_to_zero_and_bad_kind_raises():
    out = glu_activation(jnp.array([-50.0]), jnp.array([3.0]), "situ")
    assert abs(float(out[0])) < 1e-18
    with pytest.raises(ValueError, match="gelu"):
        glu_activation(jnp.ones(2), jnp.ones(2), "gelu")


def _glu_plain(g, u, kind):
    """The activations written out for autodiff: the reference for `glu_activation`'s own backward."""
    if kind == "swiglu":
        return jax.nn.silu(g) * u
    return 4.0 * jnp.tanh(g / 4.0) * jax.nn.sigmoid(g) * (25.0 * jnp.tanh(u / 25.0))


@pytest.mark.parametrize("kind", ["situ", "swiglu"])
def test_glu_activation_gradient_matches_autodiff_float64(x64, kind):
    """Values spanning the saturated tails (|z| up to 200: tanh and sigmoid flat) and zero."""
    g = jnp.concatenate([jnp.array([0.0, -200.0, 200.0]), 30.0 * jax.random.normal(jax.random.key(0), (61,))])
    u = jnp.concatenate([jnp.array([0.0, 150.0, -150.0]), 30.0 * jax.random.normal(jax.random.key(1), (61,))])
    g, u = g.astype(jnp.float64).reshape(8, 8), u.astype(jnp.float64).reshape(8, 8)
    dout = jax.random.normal(jax.random.key(2), (8, 8), jnp.float64)
    np.testing.assert_allclose(glu_activation(g, u, kind), _glu_plain(g, u, kind), rtol=1e-13, atol=1e-13)
    got = jax.vjp(lambda a, b: glu_activation(a, b, kind), g, u)[1](dout)
    want = jax.vjp(lambda a, b: _glu_plain(a, b, kind), g, u)[1](dout)
    for x, y in zip(got, want):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)


def test_glu_activation_bf16_gradients_keep_dtype_and_follow_fp32():
    g, u = _rand(3, (4, 32), 3.0), _rand(4, (4, 32), 3.0)
    dout = _rand(5, (4, 32))
    gb, ub = g.astype(jnp.bfloat16), u.astype(jnp.bfloat16)
    dg, du = jax.vjp(lambda a, b: glu_activation(a, b, "situ"), gb, ub)[1](dout.astype(jnp.bfloat16))
    assert dg.dtype == du.dtype == jnp.bfloat16
    rg, ru = jax.vjp(lambda a, b: _glu_plain(a, b, "situ"), gb.astype(jnp.float32), ub.astype(jnp.float32))[1](
        dout.astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(dg, np.float32), rg, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(du, np.float32), ru, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- MLA
def naive_attention(q, k, v, seg, scale):
    """Float64 numpy softmax attention, causal and within documents. q,k [B,T,H,D]; v [B,T,H,E]."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    B, T, H, _ = q.shape
    out = np.zeros(v.shape)
    for b in range(B):
        for h in range(H):
            s = q[b, :, h] @ k[b, :, h].T * scale
            allowed = np.tril(np.ones((T, T), bool)) & (seg[b][:, None] == seg[b][None, :])
            s = np.where(allowed, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[b, :, h] = p @ v[b, :, h]
    return out


def naive_rope(x, pos, theta):
    x = np.asarray(x, np.float64)
    R = x.shape[-1]
    freq = theta ** (-np.arange(0, R, 2) / R)
    ang = np.asarray(pos, np.float64)[..., None] * freq
    c, s = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
    x1, x2 = x[..., : R // 2], x[..., R // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


@pytest.mark.parametrize("use_rope,gate", [(True, False), (False, True)])
def test_mla_matches_naive_attention(use_rope, gate):
    cfg = tiny_model_cfg(**{"mla.use_rope": use_rope, "mla.output_gate": gate})
    mla = MLA(cfg, rngs=nnx.Rngs(3))
    B, T = 2, 13
    x = _rand(4, (B, T, cfg.d_model))
    seg = jnp.array([[1] * 5 + [2] * 8, [1] * 13], jnp.int32)
    y = mla(x, seg)
    # Reference: recompute q, k, v from the weights in numpy, then naive attention.
    W = {n: np.asarray(getattr(mla, n)[...], np.float64) for n in ("q_a", "q_b", "kv_a", "kv_b", "w_o")}
    xn = np.asarray(x, np.float64)

    def rms(t, w, eps):
        return t / np.sqrt((t ** 2).mean(-1, keepdims=True) + eps) * np.asarray(w, np.float64)

    a = cfg.mla
    q = np.einsum("btr,rhk->bthk", rms(xn @ W["q_a"], mla.q_norm.weight[...], a.norm_eps), W["q_b"])
    kv = xn @ W["kv_a"]
    c_kv, k_rope = kv[..., : a.kv_lora_rank], kv[..., a.kv_lora_rank:]
    up = np.einsum("btr,rhk->bthk", rms(c_kv, mla.kv_norm.weight[...], a.norm_eps), W["kv_b"])
    k_nope, v = up[..., : a.qk_nope_dim], up[..., a.qk_nope_dim:]
    q_nope, q_rope = q[..., : a.qk_nope_dim], q[..., a.qk_nope_dim:]
    k_rope = np.repeat(k_rope[:, :, None], a.n_heads, axis=2)
    if use_rope:
        pos = np.array([list(range(5)) + list(range(8)), list(range(13))])
        q_rope, k_rope = naive_rope(q_rope, pos, a.rope_theta), naive_rope(k_rope, pos, a.rope_theta)
    o = naive_attention(np.concatenate([q_nope, q_rope], -1), np.concatenate([k_nope, k_rope], -1), v,
                        np.asarray(seg), (a.qk_nope_dim + a.qk_rope_dim) ** -0.5)
    if gate:
        g = np.einsum("btd,dhk->bthk", xn, np.asarray(mla.w_gate[...], np.float64))
        o = o / (1 + np.exp(-g))
    ref = np.einsum("bthk,hkd->btd", o, W["w_o"])
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-4, atol=2e-5)


def test_segment_positions_and_rope_relative():
    seg = jnp.array([[1, 1, 1, 2, 2, 3]])
    np.testing.assert_array_equal(segment_positions(seg), [[0, 1, 2, 0, 1, 0]])
    # RoPE makes q.k depend only on the position difference.
    q, k = _rand(0, (1, 1, 1, 8)), _rand(1, (1, 1, 1, 8))
    def dot(pq, pk):
        rq = apply_rope(q, jnp.array([[pq]]), 1e4)
        rk = apply_rope(k, jnp.array([[pk]]), 1e4)
        return float(jnp.sum(rq * rk))
    assert dot(7, 3) == pytest.approx(dot(104, 100), rel=1e-4)


# ---------------------------------------------------------------- causality
@pytest.mark.parametrize("layer_cls", [MLA, KDA])
def test_token_mixers_are_causal(layer_cls):
    cfg = tiny_model_cfg()
    layer = layer_cls(cfg, rngs=nnx.Rngs(0))
    T, t = 21, 9
    x = _rand(1, (2, T, cfg.d_model))
    x2 = x.at[:, t + 1:].set(_rand(2, (2, T - t - 1, cfg.d_model)))
    y1, y2 = layer(x), layer(x2)
    np.testing.assert_allclose(y1[:, : t + 1], y2[:, : t + 1], rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(y1[:, t + 1:] - y2[:, t + 1:]))) > 1e-4


@pytest.mark.parametrize("layer_cls", [MLA, KDA])
def test_packed_documents_equal_separate_runs(layer_cls):
    cfg = tiny_model_cfg(**{"mla.use_rope": True})
    layer = layer_cls(cfg, rngs=nnx.Rngs(5))
    lens = [7, 1, 12]
    x = _rand(6, (1, sum(lens), cfg.d_model))
    seg = jnp.concatenate([jnp.full((n,), i + 1, jnp.int32) for i, n in enumerate(lens)])[None]
    packed = layer(x, seg)
    start = 0
    for n in lens:
        alone = layer(x[:, start:start + n])
        np.testing.assert_allclose(packed[:, start:start + n], alone, rtol=1e-4, atol=1e-5)
        start += n


def test_causal_conv_matches_numpy_with_resets():
    x = np.asarray(_rand(0, (1, 9, 3)))
    w = np.asarray(_rand(1, (4, 3)))
    seg = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 2]])
    out = np.asarray(causal_conv(jnp.asarray(x), jnp.asarray(w), jnp.asarray(seg)))
    ref = np.zeros_like(x)
    for t in range(9):
        for i in range(4):
            if t - i >= 0 and seg[0, t - i] == seg[0, t]:
                ref[0, t] += w[3 - i] * x[0, t - i]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_kda_gate_at_bound_and_output_finite():
    cfg = tiny_model_cfg()
    layer = KDA(cfg, rngs=nnx.Rngs(0))
    layer.dt_bias[...] = jnp.full(layer.dt_bias.shape, 50.0)  # drive z up: g -> lower bound
    x = _rand(0, (1, 40, cfg.d_model))
    g, beta = layer.gates(x)
    assert g.dtype == jnp.float32 and beta.dtype == jnp.float32
    assert float(jnp.min(g)) > cfg.kda.gate_lower_bound - 1e-6 and float(jnp.max(g)) < 0
    assert float(jnp.min(g)) < cfg.kda.gate_lower_bound + 0.01
    assert bool(jnp.all(jnp.isfinite(layer(x))))


def test_kda_chunk_and_recurrent_impls_agree():
    cfg = tiny_model_cfg()
    layer = KDA(cfg, rngs=nnx.Rngs(2))
    x = _rand(3, (2, 37, cfg.d_model))
    y_chunk = layer(x)
    layer.impl = "recurrent"
    np.testing.assert_allclose(y_chunk, layer(x), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- Block AttnRes
def test_attn_res_zero_query_is_uniform_mean():
    mix = attn_res.AttnResMix(16, 1e-5, rngs=nnx.Rngs(0))
    cands = _rand(0, (5, 2, 3, 16)) * jnp.arange(1, 6)[:, None, None, None]
    valid = jnp.array([True, True, False, True, True])
    out = mix(cands, valid)
    np.testing.assert_allclose(out, cands[jnp.array([0, 1, 3, 4])].mean(0), rtol=1e-5, atol=1e-6)


def test_attn_res_mix_matches_formula():
    mix = attn_res.AttnResMix(8, 1e-5, rngs=nnx.Rngs(0))
    mix.query[...] = _rand(1, (8,))
    mix.norm[...] = 1.0 + _rand(2, (8,), 0.1)
    cands = np.asarray(_rand(3, (3, 1, 2, 8)), np.float64)
    w = np.asarray(mix.query[...], np.float64) * np.asarray(mix.norm[...], np.float64)
    logits = (cands * w).sum(-1) / np.sqrt((cands ** 2).mean(-1) + 1e-5)
    p = np.exp(logits - logits.max(0))
    p /= p.sum(0)
    ref = (p[..., None] * cands).sum(0)
    np.testing.assert_allclose(mix(jnp.asarray(cands, jnp.float32), jnp.ones(3, bool)), ref, rtol=1e-5)


@pytest.mark.parametrize("extra_valid", [True, False])
def test_attn_res_extra_candidate_equals_concatenation(extra_valid):
    """The partial sum passed apart from the bank mixes exactly as if concatenated to it: values and
    gradients, with invalid slots in the bank and the extra candidate valid or not."""
    mix = attn_res.AttnResMix(8, 1e-5, rngs=nnx.Rngs(0))
    mix.query[...] = _rand(1, (8,), 3.0)
    bank, extra = _rand(2, (4, 2, 3, 8)), _rand(3, (2, 3, 8), 5.0)
    valid = jnp.array([True, False, True, True])
    ev = jnp.asarray(extra_valid)

    def split(bank, extra):
        return jnp.sum(jnp.sin(mix(bank, valid, extra, ev)))

    def joined(bank, extra):
        cands = jnp.concatenate([bank, extra[None]], axis=0)
        return jnp.sum(jnp.sin(mix(cands, jnp.concatenate([valid, ev[None]]))))

    np.testing.assert_allclose(split(bank, extra), joined(bank, extra), rtol=1e-5)
    for a, b in zip(jax.grad(split, (0, 1))(bank, extra), jax.grad(joined, (0, 1))(bank, extra)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 9])
def test_bank_count_is_the_streams_count_at_every_mix(block_size):
    """`bank_count`, the static count unrolled layers give their mixes, equals the traced count the
    stream holds when each mix reads it, and at the output mix."""
    L = 9
    stream = attn_res.init_stream(jnp.ones((1, 2, 4)), "attn_res", attn_res.n_bank_slots(L, block_size))
    for i in range(L):
        assert int(stream["count"]) == attn_res.bank_count(i, block_size, "attention"), i
        stream = attn_res.add_attention(stream, jnp.ones((1, 2, 4)), i, block_size)
        assert int(stream["count"]) == attn_res.bank_count(i, block_size, "ffn"), i
        stream = attn_res.add_ffn(stream, jnp.ones((1, 2, 4)))
    assert int(stream["count"]) == attn_res.bank_count(L - 1, block_size, "ffn")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_static_bank_count_skips_empty_slots_exactly(x64, impl):
    """A mix told that only the first n slots can be valid gives the same values and gradients as the
    full mix over the same validity, and exactly zero gradient to the skipped slots."""
    mix = attn_res.AttnResMix(16, 1e-5, rngs=nnx.Rngs(0), impl=impl)
    mix.query[...] = _rand(1, (16,), 3.0)
    bank, extra = _rand(2, (4, 2, 5, 16)).astype(jnp.float64), _rand(3, (2, 5, 16)).astype(jnp.float64)
    valid = jnp.array([True, False, False, False])  # slot 1 is inside the count but invalid

    def loss(bank, extra, n_valid):
        return jnp.sum(jnp.sin(mix(bank, valid, extra, jnp.asarray(True), n_valid=n_valid)))

    np.testing.assert_allclose(loss(bank, extra, 2), loss(bank, extra, None), rtol=1e-13)
    got = jax.grad(loss, (0, 1))(bank, extra, 2)
    want = jax.grad(loss, (0, 1))(bank, extra, None)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)
    assert not np.any(np.asarray(got[0][2:]))


@pytest.mark.parametrize("valid,extra_valid,scale", [
    ((True, False, True, True), True, 3.0),    # an invalid slot inside the bank
    ((True, True, False, False), False, 0.3),  # the extra candidate off
    ((True, False, False, False), False, 30.0),  # one valid candidate: the mix is the identity
    ((True, True, True, True), True, 30.0),    # peaked softmax: logits far apart
])
def test_depth_mix_values_and_gradients_match_autodiff_float64(x64, valid, extra_valid, scale):
    """`depth_mix`'s own VJP against autodiff of the plain formula, in float64, every input's
    gradient (candidates, extra candidate, the score vector), at an awkward size (B 2, T 5, D 7)."""
    keys = jax.random.split(jax.random.key(sum(valid) + 10 * int(extra_valid)), 5)
    cands = jax.random.normal(keys[0], (4, 2, 5, 7), jnp.float64) * jnp.array([1.0, 4.0, 0.1, 2.0])[:, None, None, None]
    extra = jax.random.normal(keys[1], (2, 5, 7), jnp.float64)
    w = scale * jax.random.normal(keys[2], (7,), jnp.float64)
    dout = jax.random.normal(keys[3], (2, 5, 7), jnp.float64)
    valid, ev = jnp.array(valid), jnp.asarray(extra_valid)
    got_out, got_vjp = jax.vjp(lambda c, e, w: attn_res.depth_mix(c, valid, e, ev, w, 1e-5), cands, extra, w)
    want_out, want_vjp = jax.vjp(lambda c, e, w: depth_mix_plain(c, valid, e, ev, w, 1e-5), cands, extra, w)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("cands", "extra", "w"), got_vjp(dout), want_vjp(dout)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-11, err_msg=name)
    if sum(valid) == 1 and not extra_valid:
        np.testing.assert_allclose(got_out, cands[0], rtol=1e-12)


def test_depth_mix_bf16_keeps_dtypes_and_follows_float32():
    cands, extra = _rand(0, (3, 2, 9, 16), 2.0), _rand(1, (2, 9, 16))
    w, dout = _rand(2, (16,), 2.0), _rand(3, (2, 9, 16))
    valid, ev = jnp.array([True, True, False]), jnp.asarray(True)
    cb, eb = cands.astype(jnp.bfloat16), extra.astype(jnp.bfloat16)
    out, vjp = jax.vjp(lambda c, e, w: attn_res.depth_mix(c, valid, e, ev, w, 1e-5), cb, eb, w)
    dc, de, dw = vjp(dout.astype(jnp.bfloat16))
    assert out.dtype == dc.dtype == de.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    ref_out, ref_vjp = jax.vjp(lambda c, e, w: depth_mix_plain(c, valid, e, ev, w, 1e-5),
                               cb.astype(jnp.float32), eb.astype(jnp.float32), w)
    rc, re, rw = ref_vjp(dout.astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(dc, np.float32), rc, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(de, np.float32), re, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(dw, rw, rtol=1e-4, atol=1e-4)


def test_depth_mix_keeps_no_float32_copy_of_the_candidates():
    """What the backward keeps: the bf16 candidates themselves and [M, B, T]-sized statistics."""
    from jax._src.ad_checkpoint import saved_residuals
    cands, extra = _rand(0, (3, 2, 64, 32)).astype(jnp.bfloat16), _rand(1, (2, 64, 32)).astype(jnp.bfloat16)
    res = saved_residuals(lambda c, e, w: attn_res.depth_mix(c, jnp.array([True, True, False]), e,
                                                             jnp.asarray(True), w, 1e-5),
                          cands, extra, _rand(2, (32,)))
    big = [aval for aval, _ in res if aval.size >= 2 * 64 * 32]
    assert all(aval.dtype == jnp.bfloat16 for aval in big), big


def test_recomputing_backwards_fence_their_residuals():
    """The VJPs that recompute forward values (GLU, RMSNorm, the jnp depth mix) read their residuals
    through `k3.nn.recomputed`'s barrier, so XLA cannot merge the recomputation into the forward and
    store fp32 intermediates there (measured on the GPU compile only: BENCHMARKS.md); each backward's
    program holds one barrier, the forward none."""
    from k3.nn import rms_norm

    x = _rand(0, (4, 16, 32)).astype(jnp.bfloat16)
    cands = _rand(1, (3, 4, 16, 32)).astype(jnp.bfloat16)
    fns = {
        "glu": lambda a, b: glu_activation(a, b, "situ"),
        "rms_norm": lambda a, b: rms_norm(a, b[0, 0], 1e-6),
        "depth_mix": lambda a, b: attn_res.depth_mix(cands, jnp.array([True, True, False]), a,
                                                     jnp.asarray(True), b[0, 0], 1e-5),
    }
    for name, fn in fns.items():
        def count(jaxpr):
            return str(jaxpr).count("optimization_barrier")
        loss = lambda a, b: jnp.sum(fn(a, b).astype(jnp.float32) ** 2)  # noqa: E731
        assert count(jax.make_jaxpr(loss)(x, x)) == 0, name
        assert count(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, x)) == 1, name


@pytest.mark.parametrize("hinted", [False, True])
def test_attn_res_stream_follows_block_schedule(hinted):
    """The traced stream equals a list-based walk of the spec's schedule (uniform mixes); with
    ``hinted`` the layers that never start a block say so statically and skip the bank write."""
    L, bs, D = 7, 3, 4
    mix = attn_res.AttnResMix(D, 1e-5, rngs=nnx.Rngs(0))
    emb = _rand(0, (1, 1, D))
    outs = [(_rand(10 + l, (1, 1, D)), _rand(50 + l, (1, 1, D))) for l in range(L)]
    stream = attn_res.init_stream(emb, "attn_res", attn_res.n_bank_slots(L, bs))
    bank, partial = [emb], None
    for l, (a, f) in enumerate(outs):
        got = attn_res.read(stream, mix)
        want = jnp.mean(jnp.stack(bank + ([partial] if partial is not None else [])), 0)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        may_start = attn_res.may_start_block([l], bs) if hinted else True
        stream = attn_res.add_attention(stream, a, jnp.asarray(l), bs, may_start)
        if l % bs == 0:
            if partial is not None:
                bank.append(partial)
            partial = a
        else:
            partial = partial + a
        np.testing.assert_allclose(attn_res.read(stream, mix), jnp.mean(jnp.stack(bank + [partial]), 0),
                                   rtol=1e-5, atol=1e-6)
        stream = attn_res.add_ffn(stream, f)
        partial = partial + f
    np.testing.assert_allclose(attn_res.read(stream, mix), jnp.mean(jnp.stack(bank + [partial]), 0),
                               rtol=1e-5, atol=1e-6)
    assert int(stream["count"]) == len(bank) == 3


def test_layers_that_never_start_a_block_are_marked_in_the_head_body_and_tail():
    """K3 ladder layout (12 layers, blocks of 3, dense first layer, period 4): head 0-3, body 4-11 as
    two repeats of 4. A body position may bank when any repeat starts a block there (6 at position 2,
    9 at position 1); positions 0 (4, 8) and 3 (7, 11) and head layers 1, 2 never do."""
    from k3.model import Model
    cfg = tiny_model_cfg(n_layers=12, attn_res_block_size=3, first_k_dense=1, mla_period=4, layer_loop="scan")
    assert cfg.residual == "attn_res" and cfg.mixer != "mla"
    model = nnx.eval_shape(lambda: Model(cfg, rngs=nnx.Rngs(0)))
    assert (model.head_idx, model.body_start, model.body_period, model.body_repeats) == ((0, 1, 2, 3), 4, 4, 2)
    assert [layer.may_start for layer in model.head_layers] == [True, False, False, True]
    assert [layer.may_start for layer in model.body.layers] == [False, True, True, False]
    assert attn_res.may_start_block([7, 11], 3) is False and attn_res.may_start_block([6, 10], 3) is True


# ---------------------------------------------------------------- RMSNorm
def _rms_plain(x, w, eps):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 7), (2, 5, 3, 9)])
def test_rms_norm_values_and_gradients_match_autodiff_float64(x64, shape):
    """`k3.nn.rms_norm`'s own VJP against autodiff of the formula in float64: one element, odd widths,
    a multi-axis input with a per-last-axis gain, rows of very different scales and an all-zero row."""
    from k3.nn import rms_norm
    keys = jax.random.split(jax.random.key(len(shape)), 3)
    x = jax.random.normal(keys[0], shape, jnp.float64) * jnp.exp(3.0 * jax.random.normal(keys[1], shape[:-1] + (1,)))
    x = x.at[(0,) * (len(shape) - 1)].set(0.0)
    w = 1.0 + jax.random.normal(keys[2], shape[-1:], jnp.float64)
    dy = jax.random.normal(jax.random.key(7), shape, jnp.float64)
    got, got_vjp = jax.vjp(lambda x, w: rms_norm(x, w, 1e-6), x, w)
    want, want_vjp = jax.vjp(lambda x, w: _rms_plain(x, w, 1e-6), x, w)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("x", "weight"), got_vjp(dy), want_vjp(dy)):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9, err_msg=name)


def test_rms_norm_bf16_gradients_keep_dtypes_and_follow_float32():
    from k3.nn import rms_norm
    x, w, dy = _rand(0, (4, 6, 48), 3.0), 1.0 + _rand(1, (48,), 0.1), _rand(2, (4, 6, 48))
    xb = x.astype(jnp.bfloat16)
    out, vjp = jax.vjp(lambda x, w: rms_norm(x, w, 1e-6), xb, w)
    dx, dw = vjp(dy.astype(jnp.bfloat16))
    assert out.dtype == dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    _, ref_vjp = jax.vjp(lambda x, w: _rms_plain(x, w, 1e-6), xb.astype(jnp.float32), w)
    rx, rw = ref_vjp(dy.astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(dx, np.float32), rx, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(dw, rw, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("eq, x_shape, w_shape", [("ecd,edf->ecf", (3, 5, 7), (3, 7, 6)),
                                                  ("btd,df->btf", (2, 9, 5), (5, 11)),
                                                  ("ecf,efd->ecd", (2, 13, 4), (2, 4, 3))])
def test_weight_einsum_gradients_match_the_einsum_float64(x64, eq, x_shape, w_shape):
    """`k3.nn.weight_einsum` inside `fp32_weight_grads`: values and both gradients equal autodiff of
    jnp.einsum in float64 (its weight gradient keeps float64), at shapes of no tile size."""
    from k3.nn import fp32_weight_grads, weight_einsum

    kx, kw, ky = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, x_shape, jnp.float64)
    w = jax.random.normal(kw, w_shape, jnp.float64)
    y0 = jnp.einsum(eq, x, w)
    ct = jax.random.normal(ky, y0.shape, jnp.float64)
    with fp32_weight_grads():
        y, vjp = jax.vjp(lambda x, w: weight_einsum(eq, x, w), x, w)
    ref = jax.vjp(lambda x, w: jnp.einsum(eq, x, w), x, w)[1](ct)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y0), rtol=1e-12)
    for got, want in zip(vjp(ct), ref):
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-10, atol=1e-12)


def test_weight_einsum_bf16_weight_gradient_in_fp32_only_inside_the_context():
    """With bf16 operands the weight gradient is fp32 (unrounded: nearer the float32 product than the
    bf16 one) inside `fp32_weight_grads`, bf16 outside; x's gradient stays bf16. A term summed within
    one operand is refused by name."""
    from k3.nn import fp32_weight_grads, weight_einsum

    kx, kw, ky = jax.random.split(jax.random.key(4), 3)
    x = jax.random.normal(kx, (4, 37, 24), jnp.float32)
    w = jax.random.normal(kw, (4, 24, 40), jnp.float32)
    ct = jax.random.normal(ky, (4, 37, 40), jnp.float32)
    eq = "ecd,edf->ecf"
    xb, wb, cb = (a.astype(jnp.bfloat16) for a in (x, w, ct))
    with fp32_weight_grads():
        dx, dw = jax.vjp(lambda x, w: weight_einsum(eq, x, w), xb, wb)[1](cb)
    plain_dx, plain_dw = jax.vjp(lambda x, w: weight_einsum(eq, x, w), xb, wb)[1](cb)
    assert (dx.dtype, dw.dtype, plain_dx.dtype, plain_dw.dtype) == (jnp.bfloat16, jnp.float32, jnp.bfloat16,
                                                                      jnp.bfloat16)
    ref = jax.vjp(lambda w: jnp.einsum(eq, xb.astype(jnp.float32), w), w)[1](cb.astype(jnp.float32))[0]
    err = lambda a: float(jnp.max(jnp.abs(a.astype(jnp.float32) - ref)))  # noqa: E731
    assert err(dw) < 1e-5 < err(plain_dw)
    with fp32_weight_grads(), pytest.raises(ValueError, match="every index in two of the three"):
        weight_einsum("ab,bc->a", x[0], w[0])
