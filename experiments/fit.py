"""Scaling-law fits for the ladder: power laws in compute, compute multipliers, and Chinchilla's L(N, D).

    python -m experiments.fit --results=DIR [--baseline=k2] [--bootstrap=1000] [--bootstrap_e=200]
                              [--seed=0] [--sigma=0] [--json=PATH] [--starts=100]
    python -m experiments.fit --chinchilla=tests/data/chinchilla_fig4_points.csv [--starts=100]

``--sigma=0`` estimates the loss noise from seed repeats; ``--starts=0`` optimises all 4500 starts of
the Chinchilla grid (about 50 s) instead of the best-scored 100 (about 1 s).

Reads the ``points*.jsonl`` files that ``experiments/run_ladder.py`` writes, fits every arm under both
FLOP conventions (``6N`` uses ``flops_6N``, ``full`` uses ``flops_full``; see `k3.params`), compares
each arm with the baseline arm and prints markdown tables; the same numbers go to a JSON report.

Which points feed which fit:
  * power laws in C (``L = A C^-alpha`` and ``L = E + A C^-alpha``): the *main* points, one per size
    (``is_final``, seed 0, ``lr_mult`` 1);
  * Chinchilla's ``L(N, D)``: every seed-0, ``lr_mult``-1 point, finals and cooldown branches, with
    ``N = C / (6 D)`` so that ``C = 6 N D`` holds under either convention;
  * the loss noise sigma_L of the bootstrap: the pooled standard deviation of the finals of repeated
    seeds and same-seed repeats (the device's run-to-run noise).

Learning-rate rules. A run trains at the ladder's shared rule or at its arm's own fitted rule
(``lr_rule`` 'shared' or 'own'; records without the field are shared). The headline fits use, per
arm, its own-rule points when it has any and its shared-rule points otherwise; an arm with shared-rule
points only is compared with the baseline's shared-rule points. When some arm has
own-rule points, the comparisons are repeated with shared-rule points only (``comparisons_shared_rule``),
so the multiplier is reported both at each arm's optimum and at one rule for all. The per-arm rule
``lr*(C) = coef C^exp`` is fitted from each arm's sweeps (>= 3 rates at a size, at >= 2 sizes) and
printed as the runner's ``lr_rules`` value.

Compute multiplier of an arm over the baseline at compute C: ``M(C) = C_b / C``, where ``C_b`` is the
compute at which the baseline's fitted law reaches the arm's fitted loss at C. ``M = 2`` means the arm
reaches a given loss with half the baseline's compute.

All numerics in float64.
"""

from __future__ import annotations

import argparse
import csv
import functools
import glob
import itertools
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

import numpy as np
from scipy.optimize import minimize
from scipy.special import fdtrc
from threadpoolctl import threadpool_limits

HUBER_DELTA = 1e-3
CONVENTIONS = {"6N": "flops_6N", "full": "flops_full"}
DEFAULT_SIGMA = 0.01  # nats; used only when no size was run with more than one seed
MIN_CHINCHILLA_POINTS = 5

# Starting grid of Hoffmann et al. 2022 (Approach 3), as used by Besiroglu et al. 2024: 4500 starts.
CHINCHILLA_GRID = {
    "alpha": (0.0, 0.5, 1.0, 1.5, 2.0),
    "beta": (0.0, 0.5, 1.0, 1.5, 2.0),
    "e": (-1.0, -0.5, 0.0, 0.5, 1.0),
    "a": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "b": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
}
# Besiroglu et al. 2024 ("Chinchilla Scaling: A replication attempt"), refit of Hoffmann et al.'s
# Figure 4 data without the five points with the fewest tokens per parameter.
BESIROGLU_2024 = {"E": 1.8172, "A": 482.01, "B": 2085.43, "alpha": 0.3478, "beta": 0.3658}

_LBFGS_OPTIONS = {"maxiter": 10_000, "maxfun": 40_000, "ftol": 1e-14, "gtol": 1e-12}


class FitError(Exception):
    """Bad or insufficient input; the CLIs turn it into a message and exit code 2."""


# --------------------------------------------------------------------------------------------------
# BLAS threads
#
# L-BFGS-B makes thousands of BLAS calls on arrays of a few elements. With OpenBLAS free to use every
# core, a fit on a machine whose cores are busy (a training run, a parallel test worker) ran 10-40x
# slower than with one BLAS thread, the time going to thread hand-offs. The fits therefore run with
# every loaded BLAS (numpy's and scipy's are separate libraries) limited to one thread.


