"""Scaling-law fits (experiments.fit) and figures (experiments.plot): recovery of known laws, the
Besiroglu et al. refit of Chinchilla's data, compute multipliers and their bootstrap, and both CLIs."""

import json
import math
import os

import numpy as np
import pytest

from experiments import fit as F
from experiments import plot as P

DATA = os.path.join(os.path.dirname(__file__), "data", "chinchilla_fig4_points.csv")


def _rel(x, ref):
    return abs(x - ref) / abs(ref)


# ---------------------------------------------------------------------------------------- power laws


def test_power_law_recovers_A_alpha():
    rng = np.random.default_rng(1)
    C = np.geomspace(1e15, 1e19, 12)
    L = 80.0 * C ** -0.09 * np.exp(rng.normal(0, 0.002, C.size))
    fit = F.fit_power_law(C, L)
    assert fit.E == 0 and fit.n == 12
    assert _rel(fit.alpha, 0.09) < 0.02
    assert _rel(fit.A, 80.0) < 0.2
    assert fit.sse == pytest.approx(fit.objective) and fit.sse < 12 * 0.002 ** 2 * 3
    assert np.allclose(fit.predict(C), fit.A * C ** -fit.alpha, rtol=1e-12)


def test_power_law_with_E_recovers_law():
    rng = np.random.default_rng(2)
    C = np.geomspace(1e15, 1e21, 40)
    E, A, alpha = 2.0, 1000.0, 0.15
    L = (E + A * C ** -alpha) * np.exp(rng.normal(0, 1e-3, C.size))
    fit = F.fit_power_law(C, L, with_E=True)
    assert _rel(fit.E, E) < 0.03
    assert _rel(fit.alpha, alpha) < 0.05
    assert _rel(fit.A, A) < 0.3
    # the E-less law cannot bend: it fits these data clearly worse
    assert F.fit_power_law(C, L).sse > 20 * fit.sse


def test_power_law_with_E_on_pure_law_finds_small_E():
    C = np.geomspace(1e14, 1e18, 8)
    L = 60.0 * C ** -0.08
    fit = F.fit_power_law(C, L, with_E=True)
    assert fit.E < 0.05 * L.min()
    assert np.allclose(fit.predict(C), L, rtol=2e-3)


def test_power_law_with_E_few_starts_match_all_starts():
    rng = np.random.default_rng(10)
    for E, A, alpha in ((2.5, 300.0, 0.2), (1.0, 40.0, 0.06), (3.0, 2e4, 0.35)):
        C = np.geomspace(1e14, 1e17, 5)
        L = (E + A * C ** -alpha) * np.exp(rng.normal(0, 0.004, 5))
        few, every = F.fit_power_law(C, L, with_E=True), F.fit_power_law(C, L, with_E=True, n_starts=None)
        assert few.objective <= every.objective * (1 + 1e-6) + 1e-15


def test_power_law_rejects_too_few_points():
    with pytest.raises(F.FitError, match="at least 2"):
        F.fit_power_law([1e15], [3.0])
    with pytest.raises(F.FitError, match="at least 3"):
        F.fit_power_law([1e15, 1e16], [3.0, 2.8], with_E=True)


def test_shared_exponent_recovers_common_alpha():
    rng = np.random.default_rng(3)
    alpha = 0.07
    arms = {}
    for k, A in enumerate((50.0, 40.0, 30.0)):
        C = np.geomspace(1e15, 1e18, 6) * (1.0 + 0.3 * k)
        arms[f"arm{k}"] = (C, A * C ** -alpha * np.exp(rng.normal(0, 0.002, C.size)))
    shared = F.fit_shared_exponent(arms)
    alpha_hat, A_hat, sse_shared, sse_separate = shared
    assert _rel(alpha_hat, alpha) < 0.02
    assert _rel(A_hat["arm0"] / A_hat["arm2"], 50.0 / 30.0) < 0.02
    assert sse_separate <= sse_shared
    # a common exponent is true here, so the F-test must not reject it at 1%
    assert F.shared_exponent_pvalue(sse_shared, sse_separate, 18, 3) > 0.01

    # a second arm with a very different slope is rejected
    C = np.geomspace(1e15, 1e18, 6)
    bent = {"a": (C, 50.0 * C ** -0.07 * np.exp(rng.normal(0, 0.002, 6))),
            "b": (C, 900.0 * C ** -0.14 * np.exp(rng.normal(0, 0.002, 6)))}
    s = F.fit_shared_exponent(bent)
    assert F.shared_exponent_pvalue(s.sse_shared, s.sse_separate, 12, 2) < 1e-6


# ---------------------------------------------------------------------------------------- Chinchilla


