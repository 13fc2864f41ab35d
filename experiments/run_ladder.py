"""Scaling-ladder runner: trains every (arm, size) of a ladder with WSD cooldown branches.

    python -m experiments.run_ladder --ladder=experiments/configs/ladder_h200.py --out=DIR \
        [--arms=k2,k3] [--sizes=64x4,96x4] [--jobs=main,shared,seeds,repeats,sweep] [--deadline_s=540] [--dry_run]
        [--speeds_from=DIR --estimate_on='NVIDIA H200']

A ladder file (see `default_ladder` for every knob) names the arms (`experiments.configs.ladder`),
the sizes (``d_model x n_layers``; ``arm_sizes`` gives an arm shapes of its own), the data, the
learning-rate rule shared by all arms and, in ``lr_rules``, any arm's own fitted rule.
Each run trains warmup -> constant learning rate -> a (1 - sqrt) cooldown to zero over the last
``decay_frac`` of its tokens D; a main run also branches off its stable phase at ``b * D`` with a
cooldown ending at ``e * D`` (``branches='0.4:0.5'``), so one run yields several (N, D, loss)
points at the price of the branch cooldowns. Every point is one JSON line appended to
``DIR/points.jsonl``: arm, size, seed, learning rate, parameters, tokens, FLOPs under both
conventions (``6N`` and ``full``, `k3.params`), held-out loss in nats/token and bits/byte, wall
time, device and the config hash.

The plan's table estimates each run's training time from the FLOP/s its arm reached in recorded
points (``--speeds_from``, default ``--out``) on a device kind (``--estimate_on``, default this
process's), so a GPU ladder can be sized from a CPU. An arm with no recorded speed is estimated at the
slowest recorded arm's (marked ``~``) until its first run in the process measures its own.

Resumable: a point already in ``DIR/points*.jsonl`` is not recomputed; a run killed midway
restarts from its last checkpoint (``DIR/runs/<run_id>/checkpoints``; deleted once the run's points
are all written). Files copied in from other machines (``points_*.jsonl``) count as done too, so
results of several GPU jobs merge in one directory.

One compiled step per (arm, size): the learning rate is a run-time scalar (``optim.schedule=
'external'``), so branches, seeds and learning-rate multipliers reuse it, through the persistent
compilation cache (``--compile_cache``; by default JAX's own, else ``DIR/compile_cache``).
While a run trains, a background thread compiles the next run's programs into that cache (the
initialiser, the optimizer's init, the train and eval steps), so on a GPU, where each (arm, size)
takes a minute or more to compile, compiling overlaps training (``--no_compile_ahead`` turns it off).

Populations (``population`` > 1): a small model's step is 900-2,400 small kernels on a GPU
(BENCHMARKS.md), so the sweep's runs of one (arm, size), which differ only in their learning-rate
scalar, train as one program over a stack of their states (`jax.vmap` of `k3.steps.Run.step_fn`;
the batch is shared).
Each member's points are recorded as a run of its own, with ``population`` set to the number of
members, ``tokens_per_s`` its own tokens over the population's time and ``mfu_full`` the program's.
A member whose loss turns non-finite is recorded as diverged (val_loss nan) and the rest go on.

Jobs: 'main' (seed 0, the rule's learning rate, with branches), 'seeds' (``extra_seeds`` at the
``seed_sizes`` smallest sizes: the noise estimate), 'repeats' (``repeats`` more runs of seed 0 at
those sizes: the device's run-to-run noise, which the noise estimate pools with the seeds'; on a CPU
they repeat the loss exactly), 'sweep' (``lr_sweep`` multipliers at the ``sweep_sizes`` smallest
sizes, per arm: a check of the rule), 'shared' (for every arm that has its own rule in ``lr_rules``,
the main sizes once more at the shared rule, without branches: the multiplier at one rule for all).

Learning rates: ``lr_coef * C ** lr_exp`` for every arm (C = 6 N D), unless ``lr_rules`` gives an arm
its own fitted rule; the sweep then brackets that arm's own rate.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import itertools
import json
import math
import os
import queue
import shutil
import sys
import threading
import time
from pathlib import Path

import ml_collections

from experiments.configs.ladder import ARMS, arm_config

ConfigDict = ml_collections.ConfigDict


class LadderError(ValueError):
    """The ladder file, the filters or the output directory are unusable."""


def default_ladder() -> ConfigDict:
    """Every ladder knob with its default; ladder files start from this and change values."""
    c = ConfigDict()
    c.name = "ladder"
    c.arms = "k2,k3"  # see experiments.configs.ladder.ARMS
    c.baseline = "k2"
    c.sizes = "64x4,96x4,128x4"  # d_model x n_layers, smallest first
    # Sizes of their own for the arms named, 'arm=SIZE,SIZE,...;arm=...' (e.g. K3 has ~1.4x K2's
    # active parameters at one shape, so equal compute ranges need other shapes); the rest use `sizes`.
    c.arm_sizes = ""
    c.tokens_per_param = 20.0  # D = tokens_per_param * non-embedding active params of the arm's rung
    c.min_steps = 20
    c.seq_len = 512
    c.batch_size = 32
    # One learning-rate rule for every arm: lr = lr_coef * C ** lr_exp, C = 6 N D in FLOPs (the
    # DeepSeek LLM fit, 0.3118 C^-0.125); Muon's updates are RMS-matched to AdamW's so one rate
    # serves both parameter groups (times adam_lr_ratio for the AdamW group).
    c.lr_coef = 0.3118
    c.lr_exp = -0.125
    c.adam_lr_ratio = 1.0
    # Per-arm rules that replace the shared one for the arms they name: 'arm=coef:exp;arm=coef:exp'
    # (from `python -m experiments.fit`'s learning-rate fit). Those arms' runs are tagged '-own<hash>'
    # and the 'shared' job trains them at the shared rule too, for the comparison at one rule.
    c.lr_rules = ""
    c.warmup_frac = 0.02
    c.decay_frac = 0.2  # cooldown share of each trajectory
    c.min_lr_ratio = 0.0
    c.branches = "0.4:0.5"  # 'b:e,...': cooldown branches off the stable phase, fractions of D
    c.extra_seeds = "1,2"
    c.seed_sizes = 2
    c.repeats = 1  # same-seed repeats of seed 0 at the seed_sizes smallest sizes ('repeats' job)
    c.lr_sweep = "0.5,2.0"
    c.sweep_sizes = 2
    c.data_seed = 0  # one data order for every run (seeds change the initialisation only)
    # Passes over the training split the largest run may make: 1 = no run repeats its data. The
    # runner refuses a ladder past it before training anything.
    c.max_epochs = 1.0
    c.eval_batches = 0  # held-out batches per evaluation; 0 = the whole validation split
    c.ckpt_every = 0.1  # checkpoint every this fraction of a run's steps
    # Up to this many runs that differ only in learning rate (same arm, size, seed and steps, no
    # branches, not a same-seed repeat: the sweep's) train as one program, vmapped over the runs, on
    # one device; they are not checkpointed (a killed population starts again). 1: one run at a time.
    c.population = 1
    c.overrides = ""  # 'key=value,...' applied to every run's config, e.g. 'model.dtype=bfloat16'
    d = c.data = ConfigDict()
    d.source = "stdlib"
    d.path = ""
    d.suffixes = "python"  # site_packages: the file suffix set (k3.data.corpus.SITE_SUFFIX_SETS)
    d.extra_roots = ""  # site_packages: more directories to read, os.pathsep-separated
    d.tokenizer = "byte"
    d.vocab_size = 264  # model vocabulary (>= the tokenizer's)
    d.val_fraction = 0.05
    d.max_docs = 0
    return c


# ---------------------------------------------------------------------------------------------
# Plan: which runs, their configs and schedules


def parse_size(size: str) -> tuple[int, int]:
    try:
        d, layers = size.lower().split("x")
        return int(d), int(layers)
    except ValueError:
        raise LadderError(f"size {size!r} is not 'D_MODELxN_LAYERS' (e.g. 128x4)") from None


def _floats(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LadderError(f"{what}={text!r} is not a comma-separated list of numbers") from None


def parse_branches(text: str) -> list[tuple[float, float]]:
    out = []
    for part in (p for p in text.split(",") if p.strip()):
        try:
            b, e = (float(x) for x in part.split(":"))
        except ValueError:
            raise LadderError(f"branch {part!r} is not 'start:end' (fractions of the run's tokens)") from None
        if not 0 < b < e < 1:
            raise LadderError(f"branch {part!r} needs 0 < start < end < 1")
        out.append((b, e))
    return sorted(out)


def _per_arm(text: str, arms, key: str, form: str):
    """(entry, arm, value text) of each ';'-separated 'arm=value' entry of the ladder key ``key``;
    every arm must be one of ``arms`` and appear once."""
    seen = set()
    for part in (p.strip() for p in text.split(";") if p.strip()):
        arm, sep, value = (x.strip() for x in part.partition("="))
        if not sep or not value:
            raise LadderError(f"{key} entry {part!r} is not '{form}' (entries separated by ';')")
        if arm not in arms:
            raise LadderError(f"{key} names arm {arm!r}, which is not in the ladder's arms ({', '.join(arms)})")
        if arm in seen:
            raise LadderError(f"{key} gives arm {arm!r} twice")
        seen.add(arm)
        yield part, arm, value


def parse_lr_rules(text: str, arms) -> dict[str, tuple[float, float]]:
    """'arm=coef:exp;...' -> {arm: (coef, exp)}; every arm must be one of ``arms`` and appear once,
    with coef > 0 (lr = coef * C ** exp, C in FLOPs)."""
    out = {}
    for part, arm, rule in _per_arm(text, arms, "lr_rules", "arm=coef:exp"):
        try:
            coef, exp = (float(x) for x in rule.split(":"))
        except ValueError:
            raise LadderError(f"lr_rules entry {part!r} is not 'arm=coef:exp' (entries separated by ';')") from None
        if not (coef > 0 and math.isfinite(coef) and math.isfinite(exp)):
            raise LadderError(f"lr_rules entry {part!r}: coef must be a positive number and exp finite")
        out[arm] = (coef, exp)
    return out


def parse_arm_sizes(text: str, arms) -> dict[str, list[str]]:
    """'arm=SIZE,SIZE;arm=...' -> {arm: [size, ...] sorted by (d_model, n_layers)}; arms must be of
    ``arms`` and appear once, sizes must parse and not repeat."""
    out = {}
    for part, arm, sizes in _per_arm(text, arms, "arm_sizes", "arm=SIZE,SIZE,..."):
        listed = [x.strip() for x in sizes.split(",") if x.strip()]
        if len(set(listed)) != len(listed):
            raise LadderError(f"arm_sizes entry {part!r} repeats a size")
        out[arm] = sorted(listed, key=parse_size)
    return out


def _rule_tag(coef: float, exp: float) -> str:
    """Run-id tag of an arm's own rule: a refitted rule gives new run ids, never 'done' old points."""
    return "-own" + hashlib.sha1(f"{coef!r}:{exp!r}".encode()).hexdigest()[:4]


