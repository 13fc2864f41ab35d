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

import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from k3 import optim, sharding
from k3.balancing import BALANCERS
from k3.config import ConfigError, validate
from k3.data import DataError, build_datasets
from k3.hardware import device_peak_flops
from k3.model import Model, apply_qk_clip, cross_entropy, update_router_biases
from k3.moe import EXPERT_BACKENDS
from k3.params import count_params, flops_per_token


class RunError(RuntimeError):
    """The run cannot start or continue (bad workdir, corrupt checkpoint, non-finite loss...)."""


@dataclasses.dataclass
class Run:
    """Everything the loop needs: config, model structure, optimizer and the jitted steps."""

    cfg: Any
    graphdef: Any
    tx: optax.GradientTransformation
    schedule: Any
    train_step: Any
    eval_step: Any
    sharder: sharding.Sharder | None = None
    state_shardings: Any = None  # pytree of NamedSharding like the state (None on one device)
    loss_fn: Any = None  # (params, rest, batch) -> (mean loss, aux), for tests and tools

    def put_batch(self, batch: dict) -> dict:
        """Host batch -> device arrays laid out on the mesh (each process passes its own rows)."""
        if self.sharder is None:
            return batch
        out = {}
        for key, x in batch.items():
            sh = sharding.batch_sharding(self.sharder, np.ndim(x))
            if jax.process_count() > 1:
                # Every process reads the same global batch (same data order); each places the rows
                # of its own devices.
                x = np.asarray(x)
                out[key] = jax.make_array_from_callback(x.shape, sh, lambda idx, x=x: x[idx])
            else:
                out[key] = jax.device_put(x, sh)
        return out


def make_sharder(cfg) -> sharding.Sharder | None:
    """The run's mesh and rules from ``cfg.mesh``, or None when the mesh is one device.

    Without a -1 the mesh takes the first prod(sizes) devices; with one it takes them all.
    """
    sizes = {a: cfg.mesh[a] for a in sharding.MESH_AXES}
    devices = jax.devices()
    if -1 not in sizes.values():
        n = math.prod(sizes.values())
        if n > len(devices):
            raise RunError(f"the mesh {sizes} needs {n} devices but only {len(devices)} are available")
        devices = devices[:n]
    try:
        rules = sharding.parse_rules(cfg.mesh.rule_overrides)
        mesh = sharding.make_mesh(cfg.mesh, devices)
    except ValueError as e:
        raise RunError(f"bad mesh: {e}") from e
    if mesh.size == 1:
        return None
    sh = sharding.Sharder(mesh, rules)
    batch_devices = math.prod(sh.size(a) for a in sh.axes_for("batch"))
    micro = cfg.data.batch_size // cfg.optim.grad_accum
    if micro % batch_devices:
        raise RunError(f"the micro-batch of {micro} rows (data.batch_size / optim.grad_accum) must be a "
                       f"multiple of the {batch_devices} devices that split the batch "
                       f"({', '.join(f'mesh.{a}' for a in sh.axes_for('batch'))})")
    if cfg.data.seq_len % sh.size("context"):
        raise RunError(f"data.seq_len={cfg.data.seq_len} must be a multiple of mesh.context={sh.size('context')}")
    return sh


def init_model(cfg, sharder: sharding.Sharder | None = None):
    """(graphdef, params, rest) of a freshly initialised model, built inside one ``jax.jit``.

    Eager construction would compile one small XLA program per parameter shape. With a sharder the
    parameters are created directly in their sharded layout (never whole on one device).
    """
    def build():
        return Model(cfg.model, rngs=nnx.Rngs(cfg.seed), track_max_logit=cfg.optim.qk_clip, sharder=sharder)

    graphdef, abs_params, abs_rest = nnx.split(nnx.eval_shape(build), nnx.Param, ...)
    out_shardings = None
    if sharder is not None:
        out_shardings = (sharding.state_shardings(abs_params, sharder), sharding.state_shardings(abs_rest, sharder))
    params, rest = jax.jit(lambda: tuple(nnx.split(build(), nnx.Param, ...)[1:]), out_shardings=out_shardings)()
    return graphdef, params, rest