def test_chinchilla_recovers_synthetic_law():
    rng = np.random.default_rng(4)
    N, D = (g.ravel() for g in np.meshgrid(np.geomspace(1e7, 1e10, 8), np.geomspace(1e8, 1e11, 8)))
    truth = F.ChinchillaFit(E=1.7, A=400.0, B=1100.0, alpha=0.34, beta=0.28, objective=0.0, n=64)
    L = truth.predict(N, D) * np.exp(rng.normal(0, 5e-4, N.size))
    fit = F.fit_chinchilla(N, D, L, n_starts=30)
    assert fit.n == 64
    assert _rel(fit.E, 1.7) < 0.01
    assert _rel(fit.alpha, 0.34) < 0.03
    assert _rel(fit.beta, 0.28) < 0.03
    assert _rel(fit.A, 400.0) < 0.2
    assert _rel(fit.B, 1100.0) < 0.2
    assert np.allclose(fit.predict(N, D), truth.predict(N, D), rtol=2e-3)


def test_chinchilla_reproduces_besiroglu_refit():
    N, D, L, info = F.read_chinchilla_csv(DATA)
    assert len(L) == 240 and info["n_dropped"] == 5 and info["max_dropped_ratio"] < 0.41
    fit = F.fit_chinchilla(N, D, L)
    pub = F.BESIROGLU_2024
    for k in ("E", "alpha", "beta"):
        assert _rel(getattr(fit, k), pub[k]) < 0.01, (k, getattr(fit, k))
    for k in ("A", "B"):
        assert _rel(getattr(fit, k), pub[k]) < 0.05, (k, getattr(fit, k))
    # the optimum is at least as good as the published (rounded) parameters
    at_pub = np.sum(F.huber(np.log(F.ChinchillaFit(objective=0.0, n=0, **pub).predict(N, D)) - np.log(L))[0])
    assert fit.objective <= at_pub


def test_chinchilla_grid_search_keeps_best_start():
    # a start near the truth inside a deliberately bad grid: only it reaches the optimum
    rng = np.random.default_rng(5)
    N, D = (g.ravel() for g in np.meshgrid(np.geomspace(1e7, 1e10, 6), np.geomspace(1e8, 1e11, 6)))
    L = F.ChinchillaFit(E=1.7, A=400.0, B=1100.0, alpha=0.34, beta=0.28, objective=0, n=0).predict(N, D)
    L = L * np.exp(rng.normal(0, 5e-4, N.size))
    grid = {"alpha": (0.35, 3.0), "beta": (0.3, 3.0), "e": (0.5,), "a": (6.0, 40.0), "b": (7.0, 40.0)}
    fit = F.fit_chinchilla(N, D, L, grid=grid, n_starts=None)
    assert _rel(fit.E, 1.7) < 0.02


# ---------------------------------------------------------------------------------------- multipliers


def test_multiplier_closed_form_and_E_forms():
    C = np.geomspace(1e15, 1e20, 7)
    b = F.PowerLawFit(A=80.0, alpha=0.09)
    n = F.PowerLawFit(A=60.0, alpha=0.11)
    closed = (b.A / n.A) ** (1 / b.alpha) * C ** (n.alpha / b.alpha - 1)
    assert np.allclose(F.multiplier(b, n, C), closed, rtol=1e-10)
    assert np.allclose(F.multiplier(b, b, C), 1.0, rtol=1e-12)
    # the baseline reaches the new arm's loss at C_b: check by evaluating the baseline there
    assert np.allclose(b.predict(C * F.multiplier(b, n, C)), n.predict(C), rtol=1e-10)

    bE = F.PowerLawFit(A=500.0, alpha=0.2, E=1.8)
    twice = F.PowerLawFit(A=500.0 * 2 ** -0.2, alpha=0.2, E=1.8)  # L_new(C) = L_b(2C)
    assert np.allclose(F.multiplier(bE, twice, C), 2.0, rtol=1e-9)
    below = F.PowerLawFit(A=1.0, alpha=0.2, E=1.0)  # its loss falls below the baseline's E
    M = F.multiplier(bE, below, C)
    assert np.all(np.isnan(M[below.predict(C) <= bE.E]))


def _arm(C, A=70.0, alpha=0.1, noise=None):
    L = A * C ** -alpha
    return L if noise is None else L * noise


def test_bootstrap_self_comparison_is_one():
    rng = np.random.default_rng(6)
    C = np.geomspace(1e15, 1e18, 5)
    L = _arm(C, noise=np.exp(rng.normal(0, 0.002, 5)))
    boot = F.bootstrap_multiplier(C, L, C, L, sigma=0.005, n_boot=400, seed=0)
    assert np.allclose(boot.M, 1.0, rtol=1e-10)
    assert np.all(boot.lo < 1.0) and np.all(boot.hi > 1.0)
    assert not boot.excludes_1.any()
    assert boot.samples.shape == (400, 5) and np.all(boot.n_valid == 400)