def _set_key(cfg, key: str, text: str) -> None:
    node = cfg
    *parents, leaf = key.split(".")
    try:
        for p in parents:
            node = node[p]
        old = node[leaf]
    except KeyError:
        raise LadderError(f"override {key}={text}: no such config key") from None
    if isinstance(old, bool):
        val = {"true": True, "false": False}.get(text.lower())
        if val is None:
            raise LadderError(f"override {key}={text}: expected true or false")
    else:
        try:
            val = type(old)(text)
        except ValueError:
            raise LadderError(f"override {key}={text}: expected {type(old).__name__}") from None
    node[leaf] = val


def run_config(ladder, arm: str, size: str, seed: int = 0):
    """The full training config of one run (learning rate set per step by the runner)."""
    from k3.config import ConfigError, validate

    d_model, n_layers = parse_size(size)
    try:
        cfg = arm_config(arm, d_model, n_layers)
    except ValueError as e:
        raise LadderError(str(e)) from None
    cfg.name = f"{ladder.name}_{arm}_{size}"
    cfg.seed = int(seed)
    cfg.model.vocab_size = int(ladder.data.vocab_size)
    for key in ("source", "path", "suffixes", "extra_roots", "tokenizer", "val_fraction", "max_docs"):
        cfg.data[key] = ladder.data[key]
    cfg.data.seq_len, cfg.data.batch_size = int(ladder.seq_len), int(ladder.batch_size)
    cfg.optim.schedule = "external"
    cfg.train.progress = False
    for item in (p for p in ladder.overrides.split(",") if p.strip()):
        key, sep, val = item.partition("=")
        if not sep:
            raise LadderError(f"override {item!r} is not key=value")
        _set_key(cfg, key.strip(), val.strip())
    try:
        validate(cfg)
    except ConfigError as e:
        raise LadderError(f"run {arm} {size}: {e}") from None
    return cfg


JOBS = ("main", "shared", "seeds", "repeats", "sweep")


