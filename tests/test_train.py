"""Training launcher: resume after SIGKILL, bad inputs, learning on the default corpus, eval, sample."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Module-level state (fixtures, references) is shared: keep this file on one test worker.
pytestmark = pytest.mark.xdist_group("train")

ROOT = Path(__file__).resolve().parents[1]

# A very small K3-style model and a small slice of the default corpus: fast to compile and run.
SMALL = [
    "--config=experiments/configs/k3_tiny.py",
    "--config.model.vocab_size=512", "--config.model.d_model=32", "--config.model.n_layers=4",
    "--config.model.dense_ffn_dim=64", "--config.model.attn_res_block_size=2",
    "--config.model.mla.n_heads=2", "--config.model.mla.q_lora_rank=16", "--config.model.mla.kv_lora_rank=8",
    "--config.model.mla.qk_nope_dim=8", "--config.model.mla.qk_rope_dim=4", "--config.model.mla.v_head_dim=8",
    "--config.model.kda.n_heads=2", "--config.model.kda.head_dim=8",
    "--config.model.moe.n_experts=4", "--config.model.moe.top_k=2", "--config.model.moe.expert_dim=16",
    "--config.model.moe.latent_dim=16", "--config.model.moe.shared_dim=16", "--config.model.moe.hist_bins=32",
    "--config.data.max_docs=40", "--config.data.seq_len=32", "--config.data.batch_size=4",
    "--config.train.log_every=1", "--config.train.eval_every=4", "--config.train.eval_batches=2",
    "--config.train.progress=false", "--config.optim.grad_accum=2",
]


def launch(module, *args, timeout=600, check=False):
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{module} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def metrics(workdir):
    rows = [json.loads(ln) for ln in (Path(workdir) / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in rows if "loss" in r]


def snapshot(path: Path):
    """Every file under path with its size and mtime: to prove a failed run touched nothing."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """An uninterrupted 8-step run, checkpointing every 2 steps."""
    workdir = tmp_path_factory.mktemp("run") / "full"
    launch("launch.train", *SMALL, f"--workdir={workdir}", "--config.steps=8", "--config.train.ckpt_every=2",
           check=True)
    return workdir


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory):
    """A 30-step run of the same small K3 at a higher learning rate."""
    workdir = tmp_path_factory.mktemp("run") / "learn"
    launch("launch.train", *SMALL, f"--workdir={workdir}", "--config.steps=30", "--config.train.ckpt_every=30",
           "--config.optim.lr=0.02", "--config.optim.adam_lr=0.02", check=True)
    return workdir


@pytest.mark.slow  # the longest quick-set check (about 80 s); CI runs it in the slow set
def test_resume_after_sigkill_reproduces_losses(finished_run, tmp_path):
    workdir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "launch.train", *SMALL, f"--workdir={workdir}", "--config.steps=8",
           "--config.train.ckpt_every=2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 500
    try:
        while time.time() < deadline:
            done = (workdir / "metrics.jsonl").exists() and any(s >= 5 for s, *_ in metrics(workdir))
            if done or proc.poll() is not None:
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(metrics(workdir)) < 8
    launch("launch.train", *cmd[3:], check=True)  # the same command again resumes
    assert metrics(workdir) == metrics(finished_run)  # bit-identical losses, grad norms and lrs


def test_short_run_learns(finished_run, learning_run):
    rows = metrics(learning_run)
    initial = math.log(512)
    assert abs(rows[0][1] - initial) < 0.3  # starts near ln(vocab)
    assert rows[-1][1] < initial - 1.0, rows  # and learns well below it
    rows = metrics(finished_run)
    assert len(rows) == 8 and [r[0] for r in rows] == list(range(1, 9))
    log = [json.loads(ln) for ln in (finished_run / "metrics.jsonl").read_text().splitlines()]
    first = log[0]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "expert_imbalance"):
        assert key in first
    assert len(first["expert_imbalance"]) == 4  # one per MoE layer
    assert any("val_loss" in r for r in log)
    assert (finished_run / "loss.png").stat().st_size > 1000
    assert list((finished_run / "tb").iterdir())


def test_eval_and_sample(finished_run):
    out = launch("launch.eval", f"--workdir={finished_run}", check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["step"] == 8 and result["val_loss"] > 0 and result["val_bits_per_byte"] > 0
    out = launch("launch.sample", f"--workdir={finished_run}", "--prompt=def ", "--tokens=5", check=True)
    assert out.stdout.startswith("def ")


def test_bad_inputs_fail_cleanly_and_touch_nothing(finished_run, tmp_path):
    before = snapshot(finished_run)
    cases = [
        (["--config.model.bogus_key=1"], "bogus_key"),
        (["--config.model.d_model=48"], "another run"),  # a different architecture in this workdir
    ]
    for extra, message in cases:
        out = launch("launch.train", *SMALL, f"--workdir={finished_run}", "--config.steps=10", *extra)
        assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]
    assert snapshot(finished_run) == before

    missing = tmp_path / "nope"
    out = launch("launch.train", *SMALL, f"--workdir={tmp_path / 'w1'}", "--config.data.source=text_dir",
                 f"--config.data.path={missing}")
    assert out.returncode == 2 and str(missing) in out.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    out = launch("launch.train", *SMALL, f"--workdir={tmp_path / 'w2'}", "--config.data.source=text_dir",
                 f"--config.data.path={empty}")
    assert out.returncode == 2 and str(empty) in out.stderr

    # A tokenizer whose vocabulary does not match the model.
    out = launch("launch.train", *SMALL, f"--workdir={tmp_path / 'w3'}", "--config.model.vocab_size=600",
                 f"--config.data.tokenizer_path={finished_run / 'tokenizer.json'}")
    assert out.returncode == 2 and "512" in out.stderr and "600" in out.stderr
    assert snapshot(finished_run) == before


def _corrupt(ckpt: Path, how: str) -> None:
    """Damages one orbax checkpoint directory in place."""
    files = sorted(f for f in (ckpt / "state").rglob("*") if f.is_file() and f.stat().st_size > 0)
    data = [f for f in files if "manifest" not in f.name and not f.name.startswith("_")]
    if how == "flip":  # bytes flipped in every data file
        for f in data:
            raw = bytearray(f.read_bytes())
            for i in range(0, len(raw), 7):
                raw[i] ^= 0xFF
            f.write_bytes(bytes(raw))
    elif how == "truncate":
        for f in data:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    elif how == "no_metadata":
        (ckpt / "state" / "_METADATA").unlink()
    elif how == "empty_manifest":
        for f in files:
            if f.name == "manifest.ocdbt":
                f.write_bytes(b"")
    else:
        raise ValueError(how)


def _resume_after_corruption(finished_run, tmp_path, how, extra_damage=None):
    workdir = tmp_path / f"corrupt_{how}"
    shutil.copytree(finished_run, workdir)
    steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert len(steps) == 3, steps  # keep_ckpts = 3: 4, 6, 8
    _corrupt(workdir / "checkpoints" / str(steps[-1]), how)
    if extra_damage:
        extra_damage(workdir)
    bad_files = snapshot(workdir / "checkpoints" / str(steps[-1]))
    out = launch("launch.train", *SMALL, f"--workdir={workdir}", "--config.steps=8", "--config.train.ckpt_every=2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"skipped checkpoint {steps[-1]}" in out.stderr and f"resuming from checkpoint {steps[-2]}" in out.stderr
    # The bad checkpoint is kept, moved aside whole; the run ends as the uninterrupted one did.
    moved = workdir / "checkpoints_bad" / str(steps[-1])
    assert {k.replace(str(moved), ""): v for k, v in snapshot(moved).items()} == \
        {k.replace(str(workdir / "checkpoints" / str(steps[-1])), ""): v for k, v in bad_files.items()}
    assert metrics(workdir) == metrics(finished_run)
    return workdir


def test_bad_latest_checkpoint_falls_back_to_the_newest_good_one(finished_run, tmp_path):
    _resume_after_corruption(finished_run, tmp_path, "flip")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncate", "no_metadata", "empty_manifest"])
def test_checkpoint_fault_injection_resumes_from_newest_good(finished_run, tmp_path, how):
    def cut_metrics(workdir):  # what a kill during a metrics write leaves: a partial last line
        with open(workdir / "metrics.jsonl", "a") as f:
            f.write('{"step": 9, "loss": 3.1')
    _resume_after_corruption(finished_run, tmp_path, how, cut_metrics if how == "truncate" else None)


@pytest.mark.slow
def test_no_restorable_checkpoint_is_an_error_that_moves_nothing(finished_run, tmp_path):
    workdir = tmp_path / "all_bad"
    shutil.copytree(finished_run, workdir)
    for ckpt in (workdir / "checkpoints").iterdir():
        if ckpt.name.isdigit():
            _corrupt(ckpt, "flip")
    before = snapshot(workdir)
    t0 = time.time()
    out = launch("launch.train", *SMALL, f"--workdir={workdir}", "--config.steps=10")
    assert out.returncode == 2 and "no checkpoint in" in out.stderr and "cannot be restored" in out.stderr
    assert "Traceback" not in out.stderr and time.time() - t0 < 300
    assert snapshot(workdir) == before


def test_unwritable_checkpoints_exit_quickly_naming_the_path(tmp_path):
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: root writes anywhere, so the fault cannot be made")
    workdir = tmp_path / "ro"
    (workdir / "checkpoints").mkdir(parents=True)
    (workdir / "checkpoints").chmod(0o555)
    # Root ignores file modes unless these capabilities are dropped.
    prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"] if os.geteuid() == 0 else []
    t0 = time.time()
    proc = subprocess.run([*prefix, sys.executable, "-m", "launch.train", *SMALL, f"--workdir={workdir}",
                           "--config.steps=4", "--config.train.ckpt_every=2"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"cannot write to {workdir / 'checkpoints'}" in proc.stderr and "Traceback" not in proc.stderr
    assert time.time() - t0 < 120
    assert not list((workdir / "checkpoints").iterdir()) and not (workdir / "metrics.jsonl").exists()


@pytest.mark.parametrize("extra,message", [
    (["--config.model.nonexistent=1"], "unknown config key 'nonexistent' in --config.model.nonexistent=1"),
    (["--config.model.scan_layers=False"], "(model.scan_layers is now model.layer_loop ('scan' for True, 'unroll'"),
    (["--config.train.ckpt_every=0"], "train.ckpt_every must be in (0, inf), got 0"),
    (["--config.steps=-3"], "steps must be in (0, inf), got -3"),
    (["--config.optim.adam_lr=nan"], "optim.adam_lr must be a finite number"),
    (["--config.model.kda.chunk_size=0"], "model.kda.chunk_size must be in (0, inf)"),
    (["--config.model.d_model=abc"], "--config.model.d_model=abc"),
    (["--config=experiments/configs/nonexistent.py"], "cannot load the config file"),
])
def test_bad_settings_are_one_line_errors_before_anything_is_written(tmp_path, extra, message):
    workdir = tmp_path / "w"
    t0 = time.time()
    out = launch("launch.train", *SMALL, f"--workdir={workdir}", *extra, timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1 and time.time() - t0 < 60
    assert not workdir.exists()


def test_workdir_under_a_file_is_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = launch("launch.train", *SMALL, f"--workdir={blocker / 'run'}", "--config.steps=2", timeout=120)
    assert out.returncode == 2 and f"{blocker} is not a directory" in out.stderr, out.stderr[-2000:]
    assert blocker.read_text() == "x"


def test_workdir_of_a_failed_start_accepts_a_new_config_and_partial_metrics_lines_are_dropped(tmp_path):
    from k3.config import default_config
    from k3.checkpoints import check_workdir, write_run_file
    from k3.steps import RunError
    from k3.train import _truncate_metrics

    old, new = default_config(), default_config()
    new.model.d_model = 64
    write_run_file(old, tmp_path)
    assert check_workdir(new, tmp_path) is False  # no checkpoint: nothing of the old run to protect
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    with pytest.raises(RunError, match="another run"):
        check_workdir(new, tmp_path)
    assert check_workdir(old, tmp_path) is True
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "val_loss": 1.5}\n{"step": 3, "loss": 1.')
    _truncate_metrics(log, 2)
    assert log.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "val_loss": 1.5}\n'


@pytest.mark.slow
def test_nan_loss_stops_with_the_step(tmp_path):
    workdir = tmp_path / "nan"
    out = launch("launch.train", *SMALL, f"--workdir={workdir}", "--config.steps=6", "--config.optim.lr=1e30",
                 "--config.optim.adam_lr=1e30", "--config.optim.clip_norm=0.0", "--config.train.ckpt_every=1")
    assert out.returncode == 2 and "loss is" in out.stderr and "at step" in out.stderr, out.stderr[-2000:]
    assert "last good checkpoint (step" in out.stderr
    out = launch("launch.train", *SMALL, f"--workdir={tmp_path / 'nan2'}", "--config.steps=6",
                 "--config.optim.lr=1e30", "--config.optim.adam_lr=1e30", "--config.optim.clip_norm=0.0",
                 "--config.train.ckpt_every=100")
    assert out.returncode == 2 and "No checkpoint was written" in out.stderr and "step None" not in out.stderr


@pytest.mark.parametrize("flag", ["--tokens=-1", "--tokens=0", "--temperature=-1", "--top_k=-2"])
def test_sample_rejects_bad_flags_before_loading(tmp_path, flag):
    t0 = time.time()
    out = launch("launch.sample", f"--workdir={tmp_path / 'none'}", flag, timeout=120)
    name = flag.split("=")[0]
    assert out.returncode == 2 and f"flag {flag}" in out.stderr and out.stderr.startswith("error:"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and time.time() - t0 < 60 and name in out.stderr
    assert not (tmp_path / "none").exists()


def test_params_cli_reports_a_bad_config_in_one_line():
    out = launch("launch.params", "--config=experiments/configs/k3_tiny.py", "--config.optim.b2=1.5", timeout=120)
    expected = "error: bad config: config key optim.b2 must be in [0, 1), got 1.5"
    assert out.returncode == 2 and out.stderr.strip() == expected


@pytest.mark.slow
def test_one_micro_batch_step_equals_accumulated_step():
    """optim.grad_accum=1 (no loop) and =2 (two micro-batches summed) take the same step."""
    import jax
    import numpy as np
    from flax import nnx

    from conftest import tiny_model_cfg
    from k3.config import default_config
    from k3.steps import make_run

    rng = np.random.default_rng(5)
    toks = rng.integers(0, 97, (4, 17)).astype(np.int32)
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": np.ones((4, 16), np.int32),
             "loss_mask": np.ones((4, 16), np.float32)}
    out = {}
    for accum in (1, 2):
        c = default_config()
        # Capacity experts (with room for every route) run `weight_einsum`'s fp32 weight gradients
        # under accumulation.
        c.model = tiny_model_cfg(**{"moe.expert_impl": "capacity", "moe.expert_capacity": 8.0})
        c.data.seq_len, c.data.batch_size = 16, 4
        c.optim.grad_accum = accum
        run, state = make_run(c)
        state, metrics = run.train_step(state, batch)
        out[accum] = (float(metrics["loss"]), float(metrics["grad_norm"]), nnx.to_pure_dict(state["params"]))
    np.testing.assert_allclose(out[1][0], out[2][0], rtol=1e-5)
    np.testing.assert_allclose(out[1][1], out[2][1], rtol=1e-4)
    for a, b in zip(jax.tree.leaves(out[1][2]), jax.tree.leaves(out[2][2])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def _bf16_model_with_copies(seed: int, T: int, **overrides):
    """(model config, loss(params, rest, tokens), fp32 params, rest, tokens [2, T], the params with
    their cast-only leaves in bf16 (`compute_copies`)) of a tiny bf16 model."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from conftest import tiny_model_cfg
    from k3.model import Model, cross_entropy
    from k3.steps import compute_copies

    m = tiny_model_cfg(dtype="bfloat16", **overrides)
    graphdef, params, rest = nnx.split(Model(m, rngs=nnx.Rngs(seed)), nnx.Param, ...)
    toks = jax.random.randint(jax.random.key(seed + 3), (2, T), 0, 97)

    def loss(p, r, t):
        logits, _ = nnx.merge(graphdef, p, r)(t[:, :-1])
        return cross_entropy(logits, t[:, 1:])

    return m, loss, params, rest, toks, compute_copies(loss, params, rest, toks, dtype=jnp.bfloat16)