def test_bootstrap_two_times_cheaper_arm():
    rng = np.random.default_rng(7)
    C = np.geomspace(1e15, 1e18, 5)
    L = _arm(C, noise=np.exp(rng.normal(0, 0.002, 5)))
    # the new arm measures the baseline's losses at half the compute: L_new(C) = L_base(2C), same noise
    C_new = C / 2
    C_eval = np.append(C_new, 3e18)
    boot = F.bootstrap_multiplier(C, L, C_new, L, sigma=0.002, C_eval=C_eval, n_boot=400, seed=1)
    assert np.allclose(boot.M, 2.0, rtol=1e-8)
    assert np.all(boot.lo < 2.0) and np.all(boot.hi > 2.0)
    assert boot.excludes_1.all() and np.all(boot.lo > 1.0)
    # the spread comes from the noise: ten times the noise widens the interval
    wide = F.bootstrap_multiplier(C, L, C_new, L, sigma=0.02, C_eval=C_eval, n_boot=400, seed=1)
    assert np.all(wide.hi - wide.lo > 3 * (boot.hi - boot.lo))


def test_bootstrap_with_E_refits_every_replicate():
    rng = np.random.default_rng(8)
    C = np.geomspace(1e15, 1e19, 6)
    law = F.PowerLawFit(A=400.0, alpha=0.12, E=1.5)
    L = law.predict(C) * np.exp(rng.normal(0, 5e-4, 6))
    boot = F.bootstrap_multiplier(C, L, C / 2, L, sigma=1e-3, n_boot=40, with_E=True, seed=2)
    assert np.allclose(boot.M, 2.0, rtol=1e-6)
    assert boot.samples.shape == (40, 6)
    assert np.all(np.nanstd(boot.samples, axis=0) > 0)  # replicates differ: each was refitted
    assert np.all(boot.n_valid > 30)
    inside = (boot.lo < 2.0) & (boot.hi > 2.0)
    assert inside.sum() >= 5


def test_multiplier_with_different_exponents_follows_closed_form():
    C = np.geomspace(1e15, 1e18, 6)
    L_base, L_new = _arm(C, A=70.0, alpha=0.10), _arm(C, A=90.0, alpha=0.12)
    b, n = F.fit_power_law(C, L_base), F.fit_power_law(C, L_new)
    Cq = np.geomspace(1e14, 1e20, 9)
    closed = (70.0 / 90.0) ** (1 / 0.10) * Cq ** (0.12 / 0.10 - 1)
    assert np.allclose(F.multiplier(b, n, Cq), closed, rtol=1e-8)
    boot = F.bootstrap_multiplier(C, L_base, C, L_new, sigma=0.003, C_eval=Cq, n_boot=300)
    assert np.allclose(boot.M, closed, rtol=1e-8)
    assert np.all((boot.lo < closed) & (boot.hi > closed))


def test_leave_one_size_out():
    C = np.geomspace(1e15, 1e18, 5)
    sizes = ["s1", "s2", "s3", "s4", "s5"]
    L_base, L_new = _arm(C), _arm(2 * C)
    loso = F.leave_one_size_out(C, L_base, sizes, C, L_new, sizes)
    assert set(loso.by_size) == set(sizes) and loso.C == C.max()
    assert loso.min == pytest.approx(2.0, rel=1e-8) and loso.max == pytest.approx(2.0, rel=1e-8)
    # one bad point in the new arm: only leaving its size out recovers M = 2
    L_bad = L_new.copy()
    L_bad[-1] *= 1.03
    loso = F.leave_one_size_out(C, L_base, sizes, C, L_bad, sizes)
    assert loso.by_size["s5"] == pytest.approx(2.0, rel=1e-8)
    # with the too-high last loss in, the new arm looks worse at C_max: every other drop gives M < 2
    assert all(m < 2.0 - 1e-3 for s, m in loso.by_size.items() if s != "s5")
    assert loso.max == pytest.approx(2.0, rel=1e-8) and loso.min == min(loso.by_size.values())


# ---------------------------------------------------------------------------------------- end to end

SIZES = [("128x4", 128, 4, 1.0e6), ("160x8", 160, 8, 2.0e6), ("224x8", 224, 8, 4.0e6), ("288x12", 288, 12, 8.0e6)]
FULL_FACTOR = {"k2": 1.2, "k3": 1.1, "k2+attn_res": 1.2}  # flops_full / flops_6N per arm
LAW_A, LAW_ALPHA = 100.0, 0.1  # baseline loss = A (C_6N)^-alpha; k3 reaches it with half the compute
SEED_OFFSETS = {("k2", 1): 0.01, ("k2", 2): -0.01, ("k3", 1): 0.02}  # on size 160x8
POOLED_SIGMA = math.sqrt((2e-4 + 2e-4) / 3)  # k2: 3 seeds, sample var 1e-4; k3: 2 seeds, var 2e-4


