"""Training: state, the jitted train/eval steps, checkpoints, metrics and the loop.

A run lives in a workdir:
  run.json          the run's config (its identity: another run's workdir is refused)
  checkpoints/N/    orbax checkpoints: params, optimizer state, router biases, step, data position
  metrics.jsonl     one JSON line per log step (and per evaluation)
  tb/               TensorBoard event files
  loss.png          train and validation loss curves, written at the end
  tokenizer.json, data_cache/   the locally trained tokenizer and the tokenised corpus

The model runs functionally: ``nnx.split`` once into (graphdef, params, rest); the steps merge
inside ``jax.jit``. Router biases (in ``rest``) and QK-Clip are updated after the optimizer step,
outside the gradient.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from k3 import optim
from k3.config import ConfigError, validate
from k3.data import DataError, build_datasets
from k3.model import Model, apply_qk_clip, cross_entropy, update_router_biases
from k3.params import count_params, flops_per_token


class RunError(RuntimeError):
    """The run cannot start or continue (bad workdir, corrupt checkpoint, non-finite loss...)."""


# Dense bf16 peak FLOP/s per device, for MFU; matched against jax's device_kind.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12, "TPU v5p": 459e12,
              "TPU v5 lite": 197e12, "TPU v6 lite": 918e12, "TPU v4": 275e12}


def device_peak_flops(override: float = 0.0) -> float | None:
    """Peak FLOP/s of the local devices (sum), or None when unknown (e.g. CPU)."""
    if override > 0:
        return override
    kind = jax.devices()[0].device_kind
    for name, peak in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return peak * jax.device_count()
    return None


@dataclasses.dataclass
class Run:
    """Everything the loop needs: config, model structure, optimizer and the jitted steps."""

    cfg: Any
    graphdef: Any
    tx: optax.GradientTransformation
    schedule: Any
    train_step: Any
    eval_step: Any


def init_model(cfg):
    """(graphdef, params, rest) of a freshly initialised model, built inside one ``jax.jit``.

    Eager construction would compile one small XLA program per parameter shape.
    """
    def build():
        return Model(cfg.model, rngs=nnx.Rngs(cfg.seed), track_max_logit=cfg.optim.qk_clip)

    graphdef, _, _ = nnx.split(nnx.eval_shape(build), nnx.Param, ...)
    params, rest = jax.jit(lambda: nnx.split(build(), nnx.Param, ...)[1:])()
    return graphdef, params, rest


def _combine_stats(stats_A: Any, balancing: str) -> Any:
    """Sums micro-batch statistics (loads, histograms); averages exact-QB biases; max of logits."""
    def combine(path, x):
        name = path[-1].key if hasattr(path[-1], "key") else None
        if name == "max_logit":
            return jnp.max(x, axis=0)
        if name == "balance" and balancing == "quantile":
            return jnp.mean(x, axis=0)
        return jnp.sum(x, axis=0)
    return jax.tree_util.tree_map_with_path(combine, stats_A)


def make_run(cfg) -> tuple[Run, dict]:
    """Builds the model, optimizer and jitted steps; returns (run, fresh state).

    state = {'params', 'rest' (router biases), 'opt', 'step'}.
    """
    graphdef, params, rest = init_model(cfg)
    tx, schedule = optim.build_optimizer(cfg, params)
    state = {"params": params, "rest": rest, "opt": jax.jit(tx.init)(params), "step": jnp.zeros((), jnp.int32)}
    accum = cfg.optim.grad_accum

    def loss_fn(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        logits, aux = model(batch["inputs"], batch["segment_ids"])
        loss = cross_entropy(logits, batch["targets"], batch["loss_mask"])
        return loss, aux

    def train_step(state, batch):
        params, rest = state["params"], state["rest"]
        micro = jax.tree.map(lambda x: x.reshape((accum, x.shape[0] // accum) + x.shape[1:]), batch)

        def one(carry, mb):
            (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, mb)
            return carry, (loss, grads, aux)

        _, (losses, grads_A, aux_A) = jax.lax.scan(one, None, micro)
        grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), grads_A)
        stats = _combine_stats(aux_A["layer_stats"], cfg.model.moe.balancing)
        loads = jnp.sum(aux_A["expert_load"], axis=0)
        grad_norm = optax.global_norm(grads)
        updates, opt = tx.update(grads, state["opt"], params)
        params = optax.apply_updates(params, updates)
        model = nnx.merge(graphdef, params, rest)
        n_tokens = batch["inputs"].size
        update_router_biases(model, stats, cfg.model.moe, n_tokens)
        if cfg.optim.qk_clip:
            apply_qk_clip(model, stats, cfg.optim.qk_clip_tau)
        _, params, rest = nnx.split(model, nnx.Param, ...)
        imbalance = (jnp.max(loads, axis=-1) / jnp.maximum(jnp.mean(loads, axis=-1), 1e-9)
                     if loads.size else jnp.zeros((0,)))
        metrics = {"loss": jnp.mean(losses), "grad_norm": grad_norm, "lr": schedule(state["step"]),
                   "expert_imbalance": imbalance}
        return {"params": params, "rest": rest, "opt": opt, "step": state["step"] + 1}, metrics

    def eval_step(state, batch):
        model = nnx.merge(graphdef, state["params"], state["rest"])
        logits, _ = model(batch["inputs"], batch["segment_ids"])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
        mask = batch["loss_mask"].astype(jnp.float32)
        return jnp.sum(nll * mask), jnp.sum(mask)

    run = Run(cfg=cfg, graphdef=graphdef, tx=tx, schedule=schedule,
              train_step=jax.jit(train_step, donate_argnums=0), eval_step=jax.jit(eval_step))
    return run, state


def evaluate(run: Run, state: dict, val_source, n_batches: int) -> dict:
    """Held-out loss: nats/token and bits/byte (None when the byte count is unknown)."""
    total, count = 0.0, 0.0
    for batch in val_source.val_batches(n_batches):
        s, c = run.eval_step(state, batch)
        total, count = total + float(s), count + float(c)
    nats = total / max(count, 1.0)
    return {"val_loss": nats, "val_bits_per_byte": val_source.bits_per_byte(nats), "val_tokens": int(count)}


# ------------------------------------------------------------------------------------------------
# Workdir, run identity, checkpoints
# ------------------------------------------------------------------------------------------------

IDENTITY_SECTIONS = ("model", "data", "optim", "seed")


def run_identity(cfg) -> dict:
    """The parts of the config that define a run (``steps`` and logging knobs may change on resume)."""
    d = json.loads(cfg.to_json())
    return {k: d[k] for k in IDENTITY_SECTIONS}


def _diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff_keys(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def check_workdir(cfg, workdir: Path) -> bool:
    """Validates the workdir against this run; returns True when it holds this run's checkpoints.

    Refuses (RunError, nothing touched) a workdir whose run.json belongs to another run, or that
    holds checkpoints without a run.json.
    """
    run_file = workdir / "run.json"
    has_ckpts = (workdir / "checkpoints").is_dir() and any((workdir / "checkpoints").iterdir())
    if run_file.exists():
        try:
            saved = json.loads(run_file.read_text())
        except json.JSONDecodeError as e:
            raise RunError(f"{run_file} is corrupt ({e}); refusing to touch workdir {workdir}") from e
        diff = _diff_keys(saved.get("identity"), run_identity(cfg))
        if diff:
            raise RunError(f"workdir {workdir} holds another run's checkpoints (config differs in: "
                           f"{', '.join(diff[:8])}); use a new --workdir")
        return has_ckpts
    if has_ckpts:
        raise RunError(f"workdir {workdir} holds checkpoints but no run.json: not this run's; use a new --workdir")
    return False


def write_run_file(cfg, workdir: Path) -> None:
    """Records the run's identity and full config in workdir/run.json (atomic write)."""
    tmp = workdir / "run.json.tmp"
    tmp.write_text(json.dumps({"identity": run_identity(cfg), "config": json.loads(cfg.to_json())}, indent=1))
    os.replace(tmp, workdir / "run.json")


