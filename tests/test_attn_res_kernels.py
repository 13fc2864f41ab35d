"""The Block AttnRes depth-mix kernels (`pallas_kernels.attn_res`, interpreted on a CPU) against the
jnp `k3.attn_res.depth_mix` and a float64 autodiff reference; sharded over a CPU mesh."""

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
    (3, 1, 70, 2, (True, False, False), True, 1),       # several backward steps a program
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


def test_sharded_mix_equals_one_device():
    """The kernels under shard_map on a CPU mesh (batch over data x fsdp, sequence over context):
    the mix and every gradient, the pseudo-query's summed over the devices, as on one device."""
    devices = np.array(jax.devices()[:8]).reshape(2, 2, 2)
    sharder = Sharder(Mesh(devices, ("data", "fsdp", "context")))
    one = attn_res.AttnResMix(16, 1e-5, rngs=nnx.Rngs(0), impl="xla")
    mesh_mix = attn_res.AttnResMix(16, 1e-5, rngs=nnx.Rngs(0), impl="pallas", sharder=sharder)
    q = jax.random.normal(jax.random.key(1), (16,))
    one.query[...] = q
    mesh_mix.query[...] = q
    cands, extra, _ = _inputs(3, 3, 4, 8, 16, jnp.float32)
    valid = jnp.array([True, False, True])

    def loss_and_grads(mix):
        graphdef, params = nnx.split(mix)

        def loss(params, c, e):
            return jnp.sum(jnp.sin(nnx.merge(graphdef, params)(c, valid, e, jnp.asarray(True))))

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(params, cands, extra)

    (l1, g1), (l2, g2) = loss_and_grads(one), loss_and_grads(mesh_mix)
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):  # query, norm gain, cands, extra
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