def _single_blas_thread(fn):
    """Decorator: run ``fn`` with the BLAS libraries on one thread (see above)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with threadpool_limits(limits=1, user_api="blas"):
            return fn(*args, **kwargs)

    return wrapper


# --------------------------------------------------------------------------------------------------
# Huber loss


def huber(r: np.ndarray, delta: float = HUBER_DELTA) -> tuple[np.ndarray, np.ndarray]:
    """Huber loss of residuals ``r`` (any shape) and its derivative, both shaped like ``r``.

    ``0.5 r^2`` for ``|r| <= delta``, ``delta (|r| - delta/2)`` beyond; the derivative is
    ``clip(r, -delta, delta)``, and ``c (r - c/2)`` with that clip equals the loss on both branches.
    """
    c = np.clip(r, -delta, delta)
    return c * (r - 0.5 * c), c


# --------------------------------------------------------------------------------------------------
# Power laws in compute


@dataclass(frozen=True)
class PowerLawFit:
    """``L(C) = E + A C^-alpha`` (``E = 0`` for the pure power law); C in FLOPs, L in nats/token.

    ``objective`` is the minimised value: the sum of squared log residuals for the pure law (OLS in
    log-log), the summed Huber loss of log residuals for the law with E. ``sse`` is the sum of squared
    log residuals for both forms.
    """

    A: float
    alpha: float
    E: float = 0.0
    objective: float = math.nan
    sse: float = math.nan
    n: int = 0

    @property
    def log_A(self) -> float:
        return math.log(self.A)

    def predict(self, C) -> np.ndarray:
        """Loss (nats) at compute ``C`` (FLOPs, any shape); same shape as ``C``."""
        logC = np.log(np.asarray(C, np.float64))
        return self.E + np.exp(self.log_A - self.alpha * logC)

    def log_predict(self, C) -> np.ndarray:
        """log L at compute ``C`` (FLOPs, any shape), computed without cancellation."""
        t = self.log_A - self.alpha * np.log(np.asarray(C, np.float64))
        return t if self.E == 0 else np.logaddexp(t, math.log(self.E))

    def compute_for_loss(self, L) -> np.ndarray:
        """Compute (FLOPs) at which the law reaches loss ``L`` (nats, any shape); nan where L <= E."""
        L = np.asarray(L, np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            reducible = L - self.E
            logC = (self.log_A - np.log(np.where(reducible > 0, reducible, np.nan))) / self.alpha
        return np.exp(logC)


def _ols_power_law(logC: np.ndarray, logL: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """OLS of log L on log C for one or many response rows.

    logC: (n,); logL: (n,) or (R, n). Returns log A, alpha and SSE, each () or (R,).
    """
    X = np.stack([np.ones_like(logC), -logC], axis=1)
    Y = np.atleast_2d(logL)
    coef, *_ = np.linalg.lstsq(X, Y.T, rcond=None)  # (2, R)
    resid = Y - (X @ coef).T
    sse = np.einsum("rn,rn->r", resid, resid)
    if np.ndim(logL) == 1:
        return coef[0, 0], coef[1, 0], sse[0]
    return coef[0], coef[1], sse


# Starts of the fit with E: E as fractions of the smallest loss, alpha spanning shallow to steep laws.
_E_FRACTIONS = (0.0, 0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.97)
_E_ALPHAS = (0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0)


def _fit_power_law_E(logC, logL, delta, n_starts):
    """Huber fit of log L = log(E + exp(a - alpha log C)) over a grid of starts; returns PowerLawFit."""
    # Centering log C decouples the intercept from the slope, which L-BFGS needs: at C ~ 1e18 a change
    # of alpha by 1e-3 moves log A by 0.04.
    x0 = float(np.mean(logC))
    x = logC - x0
    L = np.exp(logL)

    starts = []
    for frac, alpha in itertools.product(_E_FRACTIONS, _E_ALPHAS):
        E = frac * L.min()
        # intercept that best matches log(L - E) for this slope: the start is already on the data
        starts.append((E, float(np.mean(np.log(L - E) + alpha * x)), alpha))
    starts = np.array(starts)

    # E itself is the variable, bounded below by 0, rather than E = exp(e): when the data want no
    # irreducible term, exp(e) -> 0 has a vanishing gradient and L-BFGS crawls for hundreds of steps.
    def batch_objective(p):  # p: (S, 3) -> (S,)
        Lhat = p[:, 0:1] + np.exp(p[:, 1:2] - p[:, 2:3] * x)
        return huber(np.log(Lhat) - logL, delta)[0].sum(axis=1)

    def objective(p):
        E, a, alpha = p
        t = a - alpha * x
        # line-search probes far from the data may overflow; L-BFGS-B backs off from an inf objective
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            lse = np.logaddexp(t, math.log(E) if E > 0 else -np.inf)
            h, c = huber(lse - logL, delta)
            w = np.exp(t - lse)  # d log Lhat / d t; d log Lhat / d E = 1 / Lhat
            cw = c * w
            return float(h.sum()), np.array([float(c @ np.exp(-lse)), float(cw.sum()), -float(cw @ x)])

    f0 = batch_objective(starts)
    order = np.argsort(f0, kind="stable")
    if n_starts is not None:
        order = order[: max(1, int(n_starts))]
    bounds = [(0.0, None), (None, None), (0.0, 5.0)]  # alpha <= 5 also keeps A = exp(a + alpha x0) finite
    best = None
    for i in order:
        res = minimize(objective, starts[i], jac=True, method="L-BFGS-B", bounds=bounds, options=_LBFGS_OPTIONS)
        if best is None or res.fun < best.fun:
            best = res
    E, a, alpha = (float(v) for v in best.x)
    fit = PowerLawFit(A=math.exp(a + alpha * x0), alpha=alpha, E=E, objective=float(best.fun), n=len(logC))
    sse = float(np.sum((fit.log_predict(np.exp(logC)) - logL) ** 2))
    return PowerLawFit(A=fit.A, alpha=fit.alpha, E=fit.E, objective=fit.objective, sse=sse, n=fit.n)


@_single_blas_thread
def fit_power_law(C, L, with_E: bool = False, delta: float = HUBER_DELTA, n_starts: int | None = 4) -> PowerLawFit:
    """Fit ``L = A C^-alpha`` (OLS in log-log) or ``L = E + A C^-alpha`` (``with_E``).

    C: (n,) compute in FLOPs; L: (n,) loss in nats. The law with E minimises the summed Huber loss
    (``delta``) of log residuals with L-BFGS-B from a grid of 64 starts (E from 0 to 0.97 min L, alpha
    from 0.02 to 1) with the bound E >= 0; the ``n_starts`` starts with the lowest objective are
    optimised (None: all). The grid's starts lie on the data already; on the synthetic ladders of
    tests/test_fit.py the best four reach the optimum of all 64, at 1/16 of the cost that the
    bootstrap pays again in every replicate.
    Needs n >= 2 (n >= 3 with E).
    """
    C = np.asarray(C, np.float64)
    L = np.asarray(L, np.float64)
    if C.shape != L.shape or C.ndim != 1:
        raise FitError(f"C and L must be 1-D arrays of the same length, got {C.shape} and {L.shape}")
    need = 3 if with_E else 2
    if len(C) < need:
        raise FitError(f"a power law{' with E' if with_E else ''} needs at least {need} points, got {len(C)}")
    if np.any(C <= 0) or np.any(L <= 0):
        raise FitError("compute and loss must be positive")
    logC, logL = np.log(C), np.log(L)
    if with_E:
        return _fit_power_law_E(logC, logL, delta, n_starts)
    log_A, alpha, sse = _ols_power_law(logC, logL)
    return PowerLawFit(A=float(np.exp(log_A)), alpha=float(alpha), E=0.0, objective=float(sse), sse=float(sse),
                       n=len(C))


class SharedExponentFit(NamedTuple):
    """One exponent for all arms: ``log L = log A_arm - alpha log C``."""

    alpha: float
    A: dict  # arm -> A
    sse_shared: float  # sum of squared log residuals of the joint fit
    sse_separate: float  # the same, summed over separate per-arm fits


def fit_shared_exponent(arms: Mapping[str, tuple]) -> SharedExponentFit:
    """Joint OLS of ``log L = log A_arm - alpha log C`` with one alpha across arms.

    arms: arm -> (C, L), each (n_arm,) FLOPs and nats, n_arm >= 2. Returns (alpha, {arm: A},
    sse_shared, sse_separate); the SSEs are of log residuals.
    """
    names = list(arms)
    if not names:
        raise FitError("fit_shared_exponent needs at least one arm")
    rows, y, sse_separate = [], [], 0.0
    for k, name in enumerate(names):
        C, L = (np.asarray(v, np.float64) for v in arms[name])
        if len(C) < 2:
            raise FitError(f"arm {name!r} needs at least 2 points for a power law, got {len(C)}")
        onehot = np.zeros((len(C), len(names)))
        onehot[:, k] = 1.0
        rows.append(np.concatenate([onehot, -np.log(C)[:, None]], axis=1))
        y.append(np.log(L))
        sse_separate += _ols_power_law(np.log(C), np.log(L))[2]
    X, y = np.concatenate(rows), np.concatenate(y)
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    sse_shared = float(np.sum((y - X @ coef) ** 2))
    A = {name: float(np.exp(coef[k])) for k, name in enumerate(names)}
    return SharedExponentFit(float(coef[-1]), A, sse_shared, float(sse_separate))


def shared_exponent_pvalue(sse_shared: float, sse_separate: float, n_points: int, n_arms: int) -> float:
    """F-test p-value of 'one alpha' against 'one alpha per arm' (nested OLS models in log-log).

    Degrees of freedom: n_arms - 1 restrictions, n_points - 2 n_arms residual; nan when there are none
    or the separate fits are exact.
    """
    df1, df2 = n_arms - 1, n_points - 2 * n_arms
    if df1 <= 0 or df2 <= 0 or sse_separate <= 0:
        return math.nan
    F = max(sse_shared - sse_separate, 0.0) / df1 / (sse_separate / df2)
    return float(fdtrc(df1, df2, F))


@dataclass
class LROptimumFit:
    """Per-arm learning-rate rule fitted from sweeps: lr*(C) = coef * C ** exp.

    ``sizes``: per swept compute C, the (C, lr*) of the parabola in log lr through that size's
    losses, and whether the optimum is bracketed (inside the swept rates) or extrapolated.
    """

    coef: float
    exp: float
    sizes: list = field(default_factory=list)

    def __call__(self, C) -> np.ndarray:
        return self.coef * np.asarray(C, np.float64) ** self.exp


def lr_optimum(lr, loss) -> tuple[float, bool]:
    """The rate minimising a parabola fitted (least squares) to loss against log(lr), and whether
    it lies inside the swept rates. Needs >= 3 distinct rates; a parabola opening downwards (no
    minimum) returns the best swept rate, marked not bracketed."""
    x, y = np.log(np.asarray(lr, np.float64)), np.asarray(loss, np.float64)
    if len(np.unique(x)) < 3:
        raise ValueError(f"a learning-rate optimum needs >= 3 distinct rates, got {len(np.unique(x))}")
    a, b, _ = np.polyfit(x, y, 2)
    if a <= 0:
        return float(np.exp(x[np.argmin(y)])), False
    x_opt = -b / (2 * a)
    return float(np.exp(x_opt)), bool(x.min() <= x_opt <= x.max())


def fit_lr_rule(sweeps: Mapping[float, tuple]) -> LROptimumFit:
    """Fits lr*(C) = coef * C ** exp (least squares in log-log) to the optimum of each size's sweep.

    sweeps: compute C -> (rates, losses) of that size's runs. Needs >= 2 sizes."""
    if len(sweeps) < 2:
        raise ValueError(f"a learning-rate rule needs sweeps at >= 2 sizes, got {len(sweeps)}")
    sizes = []
    for C, (lr, loss) in sorted(sweeps.items()):
        opt, bracketed = lr_optimum(lr, loss)
        sizes.append({"C": float(C), "lr_opt": opt, "bracketed": bracketed})
    logC = np.log([r["C"] for r in sizes])
    log_lr = np.log([r["lr_opt"] for r in sizes])
    exp, log_coef = np.polyfit(logC, log_lr, 1)
    return LROptimumFit(float(np.exp(log_coef)), float(exp), sizes)


