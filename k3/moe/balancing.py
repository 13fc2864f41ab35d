"""Router load balancing without an auxiliary loss: the K2 sign update and K3 Quantile Balancing.

The router scores s = sigmoid(W_r x) [N, E] (fp32) are shifted by a non-trainable per-expert bias
b [E] for *selection only*: idx = top_k(s + b); the gating weights use the unbiased s. The bias is
updated outside the optimizer after each step and used from the next step.

Sign update (DeepSeek-V3 / K2):  b <- b + rate * sign(mean(load) - load).

Quantile Balancing (K3, TR §2.3.3 / App. C-D):
  1. route with top-(k+1) of s + b; the (k+1)-th biased score is the token threshold alpha_i,
     the value an expert has to beat to enter token i's top-k;
  2. expert j gets token i under a candidate bias b_j iff s_ij + b_j > alpha_i, i.e. iff
     b_j > r_ij with the margin r_ij = alpha_i - s_ij; so the load of expert j is the number of
     margins below b_j, and b_j = the (k/E)-quantile of r_{:,j} gives load q = N k / E;
  3. b <- b - mean(b) (a common shift changes no top-k choice, it only keeps b from drifting).
This is one exact coordinate step of the dual of the balanced-assignment LP, so it needs no rate.
It is exact only for the candidate rule with the *old* thresholds: when every bias moves at once
the tokens' k-th / (k+1)-th scores move too, so rerouting the same scores after one step lands
near q, not on it (a 10x overloaded expert comes back to within tens of percent, then a few more
steps reach the sampling-noise level; see tests/test_balancing.py).

The histogram estimator is what runs at scale: each device scatter-adds its margins into
B uniform bins over [min(b) - 1, max(b) + 1] per expert (s in (0, 1) and alpha in
(min(b), 1 + max(b)) keep every margin in that range); the integer counts of all micro-batches and
devices are summed by one all-reduce, and the quantile is read off the summed histogram.

Array suffixes name the axes: N tokens, E experts, k routes per token, B histogram bins.

`BALANCERS` (keyed by ``model.moe.balancing``) says, for each rule, what the router computes and how
the step turns its statistics into the next bias: see `Balancer`. The MoE layer and the train step
look the rule up once and never branch on its name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from k3.backends import Table


def topk_route(scores_NE: jax.Array, bias_E: jax.Array, k: int, extra: int = 0):
    """Top-k experts of the biased scores, plus each token's threshold for Quantile Balancing.

    Args:
      scores_NE: [N, E] router scores (any float dtype; the selection is done in fp32).
      bias_E: [E] selection bias.
      k: routes per token (static).
      extra: 0 -> plain top-k; 1 -> also return alpha, the (k+1)-th largest biased score (static).

    Returns:
      (idx_Nk [N, k] int32 in descending biased-score order, alpha_N [N] fp32 or None).
    """
    if extra not in (0, 1):
        raise ValueError(f"extra must be 0 or 1, got {extra}")
    n_experts = scores_NE.shape[-1]
    if not 0 < k + extra <= n_experts:
        raise ValueError(f"top-{k + extra} routing needs 1 <= k + extra <= n_experts={n_experts}")
    biased = scores_NE.astype(jnp.float32) + bias_E.astype(jnp.float32)
    # One top_k of width k+1 yields both the routes and the threshold, avoiding a token-side quantile.
    vals, idx = jax.lax.top_k(biased, k + extra)
    alpha = vals[..., k] if extra else None
    return idx[..., :k].astype(jnp.int32), alpha


def expert_load(idx_Nk: jax.Array, n_experts: int) -> jax.Array:
    """Tokens routed to each expert: idx [N, k] int -> [E] float32 counts (sum = N*k)."""
    flat = idx_Nk.reshape(-1)
    return jnp.zeros((n_experts,), jnp.float32).at[flat].add(1.0)


def sign_update(bias_E: jax.Array, load_E: jax.Array, rate: float) -> jax.Array:
    """K2 / DeepSeek-V3 rule: b + rate * sign(mean(load) - load), [E] -> [E] fp32.

    Overloaded experts move down by exactly ``rate``, underloaded ones up; experts exactly at the
    mean stay put.
    """
    load = load_E.astype(jnp.float32)
    return bias_E.astype(jnp.float32) + rate * jnp.sign(jnp.mean(load) - load)


def _margins(scores_NE: jax.Array, alpha_N: jax.Array) -> jax.Array:
    """r [N, E] = alpha_i - s_ij in fp32: expert j takes token i iff its bias exceeds r_ij."""
    return alpha_N.astype(jnp.float32)[:, None] - scores_NE.astype(jnp.float32)


def _target_rank(n_tokens: int, k: int, n_experts: int) -> tuple[int, float]:
    """Split the Hazen plotting position q + 1/2 (1-indexed, q = N k / E) into (integer, fraction).

    Exact integer arithmetic, so an integral q is never misread as q - 1 + 0.999...
    """
    num, den = 2 * n_tokens * k + n_experts, 2 * n_experts
    return num // den, (num % den) / den


def exact_margin_quantile(scores_NE: jax.Array, alpha_N: jax.Array, k: int) -> jax.Array:
    """Per-expert k/E-quantile of the margins alpha_i - s_ij, *not* mean-centred: [E] fp32.

    This is the bias under which the candidate rule s_ij + b_j > alpha_i (with the batch's own
    thresholds) gives expert j a load of q = N k / E; ``quantile_bias_exact`` centres it.

    Let r_(1) <= ... <= r_(N) be expert j's sorted margins. Any b_j in (r_(m), r_(m+1)] gives it
    exactly m tokens under the candidate rule. We interpolate at position q + 1/2 (Hazen's
    plotting position: the inverse of the piecewise-linear CDF through (r_(m), m - 1/2), the same
    CDF the histogram estimator inverts), so r_(m) <= b_j <= r_(m+1) with m = floor(q + 1/2) and
        #{r < b_j} <= m <= #{r <= b_j}:
      * distinct margins, integral q: b_j is the midpoint of r_(q) and r_(q+1) and the load is
        exactly q, with the widest fp32 room on both sides of the cut;
      * distinct margins, fractional q: the load is floor(q) or ceil(q), so |load - q| < 1 (at a
        half-integer q, b_j sits on a margin and rounding picks the side);
      * ties: equal margins cannot be split by any bias, so b_j lands on the tied value and the
        load is the count strictly below it. One tie group is structural: every token whose
        (k+1)-th choice is j has r_ij = (s_ij + b_j) - s_ij = b_j^old (to an ulp), about N/E tokens.
        An expert short by fewer than that keeps its old bias (relative to the others).
    Sentinels r_(0) = r_(1) - 1 and r_(N+1) = r_(N) + 1 cover q + 1/2 outside [1, N] (q < 1/2).
    """
    n_tokens, n_experts = scores_NE.shape
    r_EN = jnp.sort(_margins(scores_NE, alpha_N).T, axis=-1)
    r_EN = jnp.concatenate([r_EN[:, :1] - 1.0, r_EN, r_EN[:, -1:] + 1.0], axis=-1)
    m, frac = _target_rank(n_tokens, k, n_experts)
    lo, hi = r_EN[:, m], r_EN[:, min(m + 1, n_tokens + 1)]
    return lo + frac * (hi - lo)


def quantile_bias_exact(scores_NE: jax.Array, alpha_N: jax.Array, k: int) -> jax.Array:
    """Quantile Balancing with exact per-expert quantiles: new mean-centred bias [E] fp32.

    Args:
      scores_NE: [N, E] unbiased router scores of the batch.
      alpha_N: [N] token thresholds, the (k+1)-th biased score from ``topk_route(..., extra=1)``.
      k: routes per token (static; N and E are static shapes, so the target rank is static too).

    b_j = the k/E-quantile of alpha - s_{:,j} (see ``exact_margin_quantile`` for the interpolation,
    ties and non-integral q = N k / E), then b <- b - mean(b). Costs a sort of N margins per expert;
    use the histogram version when the batch is spread over micro-batches or devices.
    """
    bias = exact_margin_quantile(scores_NE, alpha_N, k)
    return bias - jnp.mean(bias)


def _bin_range(bias_E: jax.Array, n_bins: int) -> tuple[jax.Array, jax.Array]:
    """(lower edge, bin width) of the histogram range [min(b) - 1, max(b) + 1] in fp32.

    Both the histogram and its reader call this, so counts binned under one bias can be summed
    and read back with exactly the same edges.
    """
    b = bias_E.astype(jnp.float32)
    lo = jnp.min(b) - 1.0
    width = (jnp.max(b) + 1.0 - lo) / n_bins
    return lo, width


def quantile_histogram(scores_NE: jax.Array, alpha_N: jax.Array, bias_E: jax.Array,
                       n_bins: int) -> jax.Array:
    """Per-expert histogram of the margins alpha_i - s_ij: [N, E], [N], [E] -> int32 [E, B].

    ``bias_E`` must be the bias the batch was routed with (it fixes the bin range). Margins
    outside the range (only possible through fp32 rounding at s = 0 or 1) go to the edge bins.
    Counts are integers so that histograms of micro-batches / devices add exactly (one psum).
    """
    n_experts = scores_NE.shape[-1]
    lo, width = _bin_range(bias_E, n_bins)
    r_NE = _margins(scores_NE, alpha_N)
    bin_NE = jnp.clip(jnp.floor((r_NE - lo) / width), 0, n_bins - 1).astype(jnp.int32)
    # A scatter-add keeps memory at O(N E + E B); a one-hot sum would materialise N E B.
    flat = (jnp.arange(n_experts, dtype=jnp.int32)[None, :] * n_bins + bin_NE).reshape(-1)
    counts = jnp.zeros((n_experts * n_bins,), jnp.int32).at[flat].add(1)
    return counts.reshape(n_experts, n_bins)


def histogram_margin_quantile(hist_EB: jax.Array, bias_E: jax.Array, n_tokens, k: int) -> jax.Array:
    """Per-expert k/E-quantile of the margins read off their histograms, *not* mean-centred: [E].

    With q = n_tokens k / E: l_j = first bin whose cumulative count reaches ceil(q), c_j = count
    below it, h_j = count inside; b_j = lo + (l_j + clip((q - c_j) / h_j, 0, 1)) * width, i.e.
    the piecewise-linear CDF inverted at q. b_j stays inside bin l_j, so it is within one bin
    width of the exact quantile and the candidate-rule load #{r < b_j} is within h_j tokens of q.
    """
    n_experts, n_bins = hist_EB.shape
    lo, width = _bin_range(bias_E, n_bins)
    # (n k) / E rather than n (k / E): exact, so an integral q is not pushed past ceil by rounding
    # (holds while n k < 2^24 or n is a power of two).
    q = jnp.asarray(n_tokens, jnp.float32) * k / n_experts
    need = jnp.ceil(q).astype(jnp.int32)
    hist = hist_EB.astype(jnp.int32)
    cum = jnp.cumsum(hist, axis=-1)
    # Number of bins still short of ceil(q) = index of the first bin that reaches it. Clipped so a
    # histogram with fewer than q tokens (wrong n_tokens) still yields a finite bias.
    first = jnp.minimum(jnp.sum(cum < need, axis=-1), n_bins - 1)
    inside = jnp.take_along_axis(hist, first[:, None], axis=-1)[:, 0]
    below = jnp.take_along_axis(cum, first[:, None], axis=-1)[:, 0] - inside
    frac = jnp.clip((q - below) / jnp.maximum(inside, 1), 0.0, 1.0)
    return lo + (first.astype(jnp.float32) + frac) * width


def quantile_bias_from_histogram(hist_EB: jax.Array, bias_E: jax.Array, n_tokens, k: int) -> jax.Array:
    """Quantile Balancing from (summed) margin histograms: new mean-centred bias [E] fp32.

    Args:
      hist_EB: [E, B] int counts from ``quantile_histogram`` with this same ``bias_E``, possibly
        summed over micro-batches and devices.
      bias_E: [E] the bias the counted tokens were routed with (recomputes the bin edges).
      n_tokens: total number of tokens counted (python int or traced scalar).
      k: routes per token (static).

    See ``histogram_margin_quantile``; the error vs ``quantile_bias_exact`` is at most one bin
    width (B = 1000 over a range of width max(b) - min(b) + 2: about 2e-3).
    """
    bias = histogram_margin_quantile(hist_EB, bias_E, n_tokens, k)
    return bias - jnp.mean(bias)


def imbalance(load_E: jax.Array) -> jax.Array:
    """max(load) / mean(load) of an [E] load vector: a float32 scalar, 1.0 when perfectly balanced."""
    load = load_E.astype(jnp.float32)
    return jnp.max(load) / jnp.mean(load)


# ---------------------------------------------------------------------------------------------
# The rules as table entries


@dataclasses.dataclass(frozen=True)
class Balancer:
    """One balancing rule, as the router and the train step use it.

    extra_routes: candidates past the top k that the router ranks (Quantile Balancing reads each
      token's threshold from the (k+1)-th).
    balance: (scores [N, E] fp32, alpha [N], bias [E], top_k, bins) -> the 'balance' statistic, or
      None when the rule needs only the expert loads.
    summable: 'balance' of disjoint token sets adds up (histograms): each device and micro-batch
      computes its own and they are summed. Otherwise it needs all of a step's tokens at once and
      micro-batches average it.
    update: (bias [E], stats {'load', 'balance'?}, moe config, tokens in the step) -> the next bias.
    """

    extra_routes: int
    balance: Callable | None
    summable: bool
    update: Callable


BALANCERS = Table("model.moe.balancing", default="quantile_hist")

BALANCERS.register("none")(Balancer(0, None, True, lambda bias, stats, cfg, n: bias))
BALANCERS.register("sign")(Balancer(
    0, None, True, lambda bias, stats, cfg, n: sign_update(bias, stats["load"], cfg.sign_rate)))
BALANCERS.register("quantile")(Balancer(
    1, lambda scores, alpha, bias, k, bins: quantile_bias_exact(scores, alpha, k), False,
    lambda bias, stats, cfg, n: stats["balance"]))
BALANCERS.register("quantile_hist")(Balancer(
    1, lambda scores, alpha, bias, k, bins: quantile_histogram(scores, alpha, bias, bins), True,
    lambda bias, stats, cfg, n: quantile_bias_from_histogram(stats["balance"], bias, n, cfg.top_k)))
