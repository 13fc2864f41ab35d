"""Training: state, the jitted train/eval steps, checkpoints, metrics and the loop.

A run lives in a workdir:
  run.json          the run's config (its identity: another run's workdir is refused)
  checkpoints/N/    orbax checkpoints: params, optimizer state, router biases, step, data position
  metrics.jsonl     one JSON line per log step (and per evaluation)
  tb/               TensorBoard event files
  loss.png          train and validation loss curves, written at the end
  tokenizer.json, data_cache/   the locally trained tokenizer and the tokenised corpus
The pieces: `k3.steps` (state and the jitted steps), `k3.checkpoints` (run identity, workdir checks,
checkpoints); this module is the loop that drives them, its metrics, logs and plot.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import jax

from k3.checkpoints import (_check_writable, _guarded_save, _guarded_wait, abstract_like, check_workdir,
                            checkpoint_manager, restore_newest_good, settle_layer_loop, write_run_file)
from k3.config import ConfigError, validate
from k3.data import build_datasets
from k3.hardware import device_peak_flops
from k3.moe.layer import EXPERT_BACKENDS
from k3.params import count_params, flops_per_token
from k3.steps import RunError, evaluate, make_run, to_host


def _truncate_metrics(path: Path, after_step: int) -> None:
    """Drops lines logged after the restored step (and any partial line a kill left), so a resumed log
    equals an uninterrupted one."""
    if not path.exists():
        return
    keep = []
    for ln in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(ln)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill during the write
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= after_step:
            keep.append(ln)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(ln + "\n" for ln in keep))
    os.replace(tmp, path)


def plot_losses(metrics_path: Path, out_path: Path) -> None:
    """Train and validation loss against step, from metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------

def train(cfg, workdir: str | os.PathLike) -> dict:
    """Trains (or resumes) the run of ``cfg`` in ``workdir``; returns the last metrics."""
    try:
        validate(cfg)
    except ConfigError as e:
        raise RunError(f"bad config: {e}") from e
    workdir = Path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise RunError(f"--workdir {workdir} exists and is not a directory")
    settle_layer_loop(cfg, workdir)
    resuming = check_workdir(cfg, workdir) if workdir.exists() else False
    _check_writable(workdir, create=False)
    # One process per host: process 0 writes the run's files; the others only train and save
    # their shards of the checkpoints.
    primary = jax.process_index() == 0
    # Data errors (missing path, vocab mismatch) must surface before anything is written. With
    # several processes, process 0 builds the tokenizer and token cache and the others read them.
    if primary:
        train_iter, val_source, tokenizer = build_datasets(cfg, workdir)
    _barrier("data")
    if not primary:
        train_iter, val_source, tokenizer = build_datasets(cfg, workdir)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise RunError(f"tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is {cfg.model.vocab_size}")
    run, state = make_run(cfg)
    if primary:
        _check_writable(workdir / "checkpoints")
    mngr = checkpoint_manager(cfg, workdir)
    metrics_path = workdir / "metrics.jsonl"
    if resuming and mngr.latest_step() is not None:
        state, meta, mngr = restore_newest_good(cfg, workdir, mngr, abstract_like(state))
        train_iter.set_state(meta["data"])
    start = int(to_host(state["step"]))
    if primary:
        _truncate_metrics(metrics_path, start if resuming else -1)
        write_run_file(cfg, workdir)

    counts = count_params(cfg.model)
    flops_tok = flops_per_token(cfg.model, cfg.data.seq_len, counts)["full"]
    peak = device_peak_flops(cfg.train.peak_flops)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    # Routes can be dropped by a capacity: the expert-parallel one, or the 'capacity' expert backend.
    can_drop = ((run.sharder is not None and cfg.model.moe.capacity_factor > 0)
                or EXPERT_BACKENDS.resolve(cfg.model.moe.expert_impl) == "capacity")
    writer = _tb_writer(workdir) if primary else _NullWriter()
    bar = _progress(cfg, start, enabled=primary)
    last = {}
    t_last, steps_since = time.perf_counter(), 0
    with open(metrics_path if primary else os.devnull, "a") as log:
        for step in range(start, cfg.steps):
            batch = run.put_batch(next(train_iter))
            state, m = run.train_step(state, batch)
            m = {k: to_host(v) for k, v in m.items()}
            loss = float(m["loss"])
            if not math.isfinite(loss):
                _guarded_wait(mngr, workdir)
                kept = mngr.latest_step()
                raise RunError(f"loss is {loss} at step {step + 1}; stopped. " + (
                    f"The last good checkpoint (step {kept}) is kept in {workdir / 'checkpoints'}" if kept is not None
                    else "No checkpoint was written before it (train.ckpt_every="
                         f"{cfg.train.ckpt_every}); nothing to resume from"))
            steps_since += 1
            done = step + 1
            if step == start:  # keep compilation out of tokens/s
                t_last, steps_since = time.perf_counter(), 0
            if done % cfg.train.log_every == 0 or done == cfg.steps:
                dt = time.perf_counter() - t_last
                tps = steps_since * tokens_per_step / dt if steps_since else None
                last = {"step": done, "loss": loss, "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"]),
                        "tokens_per_s": tps, "mfu": (tps * flops_tok / peak) if peak and tps else None,
                        "expert_imbalance": [round(float(x), 4) for x in m["expert_imbalance"]]}
                if can_drop:
                    last["dropped_routes"] = float(m["dropped_routes"])
                log.write(json.dumps(last) + "\n")
                log.flush()
                for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
                    if last[key] is not None:
                        writer.add_scalar(f"train/{key}", last[key], done)
                if last["expert_imbalance"]:
                    writer.add_scalar("train/max_expert_imbalance", max(last["expert_imbalance"]), done)
                t_last, steps_since = time.perf_counter(), 0
            if val_source is not None and (done % cfg.train.eval_every == 0 or done == cfg.steps):
                ev = {"step": done, **evaluate(run, state, val_source, cfg.train.eval_batches)}
                log.write(json.dumps(ev) + "\n")
                log.flush()
                writer.add_scalar("val/loss", ev["val_loss"], done)
                last.update(ev)
                t_last = time.perf_counter()  # keep evaluation out of tokens/s
            if done % cfg.train.ckpt_every == 0 or done == cfg.steps:
                _guarded_save(mngr, state, train_iter.get_state(), cfg, workdir)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{last.get('tokens_per_s') or 0:.0f}")
    _guarded_wait(mngr, workdir)
    mngr.close()
    bar.close()
    writer.close()
    if primary and metrics_path.exists():
        plot_losses(metrics_path, workdir / "loss.png")
    return last




def _barrier(name: str) -> None:
    """All processes wait here (no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


class _NullWriter:
    """TensorBoard writer stand-in for the processes that do not log."""

    def add_scalar(self, *args, **kwargs):
        pass

    def close(self):
        pass




def _tb_writer(workdir: Path):
    from tensorboardX import SummaryWriter

    return SummaryWriter(str(workdir / "tb"))


def _progress(cfg, start: int, enabled: bool = True):
    from tqdm import tqdm

    return tqdm(total=cfg.steps, initial=start, disable=not (cfg.train.progress and enabled), unit="step",
                dynamic_ncols=True)