def test_accumulation_takes_the_experts_weight_gradients_in_fp32():
    """Under `k3.nn.fp32_weight_grads` (the accumulating step's micro-batches) the bf16 expert copies'
    gradients come out of their GEMMs in fp32; the other gradients keep their dtypes, and every
    gradient equals the plain one up to the plain one's bf16 rounding."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from k3.config import layer_kinds
    from k3.nn import fp32_weight_grads

    m, loss, _, rest, toks, low = _bf16_model_with_copies(2, 21, **{"moe.expert_impl": "capacity"})
    plain = jax.jit(jax.grad(loss))(low, rest, toks)
    with fp32_weight_grads():
        fp32 = jax.jit(jax.grad(loss))(low, rest, toks)
    experts = 0
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(plain)[0], jax.tree.leaves(fp32)):
        name = jax.tree_util.keystr(path)
        if a.ndim == 3 and any(f"['ffn']['{w}']" in name for w in ("w_gate", "w_up", "w_down")):  # [E, ., .]
            experts += 1
            assert (a.dtype, b.dtype) == (jnp.bfloat16, jnp.float32), name
        else:
            assert a.dtype == b.dtype, name
        scale = float(jnp.max(jnp.abs(b.astype(jnp.float32)))) + 1e-12
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=2e-2 * scale)
    assert experts == 3 * sum(1 for _, f in layer_kinds(m) if f == "moe")


def test_cast_only_inputs_follow_calls_scans_and_custom_derivatives():
    """An input is cast-only when every use converts it to the dtype, also inside jit, scan and
    custom_vjp functions; one also used at its own dtype, converted elsewhere, or returned is not."""
    import jax
    import jax.numpy as jnp

    from k3.steps import cast_only_inputs

    bf = jnp.bfloat16

    @jax.custom_vjp
    def scaled(w):
        return w.astype(bf) * 2

    scaled.defvjp(lambda w: (scaled(w), None), lambda _, g: (g.astype(jnp.float32) * 2,))

    def f(a, b, c, d, e, s, g):
        y = a.astype(bf) + jax.jit(lambda t: t.astype(bf))(b)  # a: direct, b: inside a call
        y = y + jax.lax.scan(lambda h, x: (h + x.astype(bf), None), jnp.zeros(4, bf), s)[0]  # s: stacked
        y = y + c.astype(bf) + c  # c: also used in fp32
        y = y + d.astype(jnp.float16).astype(bf)  # d: converted to another dtype
        return y + scaled(g), e  # e: returned; g: inside a custom-derivative function

    x = jnp.ones(4, jnp.float32)
    jaxpr = jax.make_jaxpr(f)(x, x, x, x, x, jnp.ones((3, 4)), x).jaxpr
    assert cast_only_inputs(jaxpr, bf) == [True, True, False, False, False, True, True]
    assert cast_only_inputs(jaxpr, jnp.float16) == [False, False, False, True, False, False, False]


def test_accumulation_casts_the_weights_once_with_the_same_gradients():
    """With a bf16 model, `compute_copies` gives the matrices the model only casts (projections,
    experts) in bf16 and keeps the rest (norm gains, the fp32 router, gate parameters) in fp32; the
    gradients with respect to the copies are the fp32 weights' gradients before their last convert."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    _, loss, params, rest, toks, low = _bf16_model_with_copies(1, 17)
    dtypes = {jax.tree_util.keystr(k): v.dtype for k, v in jax.tree_util.tree_flatten_with_path(low)[0]}
    casted = {k for k, d in dtypes.items() if d == jnp.bfloat16}
    assert any("['mixer']['w_q']" in k for k in casted) and any("['ffn']['w_up']" in k for k in casted)
    assert not any("norm" in k or "router" in k or "A_log" in k for k in casted)
    assert 0 < len(casted) < len(dtypes)
    g32 = jax.grad(loss)(params, rest, toks)
    g16 = jax.grad(loss)(low, rest, toks)
    for a, b in zip(jax.tree.leaves(g32), jax.tree.leaves(g16)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b.astype(jnp.float32)), rtol=1e-6, atol=1e-9)