def multiplier(baseline_fit: PowerLawFit, new_fit: PowerLawFit, C) -> np.ndarray:
    """Compute multiplier ``M(C) = C_b / C`` of ``new_fit`` over ``baseline_fit``; same shape as ``C``.

    ``C_b`` is the compute at which the baseline reaches the new arm's loss at ``C`` (FLOPs). For pure
    laws ``M = (A_b/A_n)^(1/alpha_b) C^(alpha_n/alpha_b - 1)``; with E, ``C_b = ((L_n(C) - E_b)/A_b)
    ^(-1/alpha_b)``, nan where the new arm's loss is at or below the baseline's E, and nan everywhere when
    alpha_b <= 0.
    """
    C = np.asarray(C, np.float64)
    if not baseline_fit.alpha > 0:  # a baseline that does not improve with compute never catches up
        return np.full(C.shape, np.nan)
    if baseline_fit.E == 0 and new_fit.E == 0:
        # closed form in logs: exact even where C^-alpha would underflow
        logC = np.log(C)
        b, n = baseline_fit, new_fit
        return np.exp((b.log_A - n.log_A) / b.alpha + (n.alpha / b.alpha - 1.0) * logC)
    return baseline_fit.compute_for_loss(new_fit.predict(C)) / C


def shared_multiplier(shared: SharedExponentFit, baseline: str, arm: str) -> float:
    """Constant multiplier ``(A_b / A_arm)^(1/alpha)`` of ``arm`` over ``baseline`` under one shared alpha."""
    return float((shared.A[baseline] / shared.A[arm]) ** (1.0 / shared.alpha))


# --------------------------------------------------------------------------------------------------
# Uncertainty of the multiplier


@dataclass
class BootstrapResult:
    """Parametric-bootstrap distribution of M at the compute values ``C`` (m,).

    ``M``: point estimate from the unperturbed fits; ``lo``/``hi``: the lower/upper percentiles over
    replicates (nan replicates, where M is undefined, are left out; ``n_valid`` counts the rest);
    ``samples``: (n_boot, m).
    """

    C: np.ndarray
    M: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    excludes_1: np.ndarray
    n_valid: np.ndarray
    samples: np.ndarray
    percentiles: tuple = (5.0, 95.0)
    sigma: float = math.nan


@_single_blas_thread
def bootstrap_multiplier(C_base, L_base, C_new, L_new, sigma: float, C_eval=None, n_boot: int = 1000,
                         with_E: bool = False, seed: int = 0, percentiles: Sequence[float] = (5.0, 95.0),
                         n_starts: int | None = 4) -> BootstrapResult:
    """Parametric bootstrap of the compute multiplier of the new arm over the baseline.

    C_*: (n_*,) FLOPs, L_*: (n_*,) nats. Each replicate adds N(0, sigma^2) noise (nats) to every loss
    of both arms and refits both from scratch (the full grid of starts for the law with E); M is taken
    at ``C_eval`` (m,), by default the new arm's measured C. Returns percentiles over replicates.
    """
    C_base, L_base, C_new, L_new = (np.asarray(v, np.float64) for v in (C_base, L_base, C_new, L_new))
    C_eval = np.asarray(C_new if C_eval is None else C_eval, np.float64).reshape(-1)
    fit_b = fit_power_law(C_base, L_base, with_E=with_E, n_starts=n_starts)
    fit_n = fit_power_law(C_new, L_new, with_E=with_E, n_starts=n_starts)
    M = multiplier(fit_b, fit_n, C_eval)

    rng = np.random.default_rng(seed)
    noisy_b = L_base + rng.normal(0.0, sigma, (n_boot, len(L_base)))
    noisy_n = L_new + rng.normal(0.0, sigma, (n_boot, len(L_new)))
    samples = np.full((n_boot, len(C_eval)), np.nan)
    # a replicate whose noise drives a loss to <= 0 has no log; it stays nan
    ok = (noisy_b > 0).all(axis=1) & (noisy_n > 0).all(axis=1)
    if not with_E:
        # pure laws are linear in log space: all replicates in one least-squares solve
        # failed replicates get the unperturbed losses so the solve stays finite; they are dropped after
        lab, alb, _ = _ols_power_law(np.log(C_base), np.log(np.where(ok[:, None], noisy_b, L_base)))
        lan, aln, _ = _ols_power_law(np.log(C_new), np.log(np.where(ok[:, None], noisy_n, L_new)))
        ok &= alb > 0  # as in `multiplier`: a baseline that does not improve never catches up
        alb = np.where(ok, alb, 1.0)
        logM = (lab - lan)[:, None] / alb[:, None] + (aln / alb - 1.0)[:, None] * np.log(C_eval)[None, :]
        samples[ok] = np.exp(logM[ok])
    else:
        for r in np.flatnonzero(ok):
            fb = fit_power_law(C_base, noisy_b[r], with_E=True, n_starts=n_starts)
            fn = fit_power_law(C_new, noisy_n[r], with_E=True, n_starts=n_starts)
            samples[r] = multiplier(fb, fn, C_eval)

    lo, hi, n_valid = _percentiles(samples, percentiles)
    return BootstrapResult(C=C_eval, M=M, lo=lo, hi=hi, excludes_1=(lo > 1) | (hi < 1), n_valid=n_valid,
                           samples=samples, percentiles=tuple(float(p) for p in percentiles), sigma=float(sigma))


