"""Tests for k3.moe.balancing: routing, sign update and Quantile Balancing (exact and histogram).

Notation: r_ij = alpha_i - s_ij are the margins; the *candidate rule* is "expert j takes token i
iff s_ij + b_j > alpha_i" with the thresholds alpha of the routing that produced the statistics.
One QB step solves the candidate rule exactly; rerouting with top-k after it only lands near
q = N k / E because every token's threshold moves once all biases move (checked separately).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3.moe import balancing as bal

N_BINS = 1000


def _scores(seed, n, e, skew_scale=0.0):
    """sigmoid(logits + per-expert skew): [n, e] fp32 router scores."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    skew = skew_scale * jax.random.normal(k2, (e,))
    return jax.nn.sigmoid(jax.random.normal(k1, (n, e)) + skew)


def _route_stats(scores, bias, k):
    idx, alpha = bal.topk_route(scores, bias, k, extra=1)
    return idx, alpha


@functools.partial(jax.jit, static_argnums=1)
def _exact_from_zero_bias(scores, k):
    _, alpha = bal.topk_route(scores, jnp.zeros(scores.shape[1]), k, extra=1)
    return bal.quantile_bias_exact(scores, alpha, k)


def _np_hazen_quantile(r_NE, k):
    """Independent reference: numpy's Hazen quantile (virtual index n p - 1/2) of each column."""
    n, e = r_NE.shape
    return np.quantile(r_NE.astype(np.float64), k / e, axis=0, method="hazen")


# ------------------------------------------------------------------------------------------------
# Routing primitives


def test_topk_route_and_load():
    s = _scores(0, 64, 8)
    b = jnp.linspace(-0.1, 0.1, 8)
    idx, alpha = bal.topk_route(s, b, 3, extra=1)
    idx0, none = bal.topk_route(s, b, 3)
    assert none is None and idx.dtype == jnp.int32 and idx.shape == (64, 3)
    np.testing.assert_array_equal(idx, idx0)
    biased = np.asarray(s + b)
    order = np.argsort(-biased, axis=1)
    np.testing.assert_array_equal(np.sort(idx, 1), np.sort(order[:, :3], 1))
    np.testing.assert_allclose(alpha, np.take_along_axis(biased, order[:, 3:4], 1)[:, 0], rtol=0)
    load = bal.expert_load(idx, 8)
    assert load.dtype == jnp.float32
    np.testing.assert_array_equal(load, np.bincount(np.asarray(idx).ravel(), minlength=8))
    assert float(bal.imbalance(jnp.array([1.0, 1.0, 4.0, 2.0]))) == pytest.approx(2.0)


def test_sign_update_moves_by_exactly_rate():
    bias = jnp.array([0.5, -0.25, 0.0, 0.125])
    load = jnp.array([10.0, 2.0, 5.0, 3.0])  # mean 5: over, under, exactly at mean, under
    new = bal.sign_update(bias, load, 0.0625)  # power-of-two rate so the check is exact
    np.testing.assert_array_equal(new - bias, [-0.0625, 0.0625, 0.0, 0.0625])


# ------------------------------------------------------------------------------------------------
# Exact quantile solver


@pytest.mark.parametrize("n,e,k", [(4096, 64, 4), (1000, 96, 6)])
def test_exact_candidate_loads_and_reference(n, e, k):
    """Candidate-rule loads after ONE update: floor(q + 1/2) is bracketed by the strict and
    non-strict counts (exactly +-1 of q wherever margins are distinct), mean(b) = 0, and the
    result matches numpy's independent Hazen quantile."""
    q = n * k / e
    s = _scores(1, n, e, skew_scale=0.5)
    bias0 = 0.05 * jax.random.normal(jax.random.PRNGKey(2), (e,))
    _, alpha = _route_stats(s, bias0, k)
    new = jax.jit(bal.quantile_bias_exact, static_argnums=2)(s, alpha, k)
    assert abs(float(jnp.mean(new))) < 1e-6
    unc = np.asarray(bal.exact_margin_quantile(s, alpha, k))
    np.testing.assert_allclose(np.asarray(new), unc - unc.mean(), atol=1e-6)

    r = np.asarray(alpha)[:, None] - np.asarray(s)  # fp32, same rounding as the module
    m = int(np.floor(q + 0.5))
    strict, nonstrict = (r < unc).sum(0), (r <= unc).sum(0)
    assert np.all(strict <= m) and np.all(nonstrict >= m)
    # The only ties are the structural ones at b_j^old (tokens whose (k+1)-th choice is j). Away
    # from them the load is within +-1 of q.
    old = np.asarray(bias0)
    clear = np.abs(unc - old) > 1e-5
    assert clear.sum() > e // 2
    assert np.all(np.abs(strict[clear] - q) < 1.0), (strict[clear], q)

    ref = _np_hazen_quantile(r, k)
    np.testing.assert_allclose(unc, ref, atol=2e-6)