def _combine_stats(stats_A: Any, balancing: str) -> Any:
    """Combines micro-batch statistics: sums loads and summable balance statistics (histograms),
    averages the others (exact-QB biases), takes the max of attention logits."""
    summable = BALANCERS.get(balancing).summable

    def combine(path, x):
        name = path[-1].key if hasattr(path[-1], "key") else None
        if name == "max_logit":
            return jnp.max(x, axis=0)
        if name == "balance" and not summable:
            return jnp.mean(x, axis=0)
        return jnp.sum(x, axis=0)
    return jax.tree_util.tree_map_with_path(combine, stats_A)


def make_run(cfg) -> tuple[Run, dict]:
    """Builds the model, optimizer and jitted steps; returns (run, fresh state).

    state = {'params', 'rest' (router biases), 'opt', 'step'}, plus 'lr' (float32 scalar, the rate
    of the next step) when ``optim.schedule='external'``. On a multi-device mesh (``cfg.mesh``)
    the parameters, router biases and optimizer state are sharded by the logical-axis rules and the
    steps are compiled with those shardings in and out (the state is donated).
    """
    sharder = make_sharder(cfg)
    graphdef, params, rest = init_model(cfg, sharder)
    tx, schedule = optim.build_optimizer(cfg, params)
    state_sh = batch_sh = None
    if sharder is not None:
        p_sh = sharding.state_shardings(params, sharder)
        sharding.check_sharded(params, p_sh)
        opt_abs = jax.eval_shape(tx.init, params)
        opt_sh = sharding.tree_shardings_like(opt_abs, nnx.to_pure_dict(params), nnx.to_pure_dict(p_sh), sharder)
        state_sh = {"params": p_sh, "rest": sharding.state_shardings(rest, sharder), "opt": opt_sh,
                    "step": sharder.replicated()}
        batch_sh = {k: sharding.batch_sharding(sharder) for k in ("inputs", "targets", "segment_ids", "loss_mask")}
        opt = jax.jit(tx.init, out_shardings=opt_sh)(params)
    else:
        opt = jax.jit(tx.init)(params)
    state = {"params": params, "rest": rest, "opt": opt, "step": jnp.zeros((), jnp.int32)}
    external_lr = cfg.optim.schedule == "external"
    if external_lr:  # the rate the caller sets before each step (optim.schedule='external')
        state["lr"] = jnp.asarray(cfg.optim.lr, jnp.float32)
        if sharder is not None:
            state_sh["lr"] = sharder.replicated()
    if sharder is not None:
        state["step"] = jax.device_put(state["step"], sharder.replicated())
        if external_lr:
            state["lr"] = jax.device_put(state["lr"], sharder.replicated())
    accum = cfg.optim.grad_accum

    def loss_fn(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        logits, aux = model(batch["inputs"], batch["segment_ids"])
        loss = cross_entropy(logits, batch["targets"], batch["loss_mask"])
        return loss, aux

    def train_step(state, batch):
        params, rest = state["params"], state["rest"]
        # Micro-batch i takes rows i, i + accum, ...: each device's rows stay on it.
        micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape((x.shape[0] // accum, accum) + x.shape[1:]), 0, 1),
                             batch)

        def one(grad_sum, mb):
            (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, mb)
            # Summed in the carry: one gradient buffer whatever the number of micro-batches.
            return jax.tree.map(jnp.add, grad_sum, grads), (loss, aux)

        zeros = jax.tree.map(jnp.zeros_like, params)
        grad_sum, (losses, aux_A) = jax.lax.scan(one, zeros, micro)
        grads = jax.tree.map(lambda g: g / accum, grad_sum)
        stats = _combine_stats(aux_A["layer_stats"], cfg.model.moe.balancing)
        loads = jnp.sum(aux_A["expert_load"], axis=0)
        grad_norm = optax.global_norm(grads)
        with jax.named_scope("optimizer"):
            updates, opt = tx.update(grads, state["opt"], params)
            if external_lr:
                updates = jax.tree.map(lambda u: (u * state["lr"]).astype(u.dtype), updates)
            params = optax.apply_updates(params, updates)
        model = nnx.merge(graphdef, params, rest)
        n_tokens = batch["inputs"].size
        update_router_biases(model, stats, cfg.model.moe, n_tokens)
        if cfg.optim.qk_clip:
            apply_qk_clip(model, stats, cfg.optim.qk_clip_tau)
        _, params, rest = nnx.split(model, nnx.Param, ...)
        imbalance = (jnp.max(loads, axis=-1) / jnp.maximum(jnp.mean(loads, axis=-1), 1e-9)
                     if loads.size else jnp.zeros((0,)))
        lr = state["lr"] if external_lr else schedule(state["step"])
        metrics = {"loss": jnp.mean(losses), "grad_norm": grad_norm, "lr": lr,
                   "expert_imbalance": imbalance, "dropped_routes": _dropped(stats)}
        new_state = {"params": params, "rest": rest, "opt": opt, "step": state["step"] + 1}
        if external_lr:
            new_state["lr"] = state["lr"]
        return new_state, metrics

    def eval_step(state, batch):
        model = nnx.merge(graphdef, state["params"], state["rest"])
        logits, _ = model(batch["inputs"], batch["segment_ids"])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
        mask = batch["loss_mask"].astype(jnp.float32)
        return jnp.sum(nll * mask), jnp.sum(mask)

    if sharder is None:
        train_jit = jax.jit(train_step, donate_argnums=0)
        eval_jit = jax.jit(eval_step)
    else:
        rep = sharder.replicated()
        train_jit = jax.jit(train_step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, rep),
                            donate_argnums=0)
        eval_jit = jax.jit(eval_step, in_shardings=(state_sh, batch_sh), out_shardings=(rep, rep))
    run = Run(cfg=cfg, graphdef=graphdef, tx=tx, schedule=schedule, train_step=train_jit, eval_step=eval_jit,
              sharder=sharder, state_shardings=state_sh, loss_fn=loss_fn)
    return run, state


def _dropped(stats: dict) -> jax.Array:
    """Routes dropped by the expert-parallel capacity, summed over layers (0 when dropless)."""
    total = jnp.zeros((), jnp.float32)
    for st in stats["head"] + stats["body"] + stats["tail"]:
        if "dropped" in st:
            total = total + jnp.sum(st["dropped"])
    return total


def to_host(x) -> np.ndarray:
    """A (replicated) result as a numpy array, also when its devices span several processes."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return np.asarray(x)


def evaluate(run: Run, state: dict, val_source, n_batches: int) -> dict:
    """Held-out loss: nats/token and bits/byte (None when the byte count is unknown)."""
    total, count = 0.0, 0.0
    for batch in val_source.val_batches(n_batches):
        s, c = run.eval_step(state, run.put_batch(batch))
        total, count = total + float(to_host(s)), count + float(to_host(c))
    nats = total / max(count, 1.0)
    return {"val_loss": nats, "val_bits_per_byte": val_source.bits_per_byte(nats), "val_tokens": int(count)}


# ------------------------------------------------------------------------------------------------
# Workdir, run identity, checkpoints
# ------------------------------------------------------------------------------------------------

IDENTITY_SECTIONS = ("model", "data", "optim", "seed")


# Knobs inside the identity sections that change how, not what, is computed.
NOT_IDENTITY = ("model.moe.ep_dispatch", "model.kda.impl", "model.mla.attention_impl", "model.remat",
                "model.remat_policy")


def run_identity(cfg) -> dict:
    """The parts of the config that define a run (``steps``, logging and mesh knobs may change on resume)."""
    d = json.loads(cfg.to_json()) if not isinstance(cfg, dict) else cfg
    out = {k: d[k] for k in IDENTITY_SECTIONS if k in d}
    for key in NOT_IDENTITY:
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.get(p, {})
        node.pop(leaf, None)
    return out


def with_schema_defaults(saved: dict) -> dict:
    """A saved config (JSON dict) with the keys added to the schema since it was written, at their
    defaults (which keep the behaviour of the code that wrote it)."""
    from k3.config import default_config

    def merge(default, given):
        if not isinstance(default, dict) or not isinstance(given, dict):
            return given
        return {**default, **{k: merge(default.get(k), v) for k, v in given.items()}}

    return merge(json.loads(default_config().to_json()), saved)


def _diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff_keys(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def check_workdir(cfg, workdir: Path) -> bool:
    """Validates the workdir against this run; returns True when it holds this run's checkpoints.

    Refuses (RunError, nothing touched) a workdir whose run.json belongs to another run that has
    checkpoints, or that holds checkpoints without a run.json. A run.json without any checkpoint (a
    start that failed early) is replaced by this run's.
    """
    run_file = workdir / "run.json"
    has_ckpts = (workdir / "checkpoints").is_dir() and any((workdir / "checkpoints").iterdir())
    if run_file.exists():
        try:
            saved = json.loads(run_file.read_text())
        except json.JSONDecodeError as e:
            raise RunError(f"{run_file} is corrupt ({e}); refusing to touch workdir {workdir}") from e
        diff = _diff_keys(run_identity(with_schema_defaults(saved.get("identity") or {})), run_identity(cfg))
        if diff and not has_ckpts:
            return False  # a start that failed before its first checkpoint: nothing to protect
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

    step = int(to_host(state["step"]))
    meta = {"data": data_state, "step": step, "config": json.loads(cfg.to_json())}
    # The next train step donates ``state``; an async save may still be reading it (on CPU the host
    # "copy" can alias the device buffer), so save a private copy.
    state = jax.tree.map(jnp.copy, state)
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))


def abstract_like(state):
    """Shapes, dtypes and shardings of a state: restoring into it lays a checkpoint saved on any
    mesh out on this run's mesh."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def _short_error(e: Exception, limit: int = 400) -> str:
    """The exception's first line, cut at a word boundary: enough to name the cause."""
    text = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def restore_checkpoint(mngr, abstract_state: dict, step: int | None = None):
    """(state, meta) of the latest (or given) complete checkpoint; RunError if it cannot be read."""
    import orbax.checkpoint as ocp

    step = mngr.latest_step() if step is None else step
    try:
        restored = mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises many types for corrupt or mismatched trees
        raise RunError(f"checkpoint {mngr.directory}/{step} cannot be restored into this model "
                       f"(corrupt, or a different architecture): {_short_error(e)}") from e
    return restored["state"], restored["meta"]


_LOOP_NOISE = ("Traceback (most recent call last):", "asyncio/base_events.py", "_check_closed",
               "Event loop is closed")
_LOOP_NOISE_LINES = ("Traceback (most recent call last):", "self._check_closed()",
                     "raise RuntimeError('Event loop is closed')", "RuntimeError: Event loop is closed")


def _is_loop_noise(line: str) -> bool:
    """A line of those tracebacks, or a piece of one (several threads print them at once)."""
    s = line.strip()
    return (not s or any(n in line for n in _LOOP_NOISE)
            or any(full.startswith(s) or full.endswith(s) for full in _LOOP_NOISE_LINES))


@contextlib.contextmanager
def _without_closed_loop_noise():
    """Holds back stderr (the file descriptor) while a checkpoint is read, then writes it out without
    the 'Event loop is closed' tracebacks that orbax's reader threads print when a restore fails
    (their callbacks reach the asyncio loop the failure already closed). Everything else passes."""
    sys.stderr.flush()
    saved = os.dup(2)
    options = {"linger": 0.0}
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield options
        finally:
            time.sleep(options["linger"])
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(ln for ln in lines if not _is_loop_noise(ln)))
            sys.stderr.flush()


