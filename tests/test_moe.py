"""MoE: ragged grouped-matmul dispatch against the dense one-hot reference, routing, bias updates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import forward, tiny_model_cfg
from k3.model import Model, update_router_biases
from k3.moe.layer import EXPERT_BACKENDS, MoE, capacity_experts, capacity_slots, dense_experts, expert_capacity, \
    gather_rows, ragged_experts


def _x(key, shape):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32)


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
def test_ragged_dispatch_equals_dense_reference(activation):
    N, D, F, E, k = 37, 8, 12, 6, 3
    x = _x(0, (N, D))
    idx = jax.random.randint(jax.random.key(1), (N, k), 0, E)
    idx = idx.at[:5].set(2)  # a popular expert, and some experts likely empty
    wg, wu, wd = _x(2, (E, D, F)), _x(3, (E, D, F)), _x(4, (E, F, D))
    ragged, _ = ragged_experts(x, idx, wg, wu, wd, activation, (4.0, 25.0))
    dense, _ = dense_experts(x, idx, wg, wu, wd, activation, (4.0, 25.0))
    np.testing.assert_allclose(ragged, dense, rtol=1e-5, atol=1e-5)
    # Gradients agree too.
    def loss(fn, wg):
        return jnp.sum(fn(x, idx, wg, wu, wd, activation, (4.0, 25.0))[0] ** 2)
    np.testing.assert_allclose(jax.grad(lambda w: loss(ragged_experts, w))(wg),
                               jax.grad(lambda w: loss(dense_experts, w))(wg), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("latent", [0, 16])
def test_moe_layer_ragged_equals_dense_and_shapes(latent):
    cfg = tiny_model_cfg(**{"moe.latent_dim": latent})
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = _x(5, (2, 9, cfg.d_model))
    y, stats = moe(x)
    assert y.shape == x.shape
    assert stats["load"].shape == (cfg.moe.n_experts,)
    assert float(stats["load"].sum()) == 2 * 9 * cfg.moe.top_k
    width = latent or cfg.d_model
    assert moe.w_gate.shape == (cfg.moe.n_experts, width, cfg.moe.expert_dim)
    moe.experts = dense_experts
    y_dense, _ = moe(x)
    np.testing.assert_allclose(y, y_dense, rtol=1e-5, atol=1e-5)


def test_router_weights_renormalised_and_bias_selects_only():
    cfg = tiny_model_cfg(**{"moe.routed_scaling": 2.5})
    moe = MoE(cfg, rngs=nnx.Rngs(1))
    x = _x(6, (50, cfg.d_model))
    idx, w, scores, _ = moe.route(x)
    np.testing.assert_allclose(w.sum(-1), 2.5, rtol=1e-6)
    # A huge bias on expert 0 forces it into every top-k, but its weight still uses the raw score.
    moe.router_bias[...] = jnp.zeros(cfg.moe.n_experts).at[0].set(100.0)
    idx_b, w_b, scores_b, _ = moe.route(x)
    assert bool(jnp.all(jnp.any(idx_b == 0, axis=-1)))
    picked = jnp.take_along_axis(scores_b, idx_b, -1)
    np.testing.assert_allclose(w_b, picked / picked.sum(-1, keepdims=True) * 2.5, rtol=1e-6)
    # Gradients reach the router weights through the combine weights.
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)

    def loss(params):
        y, _ = nnx.merge(graphdef, params, rest)(x[None])
        return jnp.sum(y ** 2)
    g = jax.grad(loss)(params)
    assert float(jnp.abs(g["router"][...]).sum()) > 0


@pytest.mark.parametrize("balancing", ["sign", "quantile", "quantile_hist"])
def test_update_router_biases_on_scanned_model(balancing):
    cfg = tiny_model_cfg(**{"mixer": "mla", "n_layers": 5, "first_k_dense": 1, "moe.balancing": balancing})
    model = Model(cfg, rngs=nnx.Rngs(0))
    assert model.body is not None and model.body_repeats == 4  # layers 1..4 are scanned
    tokens = jax.random.randint(jax.random.key(2), (4, 32), 0, cfg.vocab_size)
    _, aux = forward(model, tokens)
    assert aux["expert_load"].shape == (4, cfg.moe.n_experts)
    before = model.body.layers[0].ffn.router_bias[...]
    update_router_biases(model, aux["layer_stats"], cfg.moe, n_tokens=4 * 32)
    after = model.body.layers[0].ffn.router_bias[...]
    assert after.shape == before.shape == (4, cfg.moe.n_experts)
    assert float(jnp.abs(after - before).max()) > 0
    if balancing == "sign":
        np.testing.assert_allclose(jnp.abs(after - before).max(), cfg.moe.sign_rate, rtol=1e-6)
    else:
        np.testing.assert_allclose(after.mean(-1), 0.0, atol=1e-6)
        # Rerouting the same tokens with the new bias is better balanced than before.
        _, aux2 = forward(model, tokens)
        def worst(load):
            return float((load.max(-1) / load.mean(-1)).max())
        assert worst(aux2["expert_load"]) < worst(aux["expert_load"])


def _capacity_reference(x, idx, ws, C):
    """Float64 loop: route j of token n is kept when fewer than C earlier routes (token order, then
    route order) went to its expert; dropped routes give 0."""
    x, ws = np.asarray(x, np.float64), [np.asarray(w, np.float64) for w in ws]
    N, k = idx.shape
    out, used, dropped = np.zeros((N, k, x.shape[1])), {}, 0
    for n in range(N):
        for j in range(k):
            e = int(idx[n, j])
            if used.get(e, 0) >= C:
                dropped += 1
                continue
            used[e] = used.get(e, 0) + 1
            g, u = x[n] @ ws[0][e], x[n] @ ws[1][e]
            out[n, j] = (g / (1 + np.exp(-g)) * u) @ ws[2][e]
    return out, dropped


@pytest.mark.parametrize("N,k,E,factor", [(37, 3, 6, 1.0), (1, 2, 4, 1.25), (64, 4, 8, 0.3), (50, 2, 5, 4.0)])
def test_capacity_experts_against_float64_loop(N, k, E, factor):
    D, F = 8, 12
    x = _x(N, (N, D))
    idx = jax.random.randint(jax.random.key(N + 1), (N, k), 0, E)
    idx = idx.at[: N // 3].set(1)  # one expert over capacity: drops (not unique per token, allowed)
    ws = (_x(2, (E, D, F)), _x(3, (E, D, F)), _x(4, (E, F, D)))
    C = expert_capacity(N * k, E, factor)
    assert C % 8 == 0 and C >= factor * N * k / E
    out, dropped = capacity_experts(x, idx, *ws, "swiglu", (4.0, 25.0), factor)
    ref, ref_dropped = _capacity_reference(x, np.asarray(idx), ws, C)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    assert int(dropped) == ref_dropped
    # Undropped everywhere -> same as the dropless backends, gradients included.
    if ref_dropped == 0:
        def loss(fn, wg):
            return jnp.sum(fn(x, idx, wg, ws[1], ws[2], "swiglu", (4.0, 25.0), factor)[0] ** 2)
        np.testing.assert_allclose(jax.grad(lambda w: loss(capacity_experts, w))(ws[0]),
                                   jax.grad(lambda w: loss(ragged_experts, w))(ws[0]), rtol=1e-4, atol=1e-4)


def test_capacity_gradient_of_inputs_matches_reference_with_drops():
    N, k, E, D, F = 40, 2, 4, 8, 8
    x = _x(9, (N, D))
    idx = jnp.concatenate([jnp.zeros((N, 1), jnp.int32), jax.random.randint(jax.random.key(3), (N, 1), 1, E)], 1)
    ws = (_x(2, (E, D, F)), _x(3, (E, D, F)), _x(4, (E, F, D)))
    C = expert_capacity(N * k, E, 0.5)  # expert 0 gets N routes, keeps C of them
    slot, route_of_slot = capacity_slots(idx, E, C)
    kept = np.asarray(slot) < E * C
    assert kept.sum() == N * k - int(capacity_experts(x, idx, *ws, "swiglu", (4.0, 25.0), 0.5)[1])
    assert sorted(np.asarray(route_of_slot)[np.asarray(route_of_slot) < N * k]) == list(np.flatnonzero(kept))
    mask = jnp.asarray(kept.reshape(N, k, 1), jnp.float32)

    def loss_cap(x):
        return jnp.sum(capacity_experts(x, idx, *ws, "swiglu", (4.0, 25.0), 0.5)[0] ** 2)

    def loss_ref(x):
        return jnp.sum((dense_experts(x, idx, *ws, "swiglu", (4.0, 25.0))[0] * mask) ** 2)
    np.testing.assert_allclose(jax.grad(loss_cap)(x), jax.grad(loss_ref)(x), rtol=1e-4, atol=1e-4)


def test_gather_rows_gradient_is_the_scatter_add_of_plain_indexing():
    """gather_rows' gather-only backward equals autodiff of x_pad[index] for the capacity matchings
    (dispatch with k = 3 and drops, and the combine direction), on fresh random routes."""
    N, k, E, D = 37, 3, 5, 6
    idx = jax.random.randint(jax.random.key(11), (N, k), 0, E)
    C = expert_capacity(N * k, E, 0.7)
    slot, route_of_slot = capacity_slots(idx, E, C)
    assert int(jnp.sum(slot == E * C)) > 0  # some routes dropped
    cases = [(_x(1, (N, D)), route_of_slot // k, slot.reshape(N, k)),
             (_x(2, (E * C, D)), slot, route_of_slot[:, None])]
    for x, index, inverse in cases:
        w = _x(3, (index.shape[0], D))

        def plain(x):
            return jnp.sum(jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])[index] * w)

        np.testing.assert_array_equal(gather_rows(x, index, inverse), jnp.concatenate([x, jnp.zeros((1, D))])[index])
        np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(gather_rows(x, index, inverse) * w))(x),
                                   jax.grad(plain)(x), rtol=1e-6, atol=1e-6)


def test_expert_backend_table_and_dropped_count_in_stats():
    assert set(EXPERT_BACKENDS.choices()) >= {"auto", "ragged", "capacity", "dense"}
    assert EXPERT_BACKENDS.resolve("auto", "gpu") == "capacity"
    assert EXPERT_BACKENDS.resolve("auto", "cpu") == "ragged"
    cfg = tiny_model_cfg(**{"moe.expert_impl": "capacity", "moe.expert_capacity": 0.25})
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    y, stats = moe(_x(5, (2, 9, cfg.d_model)))
    assert y.shape == (2, 9, cfg.d_model) and float(stats["dropped"]) > 0


@pytest.mark.parametrize("latent,shared", [(16, 24), (0, 24), (16, 0)])
def test_served_inputs_stack_the_router_latent_and_shared_matrices(latent, shared):
    """`MoE.fuse_inputs`: [router | latent down | shared gate | shared up] as one [D, E + L + 2 F_s]
    matrix, the originals gone; the layer's inputs (h, the shared hidden, the fp32 logits in the first
    E columns) and its training and decoding outputs equal the unfused layer's (fp32 compute)."""
    cfg = tiny_model_cfg(**{"moe.latent_dim": latent, "moe.shared_dim": shared, "moe.decode_impl": "grouped"})
    ref, moe = MoE(cfg, rngs=nnx.Rngs(4)), MoE(cfg, rngs=nnx.Rngs(4))
    moe.router_bias[...] = ref.router_bias[...] = _x(8, (cfg.moe.n_experts,)) * 0.05
    moe.fuse_inputs()
    parts = [ref.router[...]] + ([ref.w_down_latent[...]] if latent else []) + (
        [ref.shared.w_gate[...], ref.shared.w_up[...]] if shared else [])
    np.testing.assert_array_equal(np.asarray(moe.w_in[...]), np.concatenate(parts, axis=1))
    assert moe.router is None and moe.w_down_latent is None
    assert shared == 0 or (moe.shared.w_gate is None and moe.shared.w_up is None)
    x = _x(9, (2, 5, cfg.d_model))
    with jax.default_matmul_precision("highest"):
        for i, (got, want) in enumerate(zip(moe.project_inputs(x[0]), ref.project_inputs(x[0]))):
            if want is None:  # the unfused layer forms the shared hidden later
                want = ref.shared.hidden(x[0]) if shared else None
            assert (got is None) == (want is None)
            if i == 2:  # the router's logits: the fused matmul's first E columns
                got = got[:, :cfg.moe.n_experts]
            if got is not None:
                np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
        for decode in (False, True):
            np.testing.assert_allclose(np.asarray(moe(x, decode=decode)[0]), np.asarray(ref(x, decode=decode)[0]),
                                       rtol=1e-5, atol=1e-6)


