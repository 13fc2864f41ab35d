"""Decoding's routing kernel (`pallas_kernels.moe_route.route_topk`, `k3.moe.layer.DECODE_ROUTERS`)
against a float64 sort: awkward sizes, ties, the bias deciding, one token; the kernel is interpreted on
a CPU and compiled on a GPU (`pallas_kernels.common.default_interpret`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import greedy_step_logits, tiny_model_cfg
from k3.moe.layer import DECODE_ROUTERS, MoE, router_logits
from pallas_kernels.moe_route import MAX_ROUTE_ELEMENTS, route_topk, route_topk_supported


def _route64(logits, bias, k, scaling):
    """Top-k of sigmoid(logits) + bias by a stable float64 sort (lower expert first on ties)."""
    s = 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))
    idx = np.argsort(-(s + np.asarray(bias, np.float64)), axis=1, kind="stable")[:, :k]
    p = np.take_along_axis(s, idx, axis=1)
    return idx, p / (p.sum(axis=1, keepdims=True) + 1e-20) * scaling


def _spread_logits(rng, N, E):
    """Each row a permutation of evenly spaced logits, so float32 and float64 rank them alike."""
    grid = np.linspace(-3.0, 3.0, E)
    return np.stack([rng.permutation(grid) for _ in range(N)]) + rng.normal(size=(N, E)) * 1e-3 / E


@pytest.mark.parametrize("N,E,k", [(1, 5, 4), (3, 10, 2), (8, 64, 4), (5, 896, 16), (2, 7, 1), (16, 8, 8)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_route_topk_against_float64(N, E, k, dtype):
    """Logits in either dtype against float64 of the values as stored (bf16 rounding makes ties, which
    go to the lower expert in both)."""
    rng = np.random.default_rng(N * 1000 + E)
    logits = jnp.asarray(_spread_logits(rng, N, E), dtype)
    bias = np.zeros(E)
    bias[rng.integers(0, E, 2)] = [0.75, -0.75]  # the bias moves two experts in or out of the top k
    idx, w = route_topk(logits, jnp.asarray(bias, jnp.float32), k, 2.5)
    want_idx, want_w = _route64(np.asarray(logits, np.float64), bias, k, 2.5)
    assert idx.dtype == jnp.int32 and w.dtype == jnp.float32 and idx.shape == w.shape == (N, k)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_allclose(np.asarray(w, np.float64), want_w, rtol=1e-5, atol=1e-6)


def test_route_topk_ties_saturation_and_a_deciding_bias():
    """Equal scores go to the lower expert (as `lax.top_k`); saturated sigmoids (logits +-80) tie at 1
    and 0; a bias picks an expert whose score is 0, and the weights still use the unbiased scores."""
    N, E, k = 3, 12, 4
    logits = np.zeros((N, E))
    logits[1] = 80.0
    logits[2, ::2] = -80.0
    bias = np.zeros(E)
    bias[E - 1] = 1.0
    logits[0, E - 1] = -80.0  # row 0: expert E-1 scores 0 but its bias puts it first
    idx, w = route_topk(jnp.asarray(logits, jnp.float32), jnp.asarray(bias, jnp.float32), k)
    want_idx, want_w = _route64(logits, bias, k, 1.0)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    assert list(np.asarray(idx[0])) == [E - 1, 0, 1, 2] and list(np.asarray(idx[1])) == [E - 1, 0, 1, 2]
    np.testing.assert_allclose(np.asarray(w, np.float64), want_w, rtol=1e-6, atol=1e-7)
    assert float(w[0, 0]) < 1e-30  # picked by its bias, weighted by its score (sigmoid(-80))


def test_route_topk_nan_scores_rank_last_and_ids_stay_distinct():
    """A NaN logit ranks below every number (as XLA's top-k does on a CPU; on a GPU it ranks NaN first);
    a row of NaNs (or of -inf scores after the bias) still gets k distinct experts in range, lowest first."""
    logits = np.array([[0.1, np.nan, 0.3, 0.2, -1.0, 0.5, 0.0, 0.0],
                       [np.nan] * 8,
                       [0.0] * 8], np.float32)
    bias = np.zeros(8, np.float32)
    bias[3] = -np.inf
    idx, w = route_topk(jnp.asarray(logits), jnp.asarray(bias), 4)
    assert list(np.asarray(idx[0])) == [5, 2, 0, 6] and list(np.asarray(idx[1])) == [0, 1, 2, 3]
    assert list(np.asarray(idx[2])) == [0, 1, 2, 4]
    if jax.default_backend() == "cpu":
        xla_idx, _ = DECODE_ROUTERS.get("xla")(jnp.asarray(logits), jnp.asarray(bias), 4, 1.0)
        assert list(np.asarray(xla_idx[0])) == [5, 2, 0, 6]
    assert np.isfinite(np.asarray(w[0])).all()


@pytest.mark.parametrize("N,E", [(8, 16), (3, 10)])
def test_route_topk_reads_the_first_e_columns_of_a_wider_array(N, E):
    """Logits in the first E columns of [N, C] (a fused matmul's output): the selection of the [N, E]
    slice alone, whatever the other columns hold (large values there would win if they were read)."""
    rng = np.random.default_rng(N)
    logits = rng.normal(size=(N, E)).astype(np.float32)
    wide = np.concatenate([logits, np.full((N, 40), 50.0, np.float32)], axis=1)
    bias = jnp.asarray(rng.normal(size=E) * 0.01, jnp.float32)
    for route in (route_topk, DECODE_ROUTERS.get("xla"), DECODE_ROUTERS.get("pallas")):
        idx, w = route(jnp.asarray(wide), bias, 2, 1.0)
        want_idx, want_w = route_topk(jnp.asarray(logits), bias, 2, 1.0)
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
        np.testing.assert_allclose(np.asarray(w), np.asarray(want_w), rtol=1e-6)


def test_route_kernels_reject_what_they_cannot_take():
    z = jnp.zeros((4, 16), jnp.float32)
    with pytest.raises(ValueError, match="not supported"):
        route_topk(z, jnp.zeros(16), 3)  # k not a power of two
    with pytest.raises(ValueError, match="not supported"):
        route_topk(jnp.zeros((2, 2)), jnp.zeros(2), 4)  # k > E
    with pytest.raises(ValueError, match="does not match"):
        route_topk(z, jnp.zeros(17), 2)  # more experts than logit columns
    assert route_topk_supported(8, 1024, 16) and route_topk_supported(5, 896, 16)
    assert not route_topk_supported(9, 1024, 16) and 16 * 1024 > MAX_ROUTE_ELEMENTS


@pytest.mark.parametrize("N,D,E,k", [(2, 32, 8, 2), (3, 16, 10, 2), (4, 16, 10, 3), (64, 32, 64, 4)])
def test_decode_routers_agree(N, D, E, k):
    """Both of 'pallas''s forms (the kernel; XLA where the kernel does not take the shape: k = 3) and
    'xla' give the float64 selection from the router's logits."""
    rng = np.random.default_rng(N + k)
    x = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(D, E)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=E) * 0.01, jnp.float32)
    want_idx, want_w = _route64(np.asarray(x, np.float64) @ np.asarray(w, np.float64), bias, k, 1.5)
    for name in ("xla", "pallas"):
        with jax.default_matmul_precision("float32"):
            idx, wts = DECODE_ROUTERS.get(name)(router_logits(x, w), bias, k, 1.5)
        np.testing.assert_array_equal(np.asarray(idx), want_idx)
        np.testing.assert_allclose(np.asarray(wts, np.float64), want_w, rtol=1e-5, atol=1e-6)
    assert DECODE_ROUTERS.resolve("auto", "cpu") == "xla" and DECODE_ROUTERS.resolve("auto", "gpu") == "pallas"