def restore_newest_good(cfg, workdir: Path, mngr, abstract_state: dict):
    """(state, meta, mngr) from the newest checkpoint that restores; older ones are tried in turn.

    Checkpoints newer than the one restored are moved, untouched, to ``workdir/checkpoints_bad/``
    (the run will write those step numbers again) and each is reported on stderr with its error.
    When none restores, nothing is moved and RunError lists every failure. With several processes
    only the newest is tried (moving directories that every process reads is not done behind their
    backs): a bad one is an error naming it.
    """
    failures = []
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            with _without_closed_loop_noise() as held:
                try:
                    state, meta = restore_checkpoint(mngr, abstract_state, step)
                except RunError:
                    held["linger"] = 0.5  # late reader callbacks of the failed read land in the filter
                    raise
        except RunError as e:
            if jax.process_count() > 1:
                raise
            failures.append((step, str(e)))
            continue
        if failures:
            mngr.close()
            bad_dir = workdir / "checkpoints_bad"
            bad_dir.mkdir(exist_ok=True)
            for bad, why in failures:
                target = bad_dir / str(bad)
                n = 1
                while target.exists():
                    target, n = bad_dir / f"{bad}.{n}", n + 1
                os.replace(workdir / "checkpoints" / str(bad), target)
                print(f"warning: skipped checkpoint {bad} (moved to {target}): {why}", file=sys.stderr)
            print(f"warning: resuming from checkpoint {step}", file=sys.stderr)
            mngr = checkpoint_manager(cfg, workdir)
        return state, meta, mngr
    raise RunError("no checkpoint in {} can be restored:\n  {}".format(
        workdir / "checkpoints", "\n  ".join(why for _, why in failures)))