def test_served_router_logits_keep_the_stored_values():
    """bf16 compute: with bf16 stored weights the one fp32-output matmul gives the router's logits of
    those stored values; with fp32 stored weights the router's columns are read unrounded, not cast to
    bf16 with the others (the rounded router's logits differ by far more than the tolerance)."""
    cfg = tiny_model_cfg(**{"dtype": "bfloat16"})
    x = _x(10, (6, cfg.d_model)).astype(jnp.bfloat16)
    for stored in (jnp.float32, jnp.bfloat16):
        moe = MoE(cfg, rngs=nnx.Rngs(5))
        moe.router = nnx.Param(moe.router[...] * 40.0)  # logits of order 1, where bf16 rounding shows
        for mod, name in ((moe, "router"), (moe, "w_down_latent"), (moe.shared, "w_gate"), (moe.shared, "w_up")):
            setattr(mod, name, nnx.Param(getattr(mod, name)[...].astype(stored)))
        router = np.asarray(moe.router[...], np.float64)
        moe.fuse_inputs()
        assert moe.w_in.dtype == stored
        logits = moe.project_inputs(x)[2][:, :cfg.moe.n_experts]
        want = np.asarray(x, np.float64) @ router
        rounded = np.asarray(x, np.float64) @ np.asarray(jnp.asarray(router, jnp.bfloat16), np.float64)
        np.testing.assert_allclose(np.asarray(logits, np.float64), want, rtol=1e-5, atol=1e-5)
        if stored == jnp.float32:
            assert np.max(np.abs(rounded - want)) > 100 * 1e-5