def _percentiles(samples, percentiles):
    """Lower/upper percentiles over axis 0 ignoring nan; nan where no replicate is finite."""
    finite = np.isfinite(samples)
    n_valid = finite.sum(axis=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-nan columns are reported as nan
        lo, hi = np.nanpercentile(np.where(finite, samples, np.nan), list(percentiles), axis=0)
    return np.atleast_1d(lo), np.atleast_1d(hi), n_valid


@dataclass
class LosoResult:
    """Multiplier at ``C`` (FLOPs) with each size left out of both arms in turn.

    ``by_size``: size -> M (nan where an arm kept too few points to fit); ``min``/``max`` over the
    finite values.
    """

    C: float
    by_size: dict
    min: float
    max: float


@_single_blas_thread
def leave_one_size_out(C_base, L_base, sizes_base, C_new, L_new, sizes_new, C_eval=None,
                       with_E: bool = False, n_starts: int | None = 4) -> LosoResult:
    """Leave-one-size-out sensitivity of M at ``C_eval`` (default: `common_reach` of the two arms).

    C_*: (n_*,) FLOPs, L_*: (n_*,) nats, sizes_*: (n_*,) size labels; a size present in both arms is
    dropped from both. Each dropped size gives one refit of both arms and one M.
    """
    C_base, L_base, C_new, L_new = (np.asarray(v, np.float64) for v in (C_base, L_base, C_new, L_new))
    sizes_base, sizes_new = list(sizes_base), list(sizes_new)
    C_eval = common_reach(C_base, C_new) if C_eval is None else float(C_eval)
    need = 3 if with_E else 2
    by_size = {}
    for size in dict.fromkeys(sizes_base + sizes_new):
        kb = np.array([s != size for s in sizes_base])
        kn = np.array([s != size for s in sizes_new])
        if kb.sum() < need or kn.sum() < need:
            by_size[size] = math.nan
            continue
        fb = fit_power_law(C_base[kb], L_base[kb], with_E=with_E, n_starts=n_starts)
        fn = fit_power_law(C_new[kn], L_new[kn], with_E=with_E, n_starts=n_starts)
        by_size[size] = float(multiplier(fb, fn, C_eval))
    finite = [m for m in by_size.values() if math.isfinite(m)]
    return LosoResult(C=C_eval, by_size=by_size, min=min(finite, default=math.nan), max=max(finite, default=math.nan))


# --------------------------------------------------------------------------------------------------
# Chinchilla Approach 3: L(N, D) = E + A / N^alpha + B / D^beta


@dataclass(frozen=True)
class ChinchillaFit:
    """``L(N, D) = E + A N^-alpha + B D^-beta``; N parameters, D tokens, L nats/token.

    ``objective``: the summed Huber loss of log residuals at the optimum; ``n``: number of points;
    ``converged``: whether L-BFGS-B met its tolerances at the best start.
    """

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    objective: float
    n: int
    converged: bool = True

    def predict(self, N, D) -> np.ndarray:
        """Loss (nats) at N parameters and D tokens (broadcastable arrays)."""
        N = np.asarray(N, np.float64)
        D = np.asarray(D, np.float64)
        return self.E + self.A * N ** -self.alpha + self.B * D ** -self.beta

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("E", "A", "B", "alpha", "beta", "objective", "n", "converged")}


def _chinchilla_grid(grid: Mapping[str, Sequence[float]]) -> np.ndarray:
    """Grid dict (alpha, beta, e, a, b) -> starts (S, 5) in parameter order (a, b, e, alpha, beta)."""
    combos = itertools.product(grid["alpha"], grid["beta"], grid["e"], grid["a"], grid["b"])
    return np.array([(a, b, e, al, be) for al, be, e, a, b in combos], np.float64)


def _chinchilla_batch_objective(starts, logN, logD, logL, delta, chunk=512):
    """Summed Huber objective for every start: starts (S, 5) -> (S,); chunked to bound memory."""
    out = np.empty(len(starts))
    for i in range(0, len(starts), chunk):
        p = starts[i:i + chunk]
        t1 = p[:, 0:1] - p[:, 3:4] * logN
        t2 = p[:, 1:2] - p[:, 4:5] * logD
        lse = np.logaddexp(np.logaddexp(t1, t2), p[:, 2:3])
        out[i:i + chunk] = huber(lse - logL, delta)[0].sum(axis=1)
    return out


@_single_blas_thread
def fit_chinchilla(N, D, L, delta: float = HUBER_DELTA, grid: Mapping[str, Sequence[float]] | None = None,
                   n_starts: int | None = 100, options: Mapping | None = None) -> ChinchillaFit:
    """Fit Chinchilla's parametric law by Huber regression in log space (Hoffmann et al. 2022, App. D.2).

    N: (n,) parameters, D: (n,) tokens, L: (n,) loss in nats. Minimises the sum over points of
    ``Huber_delta(LSE(a - alpha log N, b - beta log D, e) - log L)`` with L-BFGS-B and the analytic
    gradient, from the starts of ``grid`` (default `CHINCHILLA_GRID`, 4500 starts), keeping the best;
    A, B, E = exp(a), exp(b), exp(e).

    ``n_starts``: how many starts are optimised. All starts are first scored by their objective (one
    vectorised pass) and the ``n_starts`` best are run (None: every start). On Hoffmann et al.'s data the
    ten best-scored starts already reach the optimum that all 4500 reach, at 1/45 of the time.
    """
    N, D, L = (np.asarray(v, np.float64).reshape(-1) for v in (N, D, L))
    if not (len(N) == len(D) == len(L)):
        raise FitError(f"N, D and L must have the same length, got {len(N)}, {len(D)}, {len(L)}")
    if len(N) < MIN_CHINCHILLA_POINTS:
        raise FitError(f"the Chinchilla law needs at least {MIN_CHINCHILLA_POINTS} points, got {len(N)}")
    if np.any(N <= 0) or np.any(D <= 0) or np.any(L <= 0):
        raise FitError("N, D and L must be positive")
    logN, logD, logL = np.log(N), np.log(D), np.log(L)
    starts = _chinchilla_grid(CHINCHILLA_GRID if grid is None else grid)
    opts = dict(_LBFGS_OPTIONS, **(options or {}))

    def objective(p):
        a, b, e, alpha, beta = p
        t1 = a - alpha * logN
        t2 = b - beta * logD
        m = np.maximum(np.maximum(t1, t2), e)  # shift so the exponentials cannot overflow
        x1, x2, x3 = np.exp(t1 - m), np.exp(t2 - m), np.exp(e - m)
        s = x1 + x2 + x3
        h, c = huber(m + np.log(s) - logL, delta)
        g = c / s  # d objective / d lse, times 1/s for the softmax weights x_i / s
        g1, g2 = g * x1, g * x2
        grad = np.array([g1.sum(), g2.sum(), g @ x3, -(g1 @ logN), -(g2 @ logD)])
        return float(h.sum()), grad

    order = np.argsort(_chinchilla_batch_objective(starts, logN, logD, logL, delta), kind="stable")
    if n_starts is not None:
        order = order[: max(1, int(n_starts))]
    best = None
    for i in order:
        res = minimize(objective, starts[i], jac=True, method="L-BFGS-B", options=opts)
        if np.isfinite(res.fun) and (best is None or res.fun < best.fun):
            best = res
    if best is None:
        raise FitError("the Chinchilla fit failed from every start")
    a, b, e, alpha, beta = best.x
    # data that do not pin the law down (N and D moving together) can send a or b off to hundreds:
    # report such a coefficient as inf rather than fail
    with np.errstate(over="ignore"):
        E, A, B = (float(v) for v in np.exp([e, a, b]))
    return ChinchillaFit(E=E, A=A, B=B, alpha=float(alpha), beta=float(beta), objective=float(best.fun), n=len(N),
                         converged=bool(best.success))


