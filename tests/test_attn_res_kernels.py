"""The Block AttnRes depth-mix kernels (`pallas_kernels.attn_res`, interpreted on a CPU) against the
jnp `k3.attn_res.depth_mix` and a float64 autodiff reference; sharded over a CPU mesh."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from conftest import depth_mix_plain
from k3 import attn_res
from k3.sharding import Sharder
from pallas_kernels.attn_res import depth_mix_pallas


def _inputs(seed, M, B, T, D, dtype, scale=3.0):
    k = jax.random.split(jax.random.key(seed), 4)
    cands = jax.random.normal(k[0], (M, B, T, D), jnp.float32) * jnp.exp(jax.random.normal(k[1], (M, 1, 1, 1)))
    extra = jax.random.normal(k[2], (B, T, D), jnp.float32)
    w = scale * jax.random.normal(k[3], (D,), jnp.float32)
    return cands.astype(dtype), extra.astype(dtype), w


@pytest.mark.parametrize("M,B,T,block,valid,extra_valid,n_valid", [
    (3, 2, 37, 16, (True, False, True), True, None),   # tokens not a multiple of the block, a hole in the bank
    (1, 1, 1, 16, (True,), False, None),                # one token, the bank's embedding alone
    (4, 3, 8, 8, (True, True, True, True), True, None),  # blocks that divide the tokens
    (4, 2, 37, 2, (True, True, False, False), True, 2),  # the empty slots skipped by a static count
    (3, 1, 72, 2, (True, False, False), True, 1),       # several backward steps a program
])
def test_kernels_match_float64_reference(x64, M, B, T, block, valid, extra_valid, n_valid):
    """Values and the gradients of candidates, extra and w, computed in float64 in the kernels
    (interpret mode) against autodiff of the plain formula."""
    cands, extra, w = _inputs(M * 10 + T, M, B, T, 16, jnp.float64)
    w = w.astype(jnp.float64)
    dout = jax.random.normal(jax.random.key(99), (B, T, 16), jnp.float64)
    valid, ev = jnp.array(valid), jnp.asarray(extra_valid)
    got, got_vjp = jax.vjp(lambda c, e, w: depth_mix_pallas(c, valid, e, ev, w, 1e-5, n_valid=n_valid, block=block,
                                                            interpret=True), cands, extra, w)
    want, want_vjp = jax.vjp(lambda c, e, w: depth_mix_plain(c, valid, e, ev, w, 1e-5), cands, extra, w)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("cands", "extra", "w"), got_vjp(dout), want_vjp(dout)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-11, err_msg=name)


@pytest.mark.parametrize("M,B,T,n_valid,extra_valid,steps", [
    (3, 2, 37, 2, True, 1),    # awkward token count, an empty slot skipped
    (1, 1, 1, None, False, 1),  # one token, the embedding alone
    (4, 1, 72, 3, True, 4),    # several backward steps a program (72 = 9 programs of 4 x 2 tokens)
    (2, 1, 70, None, True, 4),  # 70 tokens: programs of 2 x 1 blocks instead of padding to 72
])
def test_mix_with_its_norm_matches_float64_reference(x64, M, B, T, n_valid, extra_valid, steps):
    """The RMSNorm computed inside the kernels: rms_norm(mix) * gamma and the gradients of candidates,
    extra, w and gamma against autodiff of the plain formulas, in float64."""
    cands, extra, w = _inputs(M * 7 + T, M, B, T, 16, jnp.float64)
    w = w.astype(jnp.float64)
    gamma = 1.0 + 0.3 * jax.random.normal(jax.random.key(3), (16,), jnp.float64)
    dout = jax.random.normal(jax.random.key(98), (B, T, 16), jnp.float64)
    valid, ev = jnp.arange(M) < (M if n_valid is None else n_valid), jnp.asarray(extra_valid)

    def plain(c, e, w, g):
        x = depth_mix_plain(c, valid, e, ev, w, 1e-5)
        return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g

    got, got_vjp = jax.vjp(lambda c, e, w, g: depth_mix_pallas(c, valid, e, ev, w, 1e-5, n_valid=n_valid, gamma_D=g,
                                                               norm_eps=1e-6, steps=steps, interpret=True),
                           cands, extra, w, gamma)
    want, want_vjp = jax.vjp(plain, cands, extra, w, gamma)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("cands", "extra", "w", "gamma"), got_vjp(dout), want_vjp(dout)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-11, err_msg=name)


@pytest.mark.parametrize("B,T", [(1, 1), (3, 1), (1, 37)])
def test_token_counts_off_the_block_are_not_padded(B, T):
    """A decode step of one token (or three rows, or an odd prompt) runs smaller programs instead of
    copying the bank into a padded one: the traced mix, forward and backward, has no pad (all slots
    read, so neither does the bank's gradient)."""
    cands, extra, w = _inputs(5, 3, B, T, 16, jnp.float32)
    valid, ev = jnp.array([True, True, False]), jnp.asarray(True)

    def loss(c, e, w):
        return jnp.sum(depth_mix_pallas(c, valid, e, ev, w, 1e-5, block=2, steps=4, interpret=True))

    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(cands, extra, w))
    assert " pad[" not in jaxpr and "pad " not in jaxpr
    want = depth_mix_plain(cands, valid, extra, ev, w, 1e-5)
    got = depth_mix_pallas(cands, valid, extra, ev, w, 1e-5, block=2, steps=4, interpret=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

@pytest.mark.parametrize("with_norm", [False, True])
def test_pseudo_query_gain_formed_in_the_kernels_float64(x64, with_norm):
    """``w_gain_D``: the kernels multiply the pseudo-query by the key-norm gain themselves; values and
    the gradients of both factors (and candidates, extra) against autodiff of the plain formula."""
    M, B, T = 3, 2, 19
    cands, extra, q = _inputs(5, M, B, T, 16, jnp.float64)
    q = q.astype(jnp.float64)
    gain = 1.0 + 0.4 * jax.random.normal(jax.random.key(7), (16,), jnp.float64)
    gamma = 1.0 + 0.3 * jax.random.normal(jax.random.key(8), (16,), jnp.float64)
    dout = jax.random.normal(jax.random.key(9), (B, T, 16), jnp.float64)
    valid, ev = jnp.array([True, True, False]), jnp.asarray(True)
    norm = dict(gamma_D=gamma, norm_eps=1e-6) if with_norm else {}

    def plain(c, e, q, a):
        x = depth_mix_plain(c, valid, e, ev, q * a, 1e-5)
        return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * gamma if with_norm else x

    got, got_vjp = jax.vjp(lambda c, e, q, a: depth_mix_pallas(c, valid, e, ev, q, 1e-5, n_valid=2, w_gain_D=a,
                                                               interpret=True, **norm), cands, extra, q, gain)
    want, want_vjp = jax.vjp(plain, cands, extra, q, gain)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("cands", "extra", "query", "gain"), got_vjp(dout), want_vjp(dout)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-11, err_msg=name)


