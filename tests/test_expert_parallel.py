"""Expert-parallel routed experts (8 CPU devices) against the one-device dense reference."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3 import sharding
from k3.moe.balancing import expert_load
from k3.moe.expert_parallel import ragged_all_to_all_emulated, routed_experts_sharded
from k3.moe.layer import dense_experts

B, T, W, F, E, K = 8, 6, 8, 12, 8, 2


def _sharder(**sizes):
    cfg = {a: 1 for a in sharding.MESH_AXES}
    cfg.update(sizes)
    n = math.prod(cfg.values())
    return sharding.Sharder(sharding.make_mesh(cfg, jax.devices()[:n]))


def _inputs(seed, skew=True):
    ks = jax.random.split(jax.random.key(seed), 6)
    h = jax.random.normal(ks[0], (B, T, W))
    logits = jax.random.normal(ks[1], (B, T, E)) + (jnp.linspace(2.0, 0.0, E) if skew else 0.0)
    idx = jax.lax.top_k(logits, K)[1].astype(jnp.int32)  # skewed: the low experts are popular
    wts = jax.nn.softmax(jax.random.normal(ks[2], (B, T, K)), axis=-1)
    ws = (0.3 * jax.random.normal(ks[3], (E, W, F)), 0.3 * jax.random.normal(ks[4], (E, W, F)),
          0.3 * jax.random.normal(ks[5], (E, F, W)))
    return h, idx, wts, ws


def _reference(h, idx, wts, ws):
    out, _ = dense_experts(h.reshape(-1, W), idx.reshape(-1, K), *ws, "swiglu", (4.0, 25.0))
    return jnp.einsum("nkw,nk->nw", out, wts.reshape(-1, K)).reshape(B, T, W)


@pytest.mark.parametrize("dispatch", ["padded", "ragged_emulated"])
@pytest.mark.parametrize("mesh", [dict(expert=4, data=2), dict(expert=2, tensor=2, fsdp=2),
                                  pytest.param(dict(expert=8), marks=pytest.mark.slow)])
def test_matches_dense_reference_with_gradients(mesh, dispatch):
    sh = _sharder(**mesh)
    h, idx, wts, ws = _inputs(1)

    def loss(fn, h, ws):
        y = fn(h, ws)
        return jnp.sum(y * jnp.cos(y)), y

    def sharded(h, ws):
        y, dropped, stats = routed_experts_sharded(
            sh, h, idx, wts, *ws, activation="swiglu", betas=(4.0, 25.0), dispatch=dispatch,
            stats_fn=lambda i: {"load": expert_load(i, E)})
        return y, dropped, stats

    (y, dropped, stats) = jax.jit(sharded)(h, ws)
    np.testing.assert_allclose(y, _reference(h, idx, wts, ws), rtol=1e-5, atol=1e-5)
    assert int(dropped) == 0
    np.testing.assert_array_equal(stats["load"], np.bincount(np.asarray(idx).ravel(), minlength=E))
    g = jax.jit(jax.grad(lambda h, ws: loss(lambda a, b: sharded(a, b)[0], h, ws)[0], argnums=(0, 1)))(h, ws)
    g_ref = jax.grad(lambda h, ws: loss(lambda a, b: _reference(a, idx, wts, b), h, ws)[0], argnums=(0, 1))(h, ws)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _expected_drops(idx, n_shards, capacity_factor, ragged):
    """Independent count: rows per (source device, destination device), capacity applied."""
    per_src = np.asarray(idx).reshape(n_shards, -1)  # batch split over the expert axis only
    R = per_src.shape[1]
    C = max(1, math.ceil(capacity_factor * R / n_shards))
    counts = np.stack([np.bincount(row // (E // n_shards), minlength=n_shards) for row in per_src])
    if not ragged:
        return int(np.maximum(counts - C, 0).sum())
    dropped = 0
    for d in range(n_shards):  # a destination fills n_shards * C rows, sources in device order
        room = n_shards * C
        for s in range(n_shards):
            take = min(room, counts[s, d])
            dropped += counts[s, d] - take
            room -= take
    return dropped


@pytest.mark.parametrize("dispatch", ["padded", "ragged_emulated"])
def test_capacity_drops_exactly_the_overflow(dispatch):
    sh = _sharder(expert=4)
    h, idx, wts, ws = _inputs(2)
    y, dropped, _ = jax.jit(lambda h: routed_experts_sharded(
        sh, h, idx, wts, *ws, activation="swiglu", betas=(4.0, 25.0), capacity_factor=0.5,
        dispatch=dispatch))(h)
    want = _expected_drops(idx, 4, 0.5, ragged=dispatch != "padded")
    assert want > 0 and int(dropped) == want
    # A capacity of P: C = N k rows per destination, the dropless worst case, so nothing drops.
    y, dropped, _ = jax.jit(lambda h: routed_experts_sharded(
        sh, h, idx, wts, *ws, activation="swiglu", betas=(4.0, 25.0), capacity_factor=4.0,
        dispatch=dispatch))(h)
    assert int(dropped) == 0
    np.testing.assert_allclose(y, _reference(h, idx, wts, ws), rtol=1e-5, atol=1e-5)


def test_ragged_emulation_semantics():
    """Peer j's output gets my rows [in_off[j], +send[j]) at out_off[j]; untouched rows keep their value."""
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    operand = jnp.arange(2 * 5, dtype=jnp.float32).reshape(2, 5)  # device d holds 5*d .. 5*d+4
    in_off = jnp.array([[0, 2], [0, 1]], jnp.int32)
    send = jnp.array([[2, 3], [1, 4]], jnp.int32)
    out_off = jnp.array([[0, 0], [2, 3]], jnp.int32)  # device 1's rows land after device 0's
    recv = jnp.array([[2, 1], [3, 4]], jnp.int32)

    def body(op, io, s, oo, r):
        return ragged_all_to_all_emulated(op[0], jnp.full((8,), -1.0), io[0], s[0], oo[0], r[0], axis_name="x")[None]

    P = jax.sharding.PartitionSpec
    out = jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=P("x"))(operand, in_off, send, out_off, recv)
    np.testing.assert_array_equal(out[0], [0, 1, 5, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(out[1], [2, 3, 4, 6, 7, 8, 9, -1])


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "cuda", "tpu"),
                    reason="jax.lax.ragged_all_to_all has no CPU implementation; its CPU stand-in is tested above")
