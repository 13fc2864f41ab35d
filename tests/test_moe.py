"""MoE: ragged grouped-matmul dispatch against the dense one-hot reference, routing, bias updates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import forward, tiny_model_cfg
from k3.model import Model, update_router_biases
from k3.moe import MoE, dense_experts, ragged_experts


def _x(key, shape):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32)


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
def test_ragged_dispatch_equals_dense_reference(activation):
    N, D, F, E, k = 37, 8, 12, 6, 3
    x = _x(0, (N, D))
    idx = jax.random.randint(jax.random.key(1), (N, k), 0, E)
    idx = idx.at[:5].set(2)  # a popular expert, and some experts likely empty
    wg, wu, wd = _x(2, (E, D, F)), _x(3, (E, D, F)), _x(4, (E, F, D))
    ragged = ragged_experts(x, idx, wg, wu, wd, activation, (4.0, 25.0))
    dense = dense_experts(x, idx, wg, wu, wd, activation, (4.0, 25.0))
    np.testing.assert_allclose(ragged, dense, rtol=1e-5, atol=1e-5)
    # Gradients agree too.
    def loss(fn, wg):
        return jnp.sum(fn(x, idx, wg, wu, wd, activation, (4.0, 25.0)) ** 2)
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
    moe.dispatch = "dense"
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