def read_chinchilla_csv(path: str, n_drop: int = 5) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """Hoffmann et al.'s Figure 4 points as digitised by Besiroglu et al. 2024.

    Columns used: 'Model Size' (N), 'Training FLOP' (C), 'loss'; D = C / (6 N). Drops the ``n_drop``
    points with the fewest tokens per parameter (all at D/N < 0.41 in that file; they are also its five
    highest losses), as Besiroglu et al. did. Returns N, D, L, each (n,), and a dict describing the drop.
    """
    if not os.path.isfile(path):
        raise FitError(f"Chinchilla data file not found: {path}")
    N, C, L = [], [], []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"Model Size", "Training FLOP", "loss"} - set(reader.fieldnames or ())
        if missing:
            raise FitError(f"{path} lacks the column(s) {sorted(missing)}")
        for row in reader:
            N.append(float(row["Model Size"]))
            C.append(float(row["Training FLOP"]))
            L.append(float(row["loss"]))
    N, C, L = np.array(N), np.array(C), np.array(L)
    D = C / (6.0 * N)
    ratio = D / N
    order = np.argsort(ratio, kind="stable")
    drop, keep = order[:n_drop], np.sort(order[n_drop:])
    info = {"n_total": len(N), "n_dropped": len(drop),
            "max_dropped_ratio": float(ratio[drop].max()) if len(drop) else math.nan,
            "min_kept_ratio": float(ratio[keep].min()) if len(keep) else math.nan}
    return N[keep], D[keep], L[keep], info


# --------------------------------------------------------------------------------------------------
# Results of the ladder


def load_points(results_dir: str) -> list[dict]:
    """All records of ``results_dir/points*.jsonl``, one dict per (run_id, point).

    Files are read in name order, lines in file order; a later record with the same (run_id, point)
    replaces the earlier one (a rerun appends). A truncated last line (a run still writing) is skipped.
    """
    if not os.path.isdir(results_dir):
        raise FitError(f"results directory not found: {results_dir}")
    paths = sorted(glob.glob(os.path.join(results_dir, "points*.jsonl")))
    if not paths:
        raise FitError(f"no points*.jsonl files in {results_dir}")
    records = {}
    for path in paths:
        with open(path) as f:
            lines = f.read().split("\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                if i == len(lines) - 1:  # no trailing newline yet: the writer is mid-line
                    print(f"warning: skipping incomplete last line of {path}", file=sys.stderr)
                    continue
                raise FitError(f"{path}:{i + 1}: not valid JSON ({err.msg})") from None
            if not isinstance(rec, dict) or "run_id" not in rec or "point" not in rec:
                raise FitError(f"{path}:{i + 1}: a record needs 'run_id' and 'point'")
            key = (rec["run_id"], rec["point"])
            records.pop(key, None)  # re-insert so the order follows the last occurrence
            records[key] = rec
    if not records:
        raise FitError(f"the points*.jsonl files in {results_dir} hold no records")
    return list(records.values())


def select_arms(records: Sequence[dict], arms: str | None, baseline: str) -> list[dict]:
    """The records of the comma-separated ``arms`` plus the baseline's (all records when ``arms`` is
    empty or None); `FitError` naming any arm that has no points."""
    if not arms:
        return list(records)
    wanted = {a.strip() for a in arms.split(",") if a.strip()} | {baseline}
    present = {str(r.get("arm")) for r in records}
    missing = sorted(wanted - present)
    if missing:
        raise FitError(f"--arms: no points for {', '.join(missing)} (arms present: {', '.join(sorted(present))})")
    return [r for r in records if str(r.get("arm")) in wanted]


def size_label(rec: dict) -> str:
    """A record's size label ('128x4'), from d_model and n_layers when 'size' is missing."""
    return str(rec.get("size") or f"{rec.get('d_model')}x{rec.get('n_layers')}")


def lr_rule_of(rec: dict) -> str:
    """The rule a record's run was trained at: 'own' (its arm's fitted rule) or 'shared'."""
    return str(rec.get("lr_rule", "shared"))


def is_default_lr(rec: dict) -> bool:
    """Whether a record ran at the default learning rate (lr_mult 1)."""
    return math.isclose(float(rec.get("lr_mult", 1.0)), 1.0, rel_tol=1e-9)


def has_finite_loss(rec: dict, warn: bool = False) -> bool:
    """Whether a record's val_loss is a finite number (a diverged run logs nan or inf)."""
    ok = math.isfinite(float(rec.get("val_loss", math.nan)))
    if not ok and warn:
        print(f"warning: leaving out {rec.get('run_id')}/{rec.get('point')}: val_loss is {rec.get('val_loss')}",
              file=sys.stderr)
    return ok


def is_seed0(rec: dict) -> bool:
    """Whether a record is of seed 0, the seed every fit uses, and not a same-seed repeat (repeats
    only feed the noise estimate)."""
    return int(rec.get("seed", 0)) == 0 and int(rec.get("repeat", 0)) == 0


@dataclass
class ArmPoints:
    """One arm's points under one FLOP convention.

    Main points (one per size, ascending C): ``sizes`` (n,), ``C`` (n,) FLOPs, ``L`` (n,) nats.
    All seed-0, lr_mult-1 points (finals and branches, for Chinchilla and plots): ``C_all``, ``N_all``
    (= C / (6 D)), ``D_all`` tokens, ``L_all`` nats, ``final_all`` bool, each (m,).
    """

    arm: str
    sizes: list
    C: np.ndarray
    L: np.ndarray
    lr_rule: str = "shared"
    C_all: np.ndarray = field(default_factory=lambda: np.zeros(0))
    N_all: np.ndarray = field(default_factory=lambda: np.zeros(0))
    D_all: np.ndarray = field(default_factory=lambda: np.zeros(0))
    L_all: np.ndarray = field(default_factory=lambda: np.zeros(0))
    final_all: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))


RULE_SELECTIONS = ("best", "shared")


def arm_points(records: Sequence[dict], convention: str, rule: str = "best") -> dict[str, ArmPoints]:
    """Group records by arm into `ArmPoints` under ``convention`` ('6N' or 'full'); arms sorted by name.

    rule: 'best' takes an arm's own-rule points when it has any and its shared-rule points otherwise;
    'shared' takes shared-rule points only (an arm with none is left out)."""
    if rule not in RULE_SELECTIONS:
        raise ValueError(f"rule={rule!r}; expected one of {RULE_SELECTIONS}")
    key = CONVENTIONS[convention]
    arms = {}
    for arm in sorted({str(r["arm"]) for r in records if "arm" in r}):
        base = [r for r in records if r.get("arm") == arm and is_seed0(r) and is_default_lr(r)]
        by_rule = {x: [r for r in base if lr_rule_of(r) == x] for x in ("own", "shared")}
        used = "own" if rule == "best" and by_rule["own"] else "shared"
        base = by_rule[used]
        if not base and rule == "shared":
            continue
        for r in base:
            for k in (key, "val_loss", "tokens"):
                if r.get(k) is None:
                    raise FitError(f"record {r.get('run_id')}/{r.get('point')} has no {k!r}")
        base = [r for r in base if has_finite_loss(r, warn=convention == "6N")]
        main = {}
        for r in base:
            if r.get("is_final"):
                main[size_label(r)] = r  # a duplicate size keeps the record read last
        main = sorted(main.items(), key=lambda kv: float(kv[1][key]))
        C_all = np.array([float(r[key]) for r in base])
        D_all = np.array([float(r["tokens"]) for r in base])
        arms[arm] = ArmPoints(
            arm=arm,
            sizes=[s for s, _ in main],
            C=np.array([float(r[key]) for _, r in main]),
            L=np.array([float(r["val_loss"]) for _, r in main]),
            lr_rule=used,
            C_all=C_all,
            N_all=C_all / (6.0 * D_all),
            D_all=D_all,
            L_all=np.array([float(r["val_loss"]) for r in base]),
            final_all=np.array([bool(r.get("is_final")) for r in base], bool),
        )
    return arms


