"""The scaling-ladder runner: plan, schedules, the run-time learning rate, resume after a kill."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from experiments import run_ladder as rl
from k3.config import default_config
from k3.optim import wsd_lr
from tests.conftest import tiny_model_cfg

ROOT = Path(__file__).resolve().parents[1]
MICRO = "experiments/configs/ladder_micro.py"


def _cli(*args, timeout=900):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "experiments.run_ladder", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def _points(out):
    recs = [json.loads(x) for x in (Path(out) / "points.jsonl").read_text().splitlines() if x.strip()]
    return {(r["run_id"], r["point"]): r for r in recs}


# ---------------------------------------------------------------------------------------------
# Schedules and plan


def test_schedule_warmup_stable_sqrt_cooldown():
    peak, W, c, E = 2.0, 4, 10, 20
    lrs = [float(wsd_lr(t, peak, W, c, E, 0.0)) for t in range(E)]
    np.testing.assert_allclose(lrs[:W], [peak * (t + 1) / (W + 1) for t in range(W)])
    assert lrs[W:c] == [peak] * (c - W)
    for t in range(c, E):
        assert lrs[t] == pytest.approx(peak * (1 - math.sqrt((t - c + 1) / (E - c))))
    assert lrs[-1] == 0.0
    assert all(a >= b for a, b in zip(lrs[c - 1:], lrs[c:]))
    # A branch shares the stable phase of the main trajectory up to its start.
    S = 100
    main = [float(wsd_lr(t, 1.0, 2, 80, S, 0.1)) for t in range(S)]
    branch = [float(wsd_lr(t, 1.0, 2, 40, 50, 0.1)) for t in range(50)]
    assert main[:40] == branch[:40]
    assert branch[-1] == pytest.approx(0.1)


def test_plan_micro_ladder_order_ids_and_tokens():
    lad = rl.load_ladder(MICRO)
    runs = rl.plan_runs(lad)
    ids = [r["run_id"] for r in runs]
    assert ids[:6] == ["k2-32x2-s0-lr1", "k3-32x2-s0-lr1", "k2-64x2-s0-lr1", "k3-64x2-s0-lr1",
                       "k2-96x2-s0-lr1", "k3-96x2-s0-lr1"]
    assert ids[6:] == ["k2-32x2-s1-lr1", "k3-32x2-s1-lr1", "k2-32x2-s0-lr1-r1", "k3-32x2-s0-lr1-r1",
                       "k2-32x2-s0-lr0p5", "k3-32x2-s0-lr0p5"]
    # A same-seed repeat is the main run's config again (its spread is the device's run-to-run noise).
    assert runs[8]["cfg"].to_json() == runs[0]["cfg"].to_json() and runs[8]["repeat"] == 1
    tps = lad.seq_len * lad.batch_size
    for r in runs:
        n = r["counts"]["non_embedding_active_params"]
        assert r["steps"] == max(lad.min_steps, round(lad.tokens_per_param * n / tps))
        assert r["tokens"] == r["steps"] * tps
        assert r["cfg"].optim.schedule == "external"
        main_run = r["seed"] == 0 and r["lr_mult"] == 1 and not r["repeat"]
        assert rl.point_names(r) == (["branch_0.5", "final"] if main_run else ["final"])
    # One rule for every arm: lr = coef * (6 N D)^exp, times the sweep multiplier.
    r = runs[1]
    n = r["counts"]["non_embedding_active_params"]
    assert r["lr"] == pytest.approx(lad.lr_coef * (6 * n * r["tokens"]) ** lad.lr_exp)
    assert runs[-1]["lr"] == pytest.approx(0.5 * r["lr"])
    # Filters.
    sub = rl.plan_runs(lad, arms=["k3"], sizes=["64x2"], jobs=["main"])
    assert [x["run_id"] for x in sub] == ["k3-64x2-s0-lr1"]
    # The config hash follows what defines the results.
    h0 = rl.config_hash(runs[0], lad)
    assert h0 == rl.config_hash(rl.plan_runs(lad)[0], lad)
    lad.lr_coef = 0.2
    assert rl.config_hash(rl.plan_runs(lad)[0], lad) != h0


def test_plan_units_group_the_sweep_of_one_shape_and_keep_branched_repeated_and_checkpointed_runs_single(tmp_path):
    lad = rl.load_ladder(MICRO)
    lad.lr_sweep, lad.sweep_sizes, lad.seed_sizes = "0.5,2.0,4.0", 2, 1
    runs = rl.plan_runs(lad, arms=["k2", "k3"], jobs=["main", "seeds", "repeats", "sweep"])
    units = [[r["run_id"] for r in u] for u in rl.plan_units(runs, 2, tmp_path)]
    assert units[:10] == [[r["run_id"]] for r in runs[:10]]  # main runs (branches), seeds, same-seed repeats
    assert units[10:] == [["k2-32x2-s0-lr0p5", "k2-32x2-s0-lr2"], ["k2-32x2-s0-lr4"],
                         ["k3-32x2-s0-lr0p5", "k3-32x2-s0-lr2"], ["k3-32x2-s0-lr4"],
                         ["k2-64x2-s0-lr0p5", "k2-64x2-s0-lr2"], ["k2-64x2-s0-lr4"],
                         ["k3-64x2-s0-lr0p5", "k3-64x2-s0-lr2"], ["k3-64x2-s0-lr4"]]
    assert sum(units, []) == [r["run_id"] for r in runs]  # every run once
    assert all(len(u) == 1 for u in rl.plan_units(runs, 1, tmp_path))
    # A run that has checkpoints resumes from them, on its own.
    (tmp_path / "runs" / "k2-32x2-s0-lr2" / "checkpoints").mkdir(parents=True)
    units = [[r["run_id"] for r in u] for u in rl.plan_units(runs, 4, tmp_path)]
    assert ["k2-32x2-s0-lr0p5", "k2-32x2-s0-lr4"] in units and ["k2-32x2-s0-lr2"] in units
    with pytest.raises(rl.LadderError, match="cannot train as one population"):
        rl.train_population([runs[0], runs[-1]], lad, None, tmp_path, set())


def test_per_arm_rules_set_own_rates_ids_and_shared_rule_runs():
    """An arm with its own rule trains main, seed and sweep runs at coef * (6ND)^exp (ids tagged with
    the rule), the 'shared' job trains it again at the shared rule under the plain ids, and an arm
    without a rule is planned exactly as before."""
    plain = {r["run_id"]: r for r in rl.plan_runs(rl.load_ladder(MICRO))}
    lad = rl.load_ladder(MICRO)
    lad.lr_rules = "k3=0.5:-0.1"
    runs = rl.plan_runs(lad)
    tag = rl._rule_tag(0.5, -0.1)
    for r in runs:
        n = r["counts"]["non_embedding_active_params"]
        if r["arm"] == "k2":
            assert r["lr_rule"] == "shared" and r["lr"] == plain[r["run_id"]]["lr"]
        elif r["lr_rule"] == "own":
            assert tag in r["run_id"]
            assert r["lr"] == pytest.approx(r["lr_mult"] * 0.5 * (6 * n * r["tokens"]) ** -0.1)
        else:  # the shared-rule copy of a k3 main run: the plain id and rate, no branches
            assert r["run_id"] in plain and r["lr"] == plain[r["run_id"]]["lr"] and r["branches"] == []
    ids = [r["run_id"] for r in runs]
    assert ids[:2] == ["k2-32x2-s0-lr1", f"k3-32x2-s0-lr1{tag}"]
    assert [i for i in ids if i.startswith("k3") and tag not in i] == ["k3-32x2-s0-lr1", "k3-64x2-s0-lr1",
                                                                       "k3-96x2-s0-lr1"]
    assert f"k3-32x2-s0-lr0p5{tag}" in ids and f"k3-32x2-s0-lr1{tag}-r1" in ids
    # A refitted rule gives new run ids, so old points never count as done for it.
    lad.lr_rules = "k3=0.6:-0.1"
    assert f"k3-32x2-s0-lr1{tag}" not in [r["run_id"] for r in rl.plan_runs(lad, jobs=["main"])]
    assert rl.plan_runs(lad, jobs=["shared"], arms=["k2"]) == []


def test_arm_sizes_give_an_arm_its_own_shapes_in_rank_order():
    lad = rl.load_ladder(MICRO)
    lad.arm_sizes = "k3=64x4,32x4"
    runs = rl.plan_runs(lad)
    ids = [r["run_id"] for r in runs]
    assert ids[:5] == ["k2-32x2-s0-lr1", "k3-32x4-s0-lr1", "k2-64x2-s0-lr1", "k3-64x4-s0-lr1", "k2-96x2-s0-lr1"]
    # seeds, repeats and the sweep take each arm's own smallest sizes
    assert ids[5:] == ["k2-32x2-s1-lr1", "k3-32x4-s1-lr1", "k2-32x2-s0-lr1-r1", "k3-32x4-s0-lr1-r1",
                       "k2-32x2-s0-lr0p5", "k3-32x4-s0-lr0p5"]
    assert runs[1]["cfg"].model.n_layers == 4 and runs[1]["cfg"].model.d_model == 32
    assert [r["run_id"] for r in rl.plan_runs(lad, sizes=["64x4"])] == ["k3-64x4-s0-lr1"]
    with pytest.raises(rl.LadderError, match="'128x4' is not in the ladder's sizes"):
        rl.plan_runs(lad, sizes=["128x4"])


@pytest.mark.parametrize("key, text, message", [
    ("arm_sizes", "k9=32x2", "arm 'k9', which is not in the ladder's arms"),
    ("arm_sizes", "k3", "is not 'arm=SIZE,SIZE,...'"),
    ("arm_sizes", "k3=32x2;k3=64x2", "gives arm 'k3' twice"),
    ("arm_sizes", "k3=32x2,32x2", "repeats a size"),
    ("arm_sizes", "k3=32", "not 'D_MODELxN_LAYERS'"),
    ("lr_rules", "k9=1:-0.1", "arm 'k9', which is not in the ladder's arms"),
    ("lr_rules", "k3=1", "is not 'arm=coef:exp'"),
    ("lr_rules", "k3", "is not 'arm=coef:exp'"),
    ("lr_rules", "k3=0:-0.1", "coef must be a positive number"),
    ("lr_rules", "k3=1:-0.1; k3=2:-0.1", "gives arm 'k3' twice"),
])
def test_bad_arm_sizes_and_lr_rules_name_the_problem(key, text, message):
    lad = rl.load_ladder(MICRO)
    lad[key] = text
    with pytest.raises(rl.LadderError, match=message):
        rl.plan_runs(lad)


def test_lr_rules_through_the_command_line(tmp_path, capsys):
    out = tmp_path / "o"
    assert rl.main([f"--ladder={MICRO}", f"--out={out}", "--dry_run", "--jobs=main,shared",
                    "--set=lr_rules=k2=0.4:-0.12;k3=0.5:-0.1"]) == 0
    text = capsys.readouterr().out
    assert "12 runs, 0 done, 12 to train" in text and rl._rule_tag(0.4, -0.12) in text
    assert rl.main([f"--ladder={MICRO}", f"--out={out}", "--dry_run", "--set=lr_rules=k2=x"]) == 2
    assert "is not 'arm=coef:exp'" in capsys.readouterr().err
    assert not out.exists()


def test_mechanism_arms_swap_one_piece_each():
    from experiments.configs.ladder import arm_config

    k2, k3 = arm_config("k2", 128, 4).model, arm_config("k3", 128, 4).model
    hyb = arm_config("k2+kda_hybrid", 128, 4).model
    res = arm_config("k2+attn_res", 128, 4).model
    moe = arm_config("k2+latent_moe_qb", 128, 4).model
    assert (hyb.mixer, hyb.mla.use_rope, hyb.mla.output_gate) == (k3.mixer, k3.mla.use_rope, k3.mla.output_gate)
    assert (hyb.residual, hyb.moe.to_dict(), hyb.activation) == (k2.residual, k2.moe.to_dict(), k2.activation)
    assert res.residual == k3.residual and (res.mixer, res.moe.to_dict()) == (k2.mixer, k2.moe.to_dict())
    assert moe.moe.to_dict() == k3.moe.to_dict() and moe.activation == k3.activation
    assert (moe.mixer, moe.residual) == (k2.mixer, k2.residual)


@pytest.mark.parametrize("bad, message", [
    ({"sizes": "64"}, "not 'D_MODELxN_LAYERS'"),
    ({"arms": "k2,k9"}, "ladder arm 'k9' unknown"),
    ({"branches": "0.5:0.4"}, "0 < start < end < 1"),
    ({"branches": "0.85:0.9"}, "before the main run's cooldown"),
    ({"sizes": "48x2"}, "multiple of 32"),
    ({"overrides": "model.nope=1"}, "no such config key"),
])
def test_bad_ladders_name_the_problem(bad, message):
    lad = rl.load_ladder(MICRO)
    lad.update(bad)
    with pytest.raises(rl.LadderError, match=message):
        rl.plan_runs(lad)


def test_cli_errors_exit_2(tmp_path, capsys):
    assert rl.main([f"--ladder={tmp_path}/none.py", f"--out={tmp_path}/o"]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.py"
    bad.write_text("from experiments.run_ladder import default_ladder\n"
                   "def get_config():\n    c = default_ladder()\n    c.unlocked = 1\n    return c\n")
    assert rl.main([f"--ladder={bad}", f"--out={tmp_path}/o"]) == 2
    assert "unknown ladder key unlocked" in capsys.readouterr().err
    assert rl.main([f"--ladder={MICRO}", f"--out={tmp_path}/o", "--arms=k3,k7"]) == 2
    assert "'k7' is not in the ladder's arms" in capsys.readouterr().err
    assert rl.main([f"--ladder={MICRO}", f"--out={tmp_path}/o", "--set=tokens_per_param=lots"]) == 2
    assert "expected float" in capsys.readouterr().err
    f = tmp_path / "file"
    f.write_text("x")
    assert rl.main([f"--ladder={MICRO}", f"--out={f}"]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # nothing written on bad input
    assert f.read_text() == "x"


def test_done_points_skip_and_merge(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "points.jsonl").write_text(json.dumps({"run_id": "k2-32x2-s0-lr1", "point": "final"}) + "\n")
    (out / "points_gpu2.jsonl").write_text(json.dumps({"run_id": "k2-32x2-s0-lr1", "point": "branch_0.5"}) + "\n"
                                           + '{"run_id": "cut')  # a line cut by a kill is ignored
    assert rl.main([f"--ladder={MICRO}", f"--out={out}", "--dry_run"]) == 0
    text = capsys.readouterr().out
    assert "12 runs, 1 done, 11 to train" in text
    assert "*branch_0.5,*final" in text


def test_recorded_speed_lets_the_deadline_skip_a_run_that_would_not_finish(tmp_path, capsys):
    """A new process estimates an arm's next run from the FLOP/s its largest recorded run reached on
    this kind of device (other devices' records are ignored), and skips what would pass the deadline."""
    out = tmp_path / "o"
    out.mkdir()
    kind = jax.devices()[0].device_kind
    rec = dict(arm="k2", run_id="k2-x", point="final", tokens=1000, flops_full=1e9, tokens_per_s=1e-3, device=kind)
    lines = [rec, dict(rec, arm="k3", device="another GPU"), dict(rec, run_id="k2-y", flops_full=1e6, tokens_per_s=1e6)]
    (out / "points_old.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert rl.recorded_speeds(out, kind) == {"k2": pytest.approx(1e3)}  # the largest run: 1e-3 tok/s x 1e6 FLOP/token
    assert rl.main([f"--ladder={MICRO}", f"--out={out}", "--arms=k2", "--sizes=32x2", "--jobs=main",
                    "--deadline_s=600"]) == 0
    text = capsys.readouterr().out
    assert "deadline: k2-32x2-s0-lr1 would need about" in text and "run k2-32x2" not in text
    assert not (out / "points.jsonl").exists()
    # The same records estimate a dry run's time from another directory, whose points are not "done".
    plan_dir = tmp_path / "plan"
    assert rl.main([f"--ladder={MICRO}", f"--out={plan_dir}", "--arms=k2", "--jobs=main", "--dry_run",
                    f"--speeds_from={out}", f"--estimate_on={kind}"]) == 0
    text = capsys.readouterr().out
    runs = rl.plan_runs(rl.load_ladder(MICRO), arms=["k2"], jobs=["main"])
    total = sum(rl.run_flops(r) / 1e3 for r in runs)
    assert "3 runs, 0 done, 3 to train" in text and "of the 3 runs to train" in text and f"{total:,.0f} s" in text


def test_an_arm_without_a_recorded_speed_is_estimated_at_the_slowest_arms(tmp_path, capsys):
    """A mechanism arm's first run in a process has no speed of its own: the deadline estimates it at the
    slowest recorded arm's FLOP/s rather than starting it blind."""
    speed = {"k2": 5.0, "k3": 2.0}
    assert rl.guess_speeds(speed, {"k2", "k3", "k2+attn_res"}) == {"k2+attn_res"}
    assert speed == {"k2": 5.0, "k3": 2.0, "k2+attn_res": 2.0}
    empty = {}
    assert rl.guess_speeds(empty, {"k2"}) == set() and empty == {}
    out = tmp_path / "o"
    out.mkdir()
    kind = jax.devices()[0].device_kind
    rec = dict(arm="k2", run_id="k2-x", point="final", tokens=1000, flops_full=1e9, tokens_per_s=1e-3, device=kind)
    (out / "points_old.jsonl").write_text(json.dumps(rec) + "\n")
    assert rl.main([f"--ladder={MICRO}", f"--out={out}", "--arms=k3", "--sizes=32x2", "--jobs=main",
                    "--deadline_s=600"]) == 0
    text = capsys.readouterr().out
    assert "~ arms with no speed recorded" in text and "(k3)" in text
    assert "deadline: k3-32x2-s0-lr1 would need about" in text and "run k3-32x2" not in text
    assert not (out / "points.jsonl").exists()


# ---------------------------------------------------------------------------------------------
# The run-time learning rate equals a compiled-in schedule


@pytest.mark.slow
def test_external_learning_rate_equals_wsd_schedule():
    from k3.optim import learning_rate_schedule
    from k3.steps import make_run

    def cfg(schedule):
        c = default_config()
        c.model = tiny_model_cfg()
        c.data.seq_len, c.data.batch_size = 16, 2
        c.steps = 6
        c.optim.update(dict(schedule=schedule, lr=0.02, adam_lr=0.01, warmup_steps=2, decay_frac=0.5,
                            min_lr_ratio=0.1))
        return c

    rng = np.random.default_rng(3)
    batches = []
    for _ in range(6):
        toks = rng.integers(0, 97, (2, 17)).astype(np.int32)
        batches.append({"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": np.ones((2, 16), np.int32),
                        "loss_mask": np.ones((2, 16), np.float32)})
    ref_run, ref = make_run(cfg("wsd"))
    ext_cfg = cfg("external")
    ext_run, ext = make_run(ext_cfg)
    sched = learning_rate_schedule(cfg("wsd").optim, 6)
    for t, b in enumerate(batches):
        ref, m_ref = ref_run.train_step(ref, b)
        ext["lr"] = jax.numpy.asarray(sched(t), jax.numpy.float32)
        ext, m_ext = ext_run.train_step(ext, b)
        np.testing.assert_allclose(float(m_ext["lr"]), float(m_ref["lr"]), rtol=1e-6)
        np.testing.assert_allclose(float(m_ext["loss"]), float(m_ref["loss"]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(ref["params"])), jax.tree.leaves(nnx.to_pure_dict(ext["params"]))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)


# ---------------------------------------------------------------------------------------------
# End to end (CPU): kills, resumes, fits, plots


@pytest.mark.slow
def test_resume_after_kill_reproduces_uninterrupted_points(tmp_path):
    """A run killed before its branch and one killed between branch and final give the same points."""
    common = [f"--ladder={MICRO}", "--arms=k2", "--sizes=32x2", "--jobs=main"]
    ref = _cli(*common, f"--out={tmp_path}/ref", "--no_compile_ahead")  # the kills compile ahead: same points
    assert ref.returncode == 0, ref.stderr[-2000:]
    want = _points(tmp_path / "ref")
    assert set(want) == {("k2-32x2-s0-lr1", "branch_0.5"), ("k2-32x2-s0-lr1", "final")}
    for kill in (3, 7):  # branch starts at step 4, ends at 5; main cooldown from step 8 of 10
        out = tmp_path / f"kill{kill}"
        p = _cli(*common, f"--out={out}", f"--kill_after_steps={kill}")
        assert p.returncode == 137, p.stderr[-2000:]
        assert (out / "runs" / "k2-32x2-s0-lr1" / "checkpoints").is_dir()
        p = _cli(*common, f"--out={out}")
        assert p.returncode == 0, p.stderr[-2000:]
        got = _points(out)
        assert set(got) == set(want)
        for key in want:
            assert got[key]["val_loss"] == pytest.approx(want[key]["val_loss"], rel=1e-5), (kill, key)
            assert got[key]["tokens"] == want[key]["tokens"]
        assert not (out / "runs" / "k2-32x2-s0-lr1").exists()  # checkpoints go once the run is done


@pytest.mark.slow
def test_population_trains_like_single_runs_fits_the_deadline_and_records_a_diverged_member(tmp_path, capsys):
    """K3's sweep runs of one shape train as one vmapped program: a member's point equals the run trained
    alone, a member whose loss turns nan is recorded as diverged while the others go on, and a deadline
    that cannot fit the whole population (no population speed recorded: estimated as runs one after
    another) leaves its last members for a later process."""
    ladder_file = tmp_path / "ladder_pop.py"
    ladder_file.write_text("from experiments.configs.ladder_micro import get_config as micro\n\n\n"
                           "def get_config():\n    c = micro()\n    c.lr_sweep = '1e8,0.5,2.0'\n"
                           "    c.population = 4\n    return c\n")
    out, ref = tmp_path / "pop", tmp_path / "ref"
    out.mkdir()
    run = rl.plan_runs(rl.load_ladder(str(ladder_file)), arms=["k3"], sizes=["32x2"], jobs=["sweep"])[0]
    kind = jax.devices()[0].device_kind  # a record that makes each of these runs an estimated 200 s
    rec = dict(arm="k3", run_id="k3-old", point="final", tokens=run["tokens"], flops_full=rl.run_flops(run),
               tokens_per_s=run["tokens"] / 200.0, device=kind)
    (out / "points_old.jsonl").write_text(json.dumps(rec) + "\n")
    args = [f"--ladder={ladder_file}", "--arms=k3", "--sizes=32x2", "--jobs=sweep", "--no_compile_ahead"]
    assert rl.main(args + [f"--out={out}", "--deadline_s=480"]) == 0
    text = capsys.readouterr().out
    assert "deadline: k3-32x2-s0-lr2 left out of its population" in text
    assert "population of 2: k3-32x2-s0-lr1e+08, k3-32x2-s0-lr0p5" in text
    got = _points(out)
    assert set(got) == {("k3-32x2-s0-lr1e+08", "final"), ("k3-32x2-s0-lr0p5", "final")}
    bad, good = got[("k3-32x2-s0-lr1e+08", "final")], got[("k3-32x2-s0-lr0p5", "final")]
    assert math.isnan(bad["val_loss"]) and bad["diverged_at_step"] >= 1 and bad["population"] == 2
    assert math.isfinite(good["val_loss"]) and good["population"] == 2 and "diverged_at_step" not in good
    assert good["tokens_per_s"] > 0 and good["steps"] == run["steps"]
    assert rl.main([f"--ladder={MICRO}", "--arms=k3", "--sizes=32x2", "--jobs=sweep", f"--out={ref}",
                    "--no_compile_ahead"]) == 0  # the micro ladder's sweep: x0.5 alone
    alone = _points(ref)[("k3-32x2-s0-lr0p5", "final")]
    assert good["config_hash"] == alone["config_hash"] and "population" not in alone
    assert good["val_loss"] == pytest.approx(alone["val_loss"], rel=1e-5)
    # The population's speed now estimates the next one (the left-out member: one run, at its own speed).
    assert rl.recorded_speeds(out, kind, population=True)["k3"] == pytest.approx(
        2 * good["tokens_per_s"] * good["flops_full"] / good["tokens"])


@pytest.mark.slow
def test_a_population_whose_step_does_not_compile_trains_its_runs_one_at_a_time(tmp_path, capsys, monkeypatch):
    lad = tmp_path / "ladder_pop.py"
    lad.write_text("from experiments.configs.ladder_micro import get_config as micro\n\n\n"
                   "def get_config():\n    c = micro()\n    c.lr_sweep = '0.5,2.0'\n    c.population = 2\n"
                   "    c.sweep_sizes = 2\n    return c\n")

    def unsupported(*a, **k):
        raise rl.PopulationUnsupported("no batching rule")

    monkeypatch.setattr(rl, "train_population", unsupported)
    assert rl.main([f"--ladder={lad}", "--arms=k2", "--jobs=sweep", f"--out={tmp_path}/o", "--no_compile_ahead"]) == 0
    text = capsys.readouterr().out
    assert text.count("did not compile (no batching rule)") == 1  # and the next size's pair is planned singly
    assert "run k2-64x2-s0-lr0p5" in text and "run k2-64x2-s0-lr2" in text
    got = _points(tmp_path / "o")
    assert len(got) == 4 and all("population" not in r for r in got.values())


def test_compile_ahead_keeps_order_shares_a_key_and_reports_failures(monkeypatch):
    """Compiles run one after another in submission order, once per (arm, size, seed); a failure is
    returned by `wait` (the runner then lets each run compile its own programs)."""
    calls = []

    def fake(run, ladder):
        calls.append(run["run_id"])
        if run["run_id"] == "b":
            raise ValueError("boom")

    monkeypatch.setattr(rl, "compile_run_programs", fake)
    ahead = rl.CompileAhead(ladder=None)
    runs = [dict(arm="k2", size="32x2", seed=seed, run_id=name) for seed, name in ((0, "a"), (1, "b"), (0, "a2"))]
    for r in runs:
        ahead.submit(r)
    assert ahead.wait(runs[2]) is None  # same key as "a": compiled once
    assert ahead.wait(runs[1]) == "ValueError: boom"
    assert ahead.wait(runs[0]) is None
    assert calls == ["a", "b"]


def test_compile_ahead_close_waits_for_the_compile_under_way_and_drops_the_queue(monkeypatch):
    """`close` returns only once the running compile is over (a process exiting while XLA compiles on
    another thread aborts), and the queued ones never start."""
    import threading

    started, release, calls = threading.Event(), threading.Event(), []

    def fake(run, ladder):
        calls.append(run["run_id"])
        started.set()
        assert release.wait(10)

    monkeypatch.setattr(rl, "compile_run_programs", fake)
    ahead = rl.CompileAhead(ladder=None)
    runs = [dict(arm="k2", size="32x2", seed=seed, run_id=f"r{seed}") for seed in range(3)]
    for r in runs:
        ahead.submit(r)
    assert started.wait(10)
    closer = threading.Thread(target=ahead.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()  # still waiting for r0's compile
    release.set()
    closer.join(10)
    assert not closer.is_alive() and not ahead._thread.is_alive()
    assert calls == ["r0"]
    assert ahead.wait(runs[0]) is None
    assert "closed" in ahead.wait(runs[2])


@pytest.mark.slow
def test_next_run_finds_its_programs_compiled_ahead(tmp_path):
    """The first run's programs are compiled while the data is prepared, and while a run trains the
    next run's: with an empty cache, the first size compiles at most two small one-off programs of
    the process itself, the second size nothing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["PYTHONUNBUFFERED"] = "1"
    p = subprocess.run([sys.executable, "-m", "experiments.run_ladder", f"--ladder={MICRO}", "--arms=k2",
                        "--sizes=32x2,64x2", "--jobs=main", f"--out={tmp_path}/out"], cwd=ROOT, capture_output=True,
                       text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (tmp_path / "out" / "compile_cache").is_dir()  # the default cache: under --out
    counts = [tuple(map(int, m.groups())) for m in re.finditer(r"programs: (\d+) from the compilation cache, "
                                                                 r"(\d+) compiled", p.stdout)]
    assert len(counts) == 2, p.stdout
    (hits0, compiled0), (hits1, compiled1) = counts
    assert hits0 >= 4 and compiled0 <= 2 and hits1 >= 4 and compiled1 == 0, counts


@pytest.mark.slow
def test_micro_ladder_end_to_end_fit_and_plot(tmp_path):
    out = tmp_path / "ladder"
    p = _cli(f"--ladder={MICRO}", f"--out={out}", "--kill_after_steps=25")
    assert p.returncode == 137, p.stderr[-2000:]
    p = _cli(f"--ladder={MICRO}", f"--out={out}")
    assert p.returncode == 0, p.stderr[-2000:]
    pts = _points(out)
    assert len(pts) == 6 * 2 + 6  # 6 main runs x (branch, final) + 2 seed runs + 2 same-seed repeats + 2 sweep runs
    for r in pts.values():
        assert r["flops_6N"] == pytest.approx(6 * r["params_non_embedding_active"] * r["tokens"])
        assert r["flops_full"] > r["flops_6N"]
        assert math.isfinite(r["val_loss"]) and r["val_bits_per_byte"] > 0
        assert len(r["config_hash"]) == 12 and r["wall_s"] > 0
    for arm in ("k2", "k3"):  # on the CPU a same-seed repeat reproduces its main run's loss exactly
        main_loss = pts[(f"{arm}-32x2-s0-lr1", "final")]["val_loss"]
        assert pts[(f"{arm}-32x2-s0-lr1-r1", "final")]["val_loss"] == main_loss
    again = _cli(f"--ladder={MICRO}", f"--out={out}")
    assert "0 to train" in again.stdout
    fit = subprocess.run([sys.executable, "-m", "experiments.fit", f"--results={out}", "--bootstrap=50"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert fit.returncode == 0, fit.stderr[-2000:]
    report = json.loads((out / "fit.json").read_text())
    assert "k3" in json.dumps(report)
    plot = subprocess.run([sys.executable, "-m", "experiments.plot", f"--results={out}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert plot.returncode == 0, plot.stderr[-2000:]
    pngs = sorted(out.glob("*.png"))
    assert any("loss_vs_compute" in p.name for p in pngs) and any("multiplier" in p.name for p in pngs)
    assert all(p.stat().st_size > 1000 for p in pngs)


def test_runner_refuses_a_ladder_that_would_repeat_data(tmp_path, capsys):
    """max_epochs bounds the passes of the largest run over the training split: the check names the
    run and the numbers, and the CLI stops with exit 2 before training anything."""
    runs = rl.plan_runs(rl.load_ladder(MICRO))
    biggest = max(r["tokens"] for r in runs)
    rl.check_epochs(runs, biggest, 1.0)  # exactly one pass is allowed
    with pytest.raises(rl.LadderError, match=r"run \S+ would read [\d,]+ tokens, 2\.00 passes .* max_epochs=1"):
        rl.check_epochs(runs, biggest // 2, 1.0)
    rl.check_epochs(runs, biggest // 2, 2.0)
    out = tmp_path / "o"
    assert rl.main([f"--ladder={MICRO}", f"--out={out}", "--jobs=main", "--set=tokens_per_param=1000"]) == 2
    assert "passes over the training split" in capsys.readouterr().err
    assert not (out / "runs").exists() and not list(out.glob("points*.jsonl"))


def test_single_epoch_bpe_ladder_spans_the_planned_compute():
    """experiments/configs/ladder_1e16.py: 5 sizes per main arm over >= 30x in compute up to >= 1e16
    FLOPs (6ND), depth growing with width, a x0.5..x4 sweep at 3 sizes per arm, 3 sizes per mechanism
    arm, no data repetition allowed."""
    lad = rl.load_ladder("experiments/configs/ladder_1e16.py")
    assert lad.max_epochs == 1.0 and lad.data.tokenizer == "bpe" and 16384 <= lad.data.vocab_size <= 32768
    runs = rl.plan_runs(lad)
    # the main runs: seed 0, x1, with cooldown branches (K2 and K3 at their own fitted rule, `lr_rules`)
    main = [r for r in runs if r["seed"] == 0 and r["lr_mult"] == 1 and r["branches"] and not r["repeat"]]
    assert {r["lr_rule"] for r in main if r["arm"] in ("k2", "k3")} == {"own"}
    for arm in ("k2", "k3"):
        rs = [r for r in main if r["arm"] == arm]
        C = [6 * r["counts"]["non_embedding_active_params"] * r["tokens"] for r in rs]
        shapes = [rl.parse_size(r["size"]) for r in rs]
        assert len(rs) == 5 and max(C) >= 1e16 and max(C) / min(C) >= 30, (arm, C)
        assert C == sorted(C) and [s[1] for s in shapes] == sorted(s[1] for s in shapes)
        for r in rs:
            assert r["tokens"] == pytest.approx(20 * r["counts"]["non_embedding_active_params"], rel=0.01)
        swept = {(r["size"], r["lr_mult"]) for r in runs if r["arm"] == arm and r["lr_mult"] != 1}
        assert swept == {(s, m) for s in [r["size"] for r in rs][:3] for m in (0.5, 2.0, 4.0, 8.0)}
    for arm in ("k2+kda_hybrid", "k2+attn_res", "k2+latent_moe_qb"):
        assert len([r for r in main if r["arm"] == arm]) == 3
