"""Context parallelism (k3.kda.parallel, k3.mla.parallel) against the unsplit KDA core and MLA attention.

Eight CPU devices come from conftest. Shapes are shared between cases so that the unsplit
references compile once.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3.kda.parallel import kda_core_sharded
from k3.mla.parallel import mla_attention_sharded
from k3.mla.layer import attention
from k3.kda.ops import kda_core, l2_normalize

B, T, H, K, V = 2, 40, 2, 8, 6  # V != K so that a transposed state cannot pass
CHUNK = 16  # T / P = 20, 10, 5 tokens per shard: never a multiple of the chunk
LOWER = -5.0

# Row 0: a document spanning shards 0-2 of 4 (and 0-5 of 8), a boundary exactly at the shard edge 30,
# and id 5 reused by a later, separate document. Row 1: boundaries exactly at the edges 10 and 20 and
# a document spanning shards 1-3 of 4. Boundaries at 3, 13, 33 fall inside shards.
SEGMENTS = np.array([[5] * 3 + [7] * 27 + [5] * 3 + [9] * 7, [1] * 10 + [2] * 3 + [3] * 7 + [4] * 20], np.int32)


def _mesh(shape, names):
    n = math.prod(shape)
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape), devices=jax.devices()[:n])


def _kda_inputs(seed, b=B, t=T, h=H, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 8)
    q = l2_normalize(jax.random.normal(ks[0], (b, t, h, K), dtype))
    k = l2_normalize(jax.random.normal(ks[1], (b, t, h, K), dtype))
    v = jax.random.normal(ks[2], (b, t, h, V), dtype)
    # Mostly mild gates, so that the state carried across a whole shard stays far from zero (uniform
    # gates in [-5, 0] would decay it by ~exp(-25) over 10 tokens and hide a wrong transition), plus
    # some anywhere in [-5, 0], some exactly at the bound and some at zero (no decay).
    pick = jax.random.uniform(ks[4], (b, t, h, K))
    mild = jax.random.uniform(ks[3], (b, t, h, K), dtype, -0.1, 0.0)
    g = jnp.where(pick < 0.1, 50.0 * mild, mild)
    g = jnp.where(pick < 0.03, LOWER, jnp.where(pick > 0.95, 0.0, g))
    beta = jax.random.uniform(ks[5], (b, t, h), dtype)
    init = 0.5 * jax.random.normal(ks[6], (b, h, K, V), dtype)
    w_o = jax.random.normal(ks[7], (b, t, h, V), dtype)
    w_s = jax.random.normal(jax.random.fold_in(ks[7], 1), (b, h, K, V), dtype)
    return (q, k, v, g, beta, init), (w_o, w_s)


def _kda_loss(run):
    """loss(inputs, weights, segments) -> (scalar, (o, final)); grads w.r.t. all six inputs."""

    def loss(inputs, weights, segment_ids):
        q, k, v, g, beta, init = inputs
        o, final = run(q, k, v, g, beta, segment_ids, init)
        w_o, w_s = weights
        return jnp.sum(o * w_o) + jnp.sum(final * w_s), (o, final)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def _unsplit(impl):
    return _kda_loss(
        lambda q, k, v, g, beta, seg, init: kda_core(
            q, k, v, g, beta, impl=impl, chunk_size=CHUNK, gate_lower_bound=LOWER, initial_state=init,
            output_final_state=True, segment_ids=seg,
        )
    )


def _split(mesh, impl, **axes):
    return _kda_loss(
        lambda q, k, v, g, beta, seg, init: kda_core_sharded(
            mesh, q, k, v, g, beta, seg, impl=impl, chunk_size=CHUNK, gate_lower_bound=LOWER,
            initial_state=init, output_final_state=True, **axes,
        )
    )


def _assert_close(actual, expected, tol, what):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    err = np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30)
    assert err <= tol, f"{what}: relative max error {err:.3g} > {tol}"


def _compare(split, unsplit, seed, segments, tol=1e-5, grad_tol=1e-4, dtype=jnp.float32, b=B, t=T, h=H):
    inputs, weights = _kda_inputs(seed, b, t, h, dtype)
    seg = None if segments is None else jnp.asarray(segments)
    (loss_s, (o_s, final_s)), grads_s = split(inputs, weights, seg)
    (loss_u, (o_u, final_u)), grads_u = unsplit(inputs, weights, seg)
    assert o_s.dtype == o_u.dtype and final_s.dtype == final_u.dtype
    _assert_close(o_s, o_u, tol, "output")
    _assert_close(final_s, final_u, tol, "final state")
    for name, gs, gu in zip(("q", "k", "v", "g", "beta", "initial_state"), grads_s, grads_u):
        _assert_close(gs, gu, grad_tol, f"d{name}")


# With 2 shards SEGMENTS has a boundary in every (row, shard) that carries a state, so every
# transition A would be zero; one document per row makes both transitions matter there.
@pytest.mark.parametrize(
    "n_shards, impl, segments, seed",
    [(2, "recurrent", None, 0), (4, "chunk", SEGMENTS, 1), (4, "recurrent", SEGMENTS, 2), (8, "chunk", SEGMENTS, 3)],
    ids=["2-recurrent-nosegments", "4-chunk", "4-recurrent", "8-chunk"],
)
def test_kda_matches_unsplit(n_shards, impl, segments, seed):
    mesh = _mesh((n_shards,), ("context",))
    _compare(_split(mesh, impl), _unsplit(impl), seed, segments)


@pytest.mark.slow
def test_kda_one_token_per_shard():
    mesh = _mesh((8,), ("context",))
    segments = np.array([[0, 0, 0, 1, 1, 1, 1, 2], [3, 3, 3, 3, 3, 3, 3, 3]], np.int32)
    _compare(_split(mesh, "chunk"), _unsplit("chunk"), 4, segments, t=8)


@pytest.mark.slow
def test_kda_float64(x64):
    mesh = _mesh((4,), ("context",))
    _compare(_split(mesh, "chunk"), _unsplit("chunk"), 5, SEGMENTS, tol=1e-10, grad_tol=1e-10, dtype=jnp.float64)


def test_kda_data_and_context_mesh():
    mesh = _mesh((2, 4), ("data", "context"))
    _compare(_split(mesh, "chunk", batch_axes=("data",)), _unsplit("chunk"), 6, SEGMENTS)


def test_kda_heads_over_tensor_axis():
    mesh = _mesh((4, 2), ("context", "tensor"))
    _compare(_split(mesh, "recurrent", head_axis="tensor"), _unsplit("recurrent"), 7, SEGMENTS)


def test_kda_without_initial_or_final_state():
    mesh = _mesh((4,), ("context",))
    (q, k, v, g, beta, _), _ = _kda_inputs(8)
    kwargs = dict(impl="recurrent", segment_ids=jnp.asarray(SEGMENTS))
    o_s, final_s = jax.jit(lambda *a: kda_core_sharded(mesh, *a, **kwargs))(q, k, v, g, beta)
    o_u, _ = kda_core(q, k, v, g, beta, **kwargs)
    assert final_s is None
    _assert_close(o_s, o_u, 1e-5, "output")


# ----------------------------------------------------------------------------------------------------
# MLA
# ----------------------------------------------------------------------------------------------------

D, E = 8, 6  # value head dim smaller than the query/key one, as in MLA
SCALE = D**-0.5


def _mla_loss(run):
    def loss(q, k, v, w, seg):
        o = run(q, k, v, seg)
        return jnp.sum(o * w), o

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


_MLA_UNSPLIT = _mla_loss(lambda q, k, v, seg: attention(q, k, v, seg, SCALE))


@pytest.mark.parametrize(
    "n_shards, ring, with_segments",
    [(2, False, True), (4, False, False), (8, False, True), (2, True, False), (4, True, True), (8, True, True)],
)
def test_mla_matches_unsplit(n_shards, ring, with_segments):
    mesh = _mesh((n_shards,), ("context",))
    ks = jax.random.split(jax.random.key(100 + 2 * n_shards + ring), 4)
    q = jax.random.normal(ks[0], (B, T, H, D))
    k = jax.random.normal(ks[1], (B, T, H, D))
    v = jax.random.normal(ks[2], (B, T, H, E))
    w = jax.random.normal(ks[3], (B, T, H, E))
    seg = jnp.asarray(SEGMENTS) if with_segments else None
    split = _mla_loss(lambda q, k, v, seg: mla_attention_sharded(mesh, q, k, v, seg, SCALE, ring=ring))
    (_, o_s), grads_s = split(q, k, v, w, seg)
    (_, o_u), grads_u = _MLA_UNSPLIT(q, k, v, w, seg)
    assert o_s.shape == (B, T, H, E) and o_s.dtype == q.dtype
    _assert_close(o_s, o_u, 1e-5, "output")
    for name, gs, gu in zip("qkv", grads_s, grads_u):
        _assert_close(gs, gu, 1e-4, f"d{name}")


@pytest.mark.parametrize("ring", [False, True])
def test_mla_batch_and_heads_sharded(ring):
    mesh = _mesh((2, 2, 2), ("data", "context", "tensor"))
    ks = jax.random.split(jax.random.key(200 + ring), 3)
    q = jax.random.normal(ks[0], (B, T, H, D))
    k = jax.random.normal(ks[1], (B, T, H, D))
    v = jax.random.normal(ks[2], (B, T, H, E))
    seg = jnp.asarray(SEGMENTS)
    o_s = jax.jit(
        lambda q, k, v, s: mla_attention_sharded(
            mesh, q, k, v, s, SCALE, batch_axes=("data",), head_axis="tensor", ring=ring
        )
    )(q, k, v, seg)
    _assert_close(o_s, attention(q, k, v, seg, SCALE), 1e-5, "output")


def test_sequence_not_divisible_raises():
    mesh = _mesh((4,), ("context",))
    (q, k, v, g, beta, _), _ = _kda_inputs(9, t=10)  # 10 tokens over 4 shards
    with pytest.raises(ValueError, match=r"T = 10 .* size 4"):
        kda_core_sharded(mesh, q, k, v, g, beta)
    with pytest.raises(ValueError, match=r"T = 10 .* size 4"):
        mla_attention_sharded(mesh, q, k, q, None, SCALE)