def test_exact_brute_force_one_expert():
    """Brute force over all cut points of one expert: the solver picks a bias whose load is the
    achievable load nearest to q, with random continuous thresholds (no ties) and fractional q."""
    n, e, k = 333, 10, 3  # q = 99.9
    s = _scores(3, n, e)
    alpha = jax.random.uniform(jax.random.PRNGKey(4), (n,), minval=0.2, maxval=1.0)
    unc = np.asarray(bal.exact_margin_quantile(s, alpha, k))
    r = np.asarray(alpha)[:, None] - np.asarray(s)
    for j in range(e):
        cands = np.sort(r[:, j])
        cuts = np.concatenate([[cands[0] - 1], (cands[:-1] + cands[1:]) / 2, [cands[-1] + 1]])
        loads = np.array([(np.asarray(s)[:, j] + c > np.asarray(alpha)).sum() for c in cuts])
        best = loads[np.argmin(np.abs(loads - n * k / e))]
        got = (np.asarray(s)[:, j] + unc[j] > np.asarray(alpha)).sum()
        assert got == best == 100


def test_exact_ties_and_edges():
    """Duplicated tokens (ties of size 2) and tiny batches with q < 1/2 stay finite and bracketed."""
    s = _scores(5, 200, 16)
    s = jnp.concatenate([s, s])  # every margin appears twice
    _, alpha = _route_stats(s, jnp.zeros(16), 2)
    unc = np.asarray(bal.exact_margin_quantile(s, alpha, 2))
    r = np.asarray(alpha)[:, None] - np.asarray(s)
    m = int(np.floor(400 * 2 / 16 + 0.5))
    assert np.all((r < unc).sum(0) <= m) and np.all((r <= unc).sum(0) >= m)
    for n, e, k in [(1, 4, 1), (2, 4, 3)]:  # q = 1/4 (below the first margin), q = 3/2
        new = _exact_from_zero_bias(_scores(6, n, e), k)
        assert np.all(np.isfinite(new)) and abs(float(new.mean())) < 1e-6


@pytest.mark.parametrize("n,e,k", [(4096, 64, 4), (1000, 96, 6)])
def test_reroute_after_one_update(n, e, k):
    """Top-k rerouting of the same scores: a strongly skewed router (max load ~4-10x q) comes back
    within 40% of q after ONE exact step and 20% after three; mean(b) = 0 throughout.
    (Not +-1: the thresholds alpha move with the biases, see the module docstring.)"""
    q = n * k / e
    s = _scores(7, n, e, skew_scale=1.0)
    bias = jnp.zeros(e)
    devs = []
    for _ in range(4):
        idx, alpha = _route_stats(s, bias, k)
        devs.append(float(jnp.max(jnp.abs(bal.expert_load(idx, e) - q))) / q)
        bias = bal.quantile_bias_exact(s, alpha, k)
        assert abs(float(bias.mean())) < 1e-6
    print(f"\nN={n} E={e} k={k}: max |load - q| / q after 0..3 exact QB steps:",
          [round(d, 3) for d in devs])
    assert devs[0] > 3.0 and devs[1] < 0.4 and devs[3] < 0.2


# ------------------------------------------------------------------------------------------------
# Histogram estimator


@pytest.mark.parametrize("n,e,k", [(4096, 64, 4), (1000, 96, 6)])
def test_histogram_matches_exact_within_a_bin(n, e, k):
    q = n * k / e
    s = _scores(8, n, e, skew_scale=0.5)
    bias0 = 0.05 * jax.random.normal(jax.random.PRNGKey(9), (e,))
    _, alpha = _route_stats(s, bias0, k)
    hist = jax.jit(bal.quantile_histogram, static_argnums=3)(s, alpha, bias0, N_BINS)
    assert hist.dtype == jnp.int32 and hist.shape == (e, N_BINS)
    np.testing.assert_array_equal(hist.sum(1), n)

    width = float(jnp.max(bias0) - jnp.min(bias0) + 2.0) / N_BINS
    unc_h = np.asarray(bal.histogram_margin_quantile(hist, bias0, n, k))
    unc_x = np.asarray(bal.exact_margin_quantile(s, alpha, k))
    assert np.max(np.abs(unc_h - unc_x)) <= width * (1 + 1e-3)

    new = bal.quantile_bias_from_histogram(hist, bias0, n, k)
    assert abs(float(new.mean())) < 1e-6
    np.testing.assert_allclose(np.asarray(new), unc_h - unc_h.mean(), atol=1e-6)

    # Candidate-rule load is within the h_j tokens of the chosen bin (the exact error bound), and
    # those bins are small: at most 3% of q here (bins are ~2e-3 wide).
    r = np.asarray(alpha)[:, None] - np.asarray(s)
    load = (r < unc_h).sum(0)
    chosen = np.clip(np.floor((unc_h - (float(jnp.min(bias0)) - 1.0)) / width), 0, N_BINS - 1)
    h = np.asarray(hist)[np.arange(e), chosen.astype(int)]
    # A cut exactly on a bin edge belongs to either neighbouring bin; allow the larger of the two.
    h_next = np.asarray(hist)[np.arange(e), np.maximum(chosen.astype(int) - 1, 0)]
    assert np.all(np.abs(load - q) <= np.maximum(h, h_next))
    away = np.abs(unc_h - np.asarray(bias0)) > width  # skip the structural tie at b_j^old
    assert np.all(np.abs(load[away] - q) <= 0.03 * q + 1), (load[away], q)