# ------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------

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


def _check_writable(directory: Path, create: bool = True) -> None:
    """Proves a file can be written in ``directory`` (created first when ``create``; else its nearest
    existing ancestor is probed, and nothing is left behind); RunError naming it if not.

    A checkpoint directory that cannot be written would otherwise fail inside orbax's writer threads
    at the first save, after compilation and training time are spent.
    """
    target = directory
    if not create:
        while not target.exists() and target != target.parent:
            target = target.parent
        if not target.is_dir():
            raise RunError(f"cannot create {directory}: {target} is not a directory")
    try:
        if create:
            directory.mkdir(parents=True, exist_ok=True)
        probe = target / f".k3_write_test.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise RunError(f"cannot write to {directory}: {e.strerror or e}") from e


def _guarded_save(mngr, state, data_state, cfg, workdir: Path) -> None:
    """`save_checkpoint`, with a failed write turned into RunError naming the directory."""
    try:
        save_checkpoint(mngr, state, data_state, cfg)
    except Exception as e:  # orbax surfaces OS errors of its writers under several types
        raise RunError(f"writing a checkpoint to {workdir / 'checkpoints'} failed: {_short_error(e)}") from e


def _guarded_wait(mngr, workdir: Path) -> None:
    """Waits for pending asynchronous checkpoint writes; a failed one becomes RunError."""
    try:
        mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - see _guarded_save
        raise RunError(f"writing a checkpoint to {workdir / 'checkpoints'} failed: {_short_error(e)}") from e


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