def plan_runs(ladder, arms=None, sizes=None, jobs=JOBS) -> list[dict]:
    """The ladder's runs, in training order: main runs size by size (all arms at a size before the
    next size), the shared-rule runs of arms with their own rule, then the seed repeats, the same-seed
    repeats, then the learning-rate sweep.

    Each run is a dict: run_id, arm, size, seed, repeat, lr_mult, lr_rule ('own' or 'shared'), lr
    (the peak rate), steps, tokens, counts (`k3.params.count_params`), flops_per_token, branches, cfg.
    """
    from k3.params import count_params, flops_per_token

    all_arms = [a.strip() for a in ladder.arms.split(",") if a.strip()]
    for a in all_arms:
        if a not in ARMS:
            raise LadderError(f"ladder arm {a!r} unknown; expected one of {', '.join(ARMS)}")
    shared_sizes = sorted((s.strip() for s in ladder.sizes.split(",") if s.strip()), key=parse_size)
    own_sizes = parse_arm_sizes(ladder.arm_sizes, all_arms)
    sizes_of = {a: own_sizes.get(a, shared_sizes) for a in all_arms}
    all_sizes = sorted({s for v in sizes_of.values() for s in v}, key=parse_size)
    for name, given, known in (("arm", arms, all_arms), ("size", sizes, all_sizes)):
        for x in given or []:
            if x not in known:
                raise LadderError(f"--{name}s: {x!r} is not in the ladder's {name}s ({', '.join(known)})")
    for j in jobs:
        if j not in JOBS:
            raise LadderError(f"--jobs: unknown job {j!r}; expected {', '.join(JOBS)}")
    arms = [a for a in all_arms if not arms or a in arms]
    rules = parse_lr_rules(ladder.lr_rules, all_arms)
    branches = parse_branches(ladder.branches)
    if branches and branches[-1][0] >= 1 - ladder.decay_frac:
        raise LadderError("every branch must start before the main run's cooldown (start < 1 - decay_frac)")
    tokens_per_step = ladder.seq_len * ladder.batch_size

    def ranked(count=None):
        """(arm, size) by rank: every arm's smallest size, then every arm's next one, ...; only the
        ``count`` smallest sizes of each arm, and only those the --sizes filter lets through."""
        per_arm = [[(a, s) for s in sizes_of[a][:count]] for a in arms]
        return [p for rank in itertools.zip_longest(*per_arm) for p in rank if p and (not sizes or p[1] in sizes)]

    def make(arm, size, seed, lr_mult, with_branches, repeat=0, shared=False):
        cfg = run_config(ladder, arm, size, seed)
        counts = count_params(cfg.model)
        n = counts["non_embedding_active_params"]
        steps = max(int(ladder.min_steps), round(ladder.tokens_per_param * n / tokens_per_step))
        tokens = steps * tokens_per_step
        own = arm in rules and not shared
        coef, exp = rules[arm] if own else (ladder.lr_coef, ladder.lr_exp)
        lr = float(coef * (6.0 * n * tokens) ** exp)
        lr_tag = f"{lr_mult:g}".replace(".", "p") + (_rule_tag(coef, exp) if own else "")
        rep_tag = f"-r{repeat}" if repeat else ""
        return {"run_id": f"{arm}-{size}-s{seed}-lr{lr_tag}{rep_tag}", "arm": arm, "size": size, "seed": seed,
                "repeat": repeat, "lr_mult": lr_mult, "lr_rule": "own" if own else "shared", "lr": lr * lr_mult,
                "steps": steps, "tokens": tokens, "counts": counts,
                "flops_per_token": flops_per_token(cfg.model, ladder.seq_len, counts),
                "branches": branches if with_branches else [], "cfg": cfg}

    runs = []
    if "main" in jobs:
        runs += [make(a, s, 0, 1.0, True) for a, s in ranked()]
    if "shared" in jobs:
        runs += [make(a, s, 0, 1.0, False, shared=True) for a, s in ranked() if a in rules]
    small = ranked(int(ladder.seed_sizes))
    if "seeds" in jobs:
        seeds = [int(x) for x in _floats(ladder.extra_seeds, "extra_seeds")]
        runs += [make(a, s, sd, 1.0, False) for a, s in small for sd in seeds]
    if "repeats" in jobs:
        runs += [make(a, s, 0, 1.0, False, rep) for a, s in small for rep in range(1, int(ladder.repeats) + 1)]
    if "sweep" in jobs:
        mults = _floats(ladder.lr_sweep, "lr_sweep")
        runs += [make(a, s, 0, m, False) for a, s in ranked(int(ladder.sweep_sizes)) for m in mults]
    return runs


def config_hash(run: dict, ladder) -> str:
    """Hash of everything that defines a run's results: model, data, optimizer, seed, schedule."""
    from k3.checkpoints import run_identity

    ident = {"run": run_identity(run["cfg"]), "steps": run["steps"], "lr": run["lr"],
             "schedule": {k: ladder[k] for k in ("warmup_frac", "decay_frac", "min_lr_ratio", "data_seed")},
             "branches": run["branches"]}
    return hashlib.sha1(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]


# ---------------------------------------------------------------------------------------------
# Results files