def test_histograms_of_halves_add_up():
    n, e, k = 4096, 64, 4
    s = _scores(10, n, e, skew_scale=0.5)
    bias0 = 0.05 * jax.random.normal(jax.random.PRNGKey(11), (e,))
    _, alpha = _route_stats(s, bias0, k)
    whole = bal.quantile_histogram(s, alpha, bias0, N_BINS)
    halves = (bal.quantile_histogram(s[: n // 2], alpha[: n // 2], bias0, N_BINS)
              + bal.quantile_histogram(s[n // 2:], alpha[n // 2:], bias0, N_BINS))
    np.testing.assert_array_equal(whole, halves)
    read = jax.jit(bal.quantile_bias_from_histogram, static_argnums=3)
    # n_tokens traced: the step function sums token counts across devices at run time.
    from_halves = read(halves, bias0, jnp.int32(n), k)
    np.testing.assert_array_equal(from_halves, read(whole, bias0, jnp.int32(n), k))
    # Eager vs jit may differ in the last ulp (fused arithmetic), nothing more.
    np.testing.assert_allclose(from_halves, bal.quantile_bias_from_histogram(whole, bias0, n, k),
                               atol=1e-6)


def test_histogram_clips_out_of_range():
    s = jnp.array([[0.0, 1.0], [1.0, 0.0]])
    alpha = jnp.array([5.0, -5.0])  # margins far outside [min(b) - 1, max(b) + 1]
    hist = np.asarray(bal.quantile_histogram(s, alpha, jnp.zeros(2), 10))
    np.testing.assert_array_equal(hist[:, 0] + hist[:, -1], [2, 2])


# ------------------------------------------------------------------------------------------------
# Dynamics: fresh tokens every step from a skewed router


def _run(method, steps, n, e, k, skew):
    """Imbalance of each step's routing; the bias computed from step t is used at step t+1."""
    def batch(t):
        return jax.nn.sigmoid(jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(100), t),
                                                (n, e)) + skew)

    def step(bias, t):
        s = batch(t)
        if method == "sign":
            idx, _ = bal.topk_route(s, bias, k)
            load = bal.expert_load(idx, e)
            return bal.sign_update(bias, load, 1e-3), bal.imbalance(load)
        idx, alpha = bal.topk_route(s, bias, k, extra=1)
        load = bal.expert_load(idx, e)
        if method == "qb_exact":
            new = bal.quantile_bias_exact(s, alpha, k)
        else:
            new = bal.quantile_bias_from_histogram(
                bal.quantile_histogram(s, alpha, bias, N_BINS), bias, n, k)
        return new, bal.imbalance(load)

    run = jax.jit(functools.partial(jax.lax.scan, step))
    _, curve = run(jnp.zeros(e), jnp.arange(steps))
    return np.asarray(curve)


def test_qb_balances_much_faster_than_sign():
    # q = 512 tokens per expert keeps the sampling noise of a fresh batch at max/mean ~ 1.1.
    n, e, k, steps = 4096, 32, 4, 30
    # Two experts favoured by +2 logits (they would take ~6x their share), mild noise elsewhere.
    skew = (jnp.where(jnp.arange(e) < 2, 2.0, 0.0)
            + 0.3 * jax.random.normal(jax.random.PRNGKey(12), (e,)))
    curves = {m: _run(m, steps, n, e, k, skew) for m in ("qb_exact", "qb_hist", "sign")}
    print("\nmax/mean load per step (step t routed with the bias from steps < t):")
    for m, c in curves.items():
        print(f"  {m:9s}", " ".join(f"{x:.2f}" for x in c))
    for m in ("qb_exact", "qb_hist"):
        c = curves[m]
        assert c[0] > 4.0
        # Sampling noise alone gives ~1.1 here (q = 512, sd ~ 22, max of 32 experts).
        assert c[1] < 1.6 and np.all(c[2:] < 1.3), (m, c)
    assert np.all(curves["sign"] > 3.0), curves["sign"]