def lr_rules(records: Sequence[dict], convention: str = "6N") -> dict:
    """Per arm, the learning-rate rule fitted from its sweeps (`fit_lr_rule`), or why there is none.

    A size's sweep is its seed-0 final points at >= 3 distinct rates, each rate's loss the mean over its
    same-seed repeats (on a GPU they differ by about as much as neighbouring rates near the optimum);
    its compute is that of the run at the ladder's rule (every rate trains the same tokens). Arms with
    sweeps at < 2 sizes are reported as skipped."""
    key = CONVENTIONS[convention]
    out = {}
    for arm in sorted({str(r["arm"]) for r in records if "arm" in r}):
        finals = [r for r in records if r.get("arm") == arm and int(r.get("seed", 0)) == 0 and r.get("is_final")
                  and has_finite_loss(r) and r.get("lr") is not None]
        sweeps = {}
        for size in sorted({size_label(r) for r in finals}):
            by_lr = {}
            for r in finals:
                if size_label(r) == size:
                    by_lr.setdefault(float(r["lr"]), []).append(float(r["val_loss"]))
            if len(by_lr) >= 3:
                C = next(float(r[key]) for r in finals if size_label(r) == size)
                sweeps[C] = (list(by_lr), [float(np.mean(v)) for v in by_lr.values()])
        if len(sweeps) < 2:
            out[arm] = {"skipped": f"sweeps of >= 3 rates at {len(sweeps)} size(s); a rule needs 2"}
            continue
        fit = fit_lr_rule(sweeps)
        out[arm] = {"coef": fit.coef, "exp": fit.exp, "sizes": fit.sizes}
    return out


def usable_arms(arms: Mapping[str, ArmPoints], baseline: str,
                warn: bool = True) -> tuple[dict[str, ArmPoints], dict[str, str]]:
    """(the arms a fit can use, {arm left out: why}): an arm with fewer than 2 sizes of final seed-0,
    lr_mult-1 points (a ladder still running) is left out, with ``warn`` a line on stderr each. Raise
    `FitError` if the baseline is absent or would be left out."""
    if baseline not in arms:
        raise FitError(f"baseline arm {baseline!r} not found in the results (arms present: {sorted(arms) or 'none'})")
    short = {name: f"{len(a.C)} size(s) with a final seed-0, lr_mult-1 point; a power law needs at least 2"
             for name, a in arms.items() if len(a.C) < 2}
    if baseline in short:
        raise FitError(f"arm {baseline!r} has {short[baseline]}")
    for name, why in short.items() if warn else ():
        print(f"warning: arm {name!r} left out: {why}", file=sys.stderr)
    return {name: a for name, a in arms.items() if name not in short}, short


def estimate_sigma(records: Sequence[dict]) -> tuple[float | None, dict]:
    """Pooled std (ddof=1, nats) of final val_loss per (arm, size, rule) with >= 2 runs at lr_mult 1.

    A group's runs are its seeds and its same-seed repeats (the runner's 'repeats' job), so the
    estimate carries both the initialisation noise and the run-to-run noise of the device (on a GPU
    the same seed need not give the same loss). Returns (sigma or None when no group has two runs,
    {'n_groups', 'n_runs', 'n_repeat_runs', 'repeat_sigma'}); repeat_sigma is the pooled std over the
    same-seed repeats alone (None without any).
    """
    groups = {}
    for r in records:
        if r.get("is_final") and is_default_lr(r) and r.get("val_loss") is not None and has_finite_loss(r):
            key = (int(r.get("seed", 0)), int(r.get("repeat", 0)))
            groups.setdefault((r.get("arm"), size_label(r), lr_rule_of(r)), {})[key] = float(r["val_loss"])

    def pooled(value_lists):
        ss, dof = 0.0, 0
        for v in value_lists:
            if len(v) >= 2:
                v = np.asarray(v)
                ss += float(np.sum((v - v.mean()) ** 2))
                dof += len(v) - 1
        return (math.sqrt(ss / dof) if dof else None), dof

    multi = [g for g in groups.values() if len(g) >= 2]
    sigma, _ = pooled([list(g.values()) for g in multi])
    same_seed = [[x for (sd, _), x in g.items() if sd == seed] for g in groups.values() for seed in {k[0] for k in g}]
    repeat_sigma, _ = pooled(same_seed)
    info = {"n_groups": len(multi), "n_runs": sum(len(g) for g in multi),
            "n_repeat_runs": sum(1 for g in groups.values() for (_, rep) in g if rep > 0), "repeat_sigma": repeat_sigma}
    return sigma, info


def resolve_sigma(records: Sequence[dict], sigma: float = 0.0, default_sigma: float = DEFAULT_SIGMA) -> dict:
    """The bootstrap's loss noise (nats) and where it came from: {'value', 'source', ...}.

    sigma > 0 is taken as given; otherwise the seed-repeat estimate (`estimate_sigma`), otherwise
    ``default_sigma``.
    """
    if sigma and sigma > 0:
        return {"value": float(sigma), "source": "given (--sigma)"}
    est, info = estimate_sigma(records)
    if est is None:
        return {"value": float(default_sigma),
                "source": f"default {default_sigma:g} nats: no size was run with more than one seed", **info}
    return {"value": est, "source": f"pooled std of final val_loss over seeds and same-seed repeats: "
                                   f"{info['n_groups']} (arm, size, rule) groups, {info['n_runs']} runs "
                                   f"({info['n_repeat_runs']} repeats)", **info}


# --------------------------------------------------------------------------------------------------
# Report


def common_reach(C_base, C_new) -> float:
    """C_max of a comparison: the largest compute both arms were measured at (the smaller of their
    largest C), so that neither arm's law is read beyond its own points there."""
    return float(min(np.max(C_base), np.max(C_new)))


def _compare(a_b: ArmPoints, a_n: ArmPoints, baseline: str, sigma: float, n_boot: int, n_boot_E: int,
             seed: int) -> dict:
    """Every multiplier estimate of arm ``a_n`` over ``a_b``, JSON-ready."""
    C_max = common_reach(a_b.C, a_n.C)
    C_eval = np.append(a_n.C, C_max)
    # Which learning-rate rule each side's points ran at: a comparison across rules is flagged.
    out = {"lr_rules": {"arm": a_n.lr_rule, "baseline": a_b.lr_rule}}

    shared = fit_shared_exponent({baseline: (a_b.C, a_b.L), a_n.arm: (a_n.C, a_n.L)})
    out["shared_alpha"] = {
        "alpha": shared.alpha, "A": shared.A, "M": shared_multiplier(shared, baseline, a_n.arm),
        "sse_shared": shared.sse_shared, "sse_separate": shared.sse_separate,
        "f_test_p": shared_exponent_pvalue(shared.sse_shared, shared.sse_separate, len(a_b.C) + len(a_n.C), 2),
    }
    forms = [("power_law", False, n_boot)]
    if len(a_b.C) >= 3 and len(a_n.C) >= 3:
        forms.append(("power_law_E", True, n_boot_E))
    for name, with_E, reps in forms:
        boot = bootstrap_multiplier(a_b.C, a_b.L, a_n.C, a_n.L, sigma, C_eval=C_eval, n_boot=reps, with_E=with_E,
                                    seed=seed)
        rows = [{"size": s, "C": float(c), "M": float(m), "lo": float(lo), "hi": float(hi), "excludes_1": bool(x)}
                for s, c, m, lo, hi, x in zip(a_n.sizes + ["C_max"], boot.C, boot.M, boot.lo, boot.hi,
                                              boot.excludes_1)]
        loso = leave_one_size_out(a_b.C, a_b.L, a_b.sizes, a_n.C, a_n.L, a_n.sizes, C_eval=C_max, with_E=with_E)
        out[name] = {"at_measured_C": rows[:-1], "at_C_max": rows[-1], "n_boot": reps,
                     "loso": {"C": loso.C, "by_size": loso.by_size, "min": loso.min, "max": loso.max}}
    if len(forms) == 1:
        out["power_law_E"] = {"skipped": "the fit with E needs at least 3 sizes in both arms"}
    return out