def checkpoint_manager(cfg, workdir: Path):
    """Orbax manager: keeps the last ``keep_ckpts`` plus every ``keep_period``-th step.

    Orbax writes each checkpoint to a temporary directory and renames it when complete, so a
    checkpoint interrupted by a crash is never listed.
    """
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.train.keep_ckpts, keep_period=cfg.train.keep_period or None,
        enable_async_checkpointing=cfg.train.async_ckpt, create=True)
    return ocp.CheckpointManager((workdir / "checkpoints").absolute(), options=options)


def save_checkpoint(mngr, state: dict, data_state: dict, cfg) -> None:
    """Saves the train state and the data iterator position at ``state['step']``."""
    import orbax.checkpoint as ocp

    step = int(state["step"])
    meta = {"data": data_state, "step": step, "config": json.loads(cfg.to_json())}
    # The next train step donates ``state``; an async save may still be reading it (on CPU the host
    # "copy" can alias the device buffer), so save a private copy.
    state = jax.tree.map(jnp.copy, state)
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))


def restore_checkpoint(mngr, abstract_state: dict, step: int | None = None):
    """(state, meta) of the latest (or given) complete checkpoint; RunError if it cannot be read."""
    import orbax.checkpoint as ocp

    step = mngr.latest_step() if step is None else step
    try:
        restored = mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises many types for corrupt or mismatched trees
        raise RunError(f"checkpoint {mngr.directory}/{step} cannot be restored into this model "
                       f"(corrupt, or a different architecture): {type(e).__name__}: {str(e)[:300]}") from e
    return restored["state"], restored["meta"]