def test_init_compiler_options_change_no_value():
    """The GPU initialiser's compiler options (`k3.steps.INIT_COMPILER_OPTIONS`, here compiled for the
    CPU under `backends.targeting('gpu')`) draw the same parameters as the plain compile."""
    import jax
    import numpy as np

    from conftest import tiny_model_cfg
    from k3 import backends
    from k3.config import default_config
    from k3.steps import INIT_COMPILER_OPTIONS, init_model

    assert INIT_COMPILER_OPTIONS["gpu"]
    cfg = default_config()
    cfg.model = tiny_model_cfg(dtype="float32")
    _, plain, _ = init_model(cfg)
    with backends.targeting("gpu"):
        _, gpu_opts, _ = init_model(cfg)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(gpu_opts), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with backends.targeting("gpu"):  # traced (as `aot_report` and the ladder's compile-ahead do): no options
        shapes = jax.eval_shape(lambda: init_model(cfg)[1])
    assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(lambda x: (x.shape, x.dtype), plain)


def test_use_compile_cache_writes_the_programs_there(tmp_path):
    """`k3.backends.use_compile_cache` keeps even a quickly compiled program on disk (a fresh process:
    JAX opens its persistent cache once per process)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    code = ("import jax, jax.numpy as jnp; from k3.backends import use_compile_cache; "
            f"use_compile_cache({str(tmp_path)!r}); print(jax.jit(lambda x: x * 3 + 1)(jnp.arange(5.0)).sum())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "35.0"
    assert any(tmp_path.iterdir()), "nothing was written to the cache directory"