def test_ragged_all_to_all_matches_its_emulation_on_accelerators():
    """The real primitive and the emulation the CPU tests use agree, over all local accelerators."""
    n = len(jax.devices())
    sh = _sharder(expert=n) if E % n == 0 else _sharder(expert=1)
    h, idx, wts, ws = _inputs(3)
    outs = {}
    for dispatch in ("ragged", "ragged_emulated", "padded"):
        outs[dispatch] = jax.jit(lambda h: routed_experts_sharded(
            sh, h, idx, wts, *ws, activation="swiglu", betas=(4.0, 25.0), capacity_factor=0.5,
            dispatch=dispatch))(h)
    np.testing.assert_allclose(outs["ragged"][0], outs["ragged_emulated"][0], rtol=1e-5, atol=1e-5)
    assert int(outs["ragged"][1]) == int(outs["ragged_emulated"][1])
    if n == 1:  # one device: nothing is exchanged, so compare the exchange itself at P = 1
        from k3.moe.expert_parallel import _ragged_exchange

        P = jax.sharding.PartitionSpec
        mesh = jax.make_mesh((1,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
        x, i = h.reshape(-1, W), idx.reshape(-1, K)
        res = {}
        for name, a2a in (("ragged", jax.lax.ragged_all_to_all), ("emulated", ragged_all_to_all_emulated)):
            fn = jax.shard_map(lambda x, i, a2a=a2a: _ragged_exchange(
                x, i, *ws, activation="swiglu", betas=(4.0, 25.0), expert_axes=("expert",), n_expert_shards=1,
                capacity_factor=0.0, a2a=a2a), mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()),
                check_vma=False)
            res[name] = jax.jit(fn)(x, i)
        np.testing.assert_allclose(res["ragged"][0], res["emulated"][0], rtol=1e-5, atol=1e-5)
        ref = _reference(h, idx, wts, ws).reshape(-1, W)
        np.testing.assert_allclose(jnp.einsum("nkw,nk->nw", res["ragged"][0], wts.reshape(-1, K)), ref,
                                   rtol=2e-2, atol=2e-2)  # TF32 matmuls on GPU