# ------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------

def _truncate_metrics(path: Path, after_step: int) -> None:
    """Drops lines logged after the restored step, so a resumed log equals an uninterrupted one."""
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= after_step]
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
    resuming = check_workdir(cfg, workdir) if workdir.exists() else False
    # Data errors (missing path, vocab mismatch) must surface before anything is written.
    train_iter, val_source, tokenizer = build_datasets(cfg, workdir)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise RunError(f"tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is {cfg.model.vocab_size}")
    run, state = make_run(cfg)
    mngr = checkpoint_manager(cfg, workdir)
    metrics_path = workdir / "metrics.jsonl"
    if resuming and mngr.latest_step() is not None:
        abstract = jax.eval_shape(lambda: state)
        state, meta = restore_checkpoint(mngr, abstract)
        train_iter.set_state(meta["data"])
        _truncate_metrics(metrics_path, int(state["step"]))
    else:
        _truncate_metrics(metrics_path, -1)
    write_run_file(cfg, workdir)

    counts = count_params(cfg.model)
    flops_tok = flops_per_token(cfg.model, cfg.data.seq_len, counts)["full"]
    peak = device_peak_flops(cfg.train.peak_flops)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    start = int(state["step"])
    writer = _tb_writer(workdir)
    bar = _progress(cfg, start)
    last = {}
    t_last, steps_since = time.perf_counter(), 0
    with open(metrics_path, "a") as log:
        for step in range(start, cfg.steps):
            batch = next(train_iter)
            state, m = run.train_step(state, batch)
            loss = float(m["loss"])
            if not math.isfinite(loss):
                mngr.wait_until_finished()
                raise RunError(f"loss is {loss} at step {step + 1}; stopped. The last good checkpoint "
                               f"(step {mngr.latest_step()}) is kept in {workdir / 'checkpoints'}")
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
                save_checkpoint(mngr, state, train_iter.get_state(), cfg)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{last.get('tokens_per_s') or 0:.0f}")
    mngr.wait_until_finished()
    mngr.close()
    bar.close()
    writer.close()
    if metrics_path.exists():
        plot_losses(metrics_path, workdir / "loss.png")
    return last


def load_for_inference(workdir: str | os.PathLike):
    """(cfg, run, state, tokenizer, val_source) from the latest checkpoint of a training workdir."""
    import ml_collections

    workdir = Path(workdir)
    run_file = workdir / "run.json"
    if not run_file.exists():
        raise RunError(f"{workdir} has no run.json: not a training workdir")
    try:
        cfg = ml_collections.ConfigDict(json.loads(run_file.read_text())["config"])
    except (json.JSONDecodeError, KeyError) as e:
        raise RunError(f"{run_file} is corrupt: {e}") from e
    validate(cfg)
    mngr = checkpoint_manager(cfg, workdir)
    if mngr.latest_step() is None:
        raise RunError(f"{workdir} has no complete checkpoint")
    _, val_source, tokenizer = build_datasets(cfg, workdir)
    run, state = make_run(cfg)
    state, _ = restore_checkpoint(mngr, jax.eval_shape(lambda: state))
    return cfg, run, state, tokenizer, val_source


def _tb_writer(workdir: Path):
    from tensorboardX import SummaryWriter

    return SummaryWriter(str(workdir / "tb"))


def _progress(cfg, start: int):
    from tqdm import tqdm

    return tqdm(total=cfg.steps, initial=start, disable=not cfg.train.progress, unit="step",
                dynamic_ncols=True)
