"""Training launcher: resume after SIGKILL, bad inputs, learning on the default corpus, eval, sample."""

import json
import math
import os
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


def test_corrupt_checkpoint_is_reported(finished_run, tmp_path):
    import shutil

    workdir = tmp_path / "corrupt"
    shutil.copytree(finished_run, workdir)
    latest = max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    for f in (workdir / "checkpoints" / str(latest) / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and "manifest" not in f.name:
            f.write_bytes(b"\0" * f.stat().st_size)
    before = snapshot(workdir)
    out = launch("launch.train", *SMALL, f"--workdir={workdir}", "--config.steps=10")
    assert out.returncode == 2 and "cannot be restored" in out.stderr, out.stderr[-2000:]
    assert snapshot(workdir) == before


@pytest.mark.slow
def test_nan_loss_stops_with_the_step(tmp_path):
    workdir = tmp_path / "nan"
    out = launch("launch.train", *SMALL, f"--workdir={workdir}", "--config.steps=6", "--config.optim.lr=1e30",
                 "--config.optim.adam_lr=1e30", "--config.optim.clip_norm=0.0", "--config.train.ckpt_every=1")
    assert out.returncode == 2 and "loss is" in out.stderr and "at step" in out.stderr, out.stderr[-2000:]