def load_for_inference(workdir: str | os.PathLike):
    """(cfg, run, state, tokenizer, val_source) from the latest checkpoint of a training workdir."""
    import ml_collections

    workdir = Path(workdir)
    run_file = workdir / "run.json"
    if not run_file.exists():
        raise RunError(f"{workdir} has no run.json: not a training workdir")
    try:
        cfg = ml_collections.ConfigDict(with_schema_defaults(json.loads(run_file.read_text())["config"]))
    except (json.JSONDecodeError, KeyError) as e:
        raise RunError(f"{run_file} is corrupt: {e}") from e
    validate(cfg)
    sizes = [cfg.mesh[a] for a in sharding.MESH_AXES]
    if -1 not in sizes and math.prod(sizes) > jax.device_count():
        # Trained on a larger mesh than this machine has: the checkpoint restores onto one device.
        for a in sharding.MESH_AXES:
            cfg.mesh[a] = 1
    mngr = checkpoint_manager(cfg, workdir)
    if mngr.latest_step() is None:
        raise RunError(f"{workdir} has no complete checkpoint")
    _, val_source, tokenizer = build_datasets(cfg, workdir)
    run, state = make_run(cfg)
    state, _ = restore_checkpoint(mngr, abstract_like(state))
    return cfg, run, state, tokenizer, val_source


def _tb_writer(workdir: Path):
    from tensorboardX import SummaryWriter

    return SummaryWriter(str(workdir / "tb"))


def _progress(cfg, start: int, enabled: bool = True):
    from tqdm import tqdm

    return tqdm(total=cfg.steps, initial=start, disable=not (cfg.train.progress and enabled), unit="step",
                dynamic_ncols=True)