def _recorded(out: Path):
    """Every record of ``out/points*.jsonl``, in file order; a line cut by a kill is skipped (its point
    is recomputed)."""
    for path in sorted(out.glob("points*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue


def load_done(out: Path) -> set[tuple[str, str]]:
    """(run_id, point) pairs already recorded in ``out/points*.jsonl``."""
    return {(rec["run_id"], rec["point"]) for rec in _recorded(out)}


def recorded_speeds(out: Path, device_kind: str, population: bool = False) -> dict[str, float]:
    """arm -> training FLOP/s (full convention) of its largest run recorded in ``out/points*.jsonl`` on
    a device of ``device_kind``: the deadline's first estimate for an arm's next run in a new process.
    population: from the runs trained in populations instead (the program's FLOP/s, all members)."""
    best = {}
    for rec in _recorded(out):
        if rec.get("device") != device_kind or not rec.get("tokens_per_s") or not rec.get("flops_full"):
            continue
        members = int(rec.get("population", 1))
        if (members > 1) != population:
            continue
        flops_per_s = members * rec["tokens_per_s"] * rec["flops_full"] / rec["tokens"]
        if rec["flops_full"] >= best.get(rec["arm"], (0.0, 0.0))[0]:
            best[rec["arm"]] = (rec["flops_full"], flops_per_s)
    return {arm: v for arm, (_, v) in best.items()}


def guess_speeds(speed: dict[str, float], arms: set[str]) -> set[str]:
    """Gives each of ``arms`` without a recorded speed the slowest recorded arm's (in place), so that a
    deadline skips a run of a new arm that would likely not finish instead of starting it blind; the arms
    so guessed (none when nothing is recorded)."""
    guessed = set(arms) - set(speed) if speed else set()
    slowest = min(speed.values(), default=0.0)
    speed.update({arm: slowest for arm in guessed})
    return guessed


def run_flops(run: dict) -> float:
    """Training FLOPs (full convention) of a run, its branches' extra cooldown tokens included."""
    return run["flops_per_token"]["full"] * run["tokens"] * (1 + sum(e - b for b, e in run["branches"]))


def _append(path: Path, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def point_names(run: dict) -> list[str]:
    return [f"branch_{e:g}" for _, e in run["branches"]] + ["final"]


# ---------------------------------------------------------------------------------------------
# Training one run


class _Kill(Exception):
    pass


def _record_point(run, ladder, data, out: Path, done: set, name: str, tokens_done: int, is_final: bool, ev: dict,
                  train_loss: float, wall_s: float, tps: float | None, chash: str, population: int = 1,
                  extra: dict | None = None) -> dict:
    """Appends one point of ``run`` to ``out/points.jsonl`` (and to ``done``) and returns it; ``ev`` is
    `k3.steps.evaluate`'s result, ``tps`` the run's training tokens/s (None when too few steps were
    timed); ``population`` > 1: the run trained in one program with others, that many in all;
    ``extra``: more fields for the record."""
    import jax

    from k3.hardware import device_peak_flops

    cfg = run["cfg"]
    n = run["counts"]["non_embedding_active_params"]
    fpt = run["flops_per_token"]
    peak = device_peak_flops()
    rec = {"arm": run["arm"], "size": run["size"], "d_model": cfg.model.d_model, "n_layers": cfg.model.n_layers,
           "seed": run["seed"], "repeat": run["repeat"], "lr_mult": run["lr_mult"], "lr": run["lr"],
           "lr_rule": run["lr_rule"], "run_id": run["run_id"],
           "point": name, "is_final": is_final, "tokens": tokens_done,
           "steps": tokens_done // (ladder.seq_len * ladder.batch_size),
           "tokens_per_param": tokens_done / n, "epochs": tokens_done / data.train.num_tokens,
           "params_non_embedding_active": n, "params_active": run["counts"]["active_params"],
           "params_total": run["counts"]["total_params"],
           "flops_6N": fpt["6N"] * tokens_done, "flops_full": fpt["full"] * tokens_done,
           "val_loss": ev["val_loss"], "val_bits_per_byte": ev["val_bits_per_byte"],
           "val_tokens": ev["val_tokens"], "train_loss": train_loss,
           "wall_s": wall_s, "tokens_per_s": tps,
           # The device's utilisation: a population's program trains all its members' tokens.
           "mfu_full": population * tps * fpt["full"] / peak if tps and peak else None,
           "config_hash": chash, "device": jax.devices()[0].device_kind,
           "ladder": ladder.name, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if population > 1:
        rec["population"] = population
    rec.update(extra or {})
    _append(out / "points.jsonl", rec)
    done.add((run["run_id"], name))
    print(f"  {run['run_id']:<28} {name:<11} D={tokens_done:>11,} val={ev['val_loss']:.4f} nats "
          f"({ev['val_bits_per_byte'] or float('nan'):.4f} bpb) {wall_s:.0f}s"
          + (f" {tps:,.0f} tok/s" if tps else ""), flush=True)
    return rec


def train_run(run: dict, ladder, data, out: Path, done: set, kill_after: list[int] | None = None) -> list[dict]:
    """Trains one run (resuming from its checkpoints) and appends its missing points; returns them."""
    import jax

    from k3.data.pipeline import TrainIterator, ValSource
    from k3.checkpoints import abstract_like, checkpoint_manager, copy_tree, restore_checkpoint, save_checkpoint
    from k3.optim import wsd_lr
    from k3.model import resolve_layer_loop
    from k3.steps import evaluate, make_run, to_host

    cfg = run["cfg"]
    # The layer loop shapes the parameter tree: the hash below names it, so a run's checkpoints are
    # not resumed on a platform whose 'auto' lays the layers out otherwise.
    resolve_layer_loop(cfg)
    S = run["steps"]
    warmup = max(1, round(ladder.warmup_frac * S))
    main_cool = S - max(1, round(ladder.decay_frac * S))
    rundir = out / "runs" / run["run_id"]
    rundir.mkdir(parents=True, exist_ok=True)
    chash = config_hash(run, ladder)
    stamp = rundir / "config_hash"
    if stamp.exists() and stamp.read_text().strip() != chash:
        # Checkpoints of another definition of this run (ladder file changed): start over.
        shutil.rmtree(rundir / "checkpoints", ignore_errors=True)
    stamp.write_text(chash)

    t0 = time.perf_counter()
    job, state = make_run(cfg)
    train_iter = TrainIterator(data.train, ladder.seq_len, ladder.batch_size, ladder.data_seed)
    v = data.meta["val"]
    val = ValSource(data.val, ladder.seq_len, ladder.batch_size, v.get("num_bytes"), v.get("num_text_tokens"))
    n_val = ladder.eval_batches or val.batches_per_pass
    cfg.train.keep_ckpts = 10_000  # branch starts must survive; the directory goes when the run is done
    cfg.train.async_ckpt = False
    mngr = checkpoint_manager(cfg, rundir)
    ckpt_every = max(1, round(ladder.ckpt_every * S))
    keep_steps = {round(b * S) for b, _ in run["branches"]}
    timing = [0.0, 0]  # seconds and steps of training (compilation and evaluation left out)
    last_loss = [float("nan")]

    def restore(step=None):
        st, meta = restore_checkpoint(mngr, abstract_like(state), step)
        train_iter.set_state(meta["data"])
        return st

    lr_at = jax.jit(wsd_lr)  # one dispatch per step rather than one per jnp op of the formula

    def advance(st, start, stop, cool_start, end, save):
        """Steps [start, stop) of a trajectory whose cooldown runs from cool_start to end."""
        pending = []  # device losses: read back in groups so the host does not wait on every step

        def check():
            for i, x in pending:
                loss = float(to_host(x))
                if not math.isfinite(loss):
                    raise LadderError(f"run {run['run_id']}: loss is {loss} at step {i + 1}")
                last_loss[0] = loss
            pending.clear()

        for t in range(start, stop):
            t1 = time.perf_counter()
            st["lr"] = lr_at(t, run["lr"], warmup, cool_start, end, ladder.min_lr_ratio)
            st, m = job.train_step(st, job.put_batch(next(train_iter)))
            pending.append((t, m["loss"]))
            save_now = save and ((t + 1) % ckpt_every == 0 or (t + 1) in keep_steps)
            if len(pending) >= 20 or save_now or t == stop - 1:
                check()
            if t > 0:  # the first step of a process compiles
                timing[0] += time.perf_counter() - t1
                timing[1] += 1
            if kill_after is not None:
                kill_after[0] -= 1
                if kill_after[0] <= 0:
                    check()
                    raise _Kill
            if save_now:
                save_checkpoint(mngr, st, train_iter.get_state(), cfg)
        return st

    def record(st, name, tokens_done, is_final):
        ev = evaluate(job, st, val, n_val)
        tps = ladder.seq_len * ladder.batch_size * timing[1] / timing[0] if timing[1] > 2 else None
        return _record_point(run, ladder, data, out, done, name, tokens_done, is_final, ev, last_loss[0],
                             time.perf_counter() - t0, tps, chash)

    written = []
    try:
        if mngr.latest_step() is not None:
            state = restore()
        step = int(to_host(state["step"]))
        for b, e in run["branches"]:
            name = f"branch_{e:g}"
            if (run["run_id"], name) in done:
                continue
            bs, es = round(b * S), round(e * S)
            if step < bs:
                state = advance(state, step, bs, main_cool, S, save=True)
                step = bs
            elif step > bs:
                state = restore(bs)
            main_state = copy_tree(state)  # train_step donates its input
            data_pos = train_iter.get_state()
            branch = advance(state, bs, es, bs, es, save=False)
            written.append(record(branch, name, es * ladder.seq_len * ladder.batch_size, False))
            del branch
            if step > bs:
                state = restore()
            else:
                state = main_state
                train_iter.set_state(data_pos)
        if (run["run_id"], "final") not in done:
            state = advance(state, step, S, main_cool, S, save=True)
            written.append(record(state, "final", S * ladder.seq_len * ladder.batch_size, True))
    finally:
        mngr.wait_until_finished()
        mngr.close()
    if all((run["run_id"], p) in done for p in point_names(run)):
        shutil.rmtree(rundir, ignore_errors=True)
    return written


class PopulationUnsupported(Exception):
    """The vmapped step of a population did not compile here; its runs train one at a time."""


def _batch_shapes(ladder) -> dict:
    """The train step's batch as abstract [batch_size, seq_len] arrays (what the data iterator yields)."""
    import jax
    import numpy as np

    B, T = ladder.batch_size, ladder.seq_len
    return {"inputs": jax.ShapeDtypeStruct((B, T), np.int32), "targets": jax.ShapeDtypeStruct((B, T), np.int32),
            "segment_ids": jax.ShapeDtypeStruct((B, T), np.int32),
            "loss_mask": jax.ShapeDtypeStruct((B, T), np.float32)}


def population_key(run: dict):
    """Runs with equal keys (not None) can train as one population: same arm, size, seed and steps,
    no branches, not a same-seed repeat (a repeat measures the device's run-to-run noise, which one
    program would not show)."""
    if run["branches"] or run["repeat"]:
        return None
    return run["arm"], run["size"], run["seed"], run["steps"]


def plan_units(todo: list[dict], population: int, out: Path) -> list[list[dict]]:
    """``todo`` as units of training, in order: lists of up to ``population`` runs of one
    `population_key` (the first member's place in ``todo`` is the unit's), else single runs. A run
    with checkpoints on disk stays single, so that it resumes from them."""
    units, placed = [], set()

    def joins(run):
        return population_key(run) is not None and not (out / "runs" / run["run_id"] / "checkpoints").exists()

    for i, r in enumerate(todo):
        if r["run_id"] in placed:
            continue
        unit = [r]
        if population > 1 and joins(r):
            unit += [n for n in todo[i + 1:] if n["run_id"] not in placed and joins(n)
                     and population_key(n) == population_key(r)][:population - 1]
        placed.update(u["run_id"] for u in unit)
        units.append(unit)
    return units


def train_population(runs: list[dict], ladder, data, out: Path, done: set,
                     kill_after: list[int] | None = None) -> list[dict]:
    """Trains ``runs`` (one `population_key`, final points only) as one program: their states stacked
    on a leading axis [M, ...], the step vmapped over it with the batch shared, each member at its
    own learning-rate schedule. Appends each member's final point; returns them. Not checkpointed."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from k3.data.pipeline import TrainIterator, ValSource
    from k3.model import resolve_layer_loop
    from k3.optim import wsd_lr
    from k3.steps import evaluate, make_run

    keys = {population_key(r) for r in runs}
    if len(keys) != 1 or None in keys:
        raise LadderError(f"runs {[r['run_id'] for r in runs]} cannot train as one population")
    for r in runs:  # as `train_run` does: the config hash names the resolved layer loop
        resolve_layer_loop(r["cfg"])
    first = runs[0]
    cfg = first["cfg"]
    M, S = len(runs), first["steps"]
    warmup = max(1, round(ladder.warmup_frac * S))
    main_cool = S - max(1, round(ladder.decay_frac * S))
    t0 = time.perf_counter()
    job, state = make_run(cfg)
    if job.sharder is not None:
        raise LadderError("a population trains on one device; set population = 1 for a mesh")
    if "lr" not in state:
        raise LadderError("a population needs optim.schedule='external' (the runner's setting)")
    pop = jax.tree.map(lambda x: jnp.stack([x] * M), state)
    del state  # the stack holds the members' copies
    lr_at = jax.jit(wsd_lr)
    peaks = jnp.asarray([r["lr"] for r in runs], jnp.float32)
    pop["lr"] = lr_at(0, peaks, warmup, main_cool, S, ladder.min_lr_ratio)
    train_iter = TrainIterator(data.train, ladder.seq_len, ladder.batch_size, ladder.data_seed)
    try:
        step = jax.jit(jax.vmap(job.step_fn, in_axes=(0, None)), donate_argnums=0).lower(
            pop, _batch_shapes(ladder)).compile()
    except Exception as e:  # noqa: BLE001 - a backend without a batching rule for some kernel
        raise PopulationUnsupported(f"{type(e).__name__}: {str(e)[:300]}") from e
    v = data.meta["val"]
    val = ValSource(data.val, ladder.seq_len, ladder.batch_size, v.get("num_bytes"), v.get("num_text_tokens"))
    n_val = ladder.eval_batches or val.batches_per_pass
    last_loss = [float("nan")] * M
    diverged = [0] * M  # the step whose loss was first non-finite, per member (0: none)
    timing = [0.0, 0]
    pending = []

    def check():
        for t, losses in pending:
            for i, loss in enumerate(np.asarray(losses, np.float64)):
                if diverged[i]:
                    continue
                if not math.isfinite(loss):
                    diverged[i] = t + 1
                    print(f"  {runs[i]['run_id']}: loss is {loss} at step {t + 1}; recorded as diverged", flush=True)
                else:
                    last_loss[i] = float(loss)
        pending.clear()

    for t in range(S):
        t1 = time.perf_counter()
        pop["lr"] = lr_at(t, peaks, warmup, main_cool, S, ladder.min_lr_ratio)
        pop, m = step(pop, job.put_batch(next(train_iter)))
        pending.append((t, m["loss"]))
        if len(pending) >= 20 or t == S - 1:
            check()
        if t > 0:  # as in `train_run`, whose first step compiles
            timing[0] += time.perf_counter() - t1
            timing[1] += 1
        if kill_after is not None:
            kill_after[0] -= 1
            if kill_after[0] <= 0:
                raise _Kill
    tps = ladder.seq_len * ladder.batch_size * timing[1] / timing[0] if timing[1] > 2 else None
    written = []
    for i, r in enumerate(runs):
        if diverged[i]:
            ev = {"val_loss": math.nan, "val_bits_per_byte": None, "val_tokens": 0}
        else:
            ev = evaluate(job, jax.tree.map(lambda x: x[i], pop), val, n_val)
        # tps: each member's own tokens over the program's time (the device trains M times as many)
        written.append(_record_point(r, ladder, data, out, done, "final", S * ladder.seq_len * ladder.batch_size,
                                     True, ev, last_loss[i], time.perf_counter() - t0, tps,
                                     config_hash(r, ladder), population=M,
                                     extra={"diverged_at_step": diverged[i]} if diverged[i] else None))
    return written


# ---------------------------------------------------------------------------------------------
# Compiling ahead


def compile_run_programs(run: dict, ladder) -> None:
    """Compiles ``run``'s programs as `train_run` will call them, running nothing: the initialiser,
    the optimizer's init, the train step (with the learning rate `wsd_lr` returns) and the eval step,
    on [batch_size, seq_len] batches. With a persistent compilation cache on, the run then loads them.
    Single-device runs only: on a mesh the batch's shardings would have to match too (a LadderError)."""
    import jax

    from k3.checkpoints import copy_tree
    from k3.model import resolve_layer_loop
    from k3.optim import wsd_lr
    from k3.steps import init_program, make_run

    cfg = copy.deepcopy(run["cfg"])
    resolve_layer_loop(cfg)
    held = {}

    def build():
        held["job"], state = make_run(cfg)
        return state

    state = jax.eval_shape(build)
    job = held["job"]
    if job.sharder is not None:
        raise LadderError("compiling ahead needs a single-device run")
    init_program(cfg)[1].lower().compile()
    jax.jit(job.tx.init).lower(state["params"]).compile()
    if "lr" in state:  # the type `train_run`'s jitted wsd_lr gives it (Python scalars in, as there)
        state["lr"] = jax.eval_shape(jax.jit(wsd_lr), 0, float(run["lr"]), 1, 1, 2, float(ladder.min_lr_ratio))
    batch = _batch_shapes(ladder)
    job.train_step.lower(state, batch).compile()
    job.eval_step.lower(state, batch).compile()
    copy_tree.lower(state).compile()  # checkpoints and branch starts


class CompileAhead:
    """Compiles runs' programs (`compile_run_programs`) on one background thread, in the order they
    are submitted; runs of the same arm, size and seed share one compile. A failure is reported by
    `wait`, and the run then compiles its programs itself. `close` drops what is queued and waits for
    the compile under way: a process must not exit while XLA compiles on another thread (the C++
    runtime aborts it, exit status 134)."""

    def __init__(self, ladder):
        self._ladder = ladder
        self._done: dict[tuple, threading.Event] = {}
        self._errors: dict[tuple, str] = {}
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="compile-ahead", daemon=True)
        self._thread.start()

    @staticmethod
    def key(run: dict) -> tuple:
        return run["arm"], run["size"], run["seed"]

    def _work(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, run = item
            try:
                compile_run_programs(run, self._ladder)
            except Exception as e:  # noqa: BLE001 - reported by `wait`; the run compiles itself
                self._errors[key] = f"{type(e).__name__}: {e}"
            finally:
                self._done[key].set()

    def submit(self, run: dict) -> None:
        """Queues ``run``'s compile (no-op if its key is already queued or done)."""
        key = self.key(run)
        if key not in self._done:
            self._done[key] = threading.Event()
            self._queue.put((key, run))

    def wait(self, run: dict) -> str | None:
        """Blocks until ``run``'s compile (if submitted) is over; returns its failure, if any."""
        done = self._done.get(self.key(run))
        if done is not None:
            done.wait()
        return self._errors.get(self.key(run))

    def close(self) -> None:
        """Drops the queued compiles, waits for the one under way and stops the thread."""
        while True:
            try:
                key, _ = self._queue.get_nowait()
            except queue.Empty:
                break
            self._errors[key] = "not compiled: compiling ahead was closed"
            self._done[key].set()
        self._queue.put(None)
        self._thread.join()


class CacheCounter:
    """Counts the main thread's persistent-cache hits and misses (`jax.monitoring` events)."""

    def __init__(self):
        import jax

        self.hits = self.misses = 0
        main = threading.main_thread()

        def listen(event, **_):
            if threading.current_thread() is main:
                if event == "/jax/compilation_cache/cache_hits":
                    self.hits += 1
                elif event == "/jax/compilation_cache/cache_misses":
                    self.misses += 1

        jax.monitoring.register_event_listener(listen)

    def take(self) -> tuple[int, int]:
        """(hits, misses) since the last call."""
        out = (self.hits, self.misses)
        self.hits = self.misses = 0
        return out


# ---------------------------------------------------------------------------------------------
# CLI


def load_ladder(path: str) -> ConfigDict:
    """The ladder ConfigDict of a ladder file (``get_config()``), checked against `default_ladder`."""
    import importlib.util

    file, _, arg = path.partition(":")
    if not Path(file).is_file():
        raise LadderError(f"--ladder {file}: no such file")
    spec = importlib.util.spec_from_file_location("_ladder_file", file)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        raise LadderError(f"--ladder {file} cannot be loaded: {type(e).__name__}: {e}") from None
    if not hasattr(mod, "get_config"):
        raise LadderError(f"--ladder {file} defines no get_config()")
    lad = mod.get_config(arg) if arg else mod.get_config()
    known = default_ladder()
    _check_keys(lad, known, "")
    return lad


def _check_keys(given, schema, prefix):
    for key, val in given.items():
        if key not in schema:
            raise LadderError(f"unknown ladder key {prefix}{key}")
        if isinstance(val, (ConfigDict, dict)):
            _check_keys(val, schema[key], f"{prefix}{key}.")
    missing = [k for k in schema if k not in given]
    if missing:
        raise LadderError(f"missing ladder key(s) {', '.join(prefix + k for k in missing)}")


def _csv(text):
    return [x.strip() for x in text.split(",") if x.strip()] if text else None


def check_epochs(runs: list[dict], train_tokens: int, max_epochs: float) -> None:
    """Raises LadderError when the largest run would read the training split (``train_tokens``
    tokens) more than ``max_epochs`` times. Branches end inside their run's tokens, so a run's
    ``tokens`` bound what it reads."""
    if not runs:
        return
    big = max(runs, key=lambda r: r["tokens"])
    epochs = big["tokens"] / max(train_tokens, 1)
    if epochs > max_epochs:
        raise LadderError(
            f"run {big['run_id']} would read {big['tokens']:,} tokens, {epochs:.2f} passes over the training "
            f"split of {train_tokens:,} tokens, more than the ladder's max_epochs={max_epochs:g}: use fewer "
            "tokens_per_param or smaller sizes, a larger corpus (data.source='site_packages', "
            "data.suffixes='code', data.extra_roots=...), or set max_epochs knowingly")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ladder", required=True, help="ladder file (get_config() from default_ladder())")
    p.add_argument("--out", required=True, help="results directory (points.jsonl, runs/, data/)")
    p.add_argument("--arms", default="", help="comma-separated subset of the ladder's arms")
    p.add_argument("--sizes", default="", help="comma-separated subset of the ladder's sizes")
    p.add_argument("--jobs", default=",".join(JOBS))
    p.add_argument("--set", default="", help="ladder overrides 'key=value,...' (e.g. tokens_per_param=10)")
    p.add_argument("--deadline_s", type=float, default=0,
                   help="start no new run after this many seconds, nor one its arm's last speed (this process's, "
                        "else the largest run recorded on this kind of device) says would pass it")
    p.add_argument("--compile_cache", default="",
                   help="persistent XLA compilation cache directory (default: JAX's own, else OUT/compile_cache)")
    p.add_argument("--no_compile_ahead", action="store_true",
                   help="do not compile the next run's programs while a run trains")
    p.add_argument("--dry_run", action="store_true", help="print the plan and exit")
    p.add_argument("--estimate_on", default="",
                   help="device kind whose recorded speeds estimate each run's time (default: this process's), "
                        "e.g. 'NVIDIA H200' to plan a GPU ladder from a CPU")
    p.add_argument("--speeds_from", default="",
                   help="results directory whose points*.jsonl give the recorded speeds (default: --out); its "
                        "points do not count as done")
    p.add_argument("--kill_after_steps", type=int, default=0, help=argparse.SUPPRESS)  # tests: a hard kill
    a = p.parse_args(argv)
    t_start = time.perf_counter()
    try:
        ladder = load_ladder(a.ladder)
        for item in _csv(a.set) or []:
            key, sep, val = item.partition("=")
            if not sep:
                raise LadderError(f"--set {item!r} is not key=value")
            _set_key(ladder, key, val)
        runs = plan_runs(ladder, _csv(a.arms), _csv(a.sizes), _csv(a.jobs))
    except LadderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        print(f"error: --out {out} exists and is not a directory", file=sys.stderr)
        return 2
    done = load_done(out) if out.exists() else set()
    todo = [r for r in runs if any((r["run_id"], n) not in done for n in point_names(r))]
    import jax

    device_kind = a.estimate_on or jax.devices()[0].device_kind
    # arm -> training FLOP/s (full convention): recorded on this kind of device, then this process's runs
    speeds_dir = Path(a.speeds_from) if a.speeds_from else out
    speed = recorded_speeds(speeds_dir, device_kind) if speeds_dir.is_dir() else {}
    pop_speed = recorded_speeds(speeds_dir, device_kind, population=True) if speeds_dir.is_dir() else {}
    guessed = guess_speeds(speed, {r["arm"] for r in runs})
    print(f"ladder {ladder.name}: {len(runs)} runs, {len(runs) - len(todo)} done, {len(todo)} to train")
    print(f"{'run':<28}{'N (non-emb act)':>16}{'steps':>8}{'tokens':>13}{'6ND':>10}{'full':>10}{'lr':>9}"
          f"{'est s':>8}  points")
    for r in runs:
        n = r["counts"]["non_embedding_active_params"]
        est = (f"{run_flops(r) / speed[r['arm']]:>7.0f}{'~' if r['arm'] in guessed else ' '}"
               if r["arm"] in speed else f"{'-':>8}")
        print(f"{r['run_id']:<28}{n:>16,}{r['steps']:>8}{r['tokens']:>13,}{6 * n * r['tokens']:>10.2e}"
              f"{r['flops_per_token']['full'] * r['tokens']:>10.2e}{r['lr']:>9.2e}{est}  "
              + ",".join(("*" if (r['run_id'], x) in done else "") + x for x in point_names(r)))
    known = [r for r in todo if r["arm"] in speed and r["arm"] not in guessed]
    if known:
        print(f"estimated training time of the {len(known)} runs to train whose arm has a speed recorded on "
              f"{device_kind!r}: {sum(run_flops(r) / speed[r['arm']] for r in known):,.0f} s (compilation and "
              f"evaluation not included; {len(todo) - len(known)} runs of arms without one)")
    if guessed:
        rest = [r for r in todo if r["arm"] in guessed]
        print(f"~ arms with no speed recorded on {device_kind!r} ({', '.join(sorted(guessed))}): estimated at the "
              f"slowest recorded arm's speed until their first run here measures their own; their {len(rest)} runs "
              f"to train: about {sum(run_flops(r) / speed[r['arm']] for r in rest):,.0f} s")
    if int(ladder.population) > 1:
        units = plan_units(todo, int(ladder.population), out)
        pops = [u for u in units if len(u) > 1]
        print(f"populations (up to {int(ladder.population)} runs in one program): {len(pops)}, training "
              f"{sum(map(len, pops))} of the {len(todo)} runs; "
              + (f"estimated {sum(_unit_estimate_s(u, speed, pop_speed) or 0.0 for u in units):,.0f} s in all"
                 if pop_speed else "no population speed recorded yet"))
    if a.dry_run or not todo:
        return 0
    from k3.backends import use_compile_cache

    if a.compile_cache or not jax.config.jax_compilation_cache_dir:
        use_compile_cache(a.compile_cache or str(out / "compile_cache"))
    from k3.data import DataError
    from k3.data.pipeline import prepare_data

    out.mkdir(parents=True, exist_ok=True)
    ahead = None if a.no_compile_ahead else CompileAhead(ladder)
    try:
        # The first single run's programs compile while the data is prepared (its model needs no data).
        first = next((u[0] for u in plan_units(todo, int(ladder.population), out)
                      if len(u) == 1 and not _too_late(u, 0.0, speed, a.deadline_s)), None)
        if ahead is not None and first is not None:
            ahead.submit(first)
        t_data = time.perf_counter()
        try:
            data = prepare_data(todo[0]["cfg"], out / "data")
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        phases = ", ".join(f"{k} {v:.0f}s" for k, v in data.meta.get("phases", {}).items())
        print(f"data: {data.train.num_tokens:,} training tokens, {data.val.num_tokens:,} held out; ready in "
              f"{time.perf_counter() - t_data:.0f}s{f' ({phases})' if phases else ''} "
              f"({time.perf_counter() - t_start:.0f}s since start)", flush=True)
        try:
            check_epochs(runs, data.train.num_tokens, ladder.max_epochs)
        except LadderError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if data.tokenizer.vocab_size > ladder.data.vocab_size:
            print(f"error: the tokenizer has {data.tokenizer.vocab_size} tokens but data.vocab_size is "
                  f"{ladder.data.vocab_size}", file=sys.stderr)
            return 2
        kill = [a.kill_after_steps] if a.kill_after_steps > 0 else None
        return _train_all(todo, ladder, data, out, done, kill, speed, ahead, a.deadline_s, t_start, pop_speed)
    finally:
        if ahead is not None:
            ahead.close()


def _estimate_s(run: dict, speed: dict) -> float | None:
    """Seconds ``run`` should train for at its arm's recorded speed (None without one)."""
    return run_flops(run) / speed[run["arm"]] if run["arm"] in speed else None


def _too_late(unit: list[dict], start_s: float, speed: dict, deadline_s: float, pop_speed: dict | None = None) -> bool:
    """Whether ``unit`` (a run, or a population: `plan_units`), started ``start_s`` seconds in, would pass
    the deadline (30 s to spare)."""
    est = _unit_estimate_s(unit, speed, pop_speed or {})
    return bool(deadline_s) and (start_s > deadline_s or (est is not None and start_s + est + 30 > deadline_s))


def _unit_estimate_s(unit: list[dict], speed: dict, pop_speed: dict) -> float | None:
    """Seconds a unit of `plan_units` should train for: a population at its arm's population speed
    (the program's FLOP/s), else as if its runs trained one after another; None without a speed."""
    if len(unit) == 1:
        return _estimate_s(unit[0], speed)
    rate = pop_speed.get(unit[0]["arm"]) or speed.get(unit[0]["arm"])
    return sum(run_flops(r) for r in unit) / rate if rate else None


def _train_all(todo, ladder, data, out, done, kill, speed, ahead, deadline_s, t_start,
               pop_speed: dict | None = None) -> int:
    """Trains ``todo`` in order (as `plan_units` groups it), skipping what the deadline leaves no time
    for; the exit status. A population the deadline cannot fit loses members from its end first."""
    from k3.steps import RunError

    pop_speed = {} if pop_speed is None else pop_speed

    def too_late(unit, start_s):
        return _too_late(unit, start_s, speed, deadline_s, pop_speed)

    cache = CacheCounter()
    units = plan_units(todo, int(ladder.population), out)
    for i, unit in enumerate(units):
        elapsed = time.perf_counter() - t_start
        r = unit[0]
        if deadline_s and elapsed > deadline_s:
            print(f"deadline: {deadline_s:.0f}s passed; stopping before {r['run_id']} (rerun to resume)")
            break
        while len(unit) > 1 and too_late(unit, elapsed):
            print(f"deadline: {unit[-1]['run_id']} left out of its population (rerun to resume)")
            unit = unit[:-1]
        if too_late(unit, elapsed):
            print(f"deadline: {r['run_id']} would need about {_estimate_s(r, speed):.0f}s; skipped (rerun to resume)")
            continue
        if len(unit) == 1:
            print(f"run {r['run_id']}: {r['steps']} steps, lr {r['lr']:.3e} (at {elapsed:.0f}s)", flush=True)
        else:
            print(f"population of {len(unit)}: {', '.join(u['run_id'] for u in unit)}: {r['steps']} steps, lr "
                  f"{', '.join(format(u['lr'], '.3e') for u in unit)} (at {elapsed:.0f}s)", flush=True)
        if ahead is not None and len(unit) == 1:  # a population compiles its own (vmapped) step
            ahead.submit(r)
            failed = ahead.wait(r)
            if failed:  # the runs compile their own programs from here on
                print(f"  compiling ahead failed ({failed[:300]}); it is off for the rest of this process")
                ahead = None
        if ahead is not None:
            # The next single run this unit leaves time for: compiling one the deadline skips only delays
            # the exit.
            after = elapsed + (_unit_estimate_s(unit, speed, pop_speed) or 0.0)
            nxt = next((n for n in units[i + 1:] if len(n) == 1 and not too_late(n, after)), None)
            if nxt is not None:
                ahead.submit(nxt[0])
        cache.take()
        try:
            if len(unit) == 1:
                recs = train_run(r, ladder, data, out, done, kill)
            else:
                try:
                    recs = train_population(unit, ladder, data, out, done, kill)
                except PopulationUnsupported as e:
                    print(f"  the population's step did not compile ({e}); its runs train one at a time, and "
                          "so do later ones", flush=True)
                    units[i + 1:] = [[x] for u in units[i + 1:] for x in u]  # the loop reads the list as it goes
                    recs = [rec for u in unit for rec in train_run(u, ladder, data, out, done, kill)]
                    unit = unit[:1]
            hits, misses = cache.take()
            print(f"  programs: {hits} from the compilation cache, {misses} compiled", flush=True)
            if recs and recs[-1]["tokens_per_s"]:
                flops_per_s = recs[-1]["tokens_per_s"] * r["flops_per_token"]["full"]
                if len(unit) == 1:
                    speed[r["arm"]] = flops_per_s
                else:
                    pop_speed[r["arm"]] = len(unit) * flops_per_s
        except _Kill:
            os._exit(137)  # as a SIGKILL would: no cleanup, no flush beyond what is on disk
        except (LadderError, RunError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