@_single_blas_thread
def build_report(records: Sequence[dict], baseline: str = "k2", n_boot: int = 1000, seed: int = 0,
                 sigma: float = 0.0, default_sigma: float = DEFAULT_SIGMA, n_boot_E: int | None = None,
                 chinchilla_starts: int | None = 100) -> dict:
    """All fits and comparisons for ``records`` (from `load_points`), JSON-ready (nan -> None later).

    sigma: loss noise of the bootstrap in nats; 0 estimates it from seed repeats (`estimate_sigma`),
    falling back to ``default_sigma``. n_boot_E: replicates for the law with E, whose every replicate
    re-runs the grid of starts (default: min(n_boot, 200)).
    """
    n_boot_E = min(n_boot, 200) if n_boot_E is None else n_boot_E
    sigma_info = resolve_sigma(records, sigma, default_sigma)
    report = {"baseline": baseline, "arms": [], "n_records": len(records), "sigma_L": sigma_info,
              "n_boot": n_boot, "n_boot_E": n_boot_E, "seed": seed, "conventions": {}}
    for conv in CONVENTIONS:
        arms, left_out = usable_arms(arm_points(records, conv), baseline, warn=not report["conventions"])
        report["arms"] = list(arms)  # the same under both conventions
        report["arms_left_out"] = left_out
        fits = {}
        for name, a in arms.items():
            pl = fit_power_law(a.C, a.L)
            entry = {"lr_rule": a.lr_rule, "n_main": len(a.C), "n_all": len(a.C_all), "sizes": a.sizes, "C": a.C.tolist(),
                     "L": a.L.tolist(), "power_law": {"A": pl.A, "alpha": pl.alpha, "sse": pl.sse}}
            if len(a.C) >= 3:
                pe = fit_power_law(a.C, a.L, with_E=True)
                entry["power_law_E"] = {"E": pe.E, "A": pe.A, "alpha": pe.alpha, "objective": pe.objective,
                                        "sse": pe.sse}
            else:
                entry["power_law_E"] = {"skipped": f"{len(a.C)} sizes; the fit with E needs at least 3"}
            if len(a.C_all) >= MIN_CHINCHILLA_POINTS:
                entry["chinchilla"] = fit_chinchilla(a.N_all, a.D_all, a.L_all, n_starts=chinchilla_starts).as_dict()
            else:
                entry["chinchilla"] = {"skipped": f"{len(a.C_all)} points; needs at least {MIN_CHINCHILLA_POINTS}"}
            fits[name] = entry
        shared_pts = arm_points(records, conv, rule="shared")
        comparisons = {name: _compare(baseline_at_rule(arms[baseline], shared_pts.get(baseline), a.lr_rule), a,
                                      baseline, sigma_info["value"], n_boot, n_boot_E, seed)
                       for name, a in arms.items() if name != baseline}
        report["conventions"][conv] = {"fits": fits, "comparisons": comparisons, "lr_rules": lr_rules(records, conv)}
        if any(a.lr_rule == "own" for a in arms.values()):
            report["conventions"][conv]["comparisons_shared_rule"] = _shared_rule_comparisons(
                shared_pts, baseline, list(arms), sigma_info["value"], n_boot, n_boot_E, seed)
    return report


def baseline_at_rule(best: ArmPoints, shared: ArmPoints | None, rule: str) -> ArmPoints:
    """The baseline's points to compare an arm trained at ``rule`` with: an arm with no rule of its own
    (a mechanism arm at the shared rule) meets the baseline's shared-rule points when those span 2
    sizes, so that its multiplier is not the two rules' difference; otherwise the baseline's best."""
    if rule == "shared" and best.lr_rule != "shared" and shared is not None and len(shared.C) >= 2:
        return shared
    return best


def _shared_rule_comparisons(arms, baseline, names, sigma, n_boot, n_boot_E, seed) -> dict:
    """`_compare` of each arm of ``names`` with the baseline on shared-rule points only (``arms``: the
    `arm_points` of rule 'shared'); an arm with fewer than 2 such sizes gets {'skipped': why}, and so
    does the whole when the baseline has."""
    size_count = lambda name: len(arms[name].C) if name in arms else 0
    if size_count(baseline) < 2:
        return {"skipped": f"the baseline {baseline!r} has {size_count(baseline)} shared-rule size(s); needs 2"}
    return {name: (_compare(arms[baseline], arms[name], baseline, sigma, n_boot, n_boot_E, seed)
                   if size_count(name) >= 2 else {"skipped": f"{size_count(name)} shared-rule size(s); needs 2"})
            for name in names if name != baseline}


def lr_rules_setting(rules: Mapping[str, dict]) -> str:
    """The runner's ``lr_rules`` value ('arm=coef:exp;...') of the fitted rules of `lr_rules`."""
    return ";".join(f"{arm}={r['coef']:.6g}:{r['exp']:.6g}" for arm, r in rules.items() if "skipped" not in r)


