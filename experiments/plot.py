"""Figures of the ladder results: loss against compute, compute multipliers, and the learning-rate sweep.

    python -m experiments.plot --results=DIR [--out=DIR] [--baseline=k2] [--bootstrap=1000] [--seed=0]
                               [--sigma=0]

Writes PNGs into ``--out`` (default: the results directory) and prints their paths:
  * ``loss_vs_compute_{6N,full}.png``: each arm's main points (cooldown branches hollow) and its fitted
    power law ``L = A C^-alpha``, log-log;
  * ``multiplier_{6N,full}.png``: the compute multiplier M(C) of every arm over the baseline, with the
    5-95% parametric-bootstrap band;
  * ``lr_sweep.png`` (only when some run has ``lr_mult != 1``): final loss against the learning-rate
    multiplier, per arm and size.

The points, fits and bootstrap are `experiments.fit`'s, so the figures match its tables.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # files only; no display on the training hosts
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FormatStrFormatter, NullFormatter  # noqa: E402

from experiments.fit import (CONVENTIONS, FitError, arm_points, baseline_at_rule, bootstrap_multiplier,  # noqa: E402
                             common_reach, fit_power_law, has_finite_loss, is_default_lr, is_seed0, load_points,
                             resolve_sigma, select_arms, size_label, usable_arms)

_DPI = 130


def _plain_ticks(axis, minor: bool = True) -> None:
    """Tick labels as plain numbers (3.5, not 3.5 x 10^0) on a log axis; ``minor``: label the minor ticks
    too (for an axis spanning less than a decade; over more their labels run into each other)."""
    axis.set_major_formatter(FormatStrFormatter("%g"))
    axis.set_minor_formatter(FormatStrFormatter("%g") if minor else NullFormatter())


def _colors(names: Sequence[str]) -> dict:
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {name: cycle[i % len(cycle)] for i, name in enumerate(names)}


def plot_loss_vs_compute(arms: dict, convention: str, path: str) -> str:
    """Log-log loss (nats) against compute (FLOPs) with each arm's power-law fit over its own points'
    range; writes ``path``."""
    colors = _colors(list(arms))
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for name, a in arms.items():
        grid = np.geomspace(a.C_all.min() / 1.3, a.C_all.max() * 1.3, 100)
        fit = fit_power_law(a.C, a.L)
        col = colors[name]
        ax.plot(grid, fit.predict(grid), color=col, lw=1.2,
                label=f"{name}: L = {fit.A:.4g} C^-{fit.alpha:.4f}")
        ax.plot(a.C, a.L, "o", color=col, ms=6)
        branch = ~a.final_all
        if branch.any():
            ax.plot(a.C_all[branch], a.L_all[branch], "o", mfc="none", mec=col, ms=6)
    ax.plot([], [], "o", color="0.4", label="final (seed 0)")
    ax.plot([], [], "o", mfc="none", mec="0.4", label="cooldown branch")
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_ticks(ax.yaxis)
    ax.set_xlabel(f"training compute C [FLOPs, {convention} convention]")
    ax.set_ylabel("validation loss [nats/token]")
    ax.set_title(f"Loss vs compute ({convention})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def plot_multiplier(arms: dict, baseline: str, convention: str, sigma: float, n_boot: int, seed: int,
                    path: str, baseline_shared=None) -> str:
    """M(C) of every non-baseline arm over ``baseline`` with its 5-95% bootstrap band; writes ``path``.

    baseline_shared: the baseline's shared-rule `ArmPoints`, which an arm trained at the shared rule
    only is compared with (`baseline_at_rule`) when the baseline's own points are at its own rule."""
    colors = _colors(list(arms))
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for name, a in arms.items():
        if name == baseline:
            continue
        b = baseline_at_rule(arms[baseline], baseline_shared, a.lr_rule)
        # up to the compute both arms reach, `experiments.fit.common_reach` (its C_max)
        grid = np.geomspace(min(a.C.min(), b.C.min()), common_reach(b.C, a.C), 80)
        boot = bootstrap_multiplier(b.C, b.L, a.C, a.L, sigma, C_eval=np.append(grid, a.C), n_boot=n_boot, seed=seed)
        g = len(grid)
        col = colors[name]
        ax.fill_between(grid, boot.lo[:g], boot.hi[:g], color=col, alpha=0.2, lw=0)
        at = f" (vs {baseline} at the shared rule)" if b is not arms[baseline] else ""
        ax.plot(grid, boot.M[:g], color=col, label=f"{name}{at}: M(C_max) = {boot.M[g - 1]:.3g} "
                                                   f"[{boot.lo[g - 1]:.3g}, {boot.hi[g - 1]:.3g}]")
        ax.plot(a.C, boot.M[g:], "o", color=col, ms=5)
    ax.axhline(1.0, color="0.3", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_ticks(ax.yaxis)
    ax.set_xlabel(f"training compute C [FLOPs, {convention} convention]")
    ax.set_ylabel(f"compute multiplier over {baseline}")
    ax.set_title(f"Compute multiplier ({convention}); band: 5-95% bootstrap, sigma_L = {sigma:.3g} nats",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def lr_sweep_curves(records: Sequence[dict]) -> tuple[bool, dict]:
    """(absolute, {(arm, size): {x: final loss}}) of the seed-0 finals with a finite loss: x is the
    peak rate when every such record has one (``absolute``), else the rule's multiplier."""
    finals = [r for r in records
              if r.get("is_final") and is_seed0(r) and r.get("val_loss") is not None and has_finite_loss(r)]
    absolute = all(r.get("lr") is not None for r in finals)
    groups = {}
    for r in finals:
        x = float(r["lr"]) if absolute else float(r.get("lr_mult", 1.0))
        groups.setdefault((str(r["arm"]), size_label(r)), {})[x] = float(r["val_loss"])
    return absolute, groups


def plot_lr_sweep(records: Sequence[dict], path: str) -> str | None:
    """Final seed-0 loss against the learning rate per (arm, size), log x; writes ``path``, or None
    without a sweep. The x axis is the peak rate itself when every record has it (runs at an arm's
    own rule and at the shared one then fall on one curve), else the multiplier of the rule."""
    if all(is_default_lr(r) for r in records):
        return None
    absolute, groups = lr_sweep_curves(records)
    colors = _colors(sorted({arm for arm, _ in groups}))
    markers = "osD^v<>p*h"
    sizes = sorted({size for _, size in groups})
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for (arm, size), by_lr in sorted(groups.items()):
        if len(by_lr) < 2:
            continue  # a size without a sweep adds a lone point and no information about the lr
        lr = np.array(sorted(by_lr))
        ax.plot(lr, [by_lr[x] for x in lr], "-", marker=markers[sizes.index(size) % len(markers)],
                color=colors[arm], label=f"{arm} {size}")
    ax.set_xscale("log")
    lo, hi = ax.get_xlim()
    _plain_ticks(ax.xaxis, minor=hi / lo < 10)
    ax.set_xlabel("peak learning rate" if absolute else "learning-rate multiplier")
    ax.set_ylabel("final validation loss [nats/token]")
    ax.set_title("Learning-rate sweep (seed 0)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def make_plots(records: Sequence[dict], out_dir: str, baseline: str = "k2", n_boot: int = 1000, seed: int = 0,
               sigma: float = 0.0) -> list[str]:
    """Every figure for ``records`` (from `load_points`) into ``out_dir``; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    sigma_value = resolve_sigma(records, sigma)["value"]
    written = []
    for conv in CONVENTIONS:
        arms, _ = usable_arms(arm_points(records, conv), baseline, warn=not written)
        shared = arm_points(records, conv, rule="shared").get(baseline)
        shown = dict(arms)
        # The baseline's shared-rule points too where an arm trained at that rule only is compared with them
        if any(baseline_at_rule(arms[baseline], shared, a.lr_rule) is shared for a in arms.values()):
            shown[f"{baseline} (shared rule)"] = shared
        written.append(plot_loss_vs_compute(shown, conv, os.path.join(out_dir, f"loss_vs_compute_{conv}.png")))
        if len(arms) > 1:
            written.append(plot_multiplier(arms, baseline, conv, sigma_value, n_boot, seed,
                                           os.path.join(out_dir, f"multiplier_{conv}.png"), shared))
    lr = plot_lr_sweep(records, os.path.join(out_dir, "lr_sweep.png"))
    if lr:
        written.append(lr)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit code (2 on bad input, with a message on stderr)."""
    p = argparse.ArgumentParser(prog="python -m experiments.plot", description=__doc__.split("\n")[0])
    p.add_argument("--results", required=True, help="directory holding points*.jsonl")
    p.add_argument("--out", default=None, help="output directory (default: the results directory)")
    p.add_argument("--baseline", default="k2", help="arm every other arm is compared with")
    p.add_argument("--arms", default="", help="comma-separated arms to plot with the baseline (default: all)")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap replicates of the multiplier band")
    p.add_argument("--seed", type=int, default=0, help="seed of the bootstrap noise")
    p.add_argument("--sigma", type=float, default=0.0, help="loss noise in nats; 0 = estimate from seed repeats")
    args = p.parse_args(argv)
    try:
        if args.bootstrap < 1:
            raise FitError("--bootstrap must be at least 1")
        records = select_arms(load_points(args.results), args.arms, args.baseline)
        written = make_plots(records, args.out or args.results, baseline=args.baseline, n_boot=args.bootstrap,
                             seed=args.seed, sigma=args.sigma)
    except FitError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