def _record(arm, size, d_model, n_layers, N, point, seed=0, lr_mult=1.0, noise=1.0, loss=None):
    frac = 1.0 if point == "final" else float(point.split("_")[1])
    tokens = 20 * N * frac
    c6 = 6 * N * tokens
    c_law = c6 * (2.0 if arm == "k3" else 1.0)
    val = LAW_A * c_law ** -LAW_ALPHA * noise if loss is None else loss
    val += SEED_OFFSETS.get((arm, seed), 0.0) if size == "160x8" else 0.0
    if not math.isclose(lr_mult, 1.0):
        val += 0.05 * math.log(lr_mult) ** 2
    run_id = f"{arm}-{size}-s{seed}-lr{lr_mult:g}"
    return {"arm": arm, "size": size, "d_model": d_model, "n_layers": n_layers, "seed": seed, "lr_mult": lr_mult,
            "run_id": run_id, "point": point, "is_final": point == "final", "tokens": tokens,
            "params_non_embedding_active": N, "params_active": 1.3 * N, "params_total": 3 * N, "flops_6N": c6,
            "flops_full": FULL_FACTOR[arm] * c6, "val_loss": val, "val_bits_per_byte": val / 2.8,
            "train_loss": val + 0.01, "wall_s": 10.0, "config_hash": "abc", "device": "cpu"}


