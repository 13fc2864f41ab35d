"""Multi-process training: two processes of four CPU devices each train on one global 8-device mesh
and reproduce the losses of one process holding all eight devices."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from test_train import ROOT, SMALL

# Module-level state (fixtures, references) is shared: keep this file on one test worker.
pytestmark = pytest.mark.xdist_group("multiprocess")

MESH = ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.expert=2"]
ARGS = [*SMALL, *MESH, "--config.data.batch_size=8", "--config.optim.grad_accum=1", "--config.steps=3",
        "--config.train.eval_every=3", "--config.train.ckpt_every=3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _losses(workdir: Path):
    rows = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [r["loss"] for r in rows if "loss" in r], [r["val_loss"] for r in rows if "val_loss" in r]


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # device counts come from --cpu_devices
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    return env


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
    single = tmp_path / "single"
    proc = subprocess.run([sys.executable, "-m", "launch.train", *ARGS, "--cpu_devices=8", f"--workdir={single}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]

    multi = tmp_path / "multi"
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "launch.train", *ARGS, "--cpu_devices=4",
                               f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={i}",
                               f"--workdir={multi}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=_env())
             for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]

    loss_1, val_1 = _losses(single)
    loss_2, val_2 = _losses(multi)
    assert len(loss_1) == 3 and len(val_1) == 1
    np.testing.assert_allclose(loss_2, loss_1, rtol=1e-5)
    np.testing.assert_allclose(val_2, val_1, rtol=1e-5)
    # Both processes wrote their shards of one checkpoint, which one process on one device reads back.
    assert (multi / "checkpoints" / "3").is_dir()
    proc = subprocess.run([sys.executable, "-m", "launch.eval", f"--workdir={multi}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["step"] == 3
    np.testing.assert_allclose(result["val_loss"], val_2[-1], rtol=1e-5)