def test_mix_with_its_norm_bf16_matches_the_unfused_backend():
    """bf16 as in training: the fused kernels against `depth_mix` followed by `rms_norm` (which rounds
    the mix to bf16 between them), through `AttnResMix` with a norm (its gain and eps)."""
    cands, extra, w = _inputs(8, 3, 2, 24, 32, jnp.bfloat16)
    gamma = 1.0 + 0.2 * jax.random.normal(jax.random.key(4), (32,))
    valid, ev = jnp.array([True, True, False]), jnp.asarray(True)
    outs = {}
    for impl in ("xla", "pallas_norm"):
        mix = attn_res.AttnResMix(32, 1e-5, rngs=nnx.Rngs(1), impl=impl)
        mix.query[...] = 0.5 * w
        mix.norm[...] = 1.0 + 0.3 * jax.random.normal(jax.random.key(5), (32,))

        def f(c, e, g, mix=mix):
            return mix(c, valid, e, ev, n_valid=2, norm=types.SimpleNamespace(weight=g, eps=1e-6))

        out, vjp = jax.vjp(f, cands, extra, gamma)
        outs[impl] = (out, vjp(jnp.ones_like(out)))
    (a, ga), (b, gb) = outs["pallas_norm"], outs["xla"]
    assert a.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)
    for name, x, y in zip(("cands", "extra", "gamma"), ga, gb):
        assert x.dtype == y.dtype, name
        scale = float(jnp.max(jnp.abs(y.astype(jnp.float32))))
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=3e-2,
                                   atol=2e-2 * scale, err_msg=name)


def test_kernels_bf16_match_jnp_backend():
    """bf16 candidates as in training: the kernels and `depth_mix` agree to bf16 rounding, and the
    gradients keep the candidates' dtype."""
    cands, extra, w = _inputs(5, 3, 2, 24, 32, jnp.bfloat16)
    dout = jax.random.normal(jax.random.key(6), (2, 24, 32), jnp.float32).astype(jnp.bfloat16)
    valid, ev = jnp.array([True, True, False]), jnp.asarray(True)
    got, got_vjp = jax.vjp(lambda c, e, w: depth_mix_pallas(c, valid, e, ev, w, 1e-5, interpret=True), cands, extra, w)
    want, want_vjp = jax.vjp(lambda c, e, w: attn_res.depth_mix(c, valid, e, ev, w, 1e-5), cands, extra, w)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
    for name, a, b in zip(("cands", "extra", "w"), got_vjp(dout), want_vjp(dout)):
        assert a.dtype == b.dtype, name
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2,
                                   err_msg=name)