def _write_results(path, arms=("k2", "k3"), sizes=SIZES, branches=True, seeds=True, lr_sweep=True):
    noise = np.exp(np.random.default_rng(9).normal(0, 0.002, len(sizes)))
    main, extra = [], []
    for arm in arms:
        for i, (size, d, nl, N) in enumerate(sizes):
            # k3 sizes have half the compute (C = 120 N^2) and the same losses, noise included: the
            # baseline's points moved to C/2, so every fitted multiplier is exactly 2 (6N convention)
            N = N / math.sqrt(2) if arm == "k3" else N
            if i == 0:  # a stale record of the same (run_id, point), superseded by the one after it
                main.append(_record(arm, size, d, nl, N, "final", loss=9.9))
            if branches:
                main.append(_record(arm, size, d, nl, N, "branch_0.5", noise=noise[i]))
            main.append(_record(arm, size, d, nl, N, "final", noise=noise[i]))
            if seeds and size == "160x8":
                for seed in (1, 2) if arm == "k2" else (1,):
                    main.append(_record(arm, size, d, nl, N, "final", seed=seed, noise=noise[i]))
            if lr_sweep and size == "160x8":
                for lr in (0.5, 2.0):
                    extra.append(_record(arm, size, d, nl, N, "final", lr_mult=lr, noise=noise[i]))
                if arm == "k2":  # a diverged run: the figures and fits must leave it out
                    extra.append(_record(arm, size, d, nl, N, "final", lr_mult=8.0, loss=math.nan))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "points.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in main)
    if extra:
        with open(os.path.join(path, "points_lr.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in extra)
    return path


def test_an_arm_with_no_rule_of_its_own_meets_the_baseline_at_the_shared_rule(tmp_path):
    """k2 has own-rule points at a third of its shared-rule compute; a mechanism arm trained at the
    shared rule only (a multiplier of 2 planted over k2's shared-rule points) must be compared with
    k2's shared-rule points, not its own-rule ones (which would give 2/3)."""
    recs = F.load_points(_write_results(str(tmp_path / "res"), sizes=SIZES[:3], branches=False, lr_sweep=False))
    for r in [r for r in recs if F.is_seed0(r) and r["is_final"]]:
        if r["arm"] == "k2":
            recs.append(dict(r, run_id=r["run_id"] + "-own", lr_rule="own",
                             val_loss=LAW_A * (3.0 * r["flops_6N"]) ** -LAW_ALPHA))
        else:  # k3's points become the mechanism arm's, trained at the shared rule
            r["arm"], r["flops_full"] = "k2+attn_res", FULL_FACTOR["k2+attn_res"] * r["flops_6N"]
    recs = [r for r in recs if r["arm"] != "k3"]
    body = F.build_report(recs, n_boot=20, sigma=1e-3, chinchilla_starts=1)["conventions"]["6N"]
    assert body["fits"]["k2"]["lr_rule"] == "own" and body["fits"]["k2+attn_res"]["lr_rule"] == "shared"
    cmp = body["comparisons"]["k2+attn_res"]
    assert cmp["lr_rules"] == {"arm": "shared", "baseline": "shared"}
    assert cmp["shared_alpha"]["M"] == pytest.approx(2.0, rel=2e-2)
    assert body["comparisons_shared_rule"]["k2+attn_res"]["shared_alpha"]["M"] == pytest.approx(2.0, rel=2e-2)
    text = F.format_report(F.build_report(recs, n_boot=5, sigma=1e-3, chinchilla_starts=1))
    assert "Learning-rate rules differ" not in text


def test_comparison_is_read_at_the_compute_both_arms_reach(tmp_path):
    """An arm measured over a shorter compute range than the baseline is compared at its own largest C
    (and the baseline's, when the baseline's is the shorter), never with its law read past its points."""
    recs = F.load_points(_write_results(str(tmp_path / "res"), branches=False, lr_sweep=False))
    largest = max(r["flops_6N"] for r in recs if r["arm"] == "k3")
    short = [r for r in recs if r["arm"] == "k2" or r["flops_6N"] < largest]
    for cut in (short, [r for r in recs if r["arm"] == "k3" or r["flops_6N"] < largest / 2]):
        cmp = F.build_report(cut, n_boot=5, sigma=1e-3, chinchilla_starts=1)["conventions"]["6N"]["comparisons"]["k3"]
        reach = min(max(r["flops_6N"] for r in cut if r["arm"] == a and r["is_final"]) for a in ("k2", "k3"))
        assert cmp["power_law"]["at_C_max"]["C"] == pytest.approx(reach)
        assert cmp["power_law"]["loso"]["C"] == pytest.approx(reach)
    assert F.common_reach([1.0, 5.0], [2.0, 3.0]) == 3.0


def test_load_points_dedupes_keeping_last(tmp_path):
    d = _write_results(str(tmp_path / "res"))
    recs = F.load_points(d)
    first = [r for r in recs if r["run_id"] == "k2-128x4-s0-lr1" and r["point"] == "final"]
    assert len(first) == 1 and first[0]["val_loss"] < 9
    # 2 arms x 4 sizes x (final + branch) + 3 extra seeds + 5 lr-sweep runs (one diverged)
    assert len(recs) == 16 + 3 + 5
    sigma, info = F.estimate_sigma(recs)
    assert sigma == pytest.approx(POOLED_SIGMA, rel=1e-9)
    assert info == {"n_groups": 2, "n_runs": 5, "n_repeat_runs": 0, "repeat_sigma": None}


def test_noise_estimate_pools_same_seed_repeats_which_no_fit_uses():
    """A same-seed repeat (the runner's 'repeats' job) enters sigma_L with the seeds, never a fit."""
    base = dict(arm="k2", size="64x4", d_model=64, n_layers=4, lr_mult=1.0, is_final=True, point="final")
    recs = [dict(base, seed=0, repeat=0, val_loss=2.00, run_id="a"), dict(base, seed=1, repeat=0, val_loss=2.03, run_id="b"),
            dict(base, seed=0, repeat=1, val_loss=2.01, run_id="c"), dict(base, seed=0, repeat=2, val_loss=1.99, run_id="d")]
    sigma, info = F.estimate_sigma(recs)
    v = np.array([2.00, 2.03, 2.01, 1.99])
    assert sigma == pytest.approx(float(np.std(v, ddof=1)), rel=1e-9)
    assert info["n_runs"] == 4 and info["n_repeat_runs"] == 2
    assert info["repeat_sigma"] == pytest.approx(float(np.std([2.00, 2.01, 1.99], ddof=1)), rel=1e-9)
    assert [r["run_id"] for r in recs if F.is_seed0(r)] == ["a"]
    assert "same-seed repeats" in F.resolve_sigma(recs)["source"]


@pytest.mark.slow
def test_fit_cli_end_to_end(tmp_path, capsys):
    d = _write_results(str(tmp_path / "res"))
    assert F.main(["--results", d, "--bootstrap", "200", "--bootstrap_e", "20", "--starts", "20"]) == 0
    out = capsys.readouterr().out
    assert "k3 vs k2 (6N)" in out and "excludes 1" in out
    with open(os.path.join(d, "fit.json")) as f:
        rep = json.load(f)
    assert rep["baseline"] == "k2" and rep["arms"] == ["k2", "k3"] and rep["n_records"] == 24
    assert rep["sigma_L"]["value"] == pytest.approx(POOLED_SIGMA, rel=1e-9) and "seed" in rep["sigma_L"]["source"]
    expected_M = {"6N": 2.0, "full": 2.0 * FULL_FACTOR["k2"] / FULL_FACTOR["k3"]}
    for conv, M in expected_M.items():
        body = rep["conventions"][conv]
        k2 = body["fits"]["k2"]
        assert k2["n_main"] == 4 and k2["n_all"] == 8 and k2["sizes"] == [s[0] for s in SIZES]
        assert k2["power_law"]["alpha"] == pytest.approx(LAW_ALPHA, rel=0.05)
        assert set(k2["power_law_E"]) >= {"E", "A", "alpha"}
        assert k2["chinchilla"]["n"] == 8 and k2["chinchilla"]["E"] > 0
        cmp = body["comparisons"]["k3"]
        rows = cmp["power_law"]["at_measured_C"]
        assert [r["size"] for r in rows] == [s[0] for s in SIZES]
        for r in rows + [cmp["power_law"]["at_C_max"]]:
            assert r["M"] == pytest.approx(M, rel=1e-8)
            assert r["lo"] < M < r["hi"] and r["excludes_1"] is True
        assert cmp["power_law"]["at_C_max"]["C"] == pytest.approx(min(max(k2["C"]), max(body["fits"]["k3"]["C"])))
        assert cmp["shared_alpha"]["M"] == pytest.approx(M, rel=1e-8)
        assert cmp["power_law"]["loso"]["min"] == pytest.approx(M, rel=1e-8)
        assert set(cmp["power_law"]["loso"]["by_size"]) == {s[0] for s in SIZES}
        assert "at_C_max" in cmp["power_law_E"] and cmp["power_law_E"]["n_boot"] == 20


def test_fit_cli_small_ladder_skips_and_default_sigma(tmp_path, capsys):
    d = _write_results(str(tmp_path / "res"), sizes=SIZES[:3], branches=False, seeds=False, lr_sweep=False)
    out_json = str(tmp_path / "report.json")
    assert F.main(["--results", d, "--bootstrap", "50", "--bootstrap_e", "5", "--json", out_json]) == 0
    out = capsys.readouterr().out
    assert "skipped" in out and "default" in out
    with open(out_json) as f:
        rep = json.load(f)
    assert rep["sigma_L"]["value"] == F.DEFAULT_SIGMA and "default" in rep["sigma_L"]["source"]
    assert "skipped" in rep["conventions"]["6N"]["fits"]["k3"]["chinchilla"]


def test_plot_cli_writes_pngs(tmp_path, capsys):
    d = _write_results(str(tmp_path / "res"))
    out = str(tmp_path / "figs")
    assert P.main(["--results", d, "--out", out, "--bootstrap", "50"]) == 0
    printed = capsys.readouterr().out.split()
    names = {"loss_vs_compute_6N.png", "loss_vs_compute_full.png", "multiplier_6N.png", "multiplier_full.png",
             "lr_sweep.png"}
    assert {os.path.basename(p) for p in printed} == names
    for name in names:
        path = os.path.join(out, name)
        assert os.path.getsize(path) > 1000
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_without_lr_sweep_skips_it(tmp_path, capsys):
    d = _write_results(str(tmp_path / "res"), lr_sweep=False)
    assert P.main(["--results", d, "--bootstrap", "20"]) == 0
    assert not os.path.exists(os.path.join(d, "lr_sweep.png"))
    assert os.path.exists(os.path.join(d, "multiplier_full.png"))


@pytest.mark.parametrize("tool", [F.main, P.main], ids=["fit", "plot"])
def test_cli_bad_input_exits_2(tool, tmp_path, capsys):
    missing = str(tmp_path / "nowhere")
    assert tool(["--results", missing]) == 2
    err = capsys.readouterr().err
    assert "not found" in err and "nowhere" in err and "Traceback" not in err

    empty = tmp_path / "empty"
    empty.mkdir()
    assert tool(["--results", str(empty)]) == 2
    assert "no points*.jsonl" in capsys.readouterr().err

    d = _write_results(str(tmp_path / "res"), lr_sweep=False)
    assert tool(["--results", d, "--baseline", "k9", "--bootstrap", "5"]) == 2
    err = capsys.readouterr().err
    assert "'k9'" in err and "k2" in err

    one = _write_results(str(tmp_path / "one"), sizes=SIZES[:1], lr_sweep=False)
    assert tool(["--results", one, "--bootstrap", "5"]) == 2
    assert "at least 2" in capsys.readouterr().err


@pytest.mark.parametrize("tool", [F.main, P.main], ids=["fit", "plot"])
def test_cli_leaves_out_an_arm_with_one_size_and_takes_arms(tool, tmp_path, capsys):
    """A ladder whose third arm has one size so far: the fit and figures leave it out, saying so once;
    ``--arms`` picks arms by name; an arm with no points is an error that lists the arms present."""
    d = _write_results(str(tmp_path / "res"), lr_sweep=False)
    _write_results(str(tmp_path / "one"), arms=("k2+attn_res",), sizes=SIZES[:1], lr_sweep=False)
    os.replace(str(tmp_path / "one" / "points.jsonl"), os.path.join(d, "points_mech.jsonl"))
    args = ["--results", d, "--bootstrap", "5"] + (["--bootstrap_e", "2", "--starts", "5"] if tool is F.main else [])
    assert tool(args) == 0
    captured = capsys.readouterr()
    assert captured.err.count("warning: arm 'k2+attn_res' left out: 1 size(s)") == 1
    if tool is F.main:
        assert "Left out: k2+attn_res (1 size(s)" in captured.out
        with open(os.path.join(d, "fit.json")) as f:
            rep = json.load(f)
        assert rep["arms"] == ["k2", "k3"] and rep["n_records"] == 21 and list(rep["arms_left_out"]) == ["k2+attn_res"]
    assert tool(args + ["--arms", "k3"]) == 0
    assert "left out" not in capsys.readouterr().err
    if tool is F.main:
        with open(os.path.join(d, "fit.json")) as f:
            rep = json.load(f)
        assert rep["arms"] == ["k2", "k3"] and rep["n_records"] == 19 and rep["arms_left_out"] == {}
    assert tool(args + ["--arms", "k3,k9"]) == 2
    err = capsys.readouterr().err
    assert "--arms: no points for k9" in err and "k2+attn_res" in err and "Traceback" not in err


def test_fit_cli_chinchilla_refit(capsys):
    assert F.main(["--chinchilla", DATA]) == 0
    out = capsys.readouterr().out
    assert "Besiroglu" in out and "fitted 240" in out
    assert F.main(["--chinchilla", DATA + ".missing"]) == 2
    assert "not found" in capsys.readouterr().err


def test_per_arm_lr_rule_recovers_a_planted_optimum():
    """Sweeps at x0.5, x1, x2, x4 of a rule around a planted lr*(C) = 0.9 C^-0.11 (loss quadratic in
    log lr, plus small noise) give back the optimum per size and the rule's coefficient and exponent;
    a sweep whose optimum lies outside its rates is reported as not bracketed."""
    rng = np.random.default_rng(5)
    coef, exp = 0.9, -0.11
    sweeps = {}
    for C in (1e13, 1e14, 1e15, 1e16):
        opt = coef * C ** exp
        rule = opt * rng.uniform(0.6, 1.6)  # the rule misses the optimum by up to 1.7x either way
        lr = rule * np.array([0.5, 1.0, 2.0, 4.0])
        loss = 3.0 - 0.1 * np.log10(C) + 0.05 * np.log(lr / opt) ** 2 + rng.normal(0, 1e-4, lr.size)
        sweeps[C] = (lr, loss)
    fit = F.fit_lr_rule(sweeps)
    assert fit.exp == pytest.approx(exp, abs=0.01) and fit.coef == pytest.approx(coef, rel=0.25)
    for r in fit.sizes:
        assert r["lr_opt"] == pytest.approx(coef * r["C"] ** exp, rel=0.05)
    assert fit(1e17) == pytest.approx(coef * 1e17 ** exp, rel=0.1)
    lr = np.array([1e-3, 2e-3, 4e-3])
    assert F.lr_optimum(lr, 0.05 * np.log(lr / 1e-2) ** 2)[1] is False  # optimum past the largest rate
    with pytest.raises(ValueError, match=">= 3 distinct rates"):
        F.lr_optimum([1e-3, 1e-3, 2e-3], [1.0, 1.0, 0.9])


def test_lr_rules_from_ladder_records():
    """`lr_rules` reads each arm's swept final points from ladder records: a rule where two sizes
    have >= 3 rates, 'skipped' where they do not."""
    recs = []
    for size, C in (("64x4", 1e14), ("96x4", 1e15)):
        opt = 0.9 * C ** -0.11
        for mult in (0.5, 1.0, 2.0, 4.0):
            lr = opt * mult / 1.3
            recs.append({"arm": "k3", "size": size, "seed": 0, "is_final": True, "lr": lr, "lr_mult": mult,
                         "flops_6N": C, "val_loss": 2.0 + 0.05 * math.log(lr / opt) ** 2})
        recs.append({"arm": "k2", "size": size, "seed": 0, "is_final": True, "lr": 1e-3, "lr_mult": 1.0,
                     "flops_6N": C, "val_loss": 2.5})
    rules = F.lr_rules(recs, "6N")
    assert rules["k3"]["exp"] == pytest.approx(-0.11, abs=1e-6) and rules["k3"]["coef"] == pytest.approx(0.9, rel=1e-4)
    assert "skipped" in rules["k2"]
    # Same-seed repeats of a rate enter as their mean: a pair +-0.03 around the curve changes nothing,
    # while the same pair's upper run alone moves the optimum.
    pair = [r for r in recs if r["arm"] == "k3" and r["size"] == "64x4" and r["lr_mult"] == 4.0][0]
    up = dict(pair, val_loss=pair["val_loss"] + 0.03, repeat=1, run_id="up")
    down = dict(pair, val_loss=pair["val_loss"] - 0.03, repeat=0)
    rest = [r for r in recs if r is not pair]
    both = F.lr_rules(rest + [down, up], "6N")["k3"]
    assert both["exp"] == pytest.approx(-0.11, abs=1e-6) and both["coef"] == pytest.approx(0.9, rel=1e-4)
    assert F.lr_rules(rest + [up], "6N")["k3"]["exp"] != pytest.approx(-0.11, abs=1e-3)


def test_report_prints_the_lr_rule_table():
    """The markdown report shows the per-arm learning-rate rule when sweeps allow one."""
    report = {"baseline": "k2", "n_records": 9, "n_boot": 10, "n_boot_E": 10,
              "sigma_L": {"value": 0.002, "source": "given"},
              "conventions": {"6N": {"fits": {}, "comparisons": {}, "lr_rules": {
        "k3": {"coef": 0.9, "exp": -0.11, "sizes": [{"C": 1e14, "lr_opt": 0.026, "bracketed": True},
                                                    {"C": 1e15, "lr_opt": 0.02, "bracketed": False}]},
        "k2": {"skipped": "sweeps of >= 3 rates at 1 size(s); a rule needs 2"}}}}}
    text = F.format_report(report)
    assert "| k3 | 0.9 | -0.11 | 1.00e+14: 0.026; 1.00e+15: 0.02 (outside) |" in text
    assert "| k2 | | | skipped:" in text
    assert '`lr_rules = "k3=0.9:-0.11"`' in text


def test_own_rule_points_give_the_headline_and_shared_rule_points_the_comparison(tmp_path):
    """With k3 trained at its own rule as well as at the shared one, the headline fits take k3's
    own-rule points (a multiplier of 3 planted) and the shared-rule comparison takes the others (2);
    k2, with no rule of its own, is the same baseline in both. Same-seed runs at two rules are not
    pooled into the noise estimate."""
    recs = F.load_points(_write_results(str(tmp_path / "res"), sizes=SIZES[:3], branches=False, lr_sweep=False))
    for r in [r for r in recs if r["arm"] == "k3" and F.is_seed0(r) and r["is_final"]]:
        # k3 at its own rule reaches the baseline's loss at a third (not a half) of its compute
        own = dict(r, run_id=r["run_id"] + "-own1234", lr_rule="own", lr_mult=1.0)
        own["val_loss"] = LAW_A * (3.0 * r["flops_6N"]) ** -LAW_ALPHA
        recs.append(own)
    report = F.build_report(recs, n_boot=20, sigma=1e-3, chinchilla_starts=1)
    body = report["conventions"]["6N"]
    assert body["fits"]["k3"]["lr_rule"] == "own" and body["fits"]["k2"]["lr_rule"] == "shared"
    assert body["comparisons"]["k3"]["shared_alpha"]["M"] == pytest.approx(3.0, rel=2e-2)
    assert body["comparisons_shared_rule"]["k3"]["shared_alpha"]["M"] == pytest.approx(2.0, rel=2e-2)
    text = F.format_report(report)
    assert "At the shared learning-rate rule" in text and "| k3 | own |" in text
    assert "Learning-rate rules differ: k3 at its own rule, k2 at the shared rule." in text
    sigma, info = F.estimate_sigma(recs)
    assert sigma == pytest.approx(POOLED_SIGMA, rel=1e-9) and info["n_groups"] == 2
    # Without any shared-rule point of k3, the shared-rule comparison says why it is missing.
    only_own = [r for r in recs if not (r["arm"] == "k3" and F.lr_rule_of(r) == "shared")]
    shared = F.build_report(only_own, n_boot=5, sigma=1e-3, chinchilla_starts=1)["conventions"]["6N"]
    assert shared["comparisons_shared_rule"]["k3"] == {"skipped": "0 shared-rule size(s); needs 2"}
    assert "| k3 | skipped: 0 shared-rule size(s)" in F.format_report(
        F.build_report(only_own, n_boot=5, sigma=1e-3, chinchilla_starts=1))
    # Only shared-rule points: no second comparison.
    plain = [r for r in recs if F.lr_rule_of(r) == "shared"]
    assert "comparisons_shared_rule" not in F.build_report(plain, n_boot=5, sigma=1e-3,
                                                           chinchilla_starts=1)["conventions"]["6N"]


def test_lr_sweep_curves_put_own_and_shared_rule_runs_on_one_axis():
    from experiments.plot import lr_sweep_curves

    base = dict(arm="k3", size="64x4", seed=0, is_final=True)
    recs = [dict(base, lr_mult=m, lr=0.01 * m, val_loss=2.0 + m) for m in (0.5, 1.0, 2.0)]
    recs.append(dict(base, lr_mult=1.0, lr=0.03, lr_rule="own", val_loss=1.9))  # x1 of another rule
    assert lr_sweep_curves(recs) == (True, {("k3", "64x4"): {0.005: 2.5, 0.01: 3.0, 0.02: 4.0, 0.03: 1.9}})
    del recs[-1]["lr"]  # without every rate known, the multiplier is the axis
    assert lr_sweep_curves(recs)[0] is False


def test_fitted_rule_setting_is_what_the_runner_parses():
    from experiments.run_ladder import parse_lr_rules

    rules = {"k2": {"coef": 1.2345678, "exp": -0.0987654, "sizes": []}, "k3": {"coef": 0.5, "exp": -0.1, "sizes": []},
             "k2+attn_res": {"skipped": "no sweep"}}
    setting = F.lr_rules_setting(rules)
    assert setting == "k2=1.23457:-0.0987654;k3=0.5:-0.1"
    assert parse_lr_rules(setting, ["k2", "k3"]) == {"k2": (1.23457, -0.0987654), "k3": (0.5, -0.1)}