def test_moe_decode_call_routes_through_the_decode_router():
    """A decoding call of a 'grouped' MoE selects its experts with the configured decode router (the
    kernel, here), and equals the training call; a training call does not use it."""
    cfg = tiny_model_cfg(**{"moe.decode_impl": "grouped", "moe.decode_route_impl": "pallas"})
    moe = MoE(cfg, rngs=nnx.Rngs(2))
    moe.router_bias[...] = jax.random.normal(jax.random.key(3), (cfg.moe.n_experts,)) * 0.05
    calls = []
    inner = moe.decode_route
    moe.decode_route = lambda *a: calls.append(a[0].shape) or inner(*a)
    x = jax.random.normal(jax.random.key(1), (2, 3, cfg.d_model))
    y_dec, _ = moe(x, decode=True)
    y_train, _ = moe(x)
    assert calls == [(6, cfg.moe.n_experts)]
    np.testing.assert_allclose(y_dec, y_train, rtol=2e-5, atol=2e-5)


def test_model_decode_with_the_routing_kernel_equals_xla_routing():
    """Greedy token-by-token decoding of a tiny K3 with the routing kernel gives the logits of XLA's
    routing, for both Pallas expert backends."""
    toks = jax.random.randint(jax.random.key(4), (2, 5), 0, 97)

    def run(impl, route):
        cfg = tiny_model_cfg(n_layers=5, first_k_dense=1, **{"moe.decode_impl": impl, "moe.decode_route_impl": route})
        return np.asarray(greedy_step_logits(cfg, toks, 8))

    for impl in ("pallas", "grouped"):
        np.testing.assert_allclose(run(impl, "pallas"), run(impl, "xla"), rtol=1e-5, atol=1e-5)