def test_width_not_a_power_of_two_uses_the_reference_and_bad_shapes_fail():
    """The 'pallas' backend runs the reference at a width the tiles cannot take; the kernels
    themselves refuse it, and mismatched shapes, with errors that name the problem."""
    cands, extra, w = _inputs(7, 2, 1, 5, 12, jnp.float32)
    valid, ev = jnp.array([True, True]), jnp.asarray(True)
    np.testing.assert_allclose(attn_res.MIX_BACKENDS.get("pallas")(cands, valid, extra, ev, w, 1e-5),
                               attn_res.depth_mix(cands, valid, extra, ev, w, 1e-5), rtol=1e-6)
    with pytest.raises(ValueError, match="power of two >= 16; got 12"):
        depth_mix_pallas(cands, valid, extra, ev, w, 1e-5)
    with pytest.raises(ValueError, match="extra"):
        depth_mix_pallas(cands, valid, extra[:, :4], ev, w, 1e-5)
    with pytest.raises(ValueError, match="power of two"):
        depth_mix_pallas(cands, valid, extra, ev, w, 1e-5, block=12)
    c16, e16, w16 = _inputs(7, 2, 1, 5, 16, jnp.float32)
    with pytest.raises(ValueError, match="steps must be a power of two; got 3"):
        depth_mix_pallas(c16, valid, e16, ev, w16, 1e-5, steps=3)
    with pytest.raises(ValueError, match=r"n_valid must be in \[0, M = 2\]; got 3"):
        depth_mix_pallas(c16, valid, e16, ev, w16, 1e-5, n_valid=3)
    with pytest.raises(ValueError, match="the norm needs both gamma"):
        depth_mix_pallas(c16, valid, e16, ev, w16, 1e-5, gamma_D=w16)


@pytest.mark.parametrize("impl,with_norm", [("pallas", False), ("pallas", True), ("pallas_norm", True)])
def test_sharded_mix_equals_one_device(impl, with_norm):
    """The kernels under shard_map on a CPU mesh (batch over data x fsdp, sequence over context):
    the mix (and the RMSNorm after it) and every gradient, the pseudo-query's and the norm gain's
    summed over the devices, as on one device."""
    devices = np.array(jax.devices()[:8]).reshape(2, 2, 2)
    sharder = Sharder(Mesh(devices, ("data", "fsdp", "context")))
    one = attn_res.AttnResMix(16, 1e-5, rngs=nnx.Rngs(0), impl="xla")
    mesh_mix = attn_res.AttnResMix(16, 1e-5, rngs=nnx.Rngs(0), impl=impl, sharder=sharder)
    q = jax.random.normal(jax.random.key(1), (16,))
    one.query[...] = q
    mesh_mix.query[...] = q
    cands, extra, _ = _inputs(3, 3, 4, 8, 16, jnp.float32)
    valid = jnp.array([True, False, True])

    def loss_and_grads(mix):
        graphdef, params = nnx.split(mix)

        def loss(params, c, e, g):
            norm = types.SimpleNamespace(weight=g, eps=1e-6) if with_norm else None
            return jnp.sum(jnp.sin(nnx.merge(graphdef, params)(c, valid, e, jnp.asarray(True), norm=norm)))

        gain = 1.0 + 0.1 * jnp.arange(16.0)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(params, cands, extra, gain)

    (l1, g1), (l2, g2) = loss_and_grads(one), loss_and_grads(mesh_mix)
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):  # query, key-norm gain, cands, extra, gain
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_few_token_calls_take_one_token_programs_and_agree():
    """`mix_tiles`: one token and 4 warps a program up to `FEW_TOKENS` tokens (a decode step), the
    training tiles above; a few-token call with the default tiles equals the reference, as with the
    training tiles given explicitly."""
    from pallas_kernels.attn_res import FEW_TOKENS, mix_tiles

    assert mix_tiles(1) == mix_tiles(FEW_TOKENS) == (1, 4) and mix_tiles(FEW_TOKENS + 1) == (2, 1)
    cands, extra, w = _inputs(11, 4, 3, 1, 32, jnp.float32)
    valid, ev = jnp.array([True, True, False, True]), jnp.asarray(True)
    want = attn_res.depth_mix(cands, valid, extra, ev, w, 1e-5)
    for tiles in ({}, {"block": 2, "num_warps": 1}):
        got = depth_mix_pallas(cands, valid, extra, ev, w, 1e-5, interpret=True, **tiles)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