def _jsonable(x):
    """numpy scalars/arrays -> Python; nan/inf -> None (strict JSON has neither)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.bool_, bool)):
        return bool(x)
    if isinstance(x, (np.integer, int)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(x) else None
    return x


def _g(x, digits=4) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}g}"


def format_report(report: dict) -> str:
    """Markdown tables of a `build_report` result."""
    b = report["baseline"]
    s = report["sigma_L"]
    lines = [f"# Ladder fits (baseline {b})", "",
             f"{report['n_records']} records; sigma_L = {s['value']:.4g} nats ({s['source']}); "
             f"bootstrap {report['n_boot']} replicates ({report['n_boot_E']} for the law with E), 5-95%.", ""]
    lines += [f"Left out: {arm} ({why})." for arm, why in report.get("arms_left_out", {}).items()]
    lines += [""] if report.get("arms_left_out") else []
    for conv, body in report["conventions"].items():
        lines += [f"## Convention {conv} (C = {CONVENTIONS[conv]})", "",
                  "| arm | lr rule | main pts | all pts | C range | A | alpha | SSE(log) | E-fit: E | A | alpha |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for arm, f in body["fits"].items():
            pe = f["power_law_E"]
            e_cols = (["skipped", "", ""] if "skipped" in pe else [_g(pe["E"]), _g(pe["A"]), _g(pe["alpha"])])
            pl = f["power_law"]
            lines.append(f"| {arm} | {f.get('lr_rule', 'shared')} | {f['n_main']} | {f['n_all']} | {min(f['C']):.2e}..{max(f['C']):.2e} | "
                         f"{_g(pl['A'])} | {_g(pl['alpha'])} | {_g(pl['sse'], 3)} | " + " | ".join(e_cols) + " |")
        lines += ["", "Chinchilla L(N, D) = E + A/N^alpha + B/D^beta (N = C/(6D)), all seed-0 points:", "",
                  "| arm | n | E | A | B | alpha | beta | objective |", "|---|---|---|---|---|---|---|---|"]
        for arm, f in body["fits"].items():
            c = f["chinchilla"]
            if "skipped" in c:
                lines.append(f"| {arm} | skipped: {c['skipped']} | | | | | | |")
            else:
                lines.append(f"| {arm} | {c['n']} | {_g(c['E'])} | {_g(c['A'])} | {_g(c['B'])} | {_g(c['alpha'])} | "
                             f"{_g(c['beta'])} | {_g(c['objective'], 3)} |")
        for arm, cmp in body["comparisons"].items():
            sh = cmp["shared_alpha"]
            rules = cmp.get("lr_rules", {})
            mixed = rules.get("arm", "shared") != rules.get("baseline", "shared")
            lines += ["", f"### {arm} vs {b} ({conv})", ""]
            if mixed:
                at = {"own": "its own rule", "shared": "the shared rule"}
                lines += [f"Learning-rate rules differ: {arm} at {at[rules['arm']]}, {b} at {at[rules['baseline']]}.",
                          ""]
            lines += [f"Shared alpha = {_g(sh['alpha'])}: M = {_g(sh['M'])} at every C; SSE(log) shared "
                      f"{_g(sh['sse_shared'], 3)} vs separate {_g(sh['sse_separate'], 3)} "
                      f"(F-test p = {_g(sh['f_test_p'], 3)}).", ""]
            for form, title in (("power_law", "L = A C^-alpha"), ("power_law_E", "L = E + A C^-alpha")):
                body_f = cmp[form]
                if "skipped" in body_f:
                    lines += [f"{title}: skipped ({body_f['skipped']}).", ""]
                    continue
                lines += [f"{title}:", "", "| size | C | M | 5% | 95% | excludes 1 |", "|---|---|---|---|---|---|"]
                for r in body_f["at_measured_C"] + [body_f["at_C_max"]]:
                    lines.append(f"| {r['size']} | {r['C']:.3e} | {_g(r['M'])} | {_g(r['lo'])} | {_g(r['hi'])} | "
                                 f"{'yes' if r['excludes_1'] else 'no'} |")
                lo = body_f["loso"]
                lines += ["", f"Leave one size out, M at C_max = {lo['C']:.3e}: {_g(lo['min'])} .. {_g(lo['max'])} ("
                          + ", ".join(f"-{k}: {_g(v)}" for k, v in lo["by_size"].items()) + ")", ""]
        rules = body.get("lr_rules", {})
        if any("skipped" not in r for r in rules.values()):
            lines += ["Learning-rate optimum per arm, lr*(C) = coef C^exp (from each size's sweep):", "",
                      "| arm | coef | exp | optima (C: lr*, bracketed) |", "|---|---|---|---|"]
            for arm, r in rules.items():
                if "skipped" in r:
                    lines.append(f"| {arm} | | | skipped: {r['skipped']} |")
                    continue
                opts = "; ".join(f"{o['C']:.2e}: {o['lr_opt']:.3g}{'' if o['bracketed'] else ' (outside)'}"
                                 for o in r["sizes"])
                lines.append(f"| {arm} | {_g(r['coef'])} | {_g(r['exp'])} | {opts} |")
            lines += ["", f"As the runner's setting: `lr_rules = \"{lr_rules_setting(rules)}\"`", ""]
        shared = body.get("comparisons_shared_rule")
        if shared is not None:
            lines += ["At the shared learning-rate rule (every arm's shared-rule points; the tables above use each "
                      "arm's own rule where it has one):", ""]
            if "skipped" in shared:
                lines += [f"skipped ({shared['skipped']}).", ""]
            else:
                lines += ["| arm | shared-alpha M | M at C_max (L = A C^-alpha) | 5% | 95% |", "|---|---|---|---|---|"]
                for arm, cmp in shared.items():
                    if "skipped" in cmp:
                        lines.append(f"| {arm} | skipped: {cmp['skipped']} | | | |")
                        continue
                    r = cmp["power_law"]["at_C_max"]
                    lines.append(f"| {arm} | {_g(cmp['shared_alpha']['M'])} | {_g(r['M'])} | {_g(r['lo'])} | "
                                 f"{_g(r['hi'])} |")
                lines.append("")
        lines.append("")
    return "\n".join(lines)


def chinchilla_refit_text(path: str, n_starts: int | None = 100) -> str:
    """Refit of Hoffmann et al.'s Figure 4 data next to Besiroglu et al. 2024's published values."""
    N, D, L, info = read_chinchilla_csv(path)
    fit = fit_chinchilla(N, D, L, n_starts=n_starts)
    n_grid = len(_chinchilla_grid(CHINCHILLA_GRID))
    pub = BESIROGLU_2024
    lines = [f"Chinchilla Approach 3 refit of {path}",
             f"{info['n_total']} points, dropped the {info['n_dropped']} with the fewest tokens per parameter "
             f"(D/N <= {info['max_dropped_ratio']:.3f}; smallest kept {info['min_kept_ratio']:.3f}), fitted {fit.n}; "
             f"Huber delta {HUBER_DELTA:g} summed, L-BFGS-B from "
             + (f"the best {n_starts} of {n_grid}" if n_starts else f"all {n_grid}") + " grid starts",
             "", "| param | this fit | Besiroglu et al. 2024 | rel. diff |", "|---|---|---|---|"]
    for k in ("E", "A", "B", "alpha", "beta"):
        v = getattr(fit, k)
        lines.append(f"| {k} | {v:.6g} | {pub[k]:.6g} | {(v - pub[k]) / pub[k]:+.2%} |")
    obj_pub = float(np.sum(huber(np.log(ChinchillaFit(n=0, objective=0, **pub).predict(N, D)) - np.log(L))[0]))
    lines += ["", f"objective (summed Huber): this fit {fit.objective:.7g}, at the published values {obj_pub:.7g}"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit code (2 on bad input, with a message on stderr)."""
    p = argparse.ArgumentParser(prog="python -m experiments.fit", description=__doc__.split("\n")[0])
    p.add_argument("--results", help="directory holding points*.jsonl")
    p.add_argument("--baseline", default="k2", help="arm every other arm is compared with")
    p.add_argument("--arms", default="", help="comma-separated arms to fit with the baseline (default: all)")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap replicates (pure power law)")
    p.add_argument("--bootstrap_e", type=int, default=None,
                   help="bootstrap replicates for the law with E (default min(--bootstrap, 200))")
    p.add_argument("--seed", type=int, default=0, help="seed of the bootstrap noise")
    p.add_argument("--sigma", type=float, default=0.0, help="loss noise in nats; 0 = estimate from seed repeats")
    p.add_argument("--json", default=None, help="JSON report path (default RESULTS/fit.json)")
    p.add_argument("--chinchilla", default=None, help="CSV of Hoffmann et al.'s Figure 4 points: refit it and exit")
    p.add_argument("--starts", type=int, default=100, help="Chinchilla grid starts optimised (0 = all 4500)")
    args = p.parse_args(argv)
    try:
        if args.chinchilla:
            print(chinchilla_refit_text(args.chinchilla, n_starts=args.starts or None))
            return 0
        if not args.results:
            raise FitError("--results=DIR (or --chinchilla=CSV) is required")
        if args.bootstrap < 1:
            raise FitError("--bootstrap must be at least 1")
        records = select_arms(load_points(args.results), args.arms, args.baseline)
        report = build_report(records, baseline=args.baseline, n_boot=args.bootstrap, seed=args.seed,
                              sigma=args.sigma, n_boot_E=args.bootstrap_e, chinchilla_starts=args.starts or None)
        print(format_report(report))
        path = args.json or os.path.join(args.results, "fit.json")
        try:
            with open(path, "w") as f:
                json.dump(_jsonable(report), f, indent=1)
        except OSError as err:
            raise FitError(f"cannot write the JSON report {path}: {err.strerror}") from None
        print(f"wrote {path}")
    except FitError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
